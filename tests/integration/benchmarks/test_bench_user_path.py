"""benchmarks/bench_user_path.py still runs end to end (smallest sizes, one repeat), so it cannot rot.

It is a benchmark, not a test: nothing here looks at a timing. What is checked is that every part
ran through the real decorator and printed its table (the benchmark itself asserts the hit and
dump counters of each part). verl's side runs too when its environment exists (`make verl-env`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.heavy


def test_bench_user_path_smoke(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_user_path.py"), "--smoke", "--threads",
                           "1", "--json", str(out)], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    for heading in ("colocated role, 16 x (16 + 32)", "V1 role (rollout_tq)", "async role (async_rollout)",
                    "per-call cost with N entries", "on object storage"):
        assert heading in done.stdout, (heading, done.stdout[-3000:])
    results = json.loads(out.read_text())
    colocated = results["runs"][0]["colocated"]["stepskip"]
    assert colocated["bytes"] > 0 and colocated["peak"] > 0
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
