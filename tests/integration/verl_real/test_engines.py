"""A run the cache serves builds no inference engine and syncs no weight, in verl 0.9.1's real trainers.

Runs in verl's own environment (tensordict 0.10), in one process (``verl_side/engines.py``) holding
several runs of both trainers, V0's first: ``RayPPOTrainer(...).init_workers()`` + ``fit()`` (V0) and
``PPOTrainerSync(config).init()`` + the agent-loop manager built as ``main_ppo`` builds it +
``fit(manager)`` (V1), over Ray (and TransferQueue for V1). Everything of verl runs for real:
``LLMServerManager.create``, ``AgentLoopManager(TQ).create``, ``CheckpointEngineManager`` with its
naive backend, ``RewardLoopManager``, the replay buffer and the whole step. Stand-ins only for what
needs GPUs or an inference server (``verl_side/engine_stand_ins.py``): the rollout replica (the
vLLM server: it counts constructions and sleeps), the actor worker group (a weight push wakes the
engine with the step's weights), the agent-loop worker class (it generates only on an awake engine,
else the run fails), the resource pools.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from verl_real_support import (
    assert_same_actor_inputs,
    assert_same_actor_rows,
    load_tensors,
    needs_verl_env,
    ok,
    role_stats,
    run_scenario,
)

pytestmark = [pytest.mark.heavy, needs_verl_env]


def section(dump: Path, steps: list[int], action: str, **extra: object) -> dict:
    return {"enable": True, "dump_dir": str(dump), "steps": steps, "action": action, **extra}


def v0_runs(base: Path) -> list[dict]:
    """Record 3 steps, replay them, add an uncached 4th step, ask for a 5th under engines: skip, validate."""
    dump = base / "dump"
    return [
        {"name": "record", "steps": 3, "skip": section(dump, [1, 2, 3], "cache"),
         "actor_inputs": str(base / "rec.pt")},
        {"name": "replay", "steps": 3, "skip": section(dump, [1, 2, 3], "replay"),
         "actor_inputs": str(base / "rep.pt")},
        {"name": "one_uncached", "steps": 4, "skip": section(dump, [1, 2, 3, 4], "cache")},
        {"name": "refused", "steps": 5, "skip": section(dump, [1, 2, 3, 4, 5], "cache", engines="skip")},
        {"name": "validate", "steps": 3, "validate": True, "skip": section(dump, [1, 2, 3], "replay")},
    ]


def v1_runs(base: Path) -> list[dict]:
    """V1: record, replay, one uncached step; a DAPO replay of a recording made without the filter; then
    ``colocate_async`` over that recording: one uncached step, and a replay resumed with prompts in flight."""
    dump, flat = base / "dump", base / "flat"
    return [
        {"name": "record", "steps": 3, "skip": section(dump, [1, 2, 3], "cache"),
         "actor_inputs": str(base / "rec.pt")},
        {"name": "replay", "steps": 3, "skip": section(dump, [1, 2, 3], "replay"),
         "actor_inputs": str(base / "rep.pt")},
        {"name": "one_uncached", "steps": 4, "skip": section(dump, [1, 2, 3, 4], "cache")},
        {"name": "record_flat", "steps": 2, "gen_batch_size": 1, "flat_groups": True,
         "skip": section(flat, [1, 2], "cache")},
        {"name": "refill", "steps": 2, "gen_batch_size": 1, "dapo": True, "skip": section(flat, [1, 2], "replay")},
        # the asynchronous modes fetch one prompt at a time (verl sets data.gen_batch_size=1): the recording
        # made with that batch size serves them, once the refill above has read it as it was
        {"name": "async_one_uncached", "steps": 3, "mode": "colocate_async", "skip": section(flat, [1, 2, 3], "cache")},
        {"name": "resumed", "steps": 3, "mode": "colocate_async", "resume_from": 1,
         "skip": section(flat, [1, 2, 3], "replay")},
    ]


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> dict[str, tuple[Path, dict[str, dict]]]:
    """The V0 runs, then the V1 runs, one after another in one verl-env process (one import of verl and
    one Ray, which the V1 runs' TransferQueue joins: seconds saved against a process each). Returns, per
    trainer, its base directory and its runs' reports by name."""
    base = tmp_path_factory.mktemp("engines")
    for trainer in ("v0", "v1"):
        (base / trainer).mkdir()
    specs = [{**run, "trainer": trainer, "name": f"{trainer}-{run['name']}"}
             for trainer, runs in (("v0", v0_runs(base / "v0")), ("v1", v1_runs(base / "v1"))) for run in runs]
    report = ok(run_scenario("engines", {"runs": specs}, base / "run"))
    assert report["impl"] == "stepskip"
    out: dict[str, tuple[Path, dict[str, dict]]] = {}
    for trainer in ("v0", "v1"):
        prefix = f"{trainer}-"
        out[trainer] = (base / trainer, {run["name"][len(prefix):]: run for run in report["runs"]
                                         if run["name"].startswith(prefix)})
    return out


@pytest.fixture(scope="module")
def v0(engine_runs) -> tuple[Path, dict[str, dict]]:
    return engine_runs["v0"]


@pytest.fixture(scope="module")
def v1(engine_runs) -> tuple[Path, dict[str, dict]]:
    return engine_runs["v1"]


def no_error(run: dict) -> dict:
    assert "error" not in run, run["error"]
    return run


def assert_recorded_with_the_engine(run: dict, steps: int) -> None:
    engine = no_error(run)["engine"]
    assert engine["replicas_constructed"] == 1 and engine["replicas_started"] == 1
    assert run["llm_server_manager"] == "LLMServerManager" and run["checkpoint_manager"] == "CheckpointEngineManager"
    # every step generated once, on an engine holding the weights of the step before (synced just in time)
    assert [(g["step"], g["weights"]) for g in engine["generations"]] == [(s, s - 1) for s in range(1, steps + 1)]
    assert engine["weight_syncs"] == list(range(steps))


def assert_generated_only_the_uncached_step(run: dict, step: int = 4) -> None:
    """Steps before ``step`` replayed, ``step`` generated: one engine, which saw the weights of the step
    before (the only sync: none on a replayed step, nor after the last) and generated ``step`` alone;
    the actor trained every step."""
    engine = no_error(run)["engine"]
    assert engine["replicas_constructed"] == 1
    assert [(g["step"], g["weights"]) for g in engine["generations"]] == [(step, step - 1)]
    assert engine["weight_syncs"] == [step - 1]
    assert run["actor_updates"] == step


def assert_no_engine(run: dict) -> None:
    engine = run["engine"]
    assert engine["replicas_constructed"] == 0 and engine["replicas_started"] == 0 and engine["workers_started"] == 0
    assert engine["weight_syncs"] == [] and engine["sleeps"] == 0 and engine["dispatches"] == 0
    assert run["gate"]["engines_skipped"] == 1 and run["gate"]["engines_started"] == 0
    assert run["plan_start"] is False


# --------------------------------------------------------------------------- V0: RayPPOTrainer


def test_v0_record_run_starts_the_engine_and_generates_every_step(v0):
    _, runs = v0
    assert_recorded_with_the_engine(runs["record"], 3)
    assert role_stats(runs["record"], "rollout")["misses"] == 3


def test_v0_replay_only_run_builds_no_engine_syncs_no_weights_and_trains_the_recording(v0):
    base, runs = v0
    run = no_error(runs["replay"])
    assert_no_engine(run)
    assert run["llm_server_manager"] == "NoEngineServerManager"
    assert run["checkpoint_manager"] == "NoEngineCheckpointManager"
    assert role_stats(run, "rollout")["hits"] == 3 and run["actor_updates"] == 3
    recorded, replayed = load_tensors(base / "rec.pt"), load_tensors(base / "rep.pt")
    assert_same_actor_inputs(recorded, replayed)
    assert any(update["advantages"].abs().sum() > 0 for update in replayed)


def test_v0_one_uncached_step_starts_the_engine_and_generates_exactly_that_step(v0):
    _, runs = v0
    run = runs["one_uncached"]
    assert_generated_only_the_uncached_step(run)
    assert run["gate"]["sleeps_skipped"] == 3  # the replayed steps' replicas were never woken
    stats = role_stats(run, "rollout")
    assert (stats["hits"], stats["misses"]) == (3, 1)


def test_v0_engines_skip_refuses_at_start_up_naming_the_uncached_step(v0):
    _, runs = v0
    run = runs["refused"]
    error = run["error"]
    assert error["type"] == "SkipConfigError"
    assert "skip.rollout.engines = skip" in error["message"] and "not served from the cache: 5" in error["message"]
    assert run["engine"]["replicas_constructed"] == 0 and run["actor_updates"] == 0


def test_v0_validation_starts_the_engine_under_auto_and_is_not_skipped(v0):
    _, runs = v0
    run = no_error(runs["validate"])
    engine = run["engine"]
    assert run["plan_start"] is True and engine["replicas_constructed"] == 1
    assert [g["validate"] for g in engine["generations"]] == [True]  # validation only: the steps replayed
    assert role_stats(run, "rollout")["hits"] == 3


# --------------------------------------------------------------------------- V1: PPOTrainerSync


def test_v1_record_run_starts_the_engine_and_generates_every_step(v1):
    _, runs = v1
    assert_recorded_with_the_engine(runs["record"], 3)


def test_v1_replay_only_run_builds_no_engine_syncs_no_weights_and_trains_the_recording(v1):
    base, runs = v1
    run = no_error(runs["replay"])
    assert_no_engine(run)
    assert role_stats(run, "rollout_tq")["hits"] == 3 and run["actor_updates"] == 3
    assert_same_actor_rows(load_tensors(base / "rec.pt"), load_tensors(base / "rep.pt"))


def test_v1_one_uncached_step_starts_the_engine_and_generates_exactly_that_step(v1):
    _, runs = v1
    run = runs["one_uncached"]
    assert_generated_only_the_uncached_step(run)
    stats = role_stats(run, "rollout_tq")
    assert (stats["hits"], stats["misses"]) == (3, 1)


def test_v1_colocate_async_one_uncached_step_syncs_weights_only_for_the_engine_generating_it(v1):
    """The asynchronous V1 mode syncs weights at every step's end (``on_step_end``, and after loading
    the checkpoint): on the two replayed steps none reaches the engine, and the sync skipped at step 2's
    end is not lost: the engine generates step 3 with step 2's weights. The replicas, put to sleep once
    after start-up, are never woken for a replayed step, so never put to sleep again before step 3."""
    _, runs = v1
    run = runs["async_one_uncached"]
    assert_generated_only_the_uncached_step(run, step=3)
    assert run["engine"]["sleeps"] == 2  # after start-up, after step 3's generation
    assert run["gate"]["weight_syncs"] == 1 and run["gate"]["weight_syncs_deferred"] == 4
    stats = role_stats(run, "rollout_tq")
    assert (stats["hits"], stats["misses"]) == (2, 1)


def test_v1_resume_reissues_in_flight_prompts_of_a_replayed_step_from_the_cache_not_the_engine(v1):
    """An asynchronous V1 run resumes from a checkpoint whose queue holds a batch of prompts in flight
    (pending, with their prompt fields, as verl's async submit leaves them); verl's ``_load_checkpoint``
    restores the queue and ``fit`` re-issues those prompts for the resumed step 2, which the cache
    replays: they were recorded at step 1, and verl stamps them with step 2 now, so each is found by
    its prompt alone and served from the recording (none dropped); none reaches an engine (none is
    built: a dispatch would fail the run), and the run trains its two steps."""
    _, runs = v1
    run = no_error(runs["resumed"])
    assert len(run["inflight"]["uids"]) == 4
    assert_no_engine(run)
    counts = run["gate"]
    assert (counts["reissued_prompts_from_cache"], counts["reissued_prompts_dropped"]) == (4, 0)
    assert run["actor_updates"] == 2
    assert role_stats(run, "rollout_tq")["hits"] == 2


def test_v1_refill_of_a_replayed_step_never_reaches_an_engine(v1):
    """The DAPO filter evicts a replayed group (the recording ran without it): the replay buffer's
    refill fires on the replayed step and takes the next prompts of the data. Step 1's refill gets
    the two prompts recorded at step 2, served from the cache by their prompts (verl stamps them with
    step 1 now); step 2's refill gets prompts never recorded, so the run stops with an error naming
    the step, instead of generating (or waiting forever for an engine)."""
    _, runs = v1
    no_error(runs["record_flat"])
    run = runs["refill"]
    assert run["error"]["type"] == "ReplayMissError", run.get("error")
    message = run["error"]["message"]
    stopped = re.search(r"step (\d+) is replayed from the cache", message)
    assert stopped and "refill" in message
    # at least the flat group the engine made (others may tie by chance): each evicted group asks for two;
    # those the cache holds are served, the rest refused
    asked = re.search(r"asked for (\d+) more prompts", message)
    assert asked and int(asked[1]) >= run["gate"]["refill_prompts_refused"] >= 2
    if int(stopped[1]) == 2:
        assert run["gate"]["refill_prompts_from_cache"] >= 2 and run["actor_updates"] == 1
    else:  # a tie at step 1 evicted another group: its refill reached past the recorded prompts
        assert int(stopped[1]) == 1
    assert_no_engine(run)
