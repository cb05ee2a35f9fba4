"""verl 0.9.1's real ``RayPPOTrainer.fit()`` records and replays 3 GRPO steps through stepskip.

Runs in verl's own environment (tensordict 0.10), each run a fresh process (``verl_side/ray_ppo.py``):
verl's Hydra config composed from its ``ppo_trainer.yaml``, ``RLHFDataset`` over a parquet file
written by the test, the dataloader, the whole step body of ``fit`` (``AgentLoopManager
.generate_sequences`` with verl's own decorator served by stepskip, ``timing_raw.update(...)``,
``batch.union``, rewards, ``compute_advantage``). Stand-ins, because they need GPUs or inference
servers: the agent-loop worker handles (random responses, a rule reward), the actor worker group
(log-probs a fixed function of the token ids; it records what ``update_actor`` receives), the
checkpoint manager and the resource-pool manager.

Record run (``action: cache`` on an empty dir): 3 misses, 3 dumps, 3 generation calls. Replay run
(``action: replay``): no generation call, 3 hits, and the actor receives the very same responses,
advantages and old log-probs. With ``carry_uid`` the rollout output carries the prompts' ``uid``
(verl's colocated reward-model case), which differs on every run: verl's own skip crashes in
``batch.union`` there, stepskip's ``rebind_keys`` (default ``["uid"]``) makes the replay pass and
``rebind_keys: []`` reproduces verl's assertion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from verl_real_support import (
    assert_same_actor_inputs,
    load_tensors,
    needs_verl_env,
    ok,
    role_stats,
    run_scenario,
)

pytestmark = [pytest.mark.heavy, needs_verl_env]

STEPS = [1, 2, 3]


def skip_section(dump_dir: Path, action: str, fmt: str, **extra: object) -> dict:
    section = {"enable": True, "dump_dir": str(dump_dir), "steps": STEPS, "action": action, "format": fmt, **extra}
    if fmt == "verl":
        section["allow_pickle"] = True
    return section


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One record run per (format, carry_uid), shared by the replay tests of this module."""
    runs: dict[tuple[str, bool], tuple[Path, dict]] = {}

    def get(fmt: str, carry_uid: bool) -> tuple[Path, dict]:
        if (fmt, carry_uid) not in runs:
            base = tmp_path_factory.mktemp(f"record-{fmt}-{'uid' if carry_uid else 'plain'}")
            dump = base / "dump"
            report = ok(run_scenario("ray_ppo", {
                "skip": skip_section(dump, "cache", fmt), "carry_uid": carry_uid,
                "actor_inputs": str(base / "actor.pt"),
            }, base / "run"))
            runs[(fmt, carry_uid)] = (base, report)
        return runs[(fmt, carry_uid)]

    return get


FORMATS = [pytest.param("safe", id="safe"), pytest.param("verl", id="verl")]
UID = [pytest.param(False, id="plain"), pytest.param(True, id="carry-uid")]


@pytest.mark.parametrize("carry_uid", UID)
@pytest.mark.parametrize("fmt", FORMATS)
def test_record_run_generates_and_dumps_every_step(recorded, fmt, carry_uid):
    base, report = recorded(fmt, carry_uid)
    assert report["impl"] == "stepskip"  # verl's SkipManager really was stepskip's
    stats = role_stats(report, "rollout")
    assert (stats["misses"], stats["dumps"], stats["hits"]) == (3, 3, 0)
    assert report["generation_calls"] == 3 and report["actor_updates"] == 3
    steps = sorted({int(Path(f).parts[-2]) for f in report["dump_files"] if f.endswith("meta.json")})
    assert steps == STEPS
    # timing_raw.update(meta_info["timing"]) ran: the agent loop's timings reached the metrics
    assert all("timing_s/agent_loop/generate_sequences/mean" in entry["keys"] for entry in report["logged"])


@pytest.mark.parametrize("carry_uid", UID)
@pytest.mark.parametrize("fmt", FORMATS)
def test_replay_run_feeds_the_actor_the_recorded_step(recorded, tmp_path, fmt, carry_uid):
    base, _ = recorded(fmt, carry_uid)
    report = run_scenario("ray_ppo", {
        "skip": skip_section(base / "dump", "replay", fmt), "carry_uid": carry_uid,
        "actor_inputs": str(tmp_path / "actor.pt"),
    }, tmp_path / "run")
    ok(report)
    stats = role_stats(report, "rollout")
    assert report["generation_calls"] == 0
    assert (stats["hits"], stats["misses"], stats["dumps"]) == (3, 0, 0)
    first, second = load_tensors(base / "actor.pt"), load_tensors(tmp_path / "actor.pt")
    assert_same_actor_inputs(first, second)
    # the comparison means something: rewards varied within groups, so advantages are not all zero
    assert any(update["advantages"].abs().sum() > 0 for update in second)
    # the replayed step still reports the agent loop's timings (they come from the entry's meta_info)
    assert all("timing_s/agent_loop/generate_sequences/mean" in entry["keys"] for entry in report["logged"])
    if carry_uid:
        # the live run's uids were rebound onto the replayed batch, not the recorded run's
        assert second[0]["uid"] and second[0]["uid"] != first[0]["uid"]


def test_compare_generates_live_and_feeds_the_actor_the_recording(recorded, tmp_path):
    """``action: compare``: every step generates live (the stand-in's responses are random: they drift) and
    is compared; under ``train_on: recorded`` the actor receives exactly what the recording fed it."""
    base, _ = recorded("safe", True)
    report = ok(run_scenario("ray_ppo", {
        "skip": skip_section(base / "dump", "compare", "safe"), "carry_uid": True,
        "actor_inputs": str(tmp_path / "actor.pt"),
    }, tmp_path / "run"))
    stats = role_stats(report, "rollout")
    assert report["generation_calls"] == 3 and stats["compared"] == 3 and stats["dumps"] == 0
    assert_same_actor_inputs(load_tensors(base / "actor.pt"), load_tensors(tmp_path / "actor.pt"))
    drift = sorted((base / "dump").glob("*/*/.stepskip-drift/*.json"))
    assert [p.stem for p in drift] == ["1", "2", "3"]
    assert stats["drifted"] > 0  # the live responses were others: the actor saw the recording all the same


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_rebind_keys_the_replay_hits_verls_union_assertion(recorded, tmp_path, fmt):
    base, _ = recorded(fmt, True)
    report = run_scenario("ray_ppo", {
        "skip": skip_section(base / "dump", "replay", fmt, rebind_keys=[]), "carry_uid": True,
    }, tmp_path / "run")
    error = report.get("error")
    assert error is not None, "a replay without rebinding uid must fail as verl's own skip does"
    assert error["type"] == "AssertionError" and "`uid`" in error["message"], error
    assert "batch.union(gen_batch_output)" in error["traceback"]
    assert report["generation_calls"] == 0


def test_verls_own_skip_crashes_in_union_when_outputs_carry_uid(tmp_path):
    """The premise of ``rebind_keys``: verl 0.9.1's own RolloutSkip replays the recorded uids."""
    dump = tmp_path / "dump"
    section = {"enable": True, "dump_dir": str(dump), "steps": STEPS, "action": "cache"}
    first = ok(run_scenario("ray_ppo", {"impl": "verl", "skip": section, "carry_uid": True}, tmp_path / "a"))
    assert first["impl"] == "verl" and first["generation_calls"] == 3
    second = run_scenario("ray_ppo", {"impl": "verl", "skip": section, "carry_uid": True}, tmp_path / "b")
    assert second.get("error") and second["error"]["type"] == "AssertionError", second.get("error")
    assert "`uid`" in second["error"]["message"]
