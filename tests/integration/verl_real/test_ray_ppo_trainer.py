"""verl 0.9.1's real ``RayPPOTrainer.fit()`` records and replays 3 GRPO steps through stepskip.

Runs in verl's own environment (tensordict 0.10), the stepskip runs one after another in one process,
verl's own skip's in a process of its own (``verl_side/ray_ppo.py``):
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


FORMATS = [pytest.param("safe", id="safe"), pytest.param("verl", id="verl")]
UID = [pytest.param(False, id="plain"), pytest.param(True, id="carry-uid")]


def tag(fmt: str, carry_uid: bool) -> str:
    return f"{fmt}-{'uid' if carry_uid else 'plain'}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """Every stepskip run of this module, one after another in one verl-env process (one import of verl:
    seconds a run): a record run per (format, carry_uid), the replay of each, a compare of the ``safe``
    recording with uids, and a replay without ``rebind_keys`` of each format's recording with uids.
    Returns the base directory (a recording's dump dir ``record-<tag>/dump``, the actor inputs of each
    run in ``<name>.pt``) and each run's report by name, with the process's log."""
    base = tmp_path_factory.mktemp("ray-ppo")
    pairs = [(fmt, carry_uid) for fmt in ("safe", "verl") for carry_uid in (False, True)]
    specs = [{"name": f"record-{tag(*pair)}", "skip": skip_section(base / f"record-{tag(*pair)}" / "dump", "cache",
                                                                     pair[0]),
              "carry_uid": pair[1], "actor_inputs": str(base / f"record-{tag(*pair)}.pt")} for pair in pairs]
    specs += [{"name": f"replay-{tag(*pair)}", "skip": skip_section(base / f"record-{tag(*pair)}" / "dump", "replay",
                                                                     pair[0]),
               "carry_uid": pair[1], "actor_inputs": str(base / f"replay-{tag(*pair)}.pt")} for pair in pairs]
    specs.append({"name": "compare", "skip": skip_section(base / "record-safe-uid" / "dump", "compare", "safe"),
                  "carry_uid": True, "actor_inputs": str(base / "compare.pt")})
    specs += [{"name": f"no-rebind-{fmt}", "skip": skip_section(base / f"record-{fmt}-uid" / "dump", "replay", fmt,
                                                                 rebind_keys=[]),
               "carry_uid": True} for fmt in ("safe", "verl")]
    report = ok(run_scenario("ray_ppo", {"runs": specs}, base / "run"))
    return base, {entry["name"]: dict(entry, log=report["log"]) for entry in report["runs"]}


@pytest.mark.parametrize("carry_uid", UID)
@pytest.mark.parametrize("fmt", FORMATS)
def test_record_run_generates_and_dumps_every_step(runs, fmt, carry_uid):
    _, reports = runs
    report = ok(reports[f"record-{tag(fmt, carry_uid)}"])
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
def test_replay_run_feeds_the_actor_the_recorded_step(runs, fmt, carry_uid):
    base, reports = runs
    ok(reports[f"record-{tag(fmt, carry_uid)}"])
    report = ok(reports[f"replay-{tag(fmt, carry_uid)}"])
    stats = role_stats(report, "rollout")
    assert report["generation_calls"] == 0
    assert (stats["hits"], stats["misses"], stats["dumps"]) == (3, 0, 0)
    first = load_tensors(base / f"record-{tag(fmt, carry_uid)}.pt")
    second = load_tensors(base / f"replay-{tag(fmt, carry_uid)}.pt")
    assert_same_actor_inputs(first, second)
    # the comparison means something: rewards varied within groups, so advantages are not all zero
    assert any(update["advantages"].abs().sum() > 0 for update in second)
    # the replayed step still reports the agent loop's timings (they come from the entry's meta_info)
    assert all("timing_s/agent_loop/generate_sequences/mean" in entry["keys"] for entry in report["logged"])
    if carry_uid:
        # the live run's uids were rebound onto the replayed batch, not the recorded run's
        assert second[0]["uid"] and second[0]["uid"] != first[0]["uid"]


def test_compare_generates_live_and_feeds_the_actor_the_recording(runs):
    """``action: compare``: every step generates live (the stand-in's responses are random: they drift) and
    is compared; under ``train_on: recorded`` the actor receives exactly what the recording fed it."""
    base, reports = runs
    report = ok(reports["compare"])
    stats = role_stats(report, "rollout")
    assert report["generation_calls"] == 3 and stats["compared"] == 3 and stats["dumps"] == 0
    assert_same_actor_inputs(load_tensors(base / "record-safe-uid.pt"), load_tensors(base / "compare.pt"))
    drift = sorted((base / "record-safe-uid" / "dump").glob("*/*/.stepskip-drift/*.json"))
    assert [p.stem for p in drift] == ["1", "2", "3"]
    assert stats["drifted"] > 0  # the live responses were others: the actor saw the recording all the same


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_rebind_keys_the_replay_hits_verls_union_assertion(runs, fmt):
    _, reports = runs
    ok(reports[f"record-{fmt}-uid"])
    report = reports[f"no-rebind-{fmt}"]
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
