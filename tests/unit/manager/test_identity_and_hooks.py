"""Framework-neutral identity (``init(identity=)``) and the decorator's ``bypass=`` / ``prompts=`` hooks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from stepskip import Batch, RunIdentity, SkipConfigError, SkipManager
from stepskip.errors import FingerprintMismatchError, PromptMismatchError


def skip_only(dump_dir, **fields) -> dict:
    """A config of a trainer that does not use verl's keys: only the skip section."""
    return {"skip": {"rollout": {"enable": True, "dump_dir": str(dump_dir), "steps": [1], "async_dump": False,
                                 **fields}}}


class Trainer:
    """A TRL-like trainer: its generation call takes token ids, not a DataProto."""

    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout", prompts=lambda self, batch, **_: batch["prompts"],
                          bypass=lambda self, batch, **_: batch.get("eval", False))
    def generate(self, batch, **_):
        self.calls += 1
        return {"completions": batch["prompts"] * 10 + self.calls}


def run_twice(tmp_path, first: RunIdentity, second: RunIdentity, prompts_a, prompts_b, **fields):
    results = []
    for identity, prompts in ((first, prompts_a), (second, prompts_b)):
        SkipManager.init(skip_only(tmp_path, **fields), identity=identity)
        SkipManager.set_step(1)
        trainer = Trainer()
        results.append((trainer.generate({"prompts": prompts}), trainer.calls))
    return results


IDENTITY = RunIdentity("grpo", "trl", gbs=8, n=4, prompt_len=16, response_len=32,
                       fingerprint={"model": "tiny", "temperature": 1.0})


def test_an_explicit_identity_names_the_directory_and_replays(tmp_path):
    prompts = torch.arange(6).reshape(2, 3)
    (first, calls1), (second, calls2) = run_twice(tmp_path, IDENTITY, IDENTITY, prompts, prompts)
    assert (calls1, calls2) == (1, 0) and torch.equal(first["completions"], second["completions"])
    entry = tmp_path / "grpo_trl" / "GBS8_N4_in16_out32" / "1"
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["fingerprint"] == {"model": "tiny", "temperature": 1.0}
    assert meta["prompt_digest"]  # found through the prompts= hook


def test_the_identity_fingerprint_detects_a_changed_run(tmp_path):
    hotter = RunIdentity("grpo", "trl", gbs=8, n=4, prompt_len=16, response_len=32,
                         fingerprint={"model": "tiny", "temperature": 0.7})
    prompts = torch.arange(6).reshape(2, 3)
    with pytest.raises(FingerprintMismatchError, match=r"temperature: recorded 1.0, now 0.7"):
        run_twice(tmp_path, IDENTITY, hotter, prompts, prompts, on_mismatch="error")


def test_the_prompts_hook_feeds_the_prompt_check(tmp_path):
    with pytest.raises(PromptMismatchError):
        run_twice(tmp_path, IDENTITY, IDENTITY, torch.arange(6).reshape(2, 3), torch.ones(2, 3, dtype=torch.long),
                  check_prompts="error")


def test_without_an_identity_verls_keys_are_the_mapping(tmp_path):
    SkipManager.init(skip_only(tmp_path))
    assert SkipManager.identity == RunIdentity()
    assert SkipManager.skip_instances["rollout"].project_dump_dir.endswith(
        "default_experiment_name_default_project_name/GBS0_N0_in0_out0")


def test_the_bypass_hook_runs_the_call_untouched(tmp_path):
    SkipManager.init(skip_only(tmp_path), identity=IDENTITY)
    SkipManager.set_step(1)
    trainer = Trainer()
    trainer.generate({"prompts": torch.zeros(1, 2), "eval": True})
    trainer.generate({"prompts": torch.zeros(1, 2), "eval": True})
    assert trainer.calls == 2 and not list(tmp_path.rglob("meta.json"))


@pytest.mark.parametrize("bad", ["GBS8", {"gbs": 8}, 3])
def test_an_identity_must_be_a_run_identity(tmp_path, bad):
    with pytest.raises(SkipConfigError, match="identity"):
        SkipManager.init(skip_only(tmp_path), identity=bad)


@pytest.mark.parametrize("field", [{"gbs": "8"}, {"n": True}, {"experiment_name": 3}, {"fingerprint": [1]}])
def test_identity_fields_are_validated(field):
    with pytest.raises(SkipConfigError, match="identity"):
        RunIdentity(**field)


def test_annotate_refuses_unknown_keywords():
    with pytest.raises(TypeError):
        SkipManager.annotate(role="rollout", colour="red")  # type: ignore[call-arg]


def test_async_wrappers_use_the_hooks_too(tmp_path):
    class AsyncTrainer:
        calls = 0

        @SkipManager.annotate(role="rollout", prompts=lambda self, ids: Batch.from_dict(tensors={"ids": ids}))
        async def generate(self, ids):
            AsyncTrainer.calls += 1
            return {"out": ids + 1}

    ids = torch.arange(4).reshape(2, 2)
    for _ in range(2):
        SkipManager.init(skip_only(tmp_path, check_prompts="error"), identity=IDENTITY)
        SkipManager.set_step(1)
        out = asyncio.run(AsyncTrainer().generate(ids))
        SkipManager.flush()
    assert AsyncTrainer.calls == 1 and torch.equal(out["out"], ids + 1)
    SkipManager.init(skip_only(tmp_path, check_prompts="error"), identity=IDENTITY)
    SkipManager.set_step(1)
    with pytest.raises(PromptMismatchError):
        asyncio.run(AsyncTrainer().generate(ids * 0))


LIGHT = """
import sys
import stepskip.config

stepskip.config.SkipManagerConfig.from_section({"reward": {"kind": "stage", "enable": True}})
assert not [m for m in sys.modules if m.startswith("stepskip.roles")], "config imported a role"

from stepskip import SkipManager

@SkipManager.annotate(role="rollout")
def generate(self, prompts):
    return prompts

SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [2], "dump_dir": sys.argv[1]}}})
SkipManager.set_step(1)
generate(None, "prompts")
heavy = sorted(m for m in ("torch", "tensordict", "safetensors") if m in sys.modules)
print(",".join(heavy) or "light")
"""


def test_the_decorator_path_imports_neither_torch_nor_tensordict(tmp_path):
    out = subprocess.run([sys.executable, "-c", LIGHT, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "light", out.stderr


class TokenTrainer:
    """TRL's shape of call: prompts as ragged token-id rows (``list[list[int]]``), results as such rows."""

    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout", prompts=lambda self, prompt_ids, **_: prompt_ids)
    def generate(self, prompt_ids, **_):
        self.calls += 1
        completions = [[t * 7 + self.calls for t in row] * 20 for row in prompt_ids]
        return completions, [[-0.5 if i % 3 else None for i in range(len(row))] for row in completions]


def run_tokens_twice(tmp_path, prompts_a, prompts_b, **fields):
    results = []
    for prompts in (prompts_a, prompts_b):
        SkipManager.init(skip_only(tmp_path, **fields), identity=IDENTITY)
        SkipManager.set_step(1)
        trainer = TokenTrainer()
        results.append((trainer.generate(prompts), trainer.calls))
    return results


def test_token_id_row_prompts_are_digested_and_a_changed_prompt_is_reported(tmp_path, caplog):
    prompts = [[3, 4, 5], [6], [7, 8]]
    (first, calls1), (second, calls2) = run_tokens_twice(tmp_path / "same", prompts, [list(r) for r in prompts])
    assert (calls1, calls2) == (1, 0) and second == first  # the rows (and their None holes) replayed exactly
    entry = tmp_path / "same" / "grpo_trl" / "GBS8_N4_in16_out32" / "1"
    assert json.loads((entry / "meta.json").read_text())["prompt_digest"]
    assert b'"__t":"rows"' in (entry / "data.json").read_bytes()  # stored packed, not as JSON lists
    with pytest.raises(PromptMismatchError, match="other prompts"):
        run_tokens_twice(tmp_path / "changed", prompts, [[3, 4, 5], [6], [7, 9]], check_prompts="error")
    with pytest.raises(PromptMismatchError, match="other prompts"):  # the same ids, other row boundaries
        run_tokens_twice(tmp_path / "split", prompts, [[3, 4], [5, 6], [7, 8]], check_prompts="error")
