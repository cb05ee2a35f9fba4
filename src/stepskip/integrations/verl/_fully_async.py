"""The fully async trainer: no weight sync into the Rollouter's engine while it only replays (verl 0.9.1).

verl's fully async trainer runs two Ray actors: the ``FullyAsyncRollouter`` builds the engine and
generates one sample at a time (the ``async_rollout`` role, each sample's step its feed index); the
``FullyAsyncTrainer`` trains and, every ``trigger_parameter_sync_step`` updates, pushes its weights
into the Rollouter's replicas with ``CheckpointEngineManager.update_weights``, over the replica list
it got from ``FullyAsyncRollouter.get_replicas``. The decision and the sync live in two processes,
so ``install()`` patches both ends:

* ``FullyAsyncRollouter.get_replicas`` returns the replicas as a :class:`RollouterReplicas` list,
  which carries a way back to the Rollouter (its actor handle, or the instance itself outside Ray);
* the trainer's patched ``update_weights`` over such a list first asks the Rollouter
  (:func:`rollouter_needs_weights`, run in the Rollouter's process through Ray's ``__ray_call__``)
  and skips the sync when the answer is no.

The Rollouter answers no only when none of its engine's requests is in flight and every sample it
can take before the trainer's next sync is served from the cache: verl's staleness control lets it
take at most ``max_required_samples`` samples between two ``reset_staleness`` calls (which follow
each sync), so the samples from the first one still queued up to what is left of the current
budget plus a whole new one are asked (:meth:`FeedWindow.of`). The next sync asks again and pushes
the then-current weights: a sync skipped is never owed, since a later one carries newer weights.
With validation on (``trainer.test_freq`` or ``val_before_train``), which generates on the same
engine, syncs keep verl's order. A dispatch to the engine after a skipped sync (which the window
should make impossible) is logged and counted (``dispatches_after_skipped_sync``).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

from stepskip.integrations.verl import _engines

logger = logging.getLogger("stepskip.integrations.verl")

MODULE = "verl.experimental.fully_async_policy.fully_async_rollouter"

__all__ = ["RollouterReplicas", "FeedWindow", "rollouter_needs_weights", "trainer_gate", "patch_rollouter"]


class _Local:
    """The in-process way back to a Rollouter that is not a Ray actor: ``__ray_call__`` as Ray's."""

    def __init__(self, instance: Any) -> None:
        self.instance = instance

    def call(self, fn: Any, *args: Any) -> Any:
        return fn(self.instance, *args)


class RollouterReplicas(list):  # type: ignore[type-arg]
    """The Rollouter's replicas as the trainer gets them, with a way to ask the Rollouter about its engine.

    Args:
        replicas: the replicas ``get_replicas`` returned.
        rollouter: the Rollouter's Ray actor handle (pickled to the trainer's process with the list),
            or a :class:`_Local` reference when the Rollouter runs in this process.
    """

    def __init__(self, replicas: Any, rollouter: Any) -> None:
        super().__init__(replicas)
        self.rollouter = rollouter

    def ask(self, global_steps: Any) -> Any:
        """Whether the Rollouter's engine needs the weights of ``global_steps``: a bool, or (from a Ray actor)
        an ``ObjectRef`` to one."""
        if isinstance(self.rollouter, _Local):
            return self.rollouter.call(rollouter_needs_weights, global_steps)
        return self.rollouter.__ray_call__.remote(rollouter_needs_weights, global_steps)


@dataclass(frozen=True)
class FeedWindow:
    """The feed indices (the ``async_rollout`` role's steps) a Rollouter may take before the trainer's next sync.

    Args:
        first: the first sample still waiting in its queue (or the next one it will feed).
        last: the last it may take before the next sync, capped by the run's last sample.
    """

    first: int
    last: int

    @classmethod
    def of(cls, rollouter: Any) -> FeedWindow | None:
        """The window of a ``FullyAsyncRollouter`` from the state verl keeps on it; None when it cannot tell.

        Example:
            >>> import asyncio, types
            >>> r = types.SimpleNamespace(global_steps=7, pending_queue=asyncio.Queue(), max_required_samples=4,
            ...                           staleness_samples=1, total_rollout_steps=100)
            >>> FeedWindow.of(r)
            FeedWindow(first=7, last=13)
        """
        try:
            fed = int(rollouter.global_steps)
            queued = int(rollouter.pending_queue.qsize())
            budget = int(rollouter.max_required_samples)
            used = int(rollouter.staleness_samples)
            total = int(rollouter.total_rollout_steps)
        except (AttributeError, TypeError, ValueError):
            return None
        first = max(1, fed - queued)  # the queue may end with verl's end marker: one earlier, never later
        # what is left of the current budget, then a whole one after the reset that follows the sync
        last = min(total, first + max(0, budget - used) + budget - 1)
        return cls(first, last)

    def steps(self) -> range:
        return range(self.first, self.last + 1)


class _RollouterState:
    """What the Rollouter's process knows of its engine: requests in flight, and whether a sync was skipped."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = 0
        self.untracked = False  # a dispatch whose end cannot be seen: the engine may be busy
        self.skipped = False  # the last sync the trainer asked about was skipped
        self.warned = False

    def dispatched(self, ref: Any) -> None:
        """A request went to the engine: in flight until ``ref`` (the worker's ``ObjectRef``) resolves."""
        with self.lock:
            if self.skipped:
                _engines.GATE.counts["dispatches_after_skipped_sync"] += 1
                if not self.warned:
                    self.warned = True
                    logger.warning("stepskip: the Rollouter's engine got a request after the trainer's weight sync was "
                                   "skipped; it generates with the weights of an earlier sync")
            future = getattr(ref, "future", None)
            if future is None:
                self.untracked = True
                return
            self.in_flight += 1
        try:
            future().add_done_callback(self._done)
        except Exception:  # noqa: BLE001 - its end cannot be seen: count the engine busy from now on
            with self.lock:
                self.in_flight -= 1
                self.untracked = True

    def _done(self, _: Any) -> None:
        with self.lock:
            self.in_flight -= 1

    def busy(self) -> bool:
        with self.lock:
            return self.untracked or self.in_flight > 0

    def reset(self) -> None:
        with self.lock:
            self.in_flight, self.untracked, self.skipped, self.warned = 0, False, False, False


ROLLOUTER = _RollouterState()


def rollouter_needs_weights(rollouter: Any, global_steps: Any = None) -> bool:
    """Whether the Rollouter's engine needs the trainer's weights now; runs in the Rollouter's process.

    Args:
        rollouter: the ``FullyAsyncRollouter`` instance.
        global_steps: the version the trainer is about to push (for the log).

    Returns:
        False only when no request is on the engine, validation is off, and every sample of
        :meth:`FeedWindow.of` is served from the cache; True otherwise (verl's order).
    """
    from stepskip._manager import SkipManager

    role = SkipManager.skip_instances.get("async_rollout")
    config = getattr(rollouter, "config", None)
    window = FeedWindow.of(rollouter)
    needed = (role is None or not role.is_enabled() or window is None or config is None
              or _engines.validation_need(config) is not None or ROLLOUTER.busy()
              or not all(role.would_replay(step) for step in window.steps()))
    with ROLLOUTER.lock:
        ROLLOUTER.skipped = not needed
    if not needed and window is not None:
        logger.info("stepskip: the weight sync of version %s is skipped: samples %d-%d are served from the cache",
                    global_steps, window.first, window.last)
    return needed


def trainer_gate(manager: Any, global_steps: Any, is_async: bool) -> Any:
    """In the trainer's process: None when ``manager`` does not sync into a Rollouter (verl's order); else
    whether to sync, a bool or (``is_async``) a coroutine giving one."""
    replicas = getattr(manager, "replicas", None)
    if not isinstance(replicas, RollouterReplicas):
        return None
    if is_async:
        async def decide() -> bool:
            try:
                answer = replicas.ask(global_steps)
                return bool(await answer) if not isinstance(answer, bool) else answer
            except Exception as err:  # noqa: BLE001 - a Rollouter that cannot answer: sync, as verl would
                logger.debug("stepskip: the Rollouter did not answer (%s); syncing the weights", err)
                return True

        return decide()
    try:
        answer = replicas.ask(global_steps)
        if isinstance(answer, bool):
            return answer
        import ray

        return bool(ray.get(answer))
    except Exception as err:  # noqa: BLE001
        logger.debug("stepskip: the Rollouter did not answer (%s); syncing the weights", err)
        return True


def _actor_class(value: Any) -> Any:
    """The class under a Ray actor class (``@ray.remote`` wraps verl's ``FullyAsyncRollouter``)."""
    metadata = getattr(value, "__ray_metadata__", None)
    modified = getattr(metadata, "modified_class", None)
    return getattr(modified, "__ray_actor_class__", modified) if modified is not None else value


def _handle_of(instance: Any) -> Any:
    """The Ray actor handle of the actor running now, else an in-process reference to ``instance``."""
    try:
        import ray

        if ray.is_initialized():
            context = ray.get_runtime_context()
            if context.get_actor_id() is not None:
                return context.current_actor
    except Exception as err:  # noqa: BLE001 - not in an actor after all: answer in process
        logger.debug("stepskip: no Ray actor handle for the Rollouter (%s)", err)
    return _Local(instance)


def patch_rollouter(module: Any) -> None:
    """``FullyAsyncRollouter.get_replicas``: the replicas with a way back to the Rollouter (see the module)."""
    cls = _actor_class(getattr(module, "FullyAsyncRollouter", None))
    if cls is None or _engines._is_patched(cls.__dict__.get("get_replicas")):
        return
    original = cls.__dict__["get_replicas"]

    def get_replicas(self: Any) -> Any:
        replicas = original(self)
        if isinstance(replicas, (_engines._NoReplicas, RollouterReplicas)):
            return replicas  # no engine: the trainer builds no checkpoint engine over it
        return RollouterReplicas(replicas, _handle_of(self))

    functools.update_wrapper(get_replicas, original)
    cls.get_replicas = _engines._mark(get_replicas, original)


def unpatched(module: Any) -> bool:
    """True when ``module``'s Rollouter class is loaded without its patch."""
    cls = _actor_class(getattr(module, "FullyAsyncRollouter", None))
    return cls is not None and not _engines._is_patched(cls.__dict__.get("get_replicas"))
