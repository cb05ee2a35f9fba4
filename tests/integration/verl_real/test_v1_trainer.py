"""verl 0.9.1's real V1 ``PPOTrainerSync`` records and replays through stepskip over the real TransferQueue.

Each run is a fresh process in verl's own environment (``verl_side/v1.py``) with Ray on 2 CPUs and
transfer_queue 0.1.11 (one storage unit): verl's Hydra config, ``RLHFDataset`` and dataloader,
``PPOTrainerSync.fit`` with its real ``ReplayBuffer``; verl's own ``annotate_tq`` decorators on
``_add_batch_to_generate`` (submit) and ``ReplayBuffer.sample`` (sample) are served by stepskip
(or, where the test says so, by verl's own skip). Stand-ins, because they need GPUs or inference
servers: the agent-loop manager (writes trajectories to the queue with the keys, fields and tags
verl's ``AgentLoopWorkerTQ`` writes), the actor worker group (log-probs a fixed function of the
token ids, written back to the queue; it records what ``update_actor`` reads), the reward-loop
manager's worker handles, the checkpoint and resource-pool managers.

Replay runs must generate nothing and feed the actor the recorded rows; cross-reads go both ways
between stepskip and verl's own skip through ``format: verl``.
"""

from __future__ import annotations

import json
import shutil

import pytest
from verl_real_support import (
    assert_same_actor_rows,
    load_tensors,
    needs_verl_env,
    ok,
    role_stats,
    run_scenario,
)

pytestmark = [pytest.mark.heavy, needs_verl_env]

STEPS = [1, 2, 3]


def section(dump_dir, action: str, fmt: str | None = None) -> dict:
    out = {"enable": True, "dump_dir": str(dump_dir), "steps": STEPS, "action": action}
    if fmt is not None:
        out["format"] = fmt
        if fmt == "verl":
            out["allow_pickle"] = True
    return out


def record(tmp_path, impl: str, fmt: str | None) -> dict:
    report = ok(run_scenario("v1", {"impl": impl, "skip": section(tmp_path / "dump", "cache", fmt),
                                    "actor_inputs": str(tmp_path / "record.pt")}, tmp_path / "record"))
    assert report["impl"] == impl
    assert report["generation_calls"] == 3 and report["actor_updates"] == 3
    if impl == "stepskip":
        stats = role_stats(report, "rollout_tq")
        assert (stats["misses"], stats["dumps"], stats["hits"]) == (3, 3, 0)
    return report


@pytest.fixture(scope="module")
def stepskip_recording(tmp_path_factory) -> tuple:
    """One recording by stepskip (``format: safe``) for the tests that replay or compare against it."""
    where = tmp_path_factory.mktemp("v1-recording")
    return where, record(where, "stepskip", "safe")


def recording_in(tmp_path, stepskip_recording) -> dict:
    """A copy of the module's recording (dump dir and the actor inputs it trained on) under ``tmp_path``."""
    where, report = stepskip_recording
    shutil.copytree(where / "dump", tmp_path / "dump")
    shutil.copy(where / "record.pt", tmp_path / "record.pt")
    return report


def test_stepskip_records_and_replays_the_v1_trainer(tmp_path, stepskip_recording):
    recorded = recording_in(tmp_path, stepskip_recording)
    steps = sorted({int(f.split("/")[-3]) for f in recorded["dump_files"] if f.endswith("meta.json")})
    assert steps == STEPS

    metrics = tmp_path / "metrics.jsonl"  # verl's file logger: what every Tracking backend received
    replayed = ok(run_scenario("v1", {"skip": section(tmp_path / "dump", "replay", "safe"),
                                      "actor_inputs": str(tmp_path / "replay.pt"), "logger": ["console", "file"],
                                      "env": {"VERL_FILE_LOGGER_PATH": str(metrics)}}, tmp_path / "replay"))
    stats = role_stats(replayed, "rollout_tq")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    per_step = [(line["step"], line["data"]["skip/rollout_tq/hits"], line["data"]["skip/rollout_tq/misses"])
                for line in lines if "skip/rollout_tq/hits" in line["data"]]
    assert per_step == [(step, 1, 0) for step in STEPS]  # each step's own hit, through verl's Tracking
    assert replayed["generation_calls"] == 0 and replayed["generated_trajectories"] == 0
    assert (stats["hits"], stats["misses"], stats["dumps"]) == (3, 0, 0)
    first, second = load_tensors(tmp_path / "record.pt"), load_tensors(tmp_path / "replay.pt")
    assert_same_actor_rows(first, second)
    assert any(float(row.abs().sum()) > 0 for update in second for row in update["advantages"])


def test_compare_generates_live_and_feeds_the_actor_the_recorded_rows(tmp_path, stepskip_recording):
    """``action: compare`` on the V1 trainer: every step is submitted to rollout live and its sampled
    trajectories compared with the recording; under ``train_on: recorded`` the actor reads the recorded rows."""
    recording_in(tmp_path, stepskip_recording)
    compared = ok(run_scenario("v1", {"skip": section(tmp_path / "dump", "compare", "safe"),
                                      "actor_inputs": str(tmp_path / "compare.pt")}, tmp_path / "compare"))
    stats = role_stats(compared, "rollout_tq")
    assert compared["generation_calls"] == 3 and stats["compared"] == 3 and stats["dumps"] == 0
    assert stats["drifted"] > 0  # the live trajectories were others: the actor read the recorded ones
    assert_same_actor_rows(load_tensors(tmp_path / "record.pt"), load_tensors(tmp_path / "compare.pt"))


def test_what_verls_own_skip_records_stepskip_replays(tmp_path):
    record(tmp_path, "verl", None)
    replayed = run_scenario("v1", {"skip": section(tmp_path / "dump", "replay", "verl"),
                                   "actor_inputs": str(tmp_path / "replay.pt")}, tmp_path / "replay")
    ok(replayed)
    stats = role_stats(replayed, "rollout_tq")
    assert replayed["generation_calls"] == 0
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (3, 0, 0)
    assert_same_actor_rows(load_tensors(tmp_path / "record.pt"), load_tensors(tmp_path / "replay.pt"))


def test_what_stepskip_records_in_verl_format_verls_own_skip_replays(tmp_path):
    record(tmp_path, "stepskip", "verl")
    replayed = run_scenario("v1", {"impl": "verl", "skip": section(tmp_path / "dump", "cache"),
                                   "actor_inputs": str(tmp_path / "replay.pt")}, tmp_path / "replay")
    ok(replayed)
    assert replayed["impl"] == "verl"
    assert replayed["generation_calls"] == 0
    assert_same_actor_rows(load_tensors(tmp_path / "record.pt"), load_tensors(tmp_path / "replay.pt"))
