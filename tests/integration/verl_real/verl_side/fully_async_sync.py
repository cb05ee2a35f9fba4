"""verl's real ``FullyAsyncRollouter`` class as a Ray actor, asked by verl's real ``CheckpointEngineManager``
whether its engine needs the trainer's weights.

Runs in .venv-verl, over Ray, every process installed by stepskip's ``worker_process_setup_hook``
(as the launcher installs verl's Ray actors). Real: verl's Hydra config, the async_rollout samples
recorded through verl's decorated ``FullyAsyncAgentLoopManager.generate_sequences_single`` (as
``fully_async.py`` feeds it), the Rollouter class (its ``get_replicas`` as ``install()`` patched it)
running as a Ray actor, ``SkipManager.init`` there as its ``init_workers`` runs it, and
``CheckpointEngineManager`` with verl's naive backend in this process, awaited as the
``FullyAsyncTrainer`` actor awaits it. Stand-ins, because they need GPUs or inference servers: the
Rollouter's ``__init__`` (it builds datasets, resource pools and engines) sets the state verl's
``__init__`` and ``set_max_required_samples`` set, with the feed moved by the scenario instead of
its feeding loop; its server manager's replicas; the agent-loop worker handle of the recording; the
actor worker group (it records each weight push).

Spec keys: work, report, skip (more of the ``skip.async_rollout`` section of the replaying Rollouter; the
recording covers samples 1-4), validate (``trainer.test_freq`` on).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

import common

SAMPLES = 6
RECORDED = 4


def record(config: Any) -> int:
    """Samples 1-``RECORDED`` through verl's decorated ``generate_sequences_single``; the generation calls."""
    import numpy as np
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.experimental.fully_async_policy.detach_utils import prepare_single_generation_data
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncAgentLoopManager
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.utils.skip import SkipManager

    tokenizer = common.make_tokenizer()
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None)
    loader = StatefulDataLoader(dataset=dataset, batch_size=1, shuffle=False, collate_fn=collate_fn)
    worker = common.StandInAgentLoopWorker(tokenizer)
    manager = FullyAsyncAgentLoopManager(config, llm_client=None, reward_loop_worker_handles=["reward-loop-worker"])
    manager.agent_loop_workers = [worker]
    SkipManager.init(config)

    async def feed() -> None:
        for index, batch_dict in enumerate(loader, start=1):
            if index > RECORDED:
                break
            full_batch = prepare_single_generation_data(batch_dict, config)
            full_batch.non_tensor_batch["uid"] = np.array([f"uid_sample_0_{index}"] * len(full_batch), dtype=object)
            await manager.generate_sequences_single(full_batch)

    asyncio.run(feed())
    SkipManager.close()
    return worker.calls


def rollouter_class() -> Any:
    """verl's Rollouter class under its ``@ray.remote``, with a stand-in ``__init__``, as a Ray actor class."""
    import ray
    from verl.experimental.fully_async_policy import fully_async_rollouter

    verl_class = fully_async_rollouter.FullyAsyncRollouter.__ray_metadata__.modified_class.__ray_actor_class__

    class StandInInitRollouter(verl_class):  # type: ignore[misc, valid-type]
        def __init__(self, config: Any, replicas: list[Any]) -> None:
            from types import SimpleNamespace

            from verl.utils.skip import SkipManager

            self.config = config
            self.llm_server_manager = SimpleNamespace(get_replicas=lambda: list(replicas))
            self.global_steps = 1  # verl's __init__: "we start from step 1"
            self.pending_queue = asyncio.Queue(maxsize=128)
            self.staleness_samples = 0
            self.total_rollout_steps = SAMPLES
            # set_max_required_samples: ppo_mini_batch_size (1) * require_batches (1) * (staleness_threshold (1)
            # + 1) * trigger_parameter_sync_step (1)
            self.max_required_samples = 2
            SkipManager.init(config)  # as init_workers runs it, once the engines are built
            self.skip_impl = SkipManager.__module__.split(".")[0]

        def move_feed(self, global_steps: int, staleness_samples: int) -> None:
            self.global_steps, self.staleness_samples = global_steps, staleness_samples

        def stand_in_skip_impl(self) -> str:
            return self.skip_impl

    return ray.remote(StandInInitRollouter)


def run(spec: dict[str, Any], report: dict[str, Any]) -> None:
    import ray
    from stepskip.integrations.verl import HOOK, _engines, engine_counts
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass

    work = Path(spec["work"])
    data = common.write_dataset(work / "data" / "train.parquet", rows=SAMPLES)
    overrides = common.base_overrides(work, data, steps=SAMPLES, batch=1, n=2)
    if spec.get("validate"):
        overrides = [o for o in overrides if not o.startswith("trainer.test_freq=")] + ["trainer.test_freq=2"]
    dump = {"enable": True, "dump_dir": str(work / "dump"), "action": "cache"}
    report["impl"] = common.skip_impl_in_use()
    report["recorded_generations"] = record(common.compose_config(
        "ppo_trainer", overrides + common.skip_overrides("async_rollout", {**dump, "steps": list(range(1, RECORDED + 1))})))
    config = common.compose_config("ppo_trainer", overrides + common.skip_overrides(
        "async_rollout", {**dump, "steps": list(range(1, SAMPLES + 1)), **spec.get("skip", {})}))

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="vr-ray-"), log_to_driver=False,
             runtime_env={"worker_process_setup_hook": HOOK})
    try:
        rollouter = rollouter_class().remote(config, ["standalone replica"])
        report["rollouter_skip_impl"] = ray.get(rollouter.stand_in_skip_impl.remote())
        replicas = ray.get(rollouter.get_replicas.remote())  # as FullyAsyncTrainer._setup_checkpoint_manager
        report["replicas_type"] = type(replicas).__name__
        report["way_back"] = type(getattr(replicas, "rollouter", None)).__name__  # the actor's handle
        pushed: list[Any] = []

        class ActorWorkerGroup:
            def update_weights(self, global_steps: Any = None, mode: str = "naive") -> Any:
                pushed.append(global_steps)
                return ray.put(None)

        manager = CheckpointEngineManager(
            config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=ActorWorkerGroup(), replicas=replicas)

        async def fit_update_weights(version: int) -> None:  # FullyAsyncTrainer._fit_update_weights
            await manager.update_weights(global_steps=version)

        asyncio.run(fit_update_weights(0))  # samples 1-4 within reach, all recorded
        report["pushed_from_sample_1"] = list(pushed)
        ray.get(rollouter.move_feed.remote(3, 1))  # samples 3-5 within reach: 5 was not recorded
        asyncio.run(fit_update_weights(1))
        report["pushed"] = list(pushed)
        report["counts"] = engine_counts()
        report["unpatched"] = _engines.unpatched()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    common.main(run)
