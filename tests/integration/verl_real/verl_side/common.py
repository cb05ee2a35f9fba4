"""What every verl-real scenario shares, run inside verl 0.9.1's environment (.venv-verl).

Real: verl's Hydra config (``verl/trainer/config/ppo_trainer.yaml`` composed with overrides),
``RLHFDataset`` over a parquet file written here, a ``transformers`` tokenizer built locally
(nothing is downloaded). Stand-ins, because they need GPUs or inference servers: the agent-loop
worker handles (``StandInAgentLoopWorker``: it "generates" random responses and scores them
with a rule), the actor worker group (``StandInActorWorkerGroup``: log-probs are a fixed function
of the token ids, ``update_actor`` records what it was given), the checkpoint manager and the
resource-pool manager.

Each scenario is a script run as its own process (``python verl_side/<scenario>.py spec.json``, with
``src`` and this folder on ``PYTHONPATH``; see ``verl_real_support.run_scenario``); it writes a JSON
report, and what the actor was given as a ``.pt`` file, where the spec says.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("verl_real")

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<unk>", "user", "assistant", ":"]
PROMPT_LEN = 16
RESPONSE_LEN = 8


# --------------------------------------------------------------------------- activation


def activate(impl: str) -> None:
    """Serve verl's skip roles with ``impl``: "stepskip" (via its verl integration) or "verl" (verl's own).

    Must run before anything imports ``verl.utils.skip``.
    """
    if impl == "verl":
        return
    if impl != "stepskip":
        raise ValueError(f"unknown skip implementation {impl!r}")
    from stepskip.integrations.verl import install

    install()


def skip_impl_in_use() -> str:
    """Which package the trainer's ``SkipManager`` really is (checked, not assumed)."""
    from verl.utils.skip import SkipManager

    return SkipManager.__module__.split(".")[0]


# --------------------------------------------------------------------------- data and tokenizer


def make_tokenizer() -> Any:
    """A word-level ``PreTrainedTokenizerFast`` with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    return tok


def write_dataset(path: Path, rows: int, seed: int = 0) -> Path:
    """A parquet file in verl's RL layout: chat ``prompt``, ``data_source``, ``reward_model``, ``extra_info``."""
    import pandas as pd

    rng = random.Random(seed)
    records = []
    for i in range(rows):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        records.append({
            "data_source": "verl_real/toy",
            "prompt": [{"role": "user", "content": words}],
            "ability": "toy",
            "reward_model": {"style": "rule", "ground_truth": rng.choice(WORDS)},
            "extra_info": {"index": i, "split": "train"},
        })
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(records).to_parquet(path)
    return path


def compose_config(config_name: str, overrides: list[str]) -> Any:
    """verl's own Hydra config ``config_name`` from its installed config dir, with ``overrides``."""
    import verl.trainer.config as config_pkg
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(config_pkg.__file__).parent)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name, overrides=overrides)


def base_overrides(work: Path, data: Path, steps: int, batch: int, n: int) -> list[str]:
    """The overrides every scenario uses: a tiny GRPO run on CPU, no validation, no checkpoints."""
    return [
        f"data.train_files=['{data}']",
        f"data.val_files=['{data}']",
        f"data.train_batch_size={batch}",
        f"data.max_prompt_length={PROMPT_LEN}",
        f"data.max_response_length={RESPONSE_LEN}",
        "data.filter_overlong_prompts=False",
        "data.dataloader_num_workers=0",
        f"+data.cache_dir={work / 'data_cache'}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        f"trainer.total_training_steps={steps}",
        "trainer.total_epochs=1",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.device=cpu",
        "trainer.resume_mode=disable",
        "trainer.project_name=verl_real",
        "trainer.experiment_name=grpo",
        f"trainer.default_local_dir={work / 'ckpt'}",
    ]


def skip_overrides(role: str, skip: dict[str, Any]) -> list[str]:
    """Hydra overrides for ``skip.<role>``: keys verl declares are set, stepskip's own need ``+``."""
    declared = {"enable", "dump_dir", "steps", "action"}
    out = []
    for key, value in skip.items():
        prefix = "" if key in declared else "+"
        out.append(f"{prefix}skip.{role}.{key}={_hydra_value(value)}")
    return out


def tracking_overrides(overrides: list[str], spec: dict[str, Any]) -> list[str]:
    """``overrides`` with ``trainer.logger`` set to the spec's ``logger`` backends (when given), and the
    spec's ``env`` (where those backends write) set in this process."""
    if spec.get("logger"):
        overrides = [o for o in overrides if not o.startswith("trainer.logger=")]
        overrides.append(f"trainer.logger=[{','.join(spec['logger'])}]")
    os.environ.update(spec.get("env", {}))
    return overrides


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value + "'"
    return str(value)


# --------------------------------------------------------------------------- stand-ins


class _Ref:
    """What a stand-in ``.remote(...)`` returns: awaitable like a Ray ObjectRef, with ``.future()``."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._future.set_result(fn())
        except BaseException as err:  # handed to whoever awaits, as Ray would
            self._future.set_exception(err)

    def future(self) -> concurrent.futures.Future:
        return self._future

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


class _RemoteMethod:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> _Ref:
        return _Ref(lambda: self._fn(*args, **kwargs))


class StandInAgentLoopWorker:
    """Stands in for a Ray handle of verl's ``AgentLoopWorker`` (no inference server on CPU).

    ``generate_sequences.remote(chunk)`` returns what ``AgentLoopWorker._postprocess`` returns for
    a single-turn agent loop: left-padded prompts, right-padded random responses, masks, position
    ids, ``rm_scores`` from a rule, ``__num_turns__``, the extra-field columns and per-sample
    metrics. With ``carry_inputs`` (verl's colocated reward-model case, ``reward_loop_worker_handles
    is None``) the input's non-tensor columns, ``uid`` among them, are passed through.
    """

    def __init__(self, tokenizer: Any, carry_inputs: bool = False, seed: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.carry_inputs = carry_inputs
        # unseeded by default: two runs that both generate give different responses
        self.rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))
        self.calls = 0
        self.rows = 0
        self.generate_sequences = _RemoteMethod(self._generate)

    def _prompt_ids(self, raw_prompt: Any) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(raw_prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)[-PROMPT_LEN:]

    def _generate(self, chunk: Any) -> Any:
        import numpy as np
        import torch
        from tensordict import TensorDict
        from verl.protocol import DataProto
        from verl.utils.model import compute_position_id_with_mask

        self.calls += 1
        size = len(chunk)
        self.rows += size
        pad = self.tokenizer.pad_token_id
        eos = self.tokenizer.eos_token_id
        word_ids = self.tokenizer.convert_tokens_to_ids(WORDS)
        prompts = torch.full((size, PROMPT_LEN), pad, dtype=torch.long)
        responses = torch.full((size, RESPONSE_LEN), pad, dtype=torch.long)
        prompt_mask = torch.zeros((size, PROMPT_LEN), dtype=torch.long)
        response_mask = torch.zeros((size, RESPONSE_LEN), dtype=torch.long)
        scores = []
        truths = chunk.non_tensor_batch.get("reward_model")
        for i in range(size):
            ids = self._prompt_ids(chunk.non_tensor_batch["raw_prompt"][i])
            prompts[i, PROMPT_LEN - len(ids):] = torch.tensor(ids)
            prompt_mask[i, PROMPT_LEN - len(ids):] = 1
            length = self.rng.randint(1, RESPONSE_LEN - 1)
            out = [self.rng.choice(word_ids) for _ in range(length)] + [eos]
            responses[i, :len(out)] = torch.tensor(out)
            response_mask[i, :len(out)] = 1
            truth = truths[i]["ground_truth"] if truths is not None else WORDS[0]
            truth_id = self.tokenizer.convert_tokens_to_ids(truth)
            # a rule reward that varies within each group, so that GRPO advantages are not all zero
            scores.append(len(out) / RESPONSE_LEN + sum(t == truth_id for t in out))
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        input_ids = torch.cat([prompts, responses], dim=1)
        rm_scores = torch.zeros((size, RESPONSE_LEN), dtype=torch.float32)
        last = response_mask.sum(dim=1) - 1
        rm_scores[torch.arange(size), last] = torch.tensor(scores, dtype=torch.float32)
        batch = TensorDict({
            "prompts": prompts, "responses": responses, "response_mask": response_mask, "input_ids": input_ids,
            "attention_mask": attention_mask, "position_ids": compute_position_id_with_mask(attention_mask),
            "rm_scores": rm_scores,
        }, batch_size=size)
        non_tensor = {"__num_turns__": np.full(size, 2, dtype=np.int32)}
        if self.carry_inputs:
            non_tensor.update(chunk.non_tensor_batch)
        for key in ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras"):
            column = np.empty(size, dtype=object)
            column[:] = [None] * size
            non_tensor[key] = column
        mm = np.empty(size, dtype=object)
        mm[:] = [{} for _ in range(size)]
        non_tensor["multi_modal_inputs"] = mm
        metrics = [{"generate_sequences": 0.01, "tool_calls": 0.0, "compute_score": 0.0, "num_preempted": 0}
                   for _ in range(size)]
        return DataProto(batch=batch, non_tensor_batch=non_tensor,
                         meta_info={"metrics": metrics, "reward_extra_keys": []})


def fake_log_probs(ids: Any) -> Any:
    """The stand-in actor's log-probs: a fixed function of the token ids (same ids, same values)."""
    return -((ids.float() % 7.0) + 1.0) / 8.0


class StandInActorWorkerGroup:
    """Stands in for verl's actor ``RayWorkerGroup`` (no FSDP engine on CPU).

    ``compute_log_prob`` answers in verl's no-padding layout (nested like ``input_ids``);
    ``update_actor`` records the per-row actor inputs (responses, advantages, old log-probs)
    in the order the trainer sent them, and returns metrics as the engine does.
    """

    def __init__(self) -> None:
        self._dispatch_info: dict[str, list[int]] = {}
        self.updates: list[dict[str, Any]] = []
        self.log_prob_calls = 0

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]  # one data-parallel rank

    def compute_log_prob(self, batch_td: Any) -> Any:
        import torch
        from verl.utils import tensordict_utils as tu

        self.log_prob_calls += 1
        ids = batch_td["input_ids"]
        values = fake_log_probs(ids.values())
        nested = torch.nested.nested_tensor_from_jagged(values, offsets=ids.offsets())
        entropy = torch.nested.nested_tensor_from_jagged(torch.ones_like(values), offsets=ids.offsets())
        return tu.get_tensordict({"log_probs": nested, "entropy": entropy}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def update_actor(self, batch_td: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        record = {}
        for key in ("responses", "advantages", "old_log_probs", "response_mask"):
            value = batch_td[key]
            record[key] = [row.clone() for row in value.unbind(0)] if value.is_nested else value.clone()
        record["uid"] = list(tu.get(batch_td, "uid") or [])
        self.updates.append(record)
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"actor/pg_loss": 0.0, "mfu": 0.0}})


class StandInCheckpointManager:
    """Stands in for verl's ``CheckpointEngineManager`` (no weights to sync without rollout servers)."""

    def __init__(self) -> None:
        self.updates: list[int] = []
        self.sleeps = 0

    def update_weights(self, global_steps: int) -> None:
        self.updates.append(global_steps)

    def sleep_replicas(self) -> None:
        self.sleeps += 1


class StandInResourcePoolManager:
    """Stands in for verl's ``ResourcePoolManager`` (no GPUs to pool on CPU)."""

    def get_n_gpus(self) -> int:
        return 1


# --------------------------------------------------------------------------- reports


def skip_stats() -> dict[str, float]:
    """stepskip's counters (empty under verl's own skip, which has none)."""
    from verl.utils.skip import SkipManager

    stats = getattr(SkipManager, "stats", None)
    if stats is None:
        return {}
    flush = getattr(SkipManager, "flush", None)
    if flush is not None:
        flush()  # background dumps are counted when written
    return dict(stats())


def tree_listing(root: Path) -> list[str]:
    """Every file under ``root``, relative, sorted (what a run left in its dump dir)."""
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def run_each(spec: dict[str, Any], report: dict[str, Any],
             fit: Callable[[dict[str, Any], Path, dict[str, Any]], None]) -> None:
    """``fit(run, work, entry)`` for the spec itself, or for each of its ``runs`` one after another in this
    process (one import of verl: seconds a run), each in ``work/<name>``, the ``SkipManager`` reset between
    runs; ``report["runs"]`` then has an entry per run, with its own ``error`` when it failed (as
    :func:`main` reports a run's error)."""
    if "runs" not in spec:
        fit(spec, Path(spec["work"]), report)
        return
    from verl.utils.skip import SkipManager

    report["runs"] = []
    for one in spec["runs"]:
        entry: dict[str, Any] = {"name": one["name"]}
        report["runs"].append(entry)
        try:
            fit(one, Path(spec["work"]) / one["name"], entry)
        except BaseException as err:  # reported per run: the test decides whether it was expected
            entry["error"] = error_report(err)
        finally:
            reset = getattr(SkipManager, "reset", None)  # (verl's own re-initialises in its init)
            if reset is not None:
                reset()


def error_report(err: BaseException) -> dict[str, Any]:
    """What a report says of a run's exception: its type (and theirs it derives from), message, traceback."""
    return {"type": type(err).__name__, "mro": [c.__name__ for c in type(err).__mro__],
            "message": str(err)[:4000], "traceback": traceback.format_exc()[-6000:]}


def main(run: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Entry point of a scenario: read the spec, run, write the report; exit 0 even on a trainer error.

    The report's ``error`` carries the exception type and message so that tests can assert on
    an expected failure (e.g. verl's ``union`` assertion); harness bugs still show in the traceback.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("HF_DATASETS_CACHE", str(Path(spec["work"]) / "hf_datasets"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    activate(spec.get("impl", "stepskip"))
    start = time.perf_counter()
    report: dict[str, Any] = {}
    try:
        run(spec, report)  # fills ``report`` as it goes, so a failed run still tells what it did
    except BaseException as err:  # reported, not raised: the test decides whether it was expected
        report["error"] = error_report(err)
    report["seconds"] = time.perf_counter() - start
    Path(spec["report"]).write_text(json.dumps(report, indent=1, default=str))
