"""Helpers of the TRL tests: a real TRL run in a fresh process (``trl_run.py``) and what to read from
its results and its cache. A module of its own, so that test modules import it by a name no other
directory's helpers share (``from conftest import`` names whichever conftest was imported first)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import stepskip

SCRIPT = Path(__file__).with_name("trl_run.py")
SRC = str(Path(stepskip.__file__).resolve().parents[1])
TIMING = re.compile(r"(time|runtime|per_second)$")
RUN_TIMEOUT = 900  # a hang guard only: a run takes ~15 s


def run_trl(workdir: Path, skip: dict[str, Any] | None, ranks: int = 1, args: dict[str, Any] | None = None,
            evaluate: bool = False, name: str = "run", env: dict[str, str] | None = None, **spec_keys: Any) -> Any:
    """One training run; returns its result (a list, one per rank, when ``ranks > 1``) and its stderr.

    ``env``: environment variables the run sets for itself; ``spec_keys``: more of ``trl_run.py``'s spec
    (``vllm``: the stand-in vLLM backend's mode; ``stepskip_trainer``: build ``StepskipGRPOTrainer`` instead
    of calling ``enable_stepskip``).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {"output_dir": str(workdir / f"{name}-out"), "skip": skip, "args": args or {}, "eval": evaluate,
            "destroy": ranks > 1, "env": env or {}, **spec_keys}
    spec_path, out = workdir / f"{name}.spec.json", workdir / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(SCRIPT), str(spec_path), str(out)]
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   *command[1:]]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, f"run {name} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    if ranks > 1:
        results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ranks)]
    else:
        results = json.loads(out.read_text())
    return results, proc.stderr


def logs_without_timings(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in entry.items() if not TIMING.search(k)} for entry in result["log_history"]]


def skip_section(dump_dir: Path, **fields: Any) -> dict[str, Any]:
    return {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], **fields}


def copy_cache(cache: Path, tmp_path: Path) -> Path:
    target = tmp_path / "cache"
    shutil.copytree(cache, target)
    return target


def entries(cache: Path) -> dict[int, list[str]]:
    """``{step: [call-rank names]}`` of every trl_generate entry under ``cache``."""
    out: dict[int, list[str]] = {}
    for meta in cache.glob("*/*/trl_generate/*/*/meta.json"):
        out.setdefault(int(meta.parent.parent.name), []).append(meta.parent.name)
    return {step: sorted(names) for step, names in sorted(out.items())}
