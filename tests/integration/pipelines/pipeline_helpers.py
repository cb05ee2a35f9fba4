"""Helpers of the reference-pipeline tests: small shapes, skip overrides, cache paths.

The pipelines run for real (tiny random-init model, GRPO updates), shrunk so that a record pass
plus a replay pass take about a second in process: 3 steps of 4 prompts x 4 responses of 12
tokens. (A module of its own, not conftest.py: several test folders have a conftest.)
"""

from __future__ import annotations

from pathlib import Path

#: Overrides shrinking a pipeline for tests (3 steps, short responses, validation at steps 2 and 3).
SMALL = [
    "trainer.total_training_steps=3",
    "trainer.test_freq=2",
    "data.max_response_length=12",
    "actor_rollout_ref.rollout.agent.num_workers=2",
]


def skip_overrides(role: str, dump_dir: Path, steps: list[int], action: str = "cache") -> list[str]:
    """Enable ``role`` on ``steps`` in ``dump_dir``; misaligned prompts are an error, not a warning."""
    return [f"skip.{role}.enable=true", f"skip.{role}.dump_dir={dump_dir}", f"skip.{role}.action={action}",
            f"skip.{role}.steps=[{','.join(map(str, steps))}]", f"+skip.{role}.check_prompts=error"]


def project_dir(dump_dir: Path, experiment: str, gbs: int = 4, n: int = 4, prompt: int = 5, response: int = 12) -> Path:
    """The run directory the layout derives from the pipelines' config."""
    return Path(dump_dir) / f"{experiment}_stepskip_pipelines" / f"GBS{gbs}_N{n}_in{prompt}_out{response}"


def entry_dirs(root: Path) -> list[str]:
    """Committed entries under ``root`` (directories holding a meta.json), relative, sorted."""
    return sorted(str(p.parent.relative_to(root)) for p in Path(root).rglob("meta.json"))
