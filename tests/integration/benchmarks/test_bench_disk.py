"""benchmarks/bench_disk.py runs end to end and cleans up after itself; nothing here looks at a timing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_disk.py"


def test_bench_disk_prints_every_kind_and_leaves_nothing_behind(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--mib", "1", "--tries", "2", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.match(rf"bench_disk: 1 MiB per file in {re.escape(str(tmp_path.resolve()))} \(\w+\), 2 tries", done.stdout)
    rows = re.findall(r"^  (.+?)\s+(\d+\.\d) \(\s*(\d+\.\d)\)\s+(\d+\.\d)$", done.stdout, re.MULTILINE)
    names = [name for name, *_ in rows]
    assert "page cache + fsync" in names and "page cache, no sync (verl)" in names, done.stdout
    if "refuses O_DIRECT" not in done.stdout:
        assert [n for n in names if n.startswith("O_DIRECT")] == [
            "O_DIRECT + fsync, 1 writer", "O_DIRECT + fsync, 2 writers", "O_DIRECT + fsync, 4 writers"]
    for _, best, median, worst in rows:
        assert float(best) <= float(median) <= float(worst)
    assert list(tmp_path.iterdir()) == []


def test_bench_disk_refuses_an_empty_file_size(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--mib", "0", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--mib and --tries must be at least 1" in done.stderr


def test_bench_disk_refuses_a_missing_directory(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dir", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not a directory" in done.stderr


def test_a_failing_writer_fails_the_run_instead_of_timing_nothing(tmp_path, monkeypatch):
    import importlib.util
    import os

    import pytest

    spec = importlib.util.spec_from_file_location("bench_disk_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def refuse(fd, view, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", refuse)
    with pytest.raises(OSError, match="No space left"):
        module.write_file(str(tmp_path / "f"), memoryview(bytearray(8192)), 2, direct=False, sync=True)
    assert list(tmp_path.iterdir()) == []
