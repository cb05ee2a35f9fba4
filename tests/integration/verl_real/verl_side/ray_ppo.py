"""verl's real ``RayPPOTrainer.fit()`` for a few GRPO steps on CPU (run in .venv-verl).

Real: the Hydra config, ``RLHFDataset`` + ``StatefulDataLoader``, the whole step body of ``fit``
(``AgentLoopManager.generate_sequences`` with verl's decorator, ``timing_raw.update``,
``batch.union``, response masks, batch balancing, rewards via ``extract_reward``,
``compute_advantage`` for GRPO, metrics). Stand-ins (see ``common``): the agent-loop worker
handles, the actor worker group, the checkpoint and resource-pool managers.

Spec keys: work, report, impl ("stepskip" | "verl"), steps, skip (the ``skip.rollout`` section),
carry_uid (the colocated reward-model output shape), actor_inputs (where to save what the actor
was given), logger (``trainer.logger``'s backends, default console) and env (variables set before
the trainer starts: where the backends write). Or, for several runs one after another in this one
process (one import of verl; the ``SkipManager`` reset between runs): work, report, impl, runs: a list
of ``{name, steps, skip, carry_uid, actor_inputs}``, each run in ``work/<name>``; the report then has
one entry per run (with its own ``error`` when it failed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import common


def run(spec: dict[str, Any], report: dict[str, Any]) -> None:
    common.run_each(spec, report, fit)


def fit(spec: dict[str, Any], work: Path, report: dict[str, Any]) -> None:
    """One ``RayPPOTrainer.fit`` of ``spec`` in ``work``; ``report`` gets what it did."""
    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role
    from verl.utils import tracking

    steps = int(spec.get("steps", 3))
    batch, n = 4, 2
    data = common.write_dataset(work / "data" / "train.parquet", rows=batch * steps)
    overrides = common.base_overrides(work, data, steps=steps, batch=batch, n=n)
    overrides += common.skip_overrides("rollout", spec.get("skip", {}))
    overrides = common.tracking_overrides(overrides, spec)
    config = common.compose_config("ppo_trainer", overrides)

    logged: list[dict[str, Any]] = []
    original_log = tracking.Tracking.log

    def spy_log(self: Any, data: dict[str, Any], step: int, *args: Any, **kwargs: Any) -> Any:
        logged.append({"step": step, "keys": sorted(data)})  # a spy: verl's own logging still runs
        return original_log(self, data, step, *args, **kwargs)

    tracking.Tracking.log = spy_log

    tokenizer = common.make_tokenizer()
    resource_pools = common.StandInResourcePoolManager()
    trainer = RayPPOTrainer(config=config, tokenizer=tokenizer, role_worker_mapping={Role.ActorRollout: object},
                            resource_pool_manager=resource_pools, device_name="cpu")
    worker = common.StandInAgentLoopWorker(tokenizer, carry_inputs=bool(spec.get("carry_uid")))
    # The real manager, with its decorated generate_sequences; only its worker handles are stood in.
    handles = None if spec.get("carry_uid") else ["reward-loop-worker"]
    manager = AgentLoopManager(config, llm_client=None, reward_loop_worker_handles=handles)
    manager.agent_loop_workers = [worker]
    trainer.async_rollout_manager = manager
    trainer.actor_rollout_wg = common.StandInActorWorkerGroup()
    checkpoints = common.StandInCheckpointManager()
    trainer.checkpoint_manager = checkpoints

    report["impl"] = common.skip_impl_in_use()
    try:
        trainer.fit()
    finally:
        tracking.Tracking.log = original_log  # a later run of this process spies afresh
        report.update({
            "generation_calls": worker.calls,
            "generated_rows": worker.rows,
            "weight_updates": checkpoints.updates,
            "actor_updates": len(trainer.actor_rollout_wg.updates),
            "logged": logged,
            "stats": common.skip_stats(),
            "dump_files": common.tree_listing(Path(spec["skip"]["dump_dir"])) if spec.get("skip") else [],
        })
        if spec.get("actor_inputs"):
            torch.save(trainer.actor_rollout_wg.updates, spec["actor_inputs"])


if __name__ == "__main__":
    common.main(run)
