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
between stepskip and verl's own skip through ``format: verl``. The runs of one skip implementation
that follow one another share a process (one import of verl, one Ray and TransferQueue), as a
trainer process running again would.
"""

from __future__ import annotations

import json

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


def check_recorded(report: dict, impl: str) -> dict:
    report = ok(report)
    assert report["impl"] == impl
    assert report["generation_calls"] == 3 and report["actor_updates"] == 3
    if impl == "stepskip":
        stats = role_stats(report, "rollout_tq")
        assert (stats["misses"], stats["dumps"], stats["hits"]) == (3, 3, 0)
    return report


def scenario_runs(impl: str, runs: list[dict], work) -> dict[str, dict]:
    """``runs`` one after another in one verl-env process (one import of verl, one Ray and TransferQueue:
    seconds a run); each run's report by name, with the process's log."""
    report = ok(run_scenario("v1", {"impl": impl, "runs": runs}, work))
    return {entry["name"]: dict(entry, log=report["log"]) for entry in report["runs"]}


@pytest.fixture(scope="module")
def v1_runs(tmp_path_factory) -> tuple:
    """Every run of this module, in three processes: verl's own skip records; stepskip records (``format:
    safe``), replays and compares that recording, records in ``format: verl`` and replays verl's recording;
    verl's own skip replays stepskip's ``format: verl`` recording. Returns the base directory (the actor
    inputs of each run in ``<name>.pt`` there) and each run's report by name."""
    base = tmp_path_factory.mktemp("v1-runs")
    recorded, verl_recorded, ours_in_verl = base / "record" / "dump", base / "verl_record" / "dump", \
        base / "record_verl_format" / "dump"
    reports = scenario_runs("verl", [
        {"name": "verl_record", "skip": section(verl_recorded, "cache"),
         "actor_inputs": str(base / "verl_record.pt")},
    ], base / "verl-1")
    reports |= scenario_runs("stepskip", [
        {"name": "record", "skip": section(recorded, "cache", "safe"), "actor_inputs": str(base / "record.pt")},
        {"name": "replay", "skip": section(recorded, "replay", "safe"), "actor_inputs": str(base / "replay.pt"),
         "logger": ["console", "file"], "env": {"VERL_FILE_LOGGER_PATH": str(base / "metrics.jsonl")}},
        {"name": "compare", "skip": section(recorded, "compare", "safe"), "actor_inputs": str(base / "compare.pt")},
        {"name": "record_verl_format", "skip": section(ours_in_verl, "cache", "verl"),
         "actor_inputs": str(base / "record_verl_format.pt")},
        {"name": "replay_verls", "skip": section(verl_recorded, "replay", "verl"),
         "actor_inputs": str(base / "replay_verls.pt")},
    ], base / "stepskip")
    reports |= scenario_runs("verl", [
        {"name": "verl_replays_ours", "skip": section(ours_in_verl, "cache"),
         "actor_inputs": str(base / "verl_replays_ours.pt")},
    ], base / "verl-2")
    return base, reports


def test_stepskip_records_and_replays_the_v1_trainer(v1_runs):
    base, reports = v1_runs
    recorded = check_recorded(reports["record"], "stepskip")
    steps = sorted({int(f.split("/")[-3]) for f in recorded["dump_files"] if f.endswith("meta.json")})
    assert steps == STEPS

    metrics = base / "metrics.jsonl"  # verl's file logger: what every Tracking backend received
    replayed = ok(reports["replay"])
    stats = role_stats(replayed, "rollout_tq")
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    per_step = [(line["step"], line["data"]["skip/rollout_tq/hits"], line["data"]["skip/rollout_tq/misses"])
                for line in lines if "skip/rollout_tq/hits" in line["data"]]
    assert per_step == [(step, 1, 0) for step in STEPS]  # each step's own hit, through verl's Tracking
    assert replayed["generation_calls"] == 0 and replayed["generated_trajectories"] == 0
    assert (stats["hits"], stats["misses"], stats["dumps"]) == (3, 0, 0)
    first, second = load_tensors(base / "record.pt"), load_tensors(base / "replay.pt")
    assert_same_actor_rows(first, second)
    assert any(float(row.abs().sum()) > 0 for update in second for row in update["advantages"])


def test_compare_generates_live_and_feeds_the_actor_the_recorded_rows(v1_runs):
    """``action: compare`` on the V1 trainer: every step is submitted to rollout live and its sampled
    trajectories compared with the recording; under ``train_on: recorded`` the actor reads the recorded rows."""
    base, reports = v1_runs
    compared = ok(reports["compare"])
    stats = role_stats(compared, "rollout_tq")
    assert compared["generation_calls"] == 3 and stats["compared"] == 3 and stats["dumps"] == 0
    assert stats["drifted"] > 0  # the live trajectories were others: the actor read the recorded ones
    assert_same_actor_rows(load_tensors(base / "record.pt"), load_tensors(base / "compare.pt"))


def test_what_verls_own_skip_records_stepskip_replays(v1_runs):
    base, reports = v1_runs
    check_recorded(reports["verl_record"], "verl")
    replayed = reports["replay_verls"]
    ok(replayed)
    stats = role_stats(replayed, "rollout_tq")
    assert replayed["generation_calls"] == 0
    assert (stats["hits"], stats["misses"], stats["corrupt"]) == (3, 0, 0)
    assert_same_actor_rows(load_tensors(base / "verl_record.pt"), load_tensors(base / "replay_verls.pt"))


def test_what_stepskip_records_in_verl_format_verls_own_skip_replays(v1_runs):
    base, reports = v1_runs
    check_recorded(reports["record_verl_format"], "stepskip")
    replayed = reports["verl_replays_ours"]
    ok(replayed)
    assert replayed["impl"] == "verl"
    assert replayed["generation_calls"] == 0
    assert_same_actor_rows(load_tensors(base / "record_verl_format.pt"),
                           load_tensors(base / "verl_replays_ours.pt"))
