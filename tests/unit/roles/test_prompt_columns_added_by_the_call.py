"""A stage may add columns to its own prompts while it runs: verl's ``AgentLoopManager.generate_sequences``
puts a ``priority`` column into ``prompts.non_tensor_batch`` before it dispatches. The recorded prompt digest
is what the stage was asked — the columns the prompts had before the call — so a replay, which checks the
live prompts before any call, sees the prompts it recorded; prompts that really differ are still told apart.
The generator here is a stand-in for verl's agent loop (no inference engine runs here)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip.errors import PromptMismatchError


class AgentLoop:
    """Adds ``priority`` to its prompts, as verl's agent loop does, then generates."""

    calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        AgentLoop.calls += 1
        if "priority" not in prompts.non_tensor_batch:
            prompts.non_tensor_batch["priority"] = np.arange(len(prompts), dtype=np.int64)
        return Batch.from_dict({"responses": prompts.batch["input_ids"] * 2},
                               {"uid": prompts.non_tensor_batch["uid"].copy()})


def prompts(shift: int = 0) -> Batch:
    ids = torch.arange(12).reshape(4, 3) + shift
    return Batch.from_dict({"input_ids": ids}, {"uid": np.array([f"u{i}" for i in range(4)], dtype=object),
                                                "raw_prompt": np.array([f"p{i + shift}" for i in range(4)],
                                                                       dtype=object)})


@pytest.fixture(autouse=True)
def _reset():
    AgentLoop.calls = 0
    yield
    SkipManager.reset()


def record(dump) -> None:
    SkipManager.init(training_config(dump, steps=[1]))
    SkipManager.set_step(1)
    AgentLoop().generate_sequences(prompts())
    SkipManager.close()


def test_a_column_the_call_adds_is_not_part_of_the_recorded_prompts(tmp_path, caplog):
    record(tmp_path)
    SkipManager.init(training_config(tmp_path, steps=[1], check_prompts="error"))
    SkipManager.set_step(1)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        replayed = AgentLoop().generate_sequences(prompts())
    assert AgentLoop.calls == 1 and SkipManager.stats()["skip/rollout/hits"] == 1
    assert torch.equal(replayed.batch["responses"], prompts().batch["input_ids"] * 2)
    assert not [r for r in caplog.records if "other prompts" in r.getMessage()]


def test_prompts_that_differ_are_still_refused(tmp_path):
    record(tmp_path)
    SkipManager.init(training_config(tmp_path, steps=[1], check_prompts="error"))
    SkipManager.set_step(1)
    with pytest.raises(PromptMismatchError):
        AgentLoop().generate_sequences(prompts(shift=1))
    assert AgentLoop.calls == 1


def test_compare_sees_the_recorded_prompts_after_the_call_added_its_column(tmp_path):
    record(tmp_path)
    SkipManager.init(training_config(tmp_path, steps=[1], action="compare", check_prompts="error"))
    SkipManager.set_step(1)
    AgentLoop().generate_sequences(prompts())
    SkipManager.flush()
    [record_] = SkipManager.drift("rollout")
    assert record_["prompts_equal"] is True and record_["passed"] is True
    meta = json.loads((run_path(tmp_path) / "1" / "meta.json").read_text())
    assert meta["prompt_digest"].startswith("xxh3")
