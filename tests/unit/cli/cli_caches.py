"""Real caches for the CLI tests, written by stepskip itself through SkipManager, plus verl's own fixture.

``build_cache(dump_dir)`` writes:

* ``exp_proj/GBS4_N2_in8_out6``: role ``rollout`` (format safe) at steps 1-6, 8, 10 and the generic
  stage role ``reward`` (a TensorDict per step) at steps 1, 2;
* ``exp_verlfmt/GBS4_N2_in8_out6``: role ``rollout`` with ``format: verl`` at steps 1, 2;
* ``exp_v1/GBS4_N2_in0_out0``: role ``rollout_tq`` (V1 trainer, ``parameter_sync_step`` 2, so two
  inner entries per step) at steps 1-3, through the V1 harness of ``tests/support``;
* ``fx_verl/GBS4_N2_in8_out6``: a copy of ``tests/fixtures/verl/cache`` (written by verl 0.9.1).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from stepskip import Batch, SkipManager
from stepskip.tq import InProcessTQClient

HERE = Path(__file__).resolve().parent
FIXTURE_CACHE = HERE.parents[1] / "fixtures" / "verl" / "cache"
if str(HERE.parents[1] / "support") not in sys.path:
    sys.path.insert(0, str(HERE.parents[1] / "support"))

from v1_harness import V1Trainer  # noqa: E402

SAFE_RUN = "exp_proj/GBS4_N2_in8_out6"
VERL_FMT_RUN = "exp_verlfmt/GBS4_N2_in8_out6"
V1_RUN = "exp_v1/GBS4_N2_in0_out0"
FIXTURE_RUN = "fx_verl/GBS4_N2_in8_out6"
ROLLOUT_STEPS = [1, 2, 3, 4, 5, 6, 8, 10]
PROMPT_LEN, RESPONSE_LEN, ROWS = 8, 6, 8


def rollout_batch(step: int, rows: int = ROWS) -> Batch:
    """A generated batch as verl's agent loop returns it: left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(step)
    prompt_lens = torch.randint(2, PROMPT_LEN + 1, (rows,), generator=gen)
    response_lens = torch.randint(1, RESPONSE_LEN + 1, (rows,), generator=gen)
    prompts = torch.zeros(rows, PROMPT_LEN, dtype=torch.int64)
    responses = torch.zeros(rows, RESPONSE_LEN, dtype=torch.int64)
    attention = torch.zeros(rows, PROMPT_LEN + RESPONSE_LEN, dtype=torch.int64)
    scores = torch.zeros(rows, RESPONSE_LEN)
    for r in range(rows):
        p, q = int(prompt_lens[r]), int(response_lens[r])
        prompts[r, PROMPT_LEN - p:] = torch.randint(10, 100, (p,), generator=gen)
        responses[r, :q] = torch.randint(100, 200, (q,), generator=gen)
        attention[r, PROMPT_LEN - p:PROMPT_LEN + q] = 1
        scores[r, q - 1] = float(r % 2)
    return Batch.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": attention, "response_mask": attention[:, PROMPT_LEN:].clone(),
                 "token_level_scores": scores},
        non_tensors={"uid": [f"s{step}-u{r // 2}" for r in range(rows)],
                     "data_source": ["gsm8k"] * rows,
                     "messages": [[{"role": "user", "content": f"question {step}.{r}"}] for r in range(rows)]},
        meta_info={"global_steps": step, "timing": {"gen": 0.25}},
    )


class Loop:
    """The decorated stages of a tiny colocated trainer."""

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return rollout_batch(SkipManager.step)

    @SkipManager.annotate(role="reward")
    def compute_reward(self, batch: Batch) -> TensorDict:
        return TensorDict({"reward": batch.batch["token_level_scores"].sum(-1),
                           "acc": batch.batch["token_level_scores"].sum(-1) > 0}, batch_size=[len(batch)])


def base_config(dump_dir: Path, experiment: str, project: str, **data: Any) -> dict[str, Any]:
    return {
        "trainer": {"experiment_name": experiment, "project_name": project},
        "data": {"train_batch_size": 4, "max_prompt_length": PROMPT_LEN, "max_response_length": RESPONSE_LEN, **data},
        "actor_rollout_ref": {"rollout": {"n": 2, "temperature": 1.0}, "model": {"path": "Qwen/Qwen2.5-0.5B"}},
        "skip": {},
    }


def prompts_for(step: int) -> Batch:
    return Batch.from_dict(non_tensors={"uid": [f"live{step}-{r // 2}" for r in range(ROWS)]})


def record_rollout(dump_dir: Path, project: str, steps: list[int], stage: bool = False, **skip: Any) -> None:
    config = base_config(dump_dir, "exp", project)
    config["skip"]["rollout"] = {"enable": True, "dump_dir": str(dump_dir), "steps": steps, "async_dump": False,
                                 **skip}
    if stage:
        config["skip"]["reward"] = {"kind": "stage", "enable": True, "dump_dir": str(dump_dir), "steps": [1, 2],
                                    "async_dump": False}
    SkipManager.init(config)
    loop = Loop()
    for step in steps:
        SkipManager.set_step(step)
        batch = loop.generate_sequences(prompts_for(step))
        if stage:
            loop.compute_reward(batch)
    SkipManager.close()
    SkipManager.reset()


def record_v1(dump_dir: Path, steps: int = 3) -> None:
    config = {
        "trainer": {"experiment_name": "exp", "project_name": "v1",
                    "v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 2}}},
        "data": {"train_batch_size": 4},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout_tq": {"enable": True, "dump_dir": str(dump_dir), "steps": list(range(1, steps + 1)),
                                "async_dump": False}},
    }
    V1Trainer(config, InProcessTQClient(), prompts_per_step=4, n=2, sync_steps=2).fit(steps)
    SkipManager.close()
    SkipManager.reset()


def build_cache(dump_dir: Path) -> Path:
    """Write every cache listed in the module docstring under ``dump_dir``; returns it."""
    dump_dir.mkdir(parents=True, exist_ok=True)
    record_rollout(dump_dir, "proj", ROLLOUT_STEPS, stage=True)
    record_rollout(dump_dir, "verlfmt", [1, 2], format="verl", allow_pickle=True)
    record_v1(dump_dir)
    shutil.copytree(FIXTURE_CACHE / FIXTURE_RUN, dump_dir / FIXTURE_RUN)
    return dump_dir


def replay_rollout(dump_dir: Path, experiment: str, project: str, steps: list[int], **skip: Any) -> dict[int, Any]:
    """Replay ``steps`` of role rollout through SkipManager (action replay: never generates)."""
    config = base_config(dump_dir, experiment, project)
    config["skip"]["rollout"] = {"enable": True, "dump_dir": str(dump_dir), "steps": steps, "action": "replay",
                                 "rebind_keys": [], **skip}

    class Never:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts: Batch) -> Batch:
            raise AssertionError("replay must not generate")

    SkipManager.init(config)
    out = {}
    for step in steps:
        SkipManager.set_step(step)
        out[step] = Never().generate_sequences(prompts_for(step))
    SkipManager.reset()
    return out


def object_column(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
