"""``action: compare`` for the V1 role (``rollout_tq``): the live trajectories are submitted to rollout as
usual and, as the replay buffer samples them, joined with the recorded ones by prompt and session and
compared; under ``train_on: recorded`` the trainer reads the recorded fields from the queue.

The trainer, agent loop and replay buffer are the small stand-ins of ``v1_harness`` over the in-process
queue (the real transfer_queue runs in tests/integration/tq)."""

from __future__ import annotations

import pytest
import v1_harness
from skip_configs import run_path, training_config
from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip.errors import DriftError
from stepskip.tq import InProcessTQClient


def config(tmp_path, sync_steps: int = 2, **fields) -> dict:
    cfg = training_config(tmp_path, role="rollout_tq", gbs=4, n=2, **fields)
    cfg["trainer"]["v1"] = {"trainer_mode": "sync", "sync": {"parameter_sync_step": sync_steps}}
    return cfg


def run(tmp_path, steps: int = 2, sync_steps: int = 2, **fields) -> list:
    trainer = V1Trainer(config(tmp_path, sync_steps, **fields), InProcessTQClient(), prompts_per_step=4, n=2,
                        sync_steps=sync_steps)
    return trainer.fit(steps)


def test_the_same_rollout_matches_per_trajectory(tmp_path):
    run(tmp_path)
    run(tmp_path, action="compare")
    records = SkipManager.drift("rollout_tq")
    assert [(r["step"], r["passed"], r["token_match"], r["prompts_equal"]) for r in records] == [
        (1, True, 1.0, True), (2, True, 1.0, True)]
    assert SkipManager.stats()["skip/rollout_tq/compared"] == 2
    assert (run_path(tmp_path, gbs=4) / ".stepskip-drift" / "1.json").is_file()


def _record_then_compare(tmp_path, monkeypatch, **fields) -> list:
    """Record two steps, then compare them while the live agent loop scores every trajectory one point higher."""
    run(tmp_path)
    original = v1_harness.trajectory_fields

    def shifted(*args, **kwargs):
        rows, td = original(*args, **kwargs)
        td["reward"] = td["reward"] + 1.0
        return rows, td

    monkeypatch.setattr(v1_harness, "trajectory_fields", shifted)
    return run(tmp_path, action="compare", **fields)


def test_drift_is_reported_and_train_on_recorded_feeds_the_recording(tmp_path, monkeypatch, caplog):
    reads = _record_then_compare(tmp_path, monkeypatch)
    records = SkipManager.drift("rollout_tq")
    assert [(r["step"], r["passed"], r["worst_field"], r["worst_delta"]) for r in records] == [
        (1, False, "reward", 1.0), (2, False, "reward", 1.0)]
    assert records[0]["token_match"] == 1.0  # the responses themselves did not change
    assert "step 1 drifted" in caplog.text and "'reward'" in caplog.text
    # what the trainer read from the queue: the recorded rewards (p * 10 + s), not the live ones
    for step_reads in reads:
        for meta, data in step_reads:
            expected = [float(int(k.split("_")[1]) + 10 * p) for k, p in zip(meta.keys, _prompt_ids(meta, data))]
            assert data["reward"].tolist() == expected


def _prompt_ids(meta, data) -> list[int]:
    return [int(row[0]) for row in data["prompts"].unbind()]


def test_train_on_live_leaves_the_queue_alone(tmp_path, monkeypatch):
    reads = _record_then_compare(tmp_path, monkeypatch, train_on="live")
    meta, data = reads[0][0]
    expected = [float(int(k.split("_")[1]) + 10 * p) + 1.0 for k, p in zip(meta.keys, _prompt_ids(meta, data))]
    assert data["reward"].tolist() == expected
    assert not SkipManager.drift("rollout_tq")[0]["passed"]


def test_on_drift_error_stops_at_the_first_compared_step(tmp_path, monkeypatch):
    with pytest.raises(DriftError, match=r"rollout_tq: step 1 drifted.*'reward'"):
        _record_then_compare(tmp_path, monkeypatch, on_drift="error")


def test_a_step_without_a_recording_is_recorded(tmp_path):
    run(tmp_path, steps=1, action="compare")
    assert (run_path(tmp_path, gbs=4) / "1" / "1" / "meta.json").is_file()  # both inner entries
    assert SkipManager.drift("rollout_tq") == [] and SkipManager.stats()["skip/rollout_tq/misses"] == 1


def test_a_damaged_step_is_counted_generated_and_reported(tmp_path):
    run(tmp_path, steps=1)
    data = run_path(tmp_path, gbs=4) / "1" / "0" / "data.safetensors"
    data.write_bytes(b"\0" * len(data.read_bytes()))
    run(tmp_path, steps=1, action="compare")
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/corrupt"] >= 1 and stats["skip/rollout_tq/compared"] == 0
    [report] = SkipManager.drift("rollout_tq")
    assert report["damaged"] is True and report["step"] == 1
    run(tmp_path, steps=1, action="compare")  # re-recorded live: compared now
    assert SkipManager.drift("rollout_tq")[0]["passed"] is True
