"""No inference engine for a run the cache serves, and no weight sync for a step it replays (verl 0.9.1).

verl builds its engines before it calls ``SkipManager.init``: ``LLMServerManager.create`` starts the
rollout replicas (vLLM, SGLang ...), ``AgentLoopManager._init_agent_loop_workers`` the workers that
talk to them, ``CheckpointEngineManager`` moves the actor's weights into them. ``install()`` patches
those three classes in place when their modules are imported (so verl's subclasses, and classes named
by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` or ``checkpoint_manager_class``, are
covered alike; V1 names its checkpoint manager in code and ``LLMServerManager.create`` has no
extension point). Before the first engine is built, :class:`Gate` asks
:meth:`stepskip.SkipManager.engine_plan` whether the run needs one (the role's ``engines`` option):

* no engine: ``LLMServerManager.create`` returns :class:`NoEngineServerManager` (no replica, no
  router), the agent-loop manager gets one :class:`NoEngineWorker` (no Ray actor), and
  ``CheckpointEngineManager(...)`` over its replicas is a :class:`NoEngineCheckpointManager`; a call
  that reaches them raises :class:`~stepskip.errors.EngineNotStartedError` naming the step and the option.
* an engine, in every V0 and V1 trainer mode (``sync``, ``colocate_async``, ``separate_async``) with
  the role on: ``update_weights`` is deferred until a dispatch to the agent-loop workers (a miss, a
  validation pass), which first syncs the latest weights of every manager that deferred one: a
  replayed step never syncs weights and never wakes the replicas, the step generated after it sees
  the then-current weights, and ``sleep_replicas`` of replicas already asleep is skipped. In the
  asynchronous modes a sync is deferred only while no prompt the engine was given is still pending
  or running in the queue (those requests need the new weights now, as verl orders it). The fully
  async trainer, whose Rollouter (another Ray actor) decides what it replays, skips a sync only when
  the Rollouter says its engine needs no weights until the next one (``_fully_async``).

On the V1 trainer a replayed step also never generates from outside its submit phase: the replay
buffer's refill (``refill_fn=self._add_prompts_to_generate``) and the re-issue of in-flight prompts
after a resume (``_reissue_inflight_prompts``) are served from the cache by prompt
(:meth:`stepskip.roles.rollout_tq.RolloutTqSkip.inject_extra`); and the async warm-up batches, which
verl turns off for the whole run when ``skip.rollout_tq.enable`` is set, stay on when the first
step is not a skipped one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from stepskip.config import select
from stepskip._engines import EnginePlan
from stepskip.errors import ReplayMissError

logger = logging.getLogger("stepskip.integrations.verl")

_PATCHED = "__stepskip_engines__"  # set on every function this module put in place of verl's

COUNTER_NAMES = ("engines_started", "engines_skipped", "weight_sync_requests", "weight_syncs", "weight_syncs_deferred",
                 "sleeps_skipped",
                 "refill_prompts_from_cache", "refill_prompts_refused", "reissued_prompts_from_cache",
                 "reissued_prompts_dropped",
                 # the fully async trainer (see _fully_async)
                 "dispatches_after_skipped_sync")


class Gate:
    """The process's engine decisions: the plan of the trainer's config, the deferred weight sync, counters."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._config: weakref.ref[Any] | None = None
        self._plan: EnginePlan | None = None
        self._deferring = False
        self._pending: dict[Any, Any] = {}  # checkpoint manager -> global_steps of the sync it deferred
        self._watch_inflight = False  # asynchronous modes: requests may stay on the engine across steps
        self._dispatched: set[str] = set()  # uids given to the engine, maybe unfinished (async modes)
        self._untracked = False  # a dispatch whose uids could not be read: the engine may be busy
        self._awake: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._syncing = threading.local()
        self.fully_async = False  # a Rollouter's process: its dispatches are followed (see _fully_async)
        self.counts = dict.fromkeys(COUNTER_NAMES, 0)

    # ---------------------------------------------------------------- the plan

    def plan_for(self, config: Any) -> EnginePlan:
        """The plan of ``config`` (the trainer's whole config), decided once per config object."""
        with self._lock:
            if self._plan is not None and self._config is not None and self._config() is config:
                return self._plan
            from stepskip._manager import SkipManager

            role = role_of(config)
            plan = SkipManager.engine_plan(role, planned_steps(config), validation=validation_need(config),
                                           config=config)
            try:
                self._config = weakref.ref(config)
            except TypeError:  # a plain dict: decided again for every engine part (cheap, and the same)
                self._config = None
            self._plan = plan
            enabled = select(config, f"skip.{role}.enable", False) is True
            self._deferring = plan.start and enabled and _deferrable(config)
            self._watch_inflight = self._deferring and not _sync_trainer(config)
            self.fully_async = plan.start and enabled and not _deferrable(config)
            self._pending, self._dispatched, self._untracked = {}, set(), False
            if plan.start:
                self.counts["engines_started"] += 1
                logger.info("stepskip: the inference engine starts (%s)", plan.reason)
            else:
                self.counts["engines_skipped"] += 1
                logger.info("stepskip: no inference engine is started (%s)", plan.reason)
            return plan

    @property
    def plan(self) -> EnginePlan | None:
        """The last plan decided in this process (None before any engine part was built)."""
        return self._plan

    # ---------------------------------------------------------------- weight syncs

    def defer(self, manager: Any, global_steps: Any) -> bool:
        """Keep ``update_weights(global_steps)`` of ``manager`` for the next dispatch; False to sync now."""
        with self._lock:
            if getattr(self._syncing, "active", False):
                return False
            self.counts["weight_sync_requests"] += 1  # what verl asked for (each one ran, before the gate)
            if not self._deferring:
                return False
            if self._watch_inflight and self._engine_busy():
                return False
            self._pending[manager] = global_steps
            self.counts["weight_syncs_deferred"] += 1
            return True

    def synced(self, manager: Any) -> None:
        with self._lock:
            self._awake[manager] = True
            self.counts["weight_syncs"] += 1
            self._pending.pop(manager, None)

    def _engine_busy(self) -> bool:
        """True when a prompt given to the engine may still be generating (pending or running in the queue)."""
        if self._untracked:
            return True
        if not self._dispatched:
            return False
        try:
            import transfer_queue as tq

            live: set[str] = set()
            for partition in ("train", "val"):
                for key, tag in ((tq.kv_list(partition) or {}).get(partition) or {}).items():
                    if key in self._dispatched and isinstance(tag, dict) and tag.get("status") in ("pending",
                                                                                                   "running"):
                        live.add(key)
        except Exception as err:  # noqa: BLE001 - a queue that cannot tell: sync now, as verl would
            logger.debug("stepskip: cannot list the queue (%s); the weight sync is not deferred", err)
            return True
        self._dispatched = live
        return bool(live)

    def asleep(self, manager: Any) -> bool:
        """True when ``manager``'s replicas are asleep already (nothing woke them since the last sleep)."""
        with self._lock:
            if not self._deferring or self._awake.get(manager, True):
                self._awake[manager] = False
                return False
            self.counts["sleeps_skipped"] += 1
            return True

    def before_dispatch(self, batch: Any = None) -> None:
        """A request is about to reach the engine: the weights it must see are synced first.

        Args:
            batch: what is dispatched (its ``uid`` column tells, in the asynchronous modes, which
                prompts the engine holds until they finish).
        """
        with self._lock:
            pending, self._pending = list(self._pending.items()), {}
            if self._watch_inflight:
                uids = _uids(batch)
                if uids is None:
                    self._untracked = True
                else:
                    self._dispatched.update(uids)
        if not pending:
            return
        self._syncing.active = True  # through the patched method (and any subclass's): it syncs, not defers
        try:
            for manager, global_steps in pending:
                manager.update_weights(global_steps)
        finally:
            self._syncing.active = False

    def reset(self) -> None:
        """Forget every decision (tests and benchmarks that run several trainers in one process)."""
        with self._lock:
            self._config, self._plan, self._pending, self._deferring = None, None, {}, False
            self._watch_inflight, self._dispatched, self._untracked = False, set(), False
            self._awake = weakref.WeakKeyDictionary()
            self.fully_async = False
            self.counts = dict.fromkeys(COUNTER_NAMES, 0)
        from stepskip.integrations.verl._fully_async import ROLLOUTER

        ROLLOUTER.reset()


GATE = Gate()


def engine_counts() -> dict[str, int]:
    """What the engine gate did in this process since it started (or was last reset).

    Returns:
        ``{name: count}`` for :data:`COUNTER_NAMES`: engines started and not started, weight syncs
        verl asked for, run and deferred, sleeps skipped, prompts added to replayed steps served from the cache, refused
        or dropped.

    Example:
        >>> from stepskip.integrations.verl import engine_counts
        >>> engine_counts()["engines_started"] >= 0
        True
    """
    return dict(GATE.counts)


# ---------------------------------------------------------------------- reading verl's config


def role_of(config: Any) -> str:
    """The role serving a verl config's rollout: ``rollout_tq`` (V1), ``async_rollout`` (fully async), ``rollout``."""
    if select(config, "async_training") is not None:
        return "async_rollout"
    return "rollout_tq" if select(config, "trainer.use_v1", False) is True else "rollout"


def _deferrable(config: Any) -> bool:
    """Trainers whose weight syncs go through the patched checkpoint manager in the trainer's own process."""
    return select(config, "async_training") is None


def _uids(batch: Any) -> list[str] | None:
    """The ``uid`` of every prompt of a dispatched batch (a TensorDict or a DataProto); None if unreadable."""
    try:
        non_tensor = getattr(batch, "non_tensor_batch", None)
        values = non_tensor["uid"] if isinstance(non_tensor, dict) else batch["uid"]
        return [str(u) for u in list(values)]
    except Exception:  # noqa: BLE001 - the caller then treats the engine as busy
        return None


def _sync_trainer(config: Any) -> bool:
    """Trainers whose engine has no request in flight between steps (a deferred sync needs no queue check)."""
    if select(config, "async_training") is not None:
        return False
    if select(config, "trainer.use_v1", False) is True:
        return select(config, "trainer.v1.trainer_mode", "sync") == "sync"
    return True


def planned_steps(config: Any) -> list[int] | None:
    """The steps a verl run will take, from its config: ``resume step + 1`` to the total; None if unknown.

    The total is ``trainer.total_training_steps``, else what the trainer computed from its dataloader
    before building the engines (it writes it into ``actor_rollout_ref.actor.optim``; V1 multiplied it
    by ``parameter_sync_step``).
    """
    total = select(config, "trainer.total_training_steps")
    if total is None:
        total = select(config, "actor_rollout_ref.actor.optim.total_training_steps")
        if total is not None and select(config, "trainer.use_v1", False) is True:
            mode = select(config, "trainer.v1.trainer_mode", "sync")
            total = int(total) // max(1, int(select(config, f"trainer.v1.{mode}.parameter_sync_step", 1) or 1))
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0:
        return None
    return list(range(resume_step(config) + 1, total + 1))


def resume_step(config: Any) -> int:
    """The step a verl run resumes from (0 for a fresh run), as its ``_load_checkpoint`` will find it."""
    mode = select(config, "trainer.resume_mode", "disable")
    folder: str | None = None
    if mode == "auto":
        base = select(config, "trainer.default_local_dir")
        if base is not None:
            try:
                from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

                folder = find_latest_ckpt_path(os.path.abspath(str(base)))
            except Exception as err:  # noqa: BLE001 - an unreadable tracker: plan from step 1 (a superset)
                logger.debug("stepskip: cannot tell the resume step (%s); planning from step 1", err)
    elif mode == "resume_path":
        folder = select(config, "trainer.resume_from_path")
    if not folder or "global_step_" not in str(folder):
        return 0
    tail = str(folder).rstrip("/").split("global_step_")[-1]
    return int(tail) if tail.isdigit() else 0


def validation_need(config: Any) -> str | None:
    """What in a verl config generates outside the training steps, and how to turn it off; None if nothing."""
    parts = []
    if select(config, "trainer.val_before_train", True) is True:
        parts.append("trainer.val_before_train=True")
    freq = select(config, "trainer.test_freq", -1)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        parts.append(f"trainer.test_freq={freq}")
    if not parts:
        return None
    return (f"validation generates ({', '.join(parts)}); it is never skipped, turn it off with "
            "trainer.val_before_train=False trainer.test_freq=-1")


# ---------------------------------------------------------------------- what stands where no engine was built


def _result(value: Any, depth: int = 2) -> Any:
    """``value``, or a coroutine giving it when the caller ``depth`` frames up awaits (as verl's ``auto_await``)."""
    frame = sys._getframe(depth)
    if frame.f_code.co_flags & inspect.CO_COROUTINE:
        async def ready() -> Any:
            return value

        return ready()
    return value


class _NoReplicas(list):  # type: ignore[type-arg]
    """The replica list of a run without engine: what tells ``CheckpointEngineManager(...)`` to build nothing,
    in this process or (the fully async trainer's) another one it is pickled to with its plan."""

    def __init__(self, plan: EnginePlan | None = None) -> None:
        super().__init__()
        self.plan = plan


class NoEngineClient:
    """Stands where verl's ``LLMServerClient`` would talk to a replica: every request is refused."""

    def __init__(self, plan: EnginePlan) -> None:
        self.plan = plan

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise self.plan.not_started(_current_step(), "a request to the inference engine")


class NoEngineServerManager:
    """What ``LLMServerManager.create`` returns when the run starts no engine: no replica, no router."""

    def __init__(self, config: Any, plan: EnginePlan) -> None:
        self.config = config
        self.plan = plan
        self.rollout_replicas: list[Any] = _NoReplicas(plan)
        self.server_handles: list[Any] = []
        self.server_addresses: list[str] = []

    def get_client(self, client_cls: Any = None, **kwargs: Any) -> NoEngineClient:
        return NoEngineClient(self.plan)

    def get_addresses(self) -> list[str]:
        return []

    def get_replicas(self) -> list[Any]:
        return self.rollout_replicas

    def start_profile(self, **kwargs: Any) -> Any:
        return _result(None)

    def stop_profile(self) -> Any:
        return _result(None)


class NoEngineCheckpointManager:
    """What ``CheckpointEngineManager(...)`` is over the replicas of a run without engine: nothing to sync."""

    def __init__(self, plan: EnginePlan) -> None:
        self.plan = plan
        self.replicas: list[Any] = _NoReplicas()

    def _nothing(self, *args: Any, **kwargs: Any) -> Any:
        return _result(None)

    def update_weights(self, global_steps: Any = None) -> Any:
        return _result({})

    sleep_replicas = wake_up_replicas = abort_replicas = resume_generation_replicas = _nothing
    release_kv_cache_replicas = resume_kv_cache_replicas = add_replicas = remove_replicas = _nothing


class _Dispatch:
    def __init__(self, worker: NoEngineWorker) -> None:
        self._worker = worker

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        raise self._worker.plan.not_started(_current_step(), _what(args))


class NoEngineWorker:
    """The agent-loop worker of a run without engine: a dispatch to it is refused, naming the step."""

    def __init__(self, plan: EnginePlan) -> None:
        self.plan = plan
        self.generate_sequences = _Dispatch(self)


class _Synced:
    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        GATE.before_dispatch(args[0] if args else kwargs.get("prompts"))
        ref = self._method.remote(*args, **kwargs)
        if GATE.fully_async:
            from stepskip.integrations.verl._fully_async import ROLLOUTER

            ROLLOUTER.dispatched(ref)
        return ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)


class SyncingWorker:
    """An agent-loop worker handle whose ``generate_sequences.remote`` first runs a deferred weight sync."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.generate_sequences = _Synced(handle.generate_sequences)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _current_step() -> int | None:
    from stepskip._manager import SkipManager

    return SkipManager.step if SkipManager.step >= 0 else None


def _what(args: tuple[Any, ...]) -> str:
    from stepskip._calls import is_validation

    batch = args[0] if args else None
    try:
        validating = batch is not None and is_validation(None, batch)
    except Exception:  # noqa: BLE001 - a batch the test cannot read is a training batch for the message
        validating = False
    return "validation" if validating else "a dispatch to the agent-loop workers (a cache miss or generation " \
        "outside the cached steps)"


# ---------------------------------------------------------------------- the patches


def _mark(fn: Callable[..., Any], original: Any) -> Callable[..., Any]:
    setattr(fn, _PATCHED, True)
    fn.__stepskip_original__ = original  # type: ignore[attr-defined]
    return fn


def _is_patched(value: Any) -> bool:
    fn = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
    return bool(getattr(fn, _PATCHED, False))


#: verl module -> the patch applied when it is imported (or at install() when it already was).
PATCHES: dict[str, Callable[[ModuleType], None]] = {}
#: verl module -> ``(class, attribute)``: the class each patch changes, and the attribute that shows it did.
PATCHED_ATTRIBUTES: dict[str, tuple[str, str]] = {}


def _patch_of(module_name: str, class_name: str, attribute: str) -> Callable[[Callable[[Any], None]],
                                                                             Callable[[ModuleType], None]]:
    """Declare ``patch(cls)`` as the patch of ``module_name``'s ``class_name``: the function made takes the
    module and patches its class once (a class whose ``attribute`` is stepskip's already is left alone)."""

    def register(patch_class: Callable[[Any], None]) -> Callable[[ModuleType], None]:
        def patch(module: ModuleType) -> None:
            cls = getattr(module, class_name, None)
            if cls is not None and not _is_patched(cls.__dict__.get(attribute)):
                patch_class(cls)

        functools.update_wrapper(patch, patch_class)
        PATCHES[module_name] = patch
        PATCHED_ATTRIBUTES[module_name] = (class_name, attribute)
        return patch

    return register


def _caller_is_async(depth: int = 2) -> bool:
    return bool(sys._getframe(depth).f_code.co_flags & inspect.CO_COROUTINE)


@_patch_of("verl.workers.rollout.llm_server", "LLMServerManager", "create")
def patch_llm_server(cls: Any) -> None:
    """``LLMServerManager.create``: no replica and no router when the plan starts no engine."""
    original = cls.__dict__["create"].__func__  # verl's auto_await wrapper

    def create(klass: type, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("config", args[0] if args else None)
        plan = GATE.plan_for(config)
        if plan.start:
            return original.__wrapped__(klass, *args, **kwargs) if _caller_is_async() else \
                original(klass, *args, **kwargs)
        return _result(NoEngineServerManager(config, plan))

    functools.update_wrapper(create, original)
    cls.create = classmethod(_mark(create, original))


@_patch_of("verl.experimental.agent_loop.agent_loop", "AgentLoopManager", "_init_agent_loop_workers")
def patch_agent_loop(cls: Any) -> None:
    """``AgentLoopManager._init_agent_loop_workers``: no worker without an engine; a deferred sync before dispatch."""
    original = cls.__dict__["_init_agent_loop_workers"]

    async def _init_agent_loop_workers(self: Any) -> None:
        plan = GATE.plan_for(self.config)
        if not plan.start:
            self.agent_loop_workers = [NoEngineWorker(plan)]
            return
        await original(self)
        self.agent_loop_workers = [SyncingWorker(w) for w in self.agent_loop_workers]

    functools.update_wrapper(_init_agent_loop_workers, original)
    cls._init_agent_loop_workers = _mark(_init_agent_loop_workers, original)


@_patch_of("verl.checkpoint_engine.base", "CheckpointEngineManager", "update_weights")
def patch_checkpoint_engine(cls: Any) -> None:
    """``CheckpointEngineManager``: none over a run without engine; syncs deferred, asleep replicas not slept."""
    update_original = cls.__dict__["update_weights"]
    sleep_original = cls.__dict__["sleep_replicas"]
    new_original = cls.__dict__.get("__new__")

    def __new__(klass: type, *args: Any, **kwargs: Any) -> Any:
        replicas = kwargs.get("replicas", args[2] if len(args) > 2 else None)
        if isinstance(replicas, _NoReplicas):
            plan = GATE.plan if GATE.plan is not None else replicas.plan  # the Rollouter's, in the fully async trainer
            if plan is not None:
                return NoEngineCheckpointManager(plan)
        return object.__new__(klass)

    def update_weights(self: Any, global_steps: Any = None) -> Any:
        from stepskip.integrations.verl._fully_async import trainer_gate

        if GATE.defer(self, global_steps):
            return _result({})
        is_async = _caller_is_async()
        decision = trainer_gate(self, global_steps, is_async)  # the fully async trainer asks its Rollouter
        if decision is not None and is_async:
            return _gated_sync(self, decision, global_steps)
        if decision is False:
            GATE.counts["weight_syncs_deferred"] += 1
            return {}
        out = update_original.__wrapped__(self, global_steps) if is_async else update_original(self, global_steps)
        GATE.synced(self)
        return out

    async def _gated_sync(self: Any, decision: Any, global_steps: Any) -> Any:
        if not await decision:
            GATE.counts["weight_syncs_deferred"] += 1
            return {}
        out = await update_original.__wrapped__(self, global_steps)
        GATE.synced(self)
        return out

    def sleep_replicas(self: Any) -> Any:
        if GATE.asleep(self):
            return _result(None)
        return sleep_original.__wrapped__(self) if _caller_is_async() else sleep_original(self)

    for fn, original in ((update_weights, update_original), (sleep_replicas, sleep_original)):
        functools.update_wrapper(fn, original)
    cls.__new__ = staticmethod(_mark(__new__, new_original))
    cls.update_weights = _mark(update_weights, update_original)
    cls.sleep_replicas = _mark(sleep_replicas, sleep_original)


# ---------------------------------------------------------------------- V1: prompts added to a replayed step


def _serving_tq_role() -> Any:
    """The run's ``rollout_tq`` role when it is on, else None."""
    from stepskip._manager import SkipManager

    role = SkipManager.skip_instances.get("rollout_tq")
    return role if role is not None and role.is_enabled() else None


class _CacheOnlyManager:
    """Stands in for the agent-loop manager while verl adds prompts to a replayed step: served from the
    cache by prompt, never generated; ``on_missing`` decides about prompts the cache does not hold."""

    def __init__(self, role: Any, step: int, on_missing: Callable[[Any], None]) -> None:
        self.role, self.step, self.on_missing = role, step, on_missing
        self.prompts = 0

    def generate_sequences(self, batch: Any) -> None:
        self.prompts += len(batch)
        missing = self.role.inject_extra(self.step, batch)
        if missing is not None:
            self.on_missing(missing)


@contextlib.contextmanager
def _manager_swapped(trainer: Any, stand_in: _CacheOnlyManager) -> Iterator[None]:
    real = getattr(trainer, "agent_loop_manager", None)
    trainer.agent_loop_manager = stand_in
    try:
        yield
    finally:
        trainer.agent_loop_manager = real


@_patch_of("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "_add_prompts_to_generate")
def patch_v1_trainer(cls: Any) -> None:
    """``PPOTrainer``: the refill and the resume of a replayed step go through the cache; warm-up per step."""
    refill_original = cls.__dict__["_add_prompts_to_generate"]
    reissue_original = cls.__dict__["_reissue_inflight_prompts"]
    warmup_original = cls.__dict__["_add_async_warmup_batches"]

    def _add_prompts_to_generate(self: Any, num_prompts: int) -> int:
        role = _serving_tq_role()
        step = getattr(self, "global_steps", None)
        if role is None or not isinstance(step, int) or not role.was_replayed(step):
            return int(refill_original(self, num_prompts))

        def refuse(missing: Any) -> None:
            GATE.counts["refill_prompts_refused"] += len(missing)
            raise ReplayMissError(
                f"step {step} is replayed from the cache, and the replay buffer asked for {num_prompts} more "
                f"prompts (its refill: groups evicted as stale, failed or filtered by algorithm.filter_groups); "
                f"{len(missing)} of them have no recorded trajectories, and a replayed step never generates. "
                f"Record step {step} with the sampler settings of this run, or take it out of "
                "skip.rollout_tq.steps")

        stand_in = _CacheOnlyManager(role, step, refuse)
        with _manager_swapped(self, stand_in):
            submitted = int(refill_original(self, num_prompts))
        GATE.counts["refill_prompts_from_cache"] += stand_in.prompts
        return submitted

    def _reissue_inflight_prompts(self: Any, partition_id: str = "train") -> int:
        role = _serving_tq_role()
        step = getattr(self, "global_steps", None)
        if role is None or not isinstance(step, int) or not role.would_replay(step):
            return int(reissue_original(self, partition_id))
        dropped: list[str] = []

        def drop(missing: Any) -> None:
            uids = [str(u) for u in missing["uid"]]
            role.tq_client.kv_clear(keys=uids, partition_id=partition_id)
            dropped.extend(uids)
            logger.warning("stepskip: %d in-flight prompts restored for step %d are not in the cache; the step "
                           "is replayed, so they are dropped from the queue instead of generated", len(uids), step)

        stand_in = _CacheOnlyManager(role, step, drop)
        with _manager_swapped(self, stand_in):
            reissued = int(reissue_original(self, partition_id))
        GATE.counts["reissued_prompts_from_cache"] += stand_in.prompts - len(dropped)
        GATE.counts["reissued_prompts_dropped"] += len(dropped)
        return reissued - len(dropped)

    def _add_async_warmup_batches(self: Any, num_warmup_batches: Any) -> None:
        role = _serving_tq_role()
        plan = GATE.plan
        step = getattr(self, "global_steps", None)
        if role is None or (plan is not None and not plan.start) or step in role.step_set:
            return warmup_original(self, num_warmup_batches)  # verl's own check turns it off under skip
        with _skip_flag_off(self.config):  # the first step is not a skipped one: warm up as without skip
            return warmup_original(self, num_warmup_batches)

    for fn, original in ((_add_prompts_to_generate, refill_original), (_reissue_inflight_prompts, reissue_original),
                         (_add_async_warmup_batches, warmup_original)):
        functools.update_wrapper(fn, original)
        setattr(cls, fn.__name__, _mark(fn, original))


@contextlib.contextmanager
def _skip_flag_off(config: Any) -> Iterator[None]:
    """``skip.rollout_tq.enable`` reads False inside (verl's warm-up check), True again after."""
    node = select(config, "skip.rollout_tq")
    if node is None or select(node, "enable", False) is not True:
        yield
        return
    _set_enable(node, False)
    try:
        yield
    finally:
        _set_enable(node, True)


def _set_enable(node: Any, value: bool) -> None:
    from omegaconf import DictConfig, open_dict, read_write

    if isinstance(node, DictConfig):
        with read_write(node), open_dict(node):
            node.enable = value
    elif isinstance(node, dict):
        node["enable"] = value
    else:
        node.enable = value


def unpatched() -> list[str]:
    """``module.Class.attribute`` of every loaded verl class still without its patch."""
    from stepskip.integrations.verl import _fully_async

    out = []
    for name, (cls_name, attr) in PATCHED_ATTRIBUTES.items():
        cls = getattr(sys.modules.get(name), cls_name, None)
        if cls is not None and not _is_patched(cls.__dict__.get(attr)):
            out.append(f"{name}.{cls_name}.{attr}")
    module = sys.modules.get(_fully_async.MODULE)
    if module is not None and _fully_async.unpatched(module):
        out.append(f"{_fully_async.MODULE}.FullyAsyncRollouter.get_replicas")
    return out


def _patch_rollouter(module: ModuleType) -> None:
    from stepskip.integrations.verl._fully_async import patch_rollouter

    patch_rollouter(module)


PATCHES["verl.experimental.fully_async_policy.fully_async_rollouter"] = _patch_rollouter
