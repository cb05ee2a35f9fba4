"""`format: verl` reads verl's caches and keeps non-tensor columns under tensordict 0.10.0 and the current one.

Regressions: under tensordict 0.10 (verl 0.9.1's pin) `torch.load(weights_only=True)`
refused tensordict's rebuild functions, so stepskip could read no verl entry and regenerated over
the user's cache; and `TensorDict.contiguous()` dropped `NonTensorStack` columns from the V1 entries
it wrote. tensordict_checks.py runs the same checks in this interpreter (current tensordict) and in
verl's environment (.venv-verl, built by `make verl-env`; STEPSKIP_VERL_PYTHON overrides it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = Path(__file__).with_name("tensordict_checks.py")
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")
CHECKS = [
    "verl_written_v0_entries_decode",
    "verl_written_v1_entry_decodes",
    "v1_entry_written_here_keeps_non_tensor_columns",
    "v0_entry_written_here_keeps_non_tensor_columns",
    "consolidated_batch_is_written_without_a_copy_first",
    "concurrent_loads_share_the_allowed_globals",
]
_results: dict[str, dict[str, dict]] = {}


def results(python: str) -> dict[str, dict]:
    if python not in _results:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        done = subprocess.run([python, "-W", "ignore", str(SCRIPT)], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        _results[python] = {line["check"]: line for line in lines}
    return _results[python]


verl_env = pytest.mark.skipif(not os.path.exists(VERL_PYTHON),
                              reason="verl 0.9.1 environment not built (run `make verl-env`)")
INTERPRETERS = [
    pytest.param(sys.executable, id="current-tensordict"),
    pytest.param(VERL_PYTHON, id="tensordict-0.10", marks=[verl_env, pytest.mark.heavy]),
]


@pytest.mark.parametrize("python", INTERPRETERS)
def test_runs_under_the_expected_tensordict(python):
    versions = results(python)["versions"]["detail"]
    if python == VERL_PYTHON:
        assert "tensordict 0.10.0" in versions, versions
    else:
        import tensordict

        assert f"tensordict {tensordict.__version__}" in versions


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("python", INTERPRETERS)
def test_check(python, check):
    got = results(python).get(check)
    assert got is not None, f"{check} did not run: {sorted(results(python))}"
    assert got["ok"], got["detail"]
    if python == VERL_PYTHON and check == "v0_entry_written_here_keeps_non_tensor_columns":
        assert "verl's unpickling" in got["detail"]  # verl's own loader read the file too
