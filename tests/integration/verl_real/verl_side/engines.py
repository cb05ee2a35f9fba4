"""verl's real trainers built and run from scratch, several runs in one process: engines started or not.

``trainer`` "v0": ``RayPPOTrainer(...)``, ``init_workers()``, ``fit()``. ``trainer`` "v1":
``PPOTrainerSync(config)``, ``init()`` (``_setup``: worker groups, reward loop, ``LLMServerManager``,
``CheckpointEngineManager``), the agent-loop manager built as verl's ``main_ppo`` builds it
(``agent_loop_manager_class``, ``create(config, llm_client=trainer.get_llm_client(), ...)``), then
``fit(manager)``. Stand-ins only for GPU workers and the inference server (``engine_stand_ins``);
Ray (and, for V1, TransferQueue) start once and serve every run.

Spec keys: work, report, trainer, runs: a list of ``{name, trainer, skip, steps, total_steps, validate,
actor_inputs, dapo, flat_groups, gen_batch_size, mode, resume_from}`` (``trainer``: the run's, default
the spec's; put V0 runs first: a V1 run swaps a class in verl's V1 module; ``skip``: the role's section;
``steps``: the data has ``4 * steps`` rows; ``total_steps``: ``trainer.total_training_steps``,
default ``steps``; ``validate``: validation before training; ``dapo``: the DAPO group filter on
``reward``; ``flat_groups``: the engine answers each batch's first prompt with equal responses;
``gen_batch_size``: ``data.gen_batch_size``; ``mode``: V1's ``trainer.v1.trainer_mode``, default
``sync``; ``resume_from``: V1 resumes from ``global_step_<resume_from>`` of a checkpoint that holds
the first batch of prompts in flight, see :func:`write_inflight_checkpoint`). The report has one
entry per run: what the engine went through, the gate's counts, the skip stats, the actor's
updates, any error.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import common
import engine_stand_ins as stand_ins

BATCH, N = 4, 2


def overrides_for(work: Path, data: Path, run: dict[str, Any], role: str, manager: str) -> list[str]:
    total = int(run.get("total_steps", run.get("steps", 3)))
    base = common.base_overrides(work, data, steps=total, batch=BATCH, n=N)
    replaced = {"trainer.val_before_train": f"trainer.val_before_train={bool(run.get('validate'))}"}
    out = [replaced.get(o.split("=", 1)[0], o) for o in base]
    out += [f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class=engine_stand_ins.{manager}",
            "reward.num_workers=0", "trainer.val_only=False", "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
    if run.get("gen_batch_size"):
        out.append(f"+data.gen_batch_size={int(run['gen_batch_size'])}")
    if run.get("dapo"):
        out += ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=reward"]
    return out + common.skip_overrides(role, run.get("skip", {}))


def run_v0(work: Path, data: Path, run: dict[str, Any], marks: dict[str, float],
           entry: dict[str, Any]) -> Any:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role

    overrides = overrides_for(work, data, run, "rollout", "StandInWorkersAgentLoopManager")
    config = common.compose_config("ppo_trainer", [*overrides, "trainer.use_v1=False"])
    trainer = RayPPOTrainer(config=config, tokenizer=common.make_tokenizer(),
                            role_worker_mapping={Role.ActorRollout: stand_ins.actor_worker_class()},
                            resource_pool_manager=stand_ins.StandInResourcePoolManager(),
                            ray_worker_group_cls=stand_ins.StandInWorkerGroup, device_name="cpu")
    trainer.init_workers()
    marks["built"] = time.perf_counter()
    trainer.fit()
    return trainer


def write_inflight_checkpoint(trainer: Any, folder: Path) -> list[str]:
    """What an asynchronous V1 run leaves in ``folder``'s ``transfer_queue`` checkpoint when it stops with
    prompts in flight: the trainer's first batch of prompts, submitted as its async modes submit them
    (prompt fields kept for the re-issue, tagged ``pending``) and never finished. The queue is emptied
    again, for verl's ``_load_checkpoint`` to restore it. Returns the prompts' uids."""
    import transfer_queue as tq
    from tensordict import NonTensorData

    step = int(folder.name.split("global_step_")[-1])
    trainer.global_steps = step
    batch = trainer._next_train_batch()
    trainer.train_dataloader_it = None  # the resumed run reads its data from the start, as without data.pt
    uids = [str(u) for u in batch["uid"]]
    tags = [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in uids]
    fields = batch.select(*[k for k in batch.keys() if not isinstance(batch.get(k), NonTensorData)])
    tq.kv_batch_put(keys=uids, partition_id="train", tags=tags, fields=fields)
    tq.save_checkpoint(str(folder / "transfer_queue"), metadata={"global_steps": step})
    tq.kv_clear(keys=uids, partition_id="train")
    return uids


def _v1_trainer_class(mode: str, inflight: dict[str, Any] | None = None) -> Any:
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1.trainer_base import get_trainer_cls

    class PPOTrainerOnCPU(get_trainer_cls(mode)):  # type: ignore[misc]
        """verl's V1 trainer of ``mode`` with what needs GPUs or the Hub stood in: the resource pools and
        the actor's Ray class (never started), the tokenizer (built locally instead of loaded from the
        model); with ``inflight``, the checkpoint it resumes from is written just before verl loads it."""

        def _init_tokenizer(self) -> None:
            self.tokenizer, self.processor = common.make_tokenizer(), None

        def _init_resource_pool_mgr(self) -> None:
            self.role_worker_mapping = {Role.ActorRollout: stand_ins.actor_worker_class()}
            self.mapping = {Role.ActorRollout: "global_pool"}
            self.resource_pool_manager = stand_ins.StandInResourcePoolManager()

        def _load_checkpoint(self) -> None:
            if inflight is not None:
                inflight["uids"] = write_inflight_checkpoint(self, Path(self.config.trainer.resume_from_path))
            super()._load_checkpoint()

    return PPOTrainerOnCPU


def run_v1(work: Path, data: Path, run: dict[str, Any], marks: dict[str, float],
           entry: dict[str, Any]) -> Any:
    import transfer_queue as tq
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from verl.utils.import_utils import load_class_from_fqn

    mode = run.get("mode", "sync")
    overrides = overrides_for(work, data, run, "rollout_tq", "StandInWorkersAgentLoopManagerTQ")
    overrides += ["trainer.use_v1=True", f"trainer.v1.trainer_mode={mode}", "transfer_queue.enable=True",
                  "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
                  "transfer_queue.backend.SimpleStorage.total_storage_size=1000"]
    inflight: dict[str, Any] | None = None
    if run.get("resume_from"):
        folder = work / "ckpt" / f"global_step_{int(run['resume_from'])}"
        folder.mkdir(parents=True)
        overrides = [o for o in overrides if not o.startswith("trainer.resume_mode=")]
        overrides += ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={folder}"]
        inflight = entry.setdefault("inflight", {})
    config = common.compose_config("ppo_trainer", overrides)
    trainer_base.RayWorkerGroup = stand_ins.StandInV1WorkerGroup  # the GPU worker groups _setup builds
    trainer = _v1_trainer_class(mode, inflight)(config=config)
    for partition in ("train", "val"):  # what an earlier run of this process left in the queue
        left = list((tq.kv_list(partition) or {}).get(partition, {}))
        if left:
            tq.kv_clear(keys=left, partition_id=partition)
    trainer.init()
    manager_class = load_class_from_fqn(config.actor_rollout_ref.rollout.agent.agent_loop_manager_class,
                                        "AgentLoopManager")
    manager = manager_class.create(config=config, llm_client=trainer.get_llm_client(),
                                   teacher_client=trainer.get_teacher_client(),
                                   reward_loop_worker_handles=trainer.get_reward_handles())
    marks["built"] = time.perf_counter()
    trainer.fit(manager)
    return trainer


def start_ray(v1: bool, config_overrides: list[str]) -> str:
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="vr-ray-")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    if v1:
        import transfer_queue as tq

        tq.init(common.compose_config("ppo_trainer", config_overrides).transfer_queue)
    return temp_dir


def run(spec: dict[str, Any], report: dict[str, Any]) -> None:
    import shutil

    import ray
    import torch
    from stepskip.integrations.verl import _engines, engine_counts

    from verl.utils.skip import SkipManager

    work = Path(spec["work"])
    trainers = {run_spec.get("trainer", spec.get("trainer")) for run_spec in spec["runs"]}
    v1 = "v1" in trainers
    data = {}
    for trainer_name in trainers:  # each trainer's data as long as its longest run needs
        rows = BATCH * max(int(r.get("total_steps", r.get("steps", 3))) for r in spec["runs"]
                           if r.get("trainer", spec.get("trainer")) == trainer_name)
        data[trainer_name] = common.write_dataset(work / f"data-{trainer_name}" / "train.parquet", rows=rows)
    report["impl"] = common.skip_impl_in_use()
    stand_ins.register_replica()
    temp_dir = start_ray(v1, ["transfer_queue.enable=True",
                              "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
                              "transfer_queue.backend.SimpleStorage.total_storage_size=1000"])
    report["runs"] = []
    try:
        for run_spec in spec["runs"]:
            stand_ins.reset()
            stand_ins.FLAT_FIRST_GROUP = bool(run_spec.get("flat_groups"))
            stand_ins._Group.made.clear()
            _engines.GATE.reset()
            entry: dict[str, Any] = {"name": run_spec["name"]}
            report["runs"].append(entry)
            trainer = None
            marks = {"start": time.perf_counter()}
            try:
                trainer_name = run_spec.get("trainer", spec.get("trainer"))
                trainer = (run_v1 if trainer_name == "v1" else run_v0)(work / run_spec["name"], data[trainer_name],
                                                                      run_spec, marks, entry)
            except BaseException as err:  # reported: some runs are expected to fail
                entry["error"] = common.error_report(err)
            finally:
                groups = stand_ins._Group.made
                updates = groups[0].updates if groups else []
                entry.update({
                    "engine": stand_ins.ENGINE.report(),
                    "gate": engine_counts(),
                    "plan_start": getattr(_engines.GATE.plan, "start", None),
                    "stats": common.skip_stats(),
                    "actor_updates": len(updates),
                    "checkpoint_manager": type(getattr(trainer, "checkpoint_manager", None)).__name__,
                    "llm_server_manager": type(getattr(trainer, "llm_server_manager", None)).__name__,
                    "timings": {
                        "start_up_s": marks.get("built", float("nan")) - marks["start"],
                        "first_trained_step_s": (stand_ins.ENGINE.trained_at[0] - marks["start"]
                                                 if stand_ins.ENGINE.trained_at else None),
                        "run_s": time.perf_counter() - marks["start"],
                    },
                })
                if run_spec.get("actor_inputs"):
                    torch.save(updates, run_spec["actor_inputs"])
                SkipManager.reset()
    finally:
        if v1:
            import transfer_queue as tq

            tq.close()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    common.main(run)
