"""``action: compare`` through the decorators: run live, read the entry, compare, report, return per train_on."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import numpy as np
import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip.errors import DriftError, PromptMismatchError
from stepskip.testing import make_rollout_batch

ROWS = 8


def prompts(tag: str = "p") -> Batch:
    return Batch.from_dict(tensors={"input_ids": torch.arange(ROWS * 4).reshape(ROWS, 4)},
                           non_tensors={"uid": [f"{tag}{i}" for i in range(ROWS)]})


class Loop:
    """A rollout whose responses can be changed from a given token on (``bump``), counting its calls."""

    def __init__(self, bump: int = 0, log_prob_shift: float = 0.0) -> None:
        self.bump, self.log_prob_shift, self.calls = bump, log_prob_shift, 0

    def _generate(self, prompts: Batch) -> Batch:
        self.calls += 1
        out = make_rollout_batch(ROWS, 16, 24, n=4)
        out.batch["responses"][:, : self.bump] += 1
        out.batch["rollout_log_probs"] += self.log_prob_shift
        out.non_tensor_batch["uid"] = np.array(list(prompts.non_tensor_batch["uid"]), dtype=object)
        return out

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return self._generate(prompts)


def record(tmp_path, steps=(1, 2), **fields) -> None:
    SkipManager.init(training_config(tmp_path, steps=list(steps), **fields))
    for step in steps:
        SkipManager.set_step(step)
        Loop().generate_sequences(prompts())
    SkipManager.flush()


def compare(tmp_path, loop: Loop, steps=(1, 2), p: Batch | None = None, **fields) -> list[Batch]:
    SkipManager.init(training_config(tmp_path, steps=list(steps), action="compare", **fields))
    out = []
    for step in steps:
        SkipManager.set_step(step)
        out.append(loop.generate_sequences(p if p is not None else prompts("live")))
    SkipManager.flush()
    return out


def drift_file(tmp_path, step: int):
    return run_path(tmp_path) / ".stepskip-drift" / f"{step}.json"


def test_the_same_generation_matches_its_recording(tmp_path, caplog):
    record(tmp_path)
    loop = Loop()
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        compare(tmp_path, loop)
    assert loop.calls == 2  # the function ran live on every compared step
    stats = SkipManager.stats()
    assert stats["skip/rollout/compared"] == 2 and stats["skip/rollout/drifted"] == 0
    assert stats["skip/rollout/token_match"] == 1.0 and stats["skip/rollout/hits"] == 0
    records = SkipManager.drift("rollout")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["passed"] is True and r["token_match"] == 1.0 and r["prompts_equal"] is True
        assert r["worst_delta"] == 0.0 and "worst_field" in r
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_drifting_step_warns_once_naming_step_field_and_figure(tmp_path, caplog):
    record(tmp_path)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        compare(tmp_path, Loop(bump=12))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per drifting step
    assert "step 1 drifted" in warnings[0] and "'responses'" in warnings[0] and "token match 0." in warnings[0]
    records = SkipManager.drift("rollout")
    assert [r["passed"] for r in records] == [False, False]
    assert records[0]["worst_field"] == "responses" and records[0]["token_match"] < 0.9
    assert records[0]["worst_delta"] == 1.0 and records[0]["first_row"] == 0
    stats = SkipManager.stats()
    assert stats["skip/rollout/drifted"] == 2 and stats["skip/rollout/token_match"] == records[-1]["token_match"]


def test_train_on_recorded_returns_the_recording_with_the_live_identity_columns(tmp_path):
    record(tmp_path)
    [out] = compare(tmp_path, Loop(bump=12), steps=[1])
    recorded = make_rollout_batch(ROWS, 16, 24, n=4)
    assert torch.equal(out.batch["responses"], recorded.batch["responses"])
    assert list(out.non_tensor_batch["uid"]) == [f"live{i}" for i in range(ROWS)]


def test_train_on_live_returns_the_live_result(tmp_path):
    record(tmp_path)
    [out] = compare(tmp_path, Loop(bump=12), steps=[1], train_on="live")
    assert not torch.equal(out.batch["responses"], make_rollout_batch(ROWS, 16, 24, n=4).batch["responses"])
    assert SkipManager.drift("rollout")[0]["train_on"] == "live"


def test_the_record_is_written_beside_the_entry_never_into_it(tmp_path):
    record(tmp_path)
    entry = run_path(tmp_path) / "1"
    before = {p.name: p.read_bytes() for p in entry.iterdir()}
    compare(tmp_path, Loop(bump=3), steps=[1])
    assert {p.name: p.read_bytes() for p in entry.iterdir()} == before
    written = json.loads(drift_file(tmp_path, 1).read_text())
    assert written["step"] == 1 and written["role"] == "rollout" and written["entry"]["path"] == str(entry)
    assert written["worst_field"] == SkipManager.drift("rollout")[0]["worst_field"]
    assert written["fields"]["responses"]["row_match"]  # the file keeps the per-row figures
    assert not [n for n in os.listdir(drift_file(tmp_path, 1).parent) if n.startswith(".tmp")]


def test_float_fields_drift_beyond_rtol_and_atol(tmp_path):
    record(tmp_path)
    compare(tmp_path, Loop(log_prob_shift=1e-3), steps=[1])
    assert SkipManager.drift("rollout")[0]["worst_field"] == "rollout_log_probs"
    assert not SkipManager.drift("rollout")[0]["passed"]
    compare(tmp_path, Loop(log_prob_shift=1e-3), steps=[1], atol=1e-2)
    assert SkipManager.drift("rollout")[0]["passed"]


def test_on_drift_error_stops_naming_the_step_and_the_field(tmp_path):
    record(tmp_path)
    with pytest.raises(DriftError, match=r"step 1 drifted.*'responses'"):
        compare(tmp_path, Loop(bump=12), on_drift="error")
    assert drift_file(tmp_path, 1).is_file()  # written before it stopped


def test_a_step_without_an_entry_is_generated_and_recorded_as_under_cache(tmp_path):
    loop = Loop()
    compare(tmp_path, loop, steps=[1])
    assert loop.calls == 1 and (run_path(tmp_path) / "1" / "meta.json").is_file()
    assert SkipManager.stats()["skip/rollout/misses"] == 1 and SkipManager.stats()["skip/rollout/compared"] == 0
    assert SkipManager.drift("rollout") == []


def test_a_damaged_entry_is_counted_generated_live_and_reported(tmp_path, caplog):
    record(tmp_path, steps=[1])
    data = run_path(tmp_path) / "1" / "data.safetensors"
    data.write_bytes(data.read_bytes()[:-7])
    loop = Loop(bump=5)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        [out] = compare(tmp_path, loop, steps=[1])
    assert loop.calls == 1 and SkipManager.stats()["skip/rollout/corrupt"] == 1
    assert out.batch["responses"][0, 0] == make_rollout_batch(ROWS, 16, 24, n=4).batch["responses"][0, 0] + 1  # live
    [report] = SkipManager.drift("rollout")
    assert report["damaged"] is True and report["step"] == 1 and report["passed"] is False
    assert any("step 1 was not compared" in r.getMessage() for r in caplog.records)
    # regenerated as under cache: the next compare reads the live recording
    compare(tmp_path, Loop(bump=5), steps=[1])
    assert SkipManager.drift("rollout")[0]["passed"] is True


def test_other_prompts_are_reported_as_such_not_as_drift(tmp_path, caplog):
    record(tmp_path, steps=[1])
    other = Batch.from_dict(tensors={"input_ids": torch.arange(ROWS * 4).reshape(ROWS, 4) + 1},
                            non_tensors={"uid": [f"x{i}" for i in range(ROWS)]})
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        compare(tmp_path, Loop(bump=12), steps=[1], p=other, on_drift="error")  # no DriftError: not drift
    [r] = SkipManager.drift("rollout")
    assert r["prompts_equal"] is False and r["passed"] is False
    assert SkipManager.stats()["skip/rollout/drifted"] == 0
    assert any("other prompts" in m.getMessage() for m in caplog.records)
    with pytest.raises(PromptMismatchError, match="action: compare"):
        compare(tmp_path, Loop(), steps=[1], p=other, check_prompts="error")


def test_compare_never_claims_to_replay(tmp_path):
    record(tmp_path)
    SkipManager.init(training_config(tmp_path, steps=[1, 2], action="compare"))
    assert SkipManager.will_replay("rollout", [1, 2]) is False


def test_steps_not_listed_pass_through(tmp_path):
    record(tmp_path, steps=[1])
    loop = Loop()
    compare(tmp_path, loop, steps=[1])
    SkipManager.set_step(5)
    loop.generate_sequences(prompts())
    assert loop.calls == 2 and [r["step"] for r in SkipManager.drift("rollout")] == [1]


def test_async_functions_compare_off_the_event_loop(tmp_path):
    class AsyncLoop(Loop):
        @SkipManager.annotate(role="rollout")
        async def generate_sequences(self, prompts: Batch) -> Batch:  # type: ignore[override]
            return self._generate(prompts)

    record(tmp_path, steps=[1])
    SkipManager.init(training_config(tmp_path, steps=[1], action="compare"))
    SkipManager.set_step(1)
    out = asyncio.run(AsyncLoop(bump=12).generate_sequences(prompts()))
    assert isinstance(out, Batch) and SkipManager.drift("rollout")[0]["passed"] is False


@pytest.mark.parametrize("key, value, allowed", [
    ("train_on", "both", "recorded, live"), ("on_drift", "raise", "warn, error"),
    ("compare_min_match", 1.5, "from 0 to 1"), ("rtol", -1.0, ">= 0"), ("atol", "tiny", ">= 0"),
])
def test_compare_options_are_validated(tmp_path, key, value, allowed):
    with pytest.raises(SkipConfigError, match=rf"skip.rollout.{key} = .* {allowed}"):
        SkipManager.init(training_config(tmp_path, action="compare", **{key: value}))


def test_drift_of_an_unknown_role_names_the_known_ones(tmp_path):
    assert SkipManager.drift("rollout") == []  # before init
    SkipManager.init(training_config(tmp_path))
    with pytest.raises(SkipConfigError, match="known roles"):
        SkipManager.drift("rollouts")
    assert SkipManager.drift("rollout") == []


class Rewards:
    def __init__(self, shift: float = 0.0) -> None:
        self.shift = shift

    @SkipManager.annotate(role="reward")
    def compute_reward(self, batch: Batch) -> dict[str, torch.Tensor]:
        return {"scores": batch.batch["responses"].float().mean(dim=1) / 1000 + self.shift}


def test_stage_roles_compare_their_output(tmp_path):
    stage = {"kind": "stage"}
    SkipManager.init(training_config(tmp_path, role="reward", steps=[1], **stage))
    SkipManager.set_step(1)
    Rewards().compute_reward(make_rollout_batch(ROWS, 16, 24, n=4))
    SkipManager.flush()
    SkipManager.init(training_config(tmp_path, role="reward", steps=[1], action="compare", **stage))
    SkipManager.set_step(1)
    out = Rewards(shift=0.5).compute_reward(make_rollout_batch(ROWS, 16, 24, n=4))
    [r] = SkipManager.drift("reward")
    assert r["worst_field"] == "scores" and r["token_match"] is None and r["worst_delta"] == pytest.approx(0.5)
    recorded = make_rollout_batch(ROWS, 16, 24, n=4).batch["responses"].float().mean(dim=1) / 1000
    assert not r["passed"] and torch.equal(out["scores"], recorded)  # train_on: recorded
    assert (run_path(tmp_path) / "reward" / ".stepskip-drift" / "1.json").is_file()


class Annotating(Loop):
    """Adds a column to its prompts in place, as verl's agent loop adds ``priority``."""

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        prompts.non_tensor_batch["priority"] = np.arange(len(prompts))
        return self._generate(prompts)


def test_prompts_a_call_annotates_are_compared_as_they_were_recorded(tmp_path):
    SkipManager.init(training_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    Annotating().generate_sequences(prompts())
    SkipManager.init(training_config(tmp_path, steps=[1], action="compare"))
    SkipManager.set_step(1)
    Annotating().generate_sequences(prompts("live"))
    [r] = SkipManager.drift("rollout")
    assert r["prompts_equal"] is True and r["passed"] is True


class Rollouter:
    """The fully async rollouter's per-sample call (the step is the feed index in the sample's uid)."""

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    @SkipManager.annotate(role="async_rollout")
    async def generate_sequences_single(self, prompts: Batch) -> Batch:
        out = make_rollout_batch(1, 8, 8, n=1)
        out.batch["responses"] += self.shift
        return out


def test_async_rollout_compares_each_sample(tmp_path):
    def sample(index: int) -> Batch:
        return Batch.from_dict(tensors={"input_ids": torch.tensor([[index, 1, 2]])},
                               non_tensors={"uid": [f"uid_sample_0_{index}"]})

    async def feed(rollouter: Rollouter) -> None:
        await asyncio.gather(*(rollouter.generate_sequences_single(sample(i)) for i in range(4)))

    SkipManager.init(training_config(tmp_path, role="async_rollout", steps=["0-3"]))
    asyncio.run(feed(Rollouter()))
    SkipManager.flush()
    SkipManager.init(training_config(tmp_path, role="async_rollout", steps=["0-3"], action="compare"))
    asyncio.run(feed(Rollouter(shift=1)))
    records = sorted(SkipManager.drift("async_rollout"), key=lambda r: r["step"])
    assert [(r["step"], r["passed"], r["worst_field"]) for r in records] == [(i, False, "responses") for i in range(4)]
    assert SkipManager.stats()["skip/async_rollout/compared"] == 4
    assert sorted(p.name for p in (run_path(tmp_path) / ".stepskip-drift").iterdir()) == [f"{i}.json" for i in range(4)]
