"""Stand-ins for what needs GPUs or inference servers, where verl's real ``init_workers`` / ``_setup`` build them.

Everything else runs for real: ``RayPPOTrainer.init_workers`` and ``PPOTrainer._setup`` themselves,
``create_colocated_worker_cls``, ``RewardLoopManager`` (no reward workers: rewards come from the
agent loop), ``LLMServerManager.create`` with its load-balancer actor, ``AgentLoopManager.create`` /
``AgentLoopManagerTQ.create`` (named by ``agent_loop_manager_class``, only their worker class
stood in), ``CheckpointEngineManager`` with verl's ``naive`` backend, and the trainers' ``fit``.

Stood in:

* the rollout replica (``StandInReplica``, registered under ``vllm`` in verl's
  ``RolloutReplicaRegistry``): the vLLM server; it counts constructions and sleeps, and the
  engine it stands for is asleep until the actor's weights are pushed into it;
* the actor worker group (``StandInWorkerGroup``, the trainer's ``ray_worker_group_cls``, and the
  Ray worker class verl would spawn on GPUs): log-probs a fixed function of the token ids,
  ``update_actor`` records its inputs, ``update_weights`` (verl's naive weight sync into the
  colocated engine) wakes the engine and records the step of the weights;
* the agent-loop worker (a Ray actor talking to the replica): it generates only on an awake
  engine (asserted), and records which step it generated with which weights;
* the resource-pool manager (GPUs).

``ENGINE`` holds what the engine saw, for the scenario's report.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import common
import v1


@dataclass
class EngineState:
    """What the stood-in engine (replicas, weight pushes, generation) went through in one run."""

    replicas_constructed: int = 0
    replicas_started: int = 0
    weight_syncs: list[Any] = field(default_factory=list)
    sleeps: int = 0
    awake: bool = False
    weights: Any = None
    generations: list[dict[str, Any]] = field(default_factory=list)
    dispatches: int = 0
    generated_rows: int = 0
    workers_started: int = 0
    trained_at: list[float] = field(default_factory=list)  # perf_counter() of every update_actor

    def report(self) -> dict[str, Any]:
        return {"replicas_constructed": self.replicas_constructed, "replicas_started": self.replicas_started,
                "weight_syncs": list(self.weight_syncs), "sleeps": self.sleeps, "generations": self.generations,
                "dispatches": self.dispatches, "generated_rows": self.generated_rows,
                "workers_started": self.workers_started}


ENGINE = EngineState()
#: The engine answers the first prompt of every batch with one response for all its sessions.
FLAT_FIRST_GROUP = False


def reset() -> None:
    global ENGINE
    ENGINE = EngineState()


def _step_of(batch: Any) -> Any:
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, dict):
        return meta.get("global_steps")
    try:
        return int(batch["global_steps"]) if "global_steps" in batch.keys() else None
    except Exception:  # noqa: BLE001
        return None


def _is_validation(batch: Any) -> bool:
    meta = getattr(batch, "meta_info", None)
    if isinstance(meta, dict):
        return bool(meta.get("validate"))
    return "validate" in batch.keys() and bool(batch["validate"])


def _generated(batch: Any) -> None:
    """Book-keeping of a generation: only an awake engine (weights pushed since the last sleep) generates."""
    if not ENGINE.awake:
        raise RuntimeError("the stand-in engine was asked to generate while asleep (no weight sync since the "
                           "last sleep_replicas)")
    ENGINE.dispatches += 1
    ENGINE.generated_rows += len(batch)
    ENGINE.generations.append({"step": _step_of(batch), "weights": ENGINE.weights,
                               "validate": _is_validation(batch), "rows": len(batch)})


# --------------------------------------------------------------------------- the replica (the vLLM server)


class StandInReplica:
    """Stands in for ``vLLMReplica``: the server verl starts inside the hybrid actor workers."""

    def __init__(self, replica_rank: int, config: Any, model_config: Any, gpus_per_node: int = 8, **kwargs: Any):
        ENGINE.replicas_constructed += 1
        self.replica_rank = replica_rank
        self.workers: list[Any] = []
        self._server_handle = f"stand-in-server-{replica_rank}"
        self._server_address = f"127.0.0.1:{20000 + replica_rank}"

    async def init_hybrid(self, worker_group: Any) -> None:
        ENGINE.replicas_started += 1

    async def sleep(self) -> None:
        ENGINE.sleeps += 1
        ENGINE.awake = False

    async def wake_up(self) -> None:
        ENGINE.awake = True

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def register_replica() -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("vllm", lambda: StandInReplica)


# --------------------------------------------------------------------------- the actor workers (GPUs)


class _Group:
    """What both trainers ask of the actor worker group beyond its compute calls."""

    made: list[Any] = []

    def _made(self) -> None:
        self.world_size = 1
        self.initialised = False
        _Group.made.append(self)

    def spawn(self, prefix_set: Any) -> dict[str, Any]:
        return dict.fromkeys(prefix_set, self)

    def init_model(self) -> None:
        self.initialised = True

    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self.loaded_from = local_path  # the actor's weights of a resumed run (none are saved here)

    def update_actor(self, batch: Any) -> Any:
        ENGINE.trained_at.append(time.perf_counter())
        return super().update_actor(batch)  # type: ignore[misc]

    def update_weights(self, global_steps: Any = None, mode: str = "naive") -> Any:
        import ray

        ENGINE.weight_syncs.append(global_steps)  # the naive sync: the colocated engine wakes with these weights
        ENGINE.awake = True
        ENGINE.weights = global_steps
        return ray.put(None)


class StandInWorkerGroup(_Group, common.StandInActorWorkerGroup):
    """V0's ``ray_worker_group_cls``: ``spawn`` gives this group for every role verl asks for."""

    def __init__(self, resource_pool: Any = None, ray_cls_with_init: Any = None, **kwargs: Any) -> None:
        common.StandInActorWorkerGroup.__init__(self)
        self._made()


class StandInV1WorkerGroup(_Group, v1.StandInV1ActorWorkerGroup):
    """V1's ``RayWorkerGroup`` (log-probs and updates through the queue)."""

    def __init__(self, resource_pool: Any = None, ray_cls_with_init: Any = None, **kwargs: Any) -> None:
        v1.StandInV1ActorWorkerGroup.__init__(self)
        self._made()


class StandInResourcePoolManager(common.StandInResourcePoolManager):
    """Stands in for verl's ``ResourcePoolManager`` (no GPUs to pool)."""

    def __init__(self) -> None:
        self.resource_pool_dict = {"global_pool": "stand-in-pool"}

    def create_resource_pool(self) -> None:
        return None

    def get_resource_pool(self, role: Any) -> str:
        return "stand-in-pool"


def actor_worker_class() -> Any:
    """The Ray class verl would spawn on GPUs for the actor (never started: the group is stood in)."""
    import ray
    from verl.single_controller.base import Worker

    class StandInActorWorker(Worker):
        pass

    return ray.remote(StandInActorWorker)


# --------------------------------------------------------------------------- the agent-loop workers


class _Remote:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.put(self._fn(*args, **kwargs))  # an ObjectRef, as verl awaits or ray.get()s


class _WorkerClass:
    """What ``ray.remote(AgentLoopWorker)`` is to verl: ``.options(...).remote(...)`` builds a worker."""

    def __init__(self, make: Any) -> None:
        self._make = make

    def options(self, **kwargs: Any) -> _WorkerClass:
        return self

    def remote(self, config: Any, llm_client: Any, *args: Any, **kwargs: Any) -> Any:
        ENGINE.workers_started += 1
        return self._make(config, llm_client)


class _V0Worker:
    def __init__(self, config: Any, llm_client: Any) -> None:
        self.llm_client = llm_client
        self.inner = common.StandInAgentLoopWorker(common.make_tokenizer())
        self.generate_sequences = _Remote(self._generate)

    def _generate(self, chunk: Any) -> Any:
        _generated(chunk)
        return self.inner._generate(chunk)


def _v0_manager_class() -> Any:
    from verl.experimental.agent_loop import AgentLoopManager

    class StandInWorkersAgentLoopManager(AgentLoopManager):
        """verl's ``AgentLoopManager``, its Ray worker class stood in (the workers would call the server)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.agent_loop_workers_class = _WorkerClass(_V0Worker)
            super().__init__(*args, **kwargs)

    return StandInWorkersAgentLoopManager


class _V1Worker:
    """``AgentLoopWorkerTQ`` on an awake engine: every trajectory of every prompt into the queue."""

    def __init__(self, config: Any, llm_client: Any) -> None:
        self.tokenizer = common.make_tokenizer()
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.generate_sequences = _Remote(self._generate)

    def _generate(self, batch: Any) -> None:
        _generated(batch)
        v1.write_trajectories(batch, self.tokenizer, self.n, self.rng,
                              partition_id="val" if _is_validation(batch) else "train", flat_first=FLAT_FIRST_GROUP)


def _v1_manager_class() -> Any:
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ

    class StandInWorkersAgentLoopManagerTQ(AgentLoopManagerTQ):
        """verl's ``AgentLoopManagerTQ``, its Ray worker class stood in."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.agent_loop_workers_class = _WorkerClass(_V1Worker)

    return StandInWorkersAgentLoopManagerTQ


def __getattr__(name: str) -> Any:  # the classes verl loads by name (agent_loop_manager_class), built on demand
    if name == "StandInWorkersAgentLoopManager":
        return _v0_manager_class()
    if name == "StandInWorkersAgentLoopManagerTQ":
        return _v1_manager_class()
    raise AttributeError(name)
