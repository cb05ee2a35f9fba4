"""Running verl-real scenarios from the main test suite.

Each scenario (``verl_side/<name>.py``) runs in verl 0.9.1's own environment (``.venv-verl``,
tensordict 0.10, built by ``make verl-env`` as part of ``make test``; ``STEPSKIP_VERL_PYTHON``
points at another interpreter) as a fresh process, with this checkout's ``src`` on its path, and
answers with a JSON report. Tests skip when that environment is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
VERL_SIDE = HERE / "verl_side"
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")
SCENARIO_TIMEOUT = 600


def _verl_env_ready() -> bool:
    if not os.path.exists(VERL_PYTHON):
        return False
    probe = subprocess.run([VERL_PYTHON, "-c", "import verl.trainer.ppo.ray_trainer, hydra, pandas"],
                           capture_output=True, timeout=300)
    return probe.returncode == 0


needs_verl_env = pytest.mark.skipif(
    not _verl_env_ready(),
    reason="verl 0.9.1 environment with its trainer dependencies not built (run `make verl-env`)",
)


def run_scenario(scenario: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run ``verl_side/<scenario>.py`` with ``spec`` in a fresh verl-env process; return its report.

    ``spec`` gets ``work`` (a fresh directory) and ``report`` filled in. A report with ``error``
    is returned as is (the trainer failed: the test decides whether that was expected); a process
    that wrote no report fails the test with its output.
    """
    work.mkdir(parents=True, exist_ok=True)
    spec = dict(spec, work=str(work), report=str(work / "report.json"))
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(VERL_SIDE)])
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env["TOKENIZERS_PARALLELISM"] = "false"
    done = subprocess.run([VERL_PYTHON, str(VERL_SIDE / f"{scenario}.py"), str(spec_path)], capture_output=True,
                          text=True, timeout=SCENARIO_TIMEOUT, cwd=str(work), env=env)
    report_path = work / "report.json"
    if not report_path.exists():
        pytest.fail(f"scenario {scenario} wrote no report (exit {done.returncode}):\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    report = json.loads(report_path.read_text())
    report["log"] = done.stderr[-20000:]
    return report


def ok(report: dict[str, Any]) -> dict[str, Any]:
    """The report of a run that must have succeeded (fails the test with verl's traceback otherwise)."""
    error = report.get("error")
    if error:
        pytest.fail(f"the run failed: {error['type']}: {error['message']}\n{error['traceback']}\n"
                    f"{report['log'][-4000:]}")
    return report


def role_stats(report: dict[str, Any], role: str) -> dict[str, float]:
    """``{"hits": ..., "misses": ..., "dumps": ...}`` of one role from a report."""
    prefix = f"skip/{role}/"
    return {k[len(prefix):]: v for k, v in report["stats"].items() if k.startswith(prefix)}


def load_tensors(path: Path) -> list[dict[str, Any]]:
    """What a scenario saved with ``torch.save`` (tensors, lists and strings only: no pickle needed)."""
    return torch.load(path, weights_only=True)


def assert_same_actor_inputs(first: list[dict[str, Any]], second: list[dict[str, Any]],
                             keys: tuple[str, ...] = ("responses", "advantages", "old_log_probs")) -> None:
    """Both runs fed the actor identical tensors, update for update."""
    assert len(first) == len(second) and first, (len(first), len(second))
    for i, (a, b) in enumerate(zip(first, second)):
        for key in keys:
            x, y = a[key], b[key]
            if isinstance(x, list):
                assert len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y)), f"update {i}: {key}"
            else:
                assert torch.equal(x, y), f"update {i}: {key} differs"


def assert_same_actor_rows(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    """Both runs fed the actor the same rows at every update, in whatever order.

    V1 batches come out of TransferQueue in the order of the replay buffer's sets (it varies
    between processes), so rows are compared as a multiset of (responses, advantages, old
    log-probs); a row's advantage also pins the group it was normalised in.
    """
    assert len(first) == len(second) and first, (len(first), len(second))

    def rows(update: dict[str, Any]) -> list[tuple]:
        return sorted(tuple(tuple(update[key][i].tolist()) for key in ("responses", "advantages", "old_log_probs"))
                      for i in range(len(update["responses"])))

    for i, (a, b) in enumerate(zip(first, second)):
        assert rows(a) == rows(b), f"update {i}: the actor was given other rows"
