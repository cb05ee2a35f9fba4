"""benchmarks/bench_content_fingerprint.py runs end to end and prints every figure; nothing here looks at a timing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_content_fingerprint.py"


def test_bench_content_fingerprint_prints_each_figure(tmp_path):
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, str(SCRIPT), "--data-mib", "1", "--vocab", "50", "--files", "3",
                           "--tries", "1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    figures = dict(re.findall(r"^  (.+?)\s+(-?\d+\.\d\d) ms$", done.stdout, re.MULTILINE))
    assert {"init, no content digests", "init, content digests (default)", "added by content digests",
            "code revision, first read (git ls-files + git status)", "all of them, as init reads them",
            "data file (1 MiB, hashed whole)"} <= set(figures), done.stdout


def test_bench_content_fingerprint_refuses_a_zero_size():
    done = subprocess.run([sys.executable, str(SCRIPT), "--data-mib", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "must be at least 1" in done.stderr
