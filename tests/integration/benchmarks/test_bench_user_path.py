"""benchmarks/bench_user_path.py still runs end to end (smallest sizes, one repeat), so it cannot rot.

It is a benchmark, not a test: nothing here looks at a timing. What is checked is that every part
ran through the real decorator and printed its table (the benchmark itself asserts the hit and
dump counters of each part). verl's side runs too when its environment exists (`make verl-env`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.heavy


def test_bench_user_path_smoke(tmp_path):
    """Every part at the smallest size, but the first calls' fresh processes (``--skip first``): the
    same code runs them at the tiny size in the ``--small`` smoke test below, which checks their rows."""
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_user_path.py"), "--smoke", "--threads",
                           "1", "--skip", "first", "--json", str(out)], capture_output=True, text=True, timeout=900,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for heading in ("colocated role, 16 x (16 + 32)", "V1 role (rollout_tq)", "async role (async_rollout)",
                    "per-call cost with N entries", "on object storage", "\ntargets, "):
        assert heading in done.stdout, (heading, done.stdout[-3000:])
    assert "a process's first" not in done.stdout, done.stdout[-3000:]  # left out, as asked
    results = json.loads(out.read_text())
    colocated = results["runs"][0]["colocated"]["stepskip"]
    assert colocated["bytes"] > 0 and "first_hit" not in colocated
    assert [row["entries"] for row in results["curve"]] == [10, 30]
    curve_s3 = results.get("curve_s3") or [{"error": "not run"}]
    if "error" not in curve_s3[0]:  # moto and s3fs installed: the requests of a call do not grow with the entries
        few, more = curve_s3
        assert (few["entries"], more["entries"]) == (10, 30)
        assert 0 < more["init"] == few["init"], (few, more)  # the start-up clean-up: one listing
        for action in ("cache", "repeat", "random", "replay", "match"):  # match's first call: the hint document
            assert 0 < more[action]["later"] == few[action]["later"], (action, few, more)
            assert more[action]["first"] == few[action]["first"], (action, few, more)
    if results["verl"]:
        verl = results["runs"][0]["colocated"]["verl"]
        assert "error" not in verl, verl
        assert verl["bytes"] > 0


def test_bench_user_path_small_smoke(tmp_path):
    """``--small`` runs only the debugging sizes' parts: the tiny size's colocated table with its first
    hit and first miss (each a fresh process, on verl's side too), repeat and random at two entry
    counts, the floor under the tiny hit beside it, and a targets table whose every row names its
    target and says met or missed."""
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_user_path.py"), "--small", "--smoke",
                           "--threads", "1", "--json", str(out)], capture_output=True, text=True, timeout=900,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    stdout = done.stdout
    for heading in ("colocated role, 32 x (128 + 256)", "a process's first hit", "a process's first miss",
                    "per-call cost with N entries", "repeat, listing", "\ntargets, "):
        assert heading in stdout, (heading, stdout[-3000:])
    for heading in ("V1 role", "async role", "on object storage", "colocated role, 16 x"):
        assert heading not in stdout, (heading, stdout[-3000:])
    results = json.loads(out.read_text())
    verl_ran = results["verl"]
    verdict = "(met|missed)" if verl_ran else "(met|missed|-)"
    for measure in ("steady-state hit", "first hit of a process", "first miss of a process"):
        line = rf"^  32 x \(128 \+ 256\)\s+1  {measure}\s+\S+ / \S+\s+\S+.*<= 1\s+{verdict}$"
        assert re.search(line, stdout, re.MULTILINE), (measure, stdout[-3000:])
    for action in ("repeat", "random"):
        for how in ("listing reused", "listed each call"):
            line = (rf"^  {action}, 30 vs 10 entries \({how}\)\s+added per call.*[+-]\d+\.\d\d ms.*"
                    r"<= \+1 ms\s+(met|missed)$")
            assert re.search(line, stdout, re.MULTILINE), (action, how, stdout[-3000:])
    (run,) = results["runs"]
    assert run["size"] == "32 x (128 + 256)" and set(run) == {"size", "threads", "colocated"}
    ours = run["colocated"]["stepskip"]
    for key in ("first_hit", "first_miss", "first_write", "init_hit", "init_miss"):
        assert len(ours[key]) == 1 and ours[key][0] > 0, (key, ours[key])
    assert ours["bytes"] > 0 and ours["peak"] > 0
    assert len(ours["hit"]) == 4  # a round's runs at a small size: 4 x --repeat
    # the floor under the hit: timed as the hit is (its tensors were checked equal to the hit's first),
    # shown beside the hit and judged in the targets table against the same verl hit
    assert len(ours["floor"]) == 4 and all(t > 0 for t in ours["floor"])
    assert "  floor under that hit (see hit_floor), touched" in stdout, stdout[-3000:]
    floor_row = r"^\s+its floor \(hit_floor\)\s+\S+ / \S+\s+\S+.*(target below the floor|floor under the target)$"
    assert re.search(floor_row, stdout, re.MULTILINE) or not verl_ran, stdout[-3000:]
    assert [row["entries"] for row in results["curve"]] == [10, 30]
    measures = [row["measure"] for row in results["targets"]]
    assert measures[:3] == ["steady-state hit", "first hit of a process", "first miss of a process"]
    assert len(measures) == 7 and all("30 vs 10 entries" in m for m in measures[3:]), measures
    if verl_ran:
        verl = run["colocated"]["verl"]
        assert "error" not in verl and "first_error" not in verl, verl
        assert len(verl["first_hit"]) == len(verl["first_miss"]) == 1
        assert all(row["met"] is not None for row in results["targets"]), results["targets"]
