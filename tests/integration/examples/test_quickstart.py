"""The quickstart example and verl-style `skip.rollout.*` command lines, run as a user would."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart.py"


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(QUICKSTART), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def modes(output: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"step (\d+): (generated|replayed)", output)}


def test_default_demo_records_then_replays():
    out = run()
    runs = out.split("run 2:")
    assert modes(runs[0]) == {1: "generated", 2: "generated", 3: "generated", 4: "generated", 5: "generated"}
    assert modes(runs[1]) == {1: "replayed", 2: "replayed", 3: "replayed", 4: "generated", 5: "generated"}
    assert "replayed identically from run 1: [1, 2, 3]" in out


def test_verl_style_command_lines_and_partial_cache(tmp_path):
    dump = tmp_path / "rollout_dump"
    args = ["skip.rollout.enable=True", f"skip.rollout.dump_dir={dump}", "skip.rollout.steps=[1,2,3,10]",
            "skip.rollout.action=cache", "--runs", "1"]
    first = modes(run(*args))
    assert first == dict.fromkeys(range(1, 6), "generated")
    run_dir = dump / "quickstart_stepskip" / "GBS4_N2_in8_out16"
    assert sorted(p.name for p in run_dir.iterdir()) == ["1", "2", "3"]
    shutil.rmtree(run_dir / "2")
    second = modes(run(*args))
    assert second == {1: "replayed", 2: "generated", 3: "replayed", 4: "generated", 5: "generated"}
    third = modes(run(*args))
    assert third == {1: "replayed", 2: "replayed", 3: "replayed", 4: "generated", 5: "generated"}


def test_step_ranges_from_the_command_line(tmp_path):
    out = run(f"skip.rollout.dump_dir={tmp_path}", "skip.rollout.steps=[\"2-4:2\"]")
    assert modes(out.split("run 2:")[1]) == {1: "generated", 2: "replayed", 3: "generated", 4: "replayed",
                                            5: "generated"}
