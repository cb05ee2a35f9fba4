"""The bookkeeping of benchmarks/bench_replay_run.py: what it reads from the engine scenario's report.
Nothing here runs verl or looks at a timing (the scenario itself is tested by the engine tests)."""

from __future__ import annotations

import pytest
from scripts import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("benchmarks/bench_replay_run.py", "bench_replay_run") as module:
        yield module


def scenario_run(replicas: int, syncs: list[int], start: float, asked: int = 0) -> dict:
    return {"engine": {"replicas_constructed": replicas, "workers_started": replicas, "weight_syncs": syncs,
                       "dispatches": len(syncs)},
            "gate": {"weight_sync_requests": asked},
            "timings": {"start_up_s": start, "first_trained_step_s": start + 1, "run_s": start + 2}}


def test_summary_counts_engine_parts_and_syncs_and_the_table_puts_runs_side_by_side(bench):
    record, replay = bench.summary(scenario_run(1, [0, 1, 2], 2.0)), bench.summary(scenario_run(0, [], 1.0))
    assert (record["replicas_built"], record["weight_syncs"], record["generations"]) == (1, 3, 3)
    assert (replay["replicas_built"], replay["weight_syncs"], replay["first_trained_step_s"]) == (0, 0, 2.0)
    text = bench.table("v0", record, replay)
    assert "weight_syncs" in text and "0.50" in text  # start-up: replay 1.0 s / record 2.0 s


def test_the_replay_with_an_engine_reports_syncs_asked_for_against_syncs_run(bench):
    started = bench.summary(scenario_run(1, [], 1.0, asked=4))
    assert (started["weight_syncs_asked"], started["weight_syncs"]) == (4, 0)
    line = bench.syncs_line("v1", 3, started)
    assert "engines: start, 3 replayed steps, 1 replicas built" in line
    assert "weight syncs 4 before -> 0 now (0.00 per replayed step)" in line
