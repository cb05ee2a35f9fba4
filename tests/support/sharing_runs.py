"""Runs for the tests of a shared cache (retention during the run, read-only caches), on any dump dir the
library takes: a flat rollout role, a generic stage role and the V1 role, driven through the public config.

A dump dir is a local path or a URL with its storage options; :func:`tree` snapshots what is under it
(every name, with its size and modification time) so that a test can tell that nothing changed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from stepskip import Batch, SkipManager


def prompts(step: int = 0) -> Batch:
    return Batch.from_dict(tensors={"input_ids": torch.arange(6).reshape(2, 3) + step},
                           non_tensors={"uid": [f"a{step}", f"b{step}"]})


class Rollout:
    """A trainer's rollout: the result depends on the step, so a replay is told from a generation."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        step = int(prompts["input_ids"][0, 0])
        self.calls.append(step)
        return Batch.from_dict(tensors={"responses": prompts["input_ids"] * 10 + torch.randint(0, 5, (2, 3))},
                               non_tensors={"uid": list(prompts["uid"])})


class Reward:
    """A generic stage (``skip.reward: {kind: stage}``)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    @SkipManager.annotate(role="reward")
    def score(self, batch: Batch) -> torch.Tensor:
        step = int(batch["input_ids"][0, 0])
        self.calls.append(step)
        return batch["input_ids"].float().sum(dim=1) + step


def training_config(dump_dir: str, role: str = "rollout", options: dict[str, Any] | None = None,
                    **fields: Any) -> dict[str, Any]:
    """A whole config with ``skip.<role>`` enabled on ``dump_dir`` (steps 1-20, action cache, synchronous dumps)."""
    section: dict[str, Any] = {"enable": True, "dump_dir": dump_dir, "steps": "1-20", "action": "cache",
                               "async_dump": False, **fields}
    if options:
        section["storage_options"] = options
    if role == "reward":
        section["kind"] = "stage"
    return {"trainer": {"experiment_name": "exp", "project_name": "proj"},
            "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 6},
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "skip": {role: section}}


def v1_config(dump_dir: str, sync: int = 1, **skip: Any) -> dict[str, Any]:
    """A V1 trainer's config with ``skip.rollout_tq`` enabled (steps 1-10, action cache, synchronous dumps)."""
    config: dict[str, Any] = {
        "actor_rollout_ref": {"rollout": {"n": 2}}, "data": {"train_batch_size": 3},
        "trainer": {"experiment_name": "exp", "project_name": "proj"},
        "skip": {"rollout_tq": {"enable": True, "steps": "1-10", "action": "cache", "dump_dir": dump_dir,
                                "async_dump": False, **skip}},
    }
    if sync > 1:
        config["trainer"]["v1"] = {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": sync}}
    return config


def run_flat(config: dict[str, Any], steps: Iterable[int], role: str = "rollout") -> list[int]:
    """Call the role's function at each step (a fresh ``SkipManager.init``); returns the steps it generated."""
    SkipManager.init(config)
    worker = Rollout() if role == "rollout" else Reward()
    call = worker.generate_sequences if isinstance(worker, Rollout) else worker.score
    for step in steps:
        SkipManager.set_step(step)
        call(prompts(step))
    SkipManager.flush()
    return list(worker.calls)


def role_dir(dump_dir: str, role: str = "rollout") -> str:
    run = f"{dump_dir.rstrip('/')}/exp_proj/GBS4_N2_in8_out6"
    return run if role == "rollout" else f"{run}/{role}"


def filesystem(dump_dir: str, options: dict[str, Any] | None = None) -> Any:
    import fsspec

    if "://" not in dump_dir:
        return fsspec.filesystem("file")
    return fsspec.filesystem(dump_dir.split("://", 1)[0], **(options or {}))


def steps_in(dump_dir: str, role: str = "rollout", options: dict[str, Any] | None = None) -> list[int]:
    """The step directories in the role's directory (sorted)."""
    fs = filesystem(dump_dir, options)
    path = role_dir(dump_dir, role)
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
    return sorted(int(n) for n in names if n.isdigit())


def tree(dump_dir: str, options: dict[str, Any] | None = None) -> dict[str, tuple[Any, ...]]:
    """Every name under ``dump_dir`` with its size and modification time (directories too, locally)."""
    if "://" not in dump_dir:
        found: dict[str, tuple[Any, ...]] = {}
        for directory, dirs, files in os.walk(dump_dir):
            for name in [*dirs, *files]:
                st = os.lstat(os.path.join(directory, name))
                found[os.path.relpath(os.path.join(directory, name), dump_dir)] = (st.st_size, st.st_mtime_ns, st.st_mode)
        return found
    fs = filesystem(dump_dir, options)
    fs.invalidate_cache()
    listed = fs.find(dump_dir, withdirs=True, detail=True)
    return {str(k): (v.get("size"), str(v.get("LastModified", v.get("created", v.get("mtime"))))) for k, v in listed.items()}
