"""The bookkeeping of benchmarks/bench_user_path.py: how rounds are merged and alternated, and the wait
for a settled filesystem. Nothing here looks at a timing: the disk wait's thresholds are forced."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from scripts import script_module


@pytest.fixture(scope="module")
def bench():
    with script_module("benchmarks/bench_user_path.py", "bench_user_path_helpers") as module:
        yield module


def test_rounds_merge_their_runs_and_rates_are_the_best_of_all(bench):
    first = {"miss": [3.0, 2.0], "write_runs": [100.0, 300.0], "write_per_s": 300.0, "bytes": 10,
             "median": {"miss": 2.5}}
    second = {"miss": [1.0], "write_runs": [200.0], "write_per_s": 200.0, "bytes": 11, "median": {"miss": 1.0}}
    out = bench.merged([first, second])
    assert out["miss"] == [3.0, 2.0, 1.0] and out["write_runs"] == [100.0, 300.0, 200.0]
    assert out["write_per_s"] == 300.0  # the best run of any round, not the last round's best
    assert out["bytes"] == 11  # what is not a list of runs comes from the last round
    assert out["median"] == {"miss": 2.0}  # medians of the joined runs
    assert first["miss"] == [3.0, 2.0]  # the rounds themselves are left alone


def test_a_failed_round_is_the_merged_result(bench):
    good = {"miss": [1.0]}
    assert bench.merged([good, {"error": "exit 1"}]) == {"error": "exit 1"}
    assert bench.merged([None, good]) is None  # verl's side absent
    assert bench.merged([]) is None


def test_alternate_runs_the_sides_in_turn_each_after_a_sync(bench, monkeypatch):
    order = []
    monkeypatch.setattr(bench, "quiet_disk", lambda: order.append("sync"))
    ours, theirs = bench.alternate(2, lambda r: order.append(f"ours{r}") or {"t": [r]},
                                   lambda r: order.append(f"verl{r}") or {"t": [10 + r]})
    assert order == ["sync", "ours0", "verl0", "sync", "ours1", "verl1"]
    assert ours["t"] == [0, 1] and theirs["t"] == [10, 11]


def test_settle_disk_returns_once_creating_is_cheap_and_keeps_its_probes(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "SETTLED_CREATE_SECONDS", float("inf"))
    line = bench.settle_disk(str(tmp_path))
    assert re.fullmatch(r"creating a directory and a file \d+\.\d\d ms after waiting \d+ s", line), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settle-0"]
    assert len(list((tmp_path / "settle-0").glob("*/f"))) == 64  # kept: deleting them would slow creations


def test_settle_disk_measures_again_until_its_time_is_up(bench, tmp_path, monkeypatch):
    sleeps = []
    clock = iter(range(0, 10_000, 200))  # each look at the clock 200 s later
    monkeypatch.setattr(bench, "SETTLED_CREATE_SECONDS", -1.0)  # never settled
    monkeypatch.setattr(bench, "time", SimpleNamespace(sleep=sleeps.append, perf_counter=lambda: float(next(clock))))
    monkeypatch.setattr(bench, "create_seconds", lambda where: 0.5)
    line = bench.settle_disk(str(tmp_path))
    assert sleeps == [bench.SETTLE_POLL_SECONDS]  # 200 s waited: once more; 400 s: past the limit
    assert line == "creating a directory and a file 500.00 ms after waiting 400 s"


def test_the_hit_target_loosens_as_the_batch_shrinks(bench):
    assert [bench.hit_target(rows) for rows in (16, 32, 255, 256, 512, 1023, 1024, 2048)] == \
        [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.3, 0.3]


def test_colocated_targets_are_judged_by_the_ratio_of_medians(bench):
    ours = {"hit": [1.0, 9.0, 2.0], "first_hit": [4.0], "first_miss": [3.0]}
    verl = {"hit": [1.5, 1.9, 2.1], "first_hit": [5.0], "first_miss": [2.0]}
    hit, first_hit, first_miss = bench.colocated_targets("32 x (128 + 256)", 32, 1, ours, verl)
    assert (hit["ratio"], hit["ratio_best"], hit["target"]) == (2.0 / 1.9, 1.0 / 1.5, 1.0)
    assert hit["met"] is False  # the best runs alone would have met it
    assert (first_hit["ratio"], first_hit["met"]) == (0.8, True)
    assert (first_miss["ratio"], first_miss["met"]) == (1.5, False)
    assert bench.colocated_targets("1024 x (1024 + 2048)", 1024, 1, ours, verl)[0]["target"] == 0.3
    unjudged = bench.colocated_targets("32 x (128 + 256)", 32, 1, ours, {"error": "no verl"})
    assert [row["met"] for row in unjudged] == [None, None, None]


def test_curve_targets_compare_two_thousand_entries_with_ten(bench):
    def row(entries, seconds):
        return {"entries": entries, "repeat": [seconds, seconds + 1.0], "repeat_listing": [seconds],
                "random": [0.001], "random_listing": [0.004]}

    curve = [row(10, 0.001), row(1000, 0.005), row(2000, 0.0015), row(10000, 0.009)]
    rows = {r["measure"]: r for r in bench.curve_targets(curve)}
    repeat = rows["repeat, 2000 vs 10 entries (listing reused)"]
    assert round(repeat["added_ms"], 6) == 0.5 and round(repeat["added_best_ms"], 6) == 0.5 and repeat["met"]
    assert round(rows["repeat, 2000 vs 10 entries (listed each call)"]["added_ms"], 6) == 0.5
    assert rows["random, 2000 vs 10 entries (listed each call)"]["added_ms"] == 0.0
    assert len(rows) == 4
    late = bench.curve_targets([row(10, 0.001), row(30, 0.003)])  # a run without 2,000: its largest count
    assert [r["measure"] for r in late][0] == "repeat, 30 vs 10 entries (listing reused)" and not late[0]["met"]
    assert bench.curve_targets([row(10, 0.001)]) == []
