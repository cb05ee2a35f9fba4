"""The ``stepskip`` console script really starts, as a fresh process; the light commands start without torch.

Everything else about the commands is tested in process (``tests/unit/cli``); these are the few
things only a new interpreter shows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cli_caches import FIXTURE_RUN, SAFE_RUN

ENV = {**os.environ, "COLUMNS": "200", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}

#: Runs one command through the console script's entry point, then says which heavy modules it loaded.
PROBE = """
import json, sys
from stepskip.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "tensordict", "safetensors", "transformers") if m in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}))
"""


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=timeout)


def test_the_console_script_starts_and_lists_a_cache(local_runs: Path):
    script = Path(sys.executable).with_name("stepskip")
    assert script.exists(), "the package's console script is not installed next to this interpreter"
    version = run([str(script), "--version"])
    assert version.returncode == 0 and version.stdout.startswith("stepskip "), version
    listed = run([sys.executable, "-m", "stepskip", "ls", str(local_runs), "--json"])
    assert listed.returncode == 0, listed.stderr
    assert SAFE_RUN in {r["name"] for r in json.loads(listed.stdout)["runs"]}
    missing = run([sys.executable, "-m", "stepskip", "verify", str(local_runs / "nope")])
    assert missing.returncode == 2 and "no such file or directory" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_light_commands_start_without_torch(local_runs: Path, tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "GBS4_N2_in8_out6").mkdir()  # an empty run directory to prune
    commands = {
        "ls": ["ls", str(local_runs)],
        "verify": ["verify", str(local_runs)],
        "prune": ["prune", str(run_dir / "GBS4_N2_in8_out6"), "--keep-last", "1", "--dry-run"],
        "info": ["info", str(local_runs / FIXTURE_RUN / "1")],  # a pickle entry, not decoded without the flag
    }
    for name, args in commands.items():
        done = run([sys.executable, "-c", PROBE, *args])
        assert done.returncode == 0, (name, done.stderr)
        probe = json.loads(done.stdout.strip().splitlines()[-1])
        assert probe == {"code": 0, "heavy": []}, (name, probe)
    decoded = run([sys.executable, "-c", PROBE, "info", str(local_runs / SAFE_RUN / "1")])
    assert "torch" in json.loads(decoded.stdout.strip().splitlines()[-1])["heavy"]  # the probe can see torch
