"""``SkipManager``: the class-level registry of skip roles and the decorators that consult it."""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import logging
import operator
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from typing import Any, ClassVar, TypeVar

from stepskip.config import SkipManagerConfig, SkipRoleConfig, disable_legacy_flag, select
from stepskip.errors import CacheMissError
from stepskip.roles.base import SKIP_REGISTRY, BaseSkip, SkipAction
from stepskip.roles.rollout import GENERATION_SECONDS
from stepskip.worker import default_worker

__all__ = ["SkipManager"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# One step of a call's plan: ("io", fn, args, kwargs) runs storage work (off the event loop in
# coroutine wrappers); ("call",) runs the decorated function and sends back its result.
_Instruction = tuple[Any, ...]
_BUILTIN_ROLES = ("rollout", "rollout_tq", "async_rollout")


def _is_validation(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """The seed's validation bypass: ``meta_info["validate"]`` or TensorDict ``non_tensor_data["validate"]``."""
    prompts = kwargs.get("prompts")
    if prompts is None:
        if len(args) > 1:
            prompts = args[1]
        elif len(args) == 1 and hasattr(args[0], "meta_info"):
            prompts = args[0]
        else:
            return False
    meta_info = getattr(prompts, "meta_info", None)
    if isinstance(meta_info, dict) and meta_info.get("validate"):
        return True
    non_tensor_data = getattr(prompts, "non_tensor_data", None)
    if non_tensor_data is not None:
        try:
            return bool(non_tensor_data.get("validate", False))
        except (AttributeError, TypeError, KeyError):
            return False
    return False


def _plan(skip: BaseSkip, step: int, func: Callable[..., Any], args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Generator[_Instruction, Any, Any]:
    """The one decision path of a decorated call on an eligible step (sync and async alike)."""
    if (yield ("io", skip.meet_precondition, (step, func, *args), kwargs)):
        try:
            return (yield ("io", skip.warp_function, (step, func, *args), kwargs))
        except CacheMissError:
            if skip.action is SkipAction.REPLAY:
                raise
            # corrupt or vanished entry: already logged and counted by the role; regenerate it
    start = time.perf_counter()
    result = yield ("call",)
    token = GENERATION_SECONDS.set(time.perf_counter() - start)
    try:
        yield ("io", skip.prepare_data, (step, result, *args), kwargs)
    finally:
        GENERATION_SECONDS.reset(token)
    return result


def _resume(plan: Generator[_Instruction, Any, Any], value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Send the last outcome into the plan: ``(True, result)`` when it finished, else ``(False, instruction)``."""
    try:
        return False, (plan.throw(error) if error is not None else plan.send(value))
    except StopIteration as stop:
        return True, stop.value


def _drive_sync(plan: Generator[_Instruction, Any, Any], func: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    value, error = None, None
    while True:
        done, instruction = _resume(plan, value, error)
        if done:
            return instruction
        value, error = None, None
        try:
            if instruction[0] == "call":
                value = func(*args, **kwargs)
            else:
                value = instruction[1](*instruction[2], **instruction[3])
        except Exception as err:  # handed back to the plan, which decides
            error = err


async def _drive_async(plan: Generator[_Instruction, Any, Any], func: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    value, error = None, None
    while True:
        done, instruction = _resume(plan, value, error)
        if done:
            return instruction
        value, error = None, None
        try:
            if instruction[0] == "call":
                value = await func(*args, **kwargs)
            else:  # storage work runs in a worker thread: the event loop never blocks on disk
                value = await asyncio.to_thread(instruction[1], *instruction[2], **instruction[3])
        except Exception as err:
            error = err


class SkipManager:
    """Process-wide registry of skip roles.

    Before :meth:`init` every decorator is a pass-through. ``init`` reads ``config.skip``, builds
    one instance per registered role, and starts a new *run* (a random id written into every
    entry it dumps).

    Example:
        >>> import tempfile
        >>> from stepskip import SkipManager, Batch
        >>> class Loop:
        ...     @SkipManager.annotate(role="rollout")
        ...     def generate_sequences(self, prompts):
        ...         return prompts
        >>> SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": tempfile.mkdtemp()}}})
        >>> SkipManager.set_step(1)
        >>> out = Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a"]}))
        >>> SkipManager.reset()
    """

    config: ClassVar[SkipManagerConfig | None] = None
    step: ClassVar[int] = -1
    skip_instances: ClassVar[dict[str, BaseSkip]] = {}
    run_id: ClassVar[str | None] = None
    _closed: ClassVar[bool] = False
    _atexit_registered: ClassVar[bool] = False

    @classmethod
    def init(cls, config: Any, **runtime: Any) -> None:
        """Build the roles from ``config.skip`` (OmegaConf node, nested dict or attribute object).

        Args:
            config: the whole training config.
            **runtime: live objects a role needs, e.g. ``tq_client=`` for ``rollout_tq``.

        Raises:
            SkipConfigError: a bad value or an unknown role under ``skip``.
        """
        extra_classes: dict[str, type[SkipRoleConfig]] = {
            name: getattr(skip_cls, "config_class", SkipRoleConfig)
            for name, skip_cls in SKIP_REGISTRY.items() if name not in _BUILTIN_ROLES
        }
        skip_config = SkipManagerConfig.from_section(select(config, "skip"), extra_classes)
        disable_legacy_flag(config, skip_config)
        run_id = uuid.uuid4().hex
        instances: dict[str, BaseSkip] = {}
        for name, skip_cls in SKIP_REGISTRY.items():
            local = skip_config.role(name) or skip_cls.config_class()
            instances[name] = cls._build(name, skip_cls, local, config, run_id, runtime)
        for name, local in skip_config.extra.items():
            if name not in instances:  # generic `kind: stage` roles
                from stepskip.roles.stage import StageSkip

                instances[name] = cls._build(name, StageSkip, local, config, run_id, runtime)
        cls.close()  # only now: a bad new config leaves the previous run untouched
        if not cls._atexit_registered:  # a run that never calls close() still flushes and summarises
            atexit.register(cls.close)
            cls._atexit_registered = True
        cls.config = skip_config
        cls.step = -1
        cls.run_id = run_id
        cls.skip_instances = instances
        cls._closed = False
        enabled = [n for n, s in instances.items() if s.is_enabled()]
        if enabled:
            logger.info("stepskip run %s: enabled roles %s", run_id[:12], ", ".join(enabled))

    @staticmethod
    def _build(name: str, skip_cls: type[BaseSkip], local: Any, config: Any, run_id: str,
               runtime: dict[str, Any]) -> BaseSkip:
        instance = skip_cls(local, config)
        instance.name = name
        instance.run_id = run_id
        instance.runtime = dict(runtime)
        return instance

    @classmethod
    def set_step(cls, step: int) -> None:
        """Set the trainer's ``global_steps``, shared by every role without online steps.

        Raises:
            TypeError: ``step`` is not an integer (numpy integers are accepted).
        """
        cls.step = operator.index(step)

    @classmethod
    def _route(cls, skip: BaseSkip, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
        """The step an enabled role's call is subject to, or None to pass the call through.

        Offline roles test the (cheap) step first; online roles must not parse a step out of a
        validation batch, so they test the validation flag first.
        """
        if skip.support_online_step:
            if _is_validation(args, kwargs):
                return None
            step = skip.extract_step(*args, **kwargs)
            return step if step in skip.steps else None
        step = cls.step
        if step not in skip.steps or _is_validation(args, kwargs):
            return None
        return step

    @classmethod
    def annotate(cls, role: str, **_: Any) -> Callable[[F], F]:
        """Decorate a sync or coroutine function as the skip unit of ``role``.

        On an eligible step the cached result is returned without calling the function (a hit),
        or the function runs and its result is dumped (a miss). Validation calls
        (``meta_info["validate"]``) always run. Coroutine wrappers do their disk I/O in worker
        threads, never on the event loop.

        Example:
            >>> @SkipManager.annotate(role="rollout")
            ... def generate_sequences(self, prompts): ...
        """

        def decorator(func: F) -> F:
            if inspect.iscoroutinefunction(func):

                @functools.wraps(func)
                async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                    skip = cls.skip_instances.get(role)
                    if skip is None or not skip.enable:
                        return await func(*args, **kwargs)
                    step = cls._route(skip, args, kwargs)
                    if step is None:
                        return await func(*args, **kwargs)
                    return await _drive_async(_plan(skip, step, func, args, kwargs), func, args, kwargs)

                return async_wrapper  # type: ignore[return-value]

            # The pass-through path is inlined: it runs on every call of the trainer's hot function.
            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                skip = cls.skip_instances.get(role)
                if skip is None or not skip.enable:
                    return func(*args, **kwargs)
                if not skip.support_online_step and cls.step not in skip.steps:
                    return func(*args, **kwargs)
                step = cls._route(skip, args, kwargs)
                if step is None:
                    return func(*args, **kwargs)
                return _drive_sync(_plan(skip, step, func, args, kwargs), func, args, kwargs)

            return sync_wrapper  # type: ignore[return-value]

        return decorator

    @classmethod
    def annotate_tq(cls, role: str, phase: str) -> Callable[[F], F]:
        """The two-phase decorator of the V1 trainer over TransferQueue (seed §4).

        ``phase="submit"`` decorates ``_add_batch_to_generate(self)``. On an eligible step it
        replaces the body: ``batch = self._next_train_batch()`` always runs (the dataloader stays
        aligned), then a cached step is injected into the queue (hit: return None without
        submitting) or ``self._submit_batch_to_rollout(batch)`` runs (miss: its value is returned).
        ``phase="sample"`` decorates ``ReplayBuffer.sample``; after it runs, a train-partition result
        of a step without a complete cache is saved as the step's next inner entry.

        Raises:
            ValueError: ``phase`` is neither ``"submit"`` nor ``"sample"``.
        """
        if phase not in ("submit", "sample"):
            raise ValueError(f"annotate_tq phase must be 'submit' or 'sample', got {phase!r}")

        def decorator(func: F) -> F:
            @functools.wraps(func)
            def wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
                skip = cls.skip_instances.get(role)
                if skip is None or not skip.enable or cls.step not in skip.steps:
                    return func(owner, *args, **kwargs)
                step = cls.step
                if phase == "submit":
                    batch = owner._next_train_batch()
                    if skip.maybe_load_and_inject(step, list(batch["uid"]), prompts=batch):  # type: ignore[attr-defined]
                        return None
                    return owner._submit_batch_to_rollout(batch)
                result = func(owner, *args, **kwargs)
                sampled = result[0] if isinstance(result, tuple) else result
                if skip.should_save(step, getattr(sampled, "partition_id", None)):  # type: ignore[attr-defined]
                    skip.prepare_data(step=step, batch=sampled, global_steps=step)
                return result

            return wrapper  # type: ignore[return-value]

        return decorator

    @classmethod
    def will_replay(cls, role: str, steps: Iterable[int]) -> bool:
        """True when every step in ``steps`` would be served from the cache under the role's action.

        Lets a trainer skip starting its inference engine when a whole run replays.
        """
        skip = cls.skip_instances.get(role)
        if skip is None or not skip.is_enabled():
            return False
        steps = list(steps)
        return bool(steps) and all(skip.would_replay(step) for step in steps)

    @classmethod
    def stats(cls) -> dict[str, float]:
        """Counters of every role as ``{"skip/{role}/{name}": value}``, ready for a metrics logger.

        Names: hits, misses, dumps, dump_failures, corrupt, load_seconds, dump_seconds,
        bytes_read, bytes_written, saved_seconds.
        """
        out: dict[str, float] = {}
        for name, skip in cls.skip_instances.items():
            stats = getattr(skip, "stats", None)
            if stats is not None:
                out.update(stats.snapshot(name))
        return out

    @classmethod
    def flush(cls, timeout: float | None = None) -> bool:
        """Wait until every pending background dump is on disk; False if ``timeout`` ran out."""
        return default_worker().flush(timeout)

    @classmethod
    def close(cls) -> None:
        """Flush pending dumps, log one summary line per enabled role, release the roles."""
        if not cls.skip_instances:
            return
        cls.flush()
        if cls._closed:
            return
        cls._closed = True
        for name, skip in cls.skip_instances.items():
            stats = getattr(skip, "stats", None)
            if skip.is_enabled() and stats is not None:
                logger.info(
                    "stepskip %s summary: %d hits, %d misses, %d dumps, %d dump failures, %d corrupt, "
                    "%.1fs of generation saved", name, stats["hits"], stats["misses"], stats["dumps"],
                    stats["dump_failures"], stats["corrupt"], stats["saved_seconds"],
                )
            skip.close()

    @classmethod
    def reset(cls) -> None:
        """Flush pending dumps and return to the pre-``init`` defaults (every decorator a pass-through)."""
        cls.close()
        cls.config = None
        cls.step = -1
        cls.skip_instances = {}
        cls.run_id = None
