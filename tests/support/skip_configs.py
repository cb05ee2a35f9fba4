"""Whole training configs for tests: a run shape that names its cache directory, and one skip role."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def training_config(dump_dir: Any, role: str = "rollout", gbs: int = 4, n: int = 2, **fields: Any) -> dict:
    """A config whose run directory is ``exp_proj/GBS{gbs}_N{n}_in8_out6``, with ``skip.<role>`` enabled.

    The role section defaults to steps 1-3, action cache and synchronous dumps; ``fields`` override it.
    """
    section = {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], "action": "cache",
               "async_dump": False, **fields}
    return {
        "trainer": {"experiment_name": "exp", "project_name": "proj"},
        "data": {"train_batch_size": gbs, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": n}},
        "skip": {role: section},
    }


def run_path(dump_dir: Any, gbs: int = 4, n: int = 2) -> Path:
    """The run directory :func:`training_config` makes caches in."""
    return Path(dump_dir) / "exp_proj" / f"GBS{gbs}_N{n}_in8_out6"
