"""benchmarks/bench_v1_floor.py: the lossless floor of the V1 step's bytes, printed against a run's bytes.

Nothing here looks at a timing. The floor is checked against what the script's own parts promise:
the entropy of a log-prob lies between the bounds that the float32 rounding of ``-5 * r`` allows, and
each row's figures are those of the V1 rows ``bench_user_path.py`` builds.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_v1_floor.py"

pytestmark = pytest.mark.heavy


def _floor_module():
    spec = importlib.util.spec_from_file_location("bench_v1_floor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_log_prob_carries_just_under_24_bits():
    bits = _floor_module().log_prob_bits()
    # -5 * r folds neighbouring draws onto one float32 only where 5 * r is 4 or more (r >= 0.8, a fifth of the
    # draws: there the float32 step, 8 * 2**-24, is wider than the draws' 5 * 2**-24, but not twice as wide,
    # so at most two draws share a value): those lose at most a bit each, the others none
    assert 24 - 0.2 * 1 - 1e-6 <= bits < 24


def test_the_floor_of_a_smoke_run_is_that_of_its_rows(tmp_path):
    results = tmp_path / "run.json"
    size = "16 x (16 + 32)"
    results.write_text(json.dumps({"runs": [{"size": size, "v1": {"verl": {"bytes": 40_000},
                                                                   "stepskip": {"bytes": 10_000}}}]}))
    done = subprocess.run([sys.executable, str(SCRIPT), "--mode", "smoke", "--results", str(results)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(rf"^{re.escape(size)}\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                    done.stdout, re.MULTILINE)
    assert row, done.stdout
    tokens, distinct = int(row[1]), int(row[2])
    floor_mb, target_mb, floor_ratio, ours_ratio = (float(row[i]) for i in (4, 5, 6, 7))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_user_path import make_inputs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    v1 = make_inputs(16, 16, 32)["v1"]["tensors"]
    assert tokens == sum(len(r) for r in v1["responses"]) == sum(len(r) for r in v1["rollout_log_probs"])
    assert distinct == np.unique(np.concatenate(v1["rollout_log_probs"]).view(np.uint32)).size
    assert (target_mb, ours_ratio) == (round(0.12 * 40_000 / 1e6, 2), 0.25)
    id_bits = math.log2(int(np.concatenate(v1["responses"]).max()) + 1)
    floor_bytes = tokens * (_floor_module().log_prob_bits() + id_bits) / 8
    assert (floor_mb, floor_ratio) == (round(floor_bytes / 1e6, 2), round(floor_bytes / 40_000, 3))
    # each response token: its id's bits and at least 23.8 for its log-prob
    assert floor_ratio >= round(tokens * (23.8 + id_bits) / 8 / 40_000, 3) > 0


def test_a_size_the_run_did_not_hold_is_named(tmp_path):
    results = tmp_path / "run.json"
    results.write_text(json.dumps({"runs": [{"size": "16 x (16 + 32)", "v1": {"verl": {"error": "no verl"}}}]}))
    done = subprocess.run([sys.executable, str(SCRIPT), "--mode", "smoke", "--results", str(results)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^16 x \(16 \+ 32\)\s+not in that run$", done.stdout, re.MULTILINE), done.stdout
