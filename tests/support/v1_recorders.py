"""Child processes that record one V1 step with ``parameter_sync_step = 2``, pausing between the two
sample calls on events, so that a test can interleave two recorders deterministically."""

from __future__ import annotations

import os
from typing import Any

from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip.tq import InProcessTQClient


def config(dump_dir: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "data": {"train_batch_size": 4},
        "trainer": {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 2}}},
        "skip": {"rollout_tq": {"enable": True, "steps": [1], "action": "record", "dump_dir": dump_dir,
                                "async_dump": False, "storage_options": dict(storage_options or {})}},
    }


def record_step(dump_dir: str, before_first: Any, after_first: Any, before_second: Any, after_second: Any,
                results: Any, crash_after_first: bool = False,
                storage_options: dict[str, Any] | None = None) -> None:
    """Record step 1: wait ``before_first``, sample, set ``after_first``, wait ``before_second``, sample,
    set ``after_second``; put this run's id on ``results``. ``crash_after_first`` dies after the first
    inner entry, as a killed recorder would (no clean-up, no flush)."""
    tq = InProcessTQClient()
    trainer = V1Trainer(config(dump_dir, storage_options), tq, prompts_per_step=4, sync_steps=2)
    SkipManager.init(trainer.config, tq_client=tq)
    results.put(SkipManager.run_id)
    trainer.global_steps = 1
    SkipManager.set_step(1)
    trainer._add_batch_to_generate()
    for wait, done in ((before_first, after_first), (before_second, after_second)):
        if wait is not None and not wait.wait(600):  # the order under test never came: say so, never run on
            os._exit(3)
        meta, _ = trainer.replay_buffer.sample(1, "train", 2)
        tq.kv_clear(keys=meta.keys, partition_id="train")
        if done is not None:
            done.set()
        if crash_after_first:
            os._exit(0)
    SkipManager.reset()
