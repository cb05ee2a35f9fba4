"""``stepskip prune``: by count, age and step list, per role; ``--dry-run`` removes nothing."""

from __future__ import annotations

import json
import os
import time

from cli_caches import ROLLOUT_STEPS, SAFE_RUN, V1_RUN
from cli_run import stepskip

from stepskip.cli import main
from stepskip.cli.verify import verify_runs
from stepskip._index import CacheIndex


def steps_of(path) -> list[int]:
    return sorted(int(name) for name in os.listdir(path) if name.isdigit())


def test_prune_by_count_age_and_steps(copy_cache, capsys):
    dry, by_count, by_age, by_steps = (copy_cache(name) for name in ("dry", "count", "age", "steps"))
    for step in (1, 2, 3):  # recorded ten days ago
        meta_path = by_age / SAFE_RUN / str(step) / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["created_unix"] = time.time() - 10 * 86400
        meta_path.write_text(json.dumps(meta))
    calls = [
        stepskip("prune", by_count / SAFE_RUN / "reward", "--keep-last", "1"),
        stepskip("prune", by_age / SAFE_RUN, "--older-than", "7d"),
        stepskip("prune", by_steps / V1_RUN, "--steps", "1,3"),
    ]
    # --dry-run in process (the console script's entry point) while the others run
    assert main(["prune", str(dry / SAFE_RUN), "--keep-last", "2", "--dry-run", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    counted, aged, listed = (c for c in calls)

    assert plan["dry_run"] is True and plan["removed"] == []
    assert [(r["role"], r["step"]) for r in plan["remove"]] == [("rollout", s) for s in ROLLOUT_STEPS[:-2]]
    assert steps_of(dry / SAFE_RUN) == ROLLOUT_STEPS  # nothing removed
    assert steps_of(dry / SAFE_RUN / "reward") == [1, 2]

    assert counted.code == 0, counted
    assert "removed 1 step" in counted.out
    assert steps_of(by_count / SAFE_RUN / "reward") == [2]  # the stage role's newest step kept
    assert steps_of(by_count / SAFE_RUN) == ROLLOUT_STEPS  # another role: untouched

    assert aged.code == 0, aged
    assert steps_of(by_age / SAFE_RUN) == ROLLOUT_STEPS[3:]
    assert steps_of(by_age / SAFE_RUN / "reward") == [1, 2]

    assert listed.code == 0, listed
    assert steps_of(by_steps / V1_RUN) == [2]  # V1 steps go whole, inner entries included

    for dump in (dry, by_count, by_age, by_steps):  # what is left is a valid cache, no trash behind
        index = CacheIndex(str(dump))
        report = verify_runs(index, index.runs())
        assert report.clean, report.problems


def test_prune_takes_the_drift_records_of_the_steps_it_removes(copy_cache, tmp_path):
    dump = copy_cache("drift")
    records = dump / SAFE_RUN / ".stepskip-drift"
    records.mkdir()
    for name in ("1.json", "2.json", "10.json", "2-c0-r0.json", "notes.txt"):
        (records / name).write_text("{}")
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (records / "3.json").symlink_to(outside)  # a link planted among the records: never followed

    result = stepskip("prune", dump / SAFE_RUN, "--steps", "1-3")

    assert result.code == 0, result
    assert steps_of(dump / SAFE_RUN) == [s for s in ROLLOUT_STEPS if s > 3]
    assert sorted(os.listdir(records)) == ["10.json", "3.json", "notes.txt"]
    assert outside.read_text() == "{}"
    index = CacheIndex(str(dump))
    report = verify_runs(index, index.runs())
    assert report.clean, report.problems
