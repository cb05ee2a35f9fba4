"""A process that exits without SkipManager.close() still writes its pending dumps and a summary."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

#: What both scripts start with: INFO logs on stdout (the summary is one of them).
PREAMBLE = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
    from stepskip import SkipManager, Batch
""")

SCRIPT = PREAMBLE + textwrap.dedent("""

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            return Batch.from_dict(tensors={"x": torch.arange(4000.0).reshape(40, 100)},
                                   non_tensors={"uid": prompts.non_tensor_batch["uid"]})

    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1, 2, 3], "dump_dir": sys.argv[1]}}})
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": [str(i) for i in range(40)]}))
    # no flush, no close: the interpreter exits with dumps still queued
""")


def run_to_exit(script: str, dump_dir: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run ``script`` with ``dump_dir`` until its interpreter exits (successfully); the run and its run directory."""
    done = subprocess.run([sys.executable, "-c", script, str(dump_dir)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done, dump_dir / "default_experiment_name_default_project_name" / "GBS0_N0_in0_out0"


def test_pending_dumps_are_written_at_exit_and_summarised(tmp_path):
    done, run_dir = run_to_exit(SCRIPT, tmp_path)
    assert sorted(p.name for p in run_dir.iterdir()) == ["1", "2", "3"]
    for step in (1, 2, 3):
        assert json.loads((run_dir / str(step) / "meta.json").read_text())["global_steps"] == step
    summary = [line for line in done.stdout.splitlines() if "summary" in line]
    assert summary == ["stepskip._manager stepskip rollout summary: 0 hits, 3 misses, 3 dumps, 0 dump failures, "
                       "0 corrupt, 0.0s of generation saved"]
    assert "dump failed" not in done.stdout


ASYNC_SCRIPT = PREAMBLE + textwrap.dedent("""

    class Rollouter:
        @SkipManager.annotate(role="async_rollout")
        def generate_sequences_single(self, prompts):
            return Batch.from_dict(tensors={"responses": torch.arange(64).reshape(1, 64)},
                                   non_tensors={"uid": prompts.non_tensor_batch["uid"]})

    SkipManager.init({"skip": {"async_rollout": {"enable": True, "steps": "all", "dump_dir": sys.argv[1]}}})
    for i in range(40):
        Rollouter().generate_sequences_single(Batch.from_dict(non_tensors={"uid": [f"uid_sample_0_{i}"]}))
    # no flush, no close: many one-sample entries are still queued when the interpreter exits
""")


def test_many_small_pending_dumps_are_written_at_exit(tmp_path):
    """Queued one-sample entries are written in batches whose syncs go to a thread pool; at exit that pool
    takes no more work, and every entry is still written."""
    done, run_dir = run_to_exit(ASYNC_SCRIPT, tmp_path)
    assert sorted(int(p.name) for p in run_dir.iterdir()) == list(range(40))
    assert "dump failed" not in done.stdout
    summary = [line for line in done.stdout.splitlines() if "summary" in line]
    assert summary and "40 dumps, 0 dump failures" in summary[0], summary
