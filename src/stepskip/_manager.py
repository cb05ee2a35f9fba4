"""``SkipManager``: the class-level registry of skip roles and the decorators that consult it."""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import logging
import operator
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterable
from typing import Any, ClassVar, TypeVar

from stepskip._dumping.worker import default_worker
from stepskip._calls import (
    CURRENT_CALL,
    BypassTest,
    CallInfo,
    PromptsFinder,
    find_prompts,
    is_validation,
    prompt_columns,
)
from stepskip.config import ROLLOUT_ROLES, SkipManagerConfig, SkipRoleConfig, disable_legacy_flag, select
from stepskip._engines import EnginePlan, decide
from stepskip.errors import CacheMissError, SkipConfigError
from stepskip._identity import RunIdentity
from stepskip._policies import Engines, SkipAction, parse_choice
from stepskip.roles.base import SKIP_REGISTRY, BaseSkip, RunContext, TwoPhaseRole

__all__ = ["SkipManager"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

# One step of a call's plan: ("io", fn, args, kwargs) runs storage work (off the event loop in
# coroutine wrappers); ("call",) runs the unit being cached and sends back its result.
_Instruction = tuple[Any, ...]


class _Hooks:
    """What the decision plan needs from a role for one call: is it cached, load it, record it.

    ``annotate`` maps these onto verl's ``meet_precondition`` / ``warp_function`` /
    ``prepare_data``; ``annotate_tq``'s submit phase onto the V1 role's ``meet_precondition`` /
    ``inject`` / ``begin_recording``.
    """

    __slots__ = ("skip", "step", "args", "kwargs", "prompts")

    def __init__(self, skip: Any, step: int, args: tuple[Any, ...], kwargs: dict[str, Any], prompts: Any) -> None:
        self.skip, self.step, self.args, self.kwargs, self.prompts = skip, step, args, kwargs, prompts

    def cached(self, func: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self.skip.meet_precondition, (self.step, func, *self.args), self.kwargs

    def load(self, func: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self.skip.warp_function, (self.step, func, *self.args), self.kwargs

    def record(self, result: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self.skip.prepare_data, (self.step, result, *self.args), self.kwargs

    def match(self, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
        """The plan of ``action: match`` for this kind of call."""
        return _match_plan(self, func)

    def compare(self, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
        """The plan of ``action: compare`` for this kind of call."""
        return _compare_plan(self, func)


class _SubmitHooks(_Hooks):
    """The V1 submit phase: the cached result is an injection into the queue, the miss a submission."""

    __slots__ = ()

    def cached(self, func: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self.skip.meet_precondition, (self.step,), {}

    def load(self, func: Callable[..., Any]) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self.skip.inject, (self.step, list(self.prompts["uid"])), {"prompts": self.prompts}

    def record(self, result: Any) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        return self.skip.begin_recording, (self.step, self.prompts), {}

    def match(self, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
        return _submit_match_plan(self, func)

    def compare(self, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
        return _submit_compare_plan(self, func)


def _with_prompts(args: tuple[Any, ...], kwargs: dict[str, Any], prompts: Any
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with its prompts (verl's convention: keyword, else second positional) replaced."""
    if "prompts" in kwargs:
        return args, {**kwargs, "prompts": prompts}
    if len(args) > 1:
        return (args[0], prompts, *args[2:]), kwargs
    if len(args) == 1:
        return (prompts,), kwargs
    raise SkipConfigError("action 'match' calls the function with only the missing prompts, so it needs them as "
                          "the keyword `prompts` or the second positional argument (verl's convention)")


def _match_plan(hooks: _Hooks, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
    """``action: match``: replay the recorded prompt groups, call ``func`` once with the missing ones."""
    skip = hooks.skip
    split = yield ("io", skip.match_split, (hooks.step, hooks.prompts), {})
    generated = None
    if split.missing_rows:
        args, kwargs = hooks.args, hooks.kwargs
        if split.found:
            args, kwargs = _with_prompts(args, kwargs, split.subset)
        start = time.perf_counter()
        generated = yield ("call", args, kwargs)
        redo = yield ("io", skip.match_rejoin, (hooks.step, split, hooks.prompts, generated), {})
        if redo is not None:  # recorded rows that cannot join the live ones: generate them too, keep the rest
            narrowed, rows, extra = redo
            regenerated = yield ("call", *_with_prompts(hooks.args, hooks.kwargs, extra))
            generated = yield ("io", skip.match_regenerated, (split, narrowed, rows, generated, regenerated), {})
            split = narrowed
        token = CURRENT_CALL.set(CallInfo(split.subset, time.perf_counter() - start))
        try:
            return (yield ("io", skip.match_merge, (hooks.step, split, hooks.prompts, generated), {}))
        finally:
            CURRENT_CALL.reset(token)
    return (yield ("io", skip.match_merge, (hooks.step, split, hooks.prompts, None), {}))


def _submit_match_plan(hooks: _Hooks, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
    """``action: match`` in the V1 submit phase: the recorded prompt groups are injected into the queue,
    then ``_submit_batch_to_rollout`` runs once with only the missing prompts (not at all when none is)."""
    subset = yield ("io", hooks.skip.match_inject, (hooks.step, hooks.prompts), {})
    if subset is None:
        return None
    return (yield ("call", (subset,), {}))


def _compare_plan(hooks: _Hooks, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
    """``action: compare``: read the step's entry, run the call live, compare them; the role returns the
    recorded result or the live one (``train_on``). Nothing to compare with: recorded as under ``cache``."""
    skip = hooks.skip
    recorded = yield ("io", skip.compare_read, (hooks.step, func, *hooks.args), hooks.kwargs)
    columns = prompt_columns(hooks.prompts)
    start = time.perf_counter()
    live = yield ("call",)
    seconds = time.perf_counter() - start
    if recorded is None:
        yield from _record(hooks, func, live, seconds, columns)
        return live
    token = CURRENT_CALL.set(CallInfo(hooks.prompts, seconds, func, columns))
    try:
        return (yield ("io", skip.compare_result, (hooks.step, recorded, live, hooks.prompts), {}))
    finally:
        CURRENT_CALL.reset(token)


def _submit_compare_plan(hooks: _Hooks, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
    """``action: compare`` in the V1 submit phase: the batch is always submitted to rollout; a step with a
    recorded entry is compared as its trajectories are sampled, one without is recorded."""
    yield ("io", hooks.skip.compare_submit, (hooks.step, hooks.prompts), {})
    return (yield ("call",))


def _record(hooks: _Hooks, func: Callable[..., Any], result: Any, seconds: float,
            columns: frozenset[str] | None = None) -> Generator[_Instruction, Any, None]:
    """Record the result of a call that ran (the role's ``prepare_data``), telling it how long the call took
    and which prompt columns there were before it ran (``columns``)."""
    token = CURRENT_CALL.set(CallInfo(hooks.prompts, seconds, func, columns))
    try:
        yield ("io", *hooks.record(result))
    finally:
        CURRENT_CALL.reset(token)


def _plan(hooks: _Hooks, func: Callable[..., Any]) -> Generator[_Instruction, Any, Any]:
    """The one decision path of a call on an eligible step (sync, async and the V1 submit phase alike)."""
    action = hooks.skip.action
    if action is SkipAction.MATCH:
        return (yield from hooks.match(func))
    if action is SkipAction.COMPARE:
        return (yield from hooks.compare(func))
    if (yield ("io", *hooks.cached(func))):
        try:
            return (yield ("io", *hooks.load(func)))
        except CacheMissError:
            if action is SkipAction.REPLAY:
                raise
            # corrupt or vanished entry: already logged and counted by the role; regenerate it
    columns = prompt_columns(hooks.prompts)  # before the call: what it adds to its prompts is not a prompt
    start = time.perf_counter()
    result = yield ("call",)
    yield from _record(hooks, func, result, time.perf_counter() - start, columns)
    return result


def _resume(plan: Generator[_Instruction, Any, Any], value: Any, error: BaseException | None) -> tuple[bool, Any]:
    """Send the last outcome into the plan: ``(True, result)`` when it finished, else ``(False, instruction)``."""
    try:
        return False, (plan.throw(error) if error is not None else plan.send(value))
    except StopIteration as stop:
        return True, stop.value


def _drive_sync(plan: Generator[_Instruction, Any, Any], func: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], prompts: Any) -> Any:
    token = CURRENT_CALL.set(CallInfo(prompts))
    try:
        value, error = None, None
        while True:
            done, instruction = _resume(plan, value, error)
            if done:
                return instruction
            value, error = None, None
            try:
                if instruction[0] == "call":
                    value = func(*instruction[1], **instruction[2]) if len(instruction) > 1 else func(*args, **kwargs)
                else:
                    value = instruction[1](*instruction[2], **instruction[3])
            except Exception as err:  # handed back to the plan, which decides
                error = err
    finally:
        CURRENT_CALL.reset(token)


async def _drive_async(plan: Generator[_Instruction, Any, Any], func: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any], prompts: Any) -> Any:
    token = CURRENT_CALL.set(CallInfo(prompts))
    try:
        value, error = None, None
        while True:
            done, instruction = _resume(plan, value, error)
            if done:
                return instruction
            value, error = None, None
            try:
                if instruction[0] == "call":
                    call_args, call_kwargs = instruction[1:] if len(instruction) > 1 else (args, kwargs)
                    value = await func(*call_args, **call_kwargs)
                else:  # storage work runs in a worker thread (it copies the context): the loop never blocks on disk
                    value = await asyncio.to_thread(instruction[1], *instruction[2], **instruction[3])
            except Exception as err:
                error = err
    finally:
        CURRENT_CALL.reset(token)


def _plan_engines(skip: BaseSkip | None, role: str, steps: Iterable[int] | None, validation: str | None) -> EnginePlan:
    local = getattr(skip, "local_config", None)
    option = parse_choice(Engines, getattr(local, "engines", Engines.AUTO), f"skip.{role}.engines")
    planned = None if steps is None else sorted(set(steps))
    enabled = skip is not None and skip.is_enabled()
    if planned is None or not enabled or option is Engines.START:
        generate: list[int] = list(planned or ())
    else:
        assert skip is not None
        generate = [step for step in planned if not skip.would_replay(step)]
    return decide(role, option, planned=planned, generate=generate, enabled=enabled, validation=validation)


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
    identity: ClassVar[RunIdentity | None] = None
    # The roles that serve calls (``is_enabled()`` at init): what the decorators look up on every call.
    _serving: ClassVar[dict[str, BaseSkip]] = {}
    _closed: ClassVar[bool] = False
    _atexit_registered: ClassVar[bool] = False

    @classmethod
    def init(cls, config: Any, identity: RunIdentity | None = None, **runtime: Any) -> None:
        """Build the roles from ``config.skip`` (OmegaConf node, nested dict or attribute object).

        Args:
            config: the whole training config.
            identity: the run's identity (cache directory shape and fingerprint values) for trainers
                whose config does not use verl's keys; default: read from ``config`` with verl's keys.
            **runtime: live objects a role needs, e.g. ``tq_client=`` for ``rollout_tq``.

        Raises:
            SkipConfigError: a bad value, an unknown role under ``skip``, or an identity that is not
                a :class:`~stepskip._identity.RunIdentity`.
        """
        skip_config, run_id, instances, identity = cls._build(config, identity, runtime)
        cls.close()  # only now: a bad new config leaves the previous run untouched
        if not cls._atexit_registered:  # a run that never calls close() still flushes and summarises
            atexit.register(cls.close)
            cls._atexit_registered = True
        cls.config = skip_config
        cls.step = -1
        cls.run_id = run_id
        cls.identity = identity
        cls.skip_instances = instances
        cls._serving = {name: skip for name, skip in instances.items() if skip.is_enabled()}
        cls._closed = False
        pages = sys.modules.get("stepskip._formats.pages")
        if pages is not None:  # released by the last close(): hits keep their pages for reuse again
            pages.POOL.resume()
        if cls._serving:
            logger.info("stepskip run %s: enabled roles %s", run_id[:12], ", ".join(cls._serving))

    @classmethod
    def _build(cls, config: Any, identity: RunIdentity | None, runtime: dict[str, Any],
               ) -> tuple[SkipManagerConfig, str, dict[str, BaseSkip], RunIdentity]:
        """Validate ``config.skip`` and build one bound role per registered name (no state of the manager changes)."""
        import stepskip.roles  # noqa: F401  (registers the built-in roles)
        from stepskip.roles.stage import StageSkip

        if identity is None:
            identity = RunIdentity.from_config(config)
        elif not isinstance(identity, RunIdentity):
            raise SkipConfigError(f"identity = {identity!r} is not valid; expected a stepskip._identity.RunIdentity")
        extra_classes: dict[str, type[SkipRoleConfig]] = {
            name: skip_cls.config_class for name, skip_cls in SKIP_REGISTRY.items() if name not in ROLLOUT_ROLES
        }
        skip_config = SkipManagerConfig.from_section(select(config, "skip"), extra_classes)
        disable_legacy_flag(config, skip_config)
        run_id = uuid.uuid4().hex
        classes: dict[str, type[BaseSkip]] = dict(SKIP_REGISTRY)
        classes.update({name: StageSkip for name in skip_config.extra if name not in classes})  # `kind: stage`
        instances: dict[str, BaseSkip] = {}
        for name, skip_cls in classes.items():
            local = skip_config.role(name) or skip_cls.config_class()
            instance = skip_cls(local, config)
            instance.bind(RunContext(name=name, run_id=run_id, identity=identity, runtime=runtime))
            instances[name] = instance
        return skip_config, run_id, instances, identity

    @classmethod
    def set_step(cls, step: int) -> None:
        """Set the trainer's ``global_steps``, shared by every role without online steps.

        Raises:
            TypeError: ``step`` is not an integer (numpy integers are accepted).
        """
        cls.step = operator.index(step)

    @classmethod
    def _should_bypass_for_validation(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """verl's name for the validation test of a call (``meta_info["validate"]``)."""
        return is_validation(*args, **kwargs)

    @classmethod
    def _route(cls, skip: BaseSkip, args: tuple[Any, ...], kwargs: dict[str, Any], bypass: BypassTest,
               prompts: Any) -> int | None:
        """The step an enabled role's call is subject to, or None to pass the call through.

        Offline roles test the (cheap) step first; online roles must not parse a step out of a
        validation batch, so they test the validation flag first.
        """
        if skip.support_online_step:
            if bypass(*args, **kwargs):
                return None
            token = CURRENT_CALL.set(CallInfo(prompts))
            try:
                step = skip.extract_step(*args, **kwargs)
            finally:
                CURRENT_CALL.reset(token)
            return step if step in skip._step_lookup else None
        step = cls.step
        if step not in skip._step_lookup or bypass(*args, **kwargs):
            return None
        return step

    @classmethod
    def annotate(cls, role: str, *, bypass: BypassTest | None = None,
                 prompts: PromptsFinder | None = None) -> Callable[[F], F]:
        """Decorate a sync or coroutine function as the skip unit of ``role``.

        On an eligible step the cached result is returned without calling the function (a hit),
        or the function runs and its result is dumped (a miss). Validation calls always run.
        Coroutine wrappers do their disk I/O in worker threads, never on the event loop.

        Args:
            role: the role's name (its key under ``skip``).
            bypass: ``bypass(*args, **kwargs) -> bool``: True for calls that must run untouched
                (validation); default: verl's ``meta_info["validate"]`` convention.
            prompts: ``prompts(*args, **kwargs)`` -> the call's prompts (identity columns are
                rebound from them, their digest is recorded and checked); default: verl's
                convention (keyword ``prompts``, else the second positional argument).

        Raises:
            TypeError: any other keyword argument.

        Example:
            >>> @SkipManager.annotate(role="rollout")
            ... def generate_sequences(self, prompts): ...
        """
        is_bypassed = bypass if bypass is not None else is_validation
        find = prompts if prompts is not None else find_prompts

        def decorator(func: F) -> F:
            if inspect.iscoroutinefunction(func):

                @functools.wraps(func)
                async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                    skip = cls._serving.get(role)
                    if skip is None:
                        return await func(*args, **kwargs)
                    found = find(*args, **kwargs)
                    step = cls._route(skip, args, kwargs, is_bypassed, found)
                    if step is None:
                        return await func(*args, **kwargs)
                    plan = _plan(_Hooks(skip, step, args, kwargs, found), func)
                    return await _drive_async(plan, func, args, kwargs, found)

                return async_wrapper  # type: ignore[return-value]

            # The pass-through path is inlined: it runs on every call of the trainer's hot function.
            @functools.wraps(func)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                skip = cls._serving.get(role)
                if skip is None:
                    return func(*args, **kwargs)
                if not skip.support_online_step and cls.step not in skip._step_lookup:
                    return func(*args, **kwargs)
                found = find(*args, **kwargs)
                step = cls._route(skip, args, kwargs, is_bypassed, found)
                if step is None:
                    return func(*args, **kwargs)
                return _drive_sync(_plan(_Hooks(skip, step, args, kwargs, found), func), func, args, kwargs, found)

            return sync_wrapper  # type: ignore[return-value]

        return decorator

    @classmethod
    def annotate_tq(cls, role: str, phase: str) -> Callable[[F], F]:
        """The two-phase decorator of the V1 trainer over TransferQueue.

        ``phase="submit"`` decorates ``_add_batch_to_generate(self)``. On an eligible step it
        replaces the body: ``batch = self._next_train_batch()`` always runs (the dataloader stays
        aligned), then the call goes through the same decision plan as :meth:`annotate`, whose
        unit is ``self._submit_batch_to_rollout(batch)``: a cached step is injected into the queue
        (hit: return None without submitting), or the batch is submitted (miss: its value is
        returned) and the step is recorded as it is sampled; under ``action: match`` the recorded prompt
        groups are injected and only the missing prompts are submitted. ``phase="sample"`` decorates
        ``ReplayBuffer.sample``; after it runs, a train-partition result of a step without a
        complete cache is saved as the step's next inner entry.

        Raises:
            ValueError: ``phase`` is neither ``"submit"`` nor ``"sample"``.
        """
        if phase not in ("submit", "sample"):
            raise ValueError(f"annotate_tq phase must be 'submit' or 'sample', got {phase!r}")

        def decorator(func: F) -> F:
            if phase == "submit":

                @functools.wraps(func)
                def submit_wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
                    serving = cls._serving.get(role)
                    if serving is None or cls.step not in serving._step_lookup:
                        return func(owner, *args, **kwargs)
                    skip = cls._two_phase(role, serving)
                    batch = owner._next_train_batch()
                    submit = owner._submit_batch_to_rollout
                    plan = _plan(_SubmitHooks(skip, cls.step, (batch,), {}, batch), submit)
                    return _drive_sync(plan, submit, (batch,), {}, batch)

                return submit_wrapper  # type: ignore[return-value]

            @functools.wraps(func)
            def sample_wrapper(owner: Any, *args: Any, **kwargs: Any) -> Any:
                serving = cls._serving.get(role)
                if serving is None or cls.step not in serving._step_lookup:
                    return func(owner, *args, **kwargs)
                skip = cls._two_phase(role, serving)
                step = cls.step
                result = func(owner, *args, **kwargs)
                sampled = result[0] if isinstance(result, tuple) else result
                if skip.should_save(step, getattr(sampled, "partition_id", None)):
                    skip.save_sample(step, sampled)
                elif skip.action is SkipAction.COMPARE:
                    skip.compare_sample(step, sampled)
                return result

            return sample_wrapper  # type: ignore[return-value]

        return decorator

    @staticmethod
    def _two_phase(role: str, skip: BaseSkip) -> TwoPhaseRole:
        """``skip`` as the two-phase role ``annotate_tq`` drives.

        Raises:
            SkipConfigError: the role has no submit and sample phases (``annotate_tq`` needs a role
                like ``rollout_tq``).
        """
        if isinstance(skip, TwoPhaseRole):
            return skip
        missing = ", ".join(name for name in dir(TwoPhaseRole) if not name.startswith("_") and not hasattr(skip, name))
        raise SkipConfigError(f"SkipManager.annotate_tq(role={role!r}): skip.{role} is a {type(skip).__name__}, which "
                              f"has no submit and sample phases (it lacks {missing}); annotate_tq drives a two-phase "
                              "role such as rollout_tq: decorate this role's function with SkipManager.annotate")

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
    def engine_plan(cls, role: str, steps: Iterable[int] | None, *, validation: str | None = None,
                    config: Any = None, identity: RunIdentity | None = None,
                    runtime: dict[str, Any] | None = None) -> EnginePlan:
        """Whether a run whose steps are ``steps`` must start its inference engine, under ``skip.<role>.engines``.

        ``auto`` starts none when :meth:`will_replay` holds for every step and nothing else generates
        (``validation`` is None); ``start`` always starts it; ``skip`` never does, and a run that
        would need it is refused here, at start-up. The integrations call this before they build an
        engine (vLLM, SGLang ...) and skip the build, and every weight sync, when ``plan.start`` is False.

        Args:
            role: the role that serves the run's generation (``rollout``, ``rollout_tq`` ...).
            steps: every step the run will take, or None when the trainer cannot tell in advance
                (then ``auto`` starts the engine).
            validation: what generates outside ``steps`` (a validation pass) and how to turn it off,
                in one sentence for the messages; None when nothing does.
            config: a training config to read ``skip.<role>`` from, for a trainer that builds its
                engine before it calls :meth:`init` (verl does): its roles are built, asked and closed,
                and the current run is left as it is. Default: the current run's roles.
            identity: with ``config``, as for :meth:`init`.
            runtime: with ``config``, the live objects of :meth:`init` (``rank=`` for per-rank entries).

        Returns:
            The :class:`~stepskip._engines.EnginePlan`: ``start``, the steps that would generate, and
            a sentence saying why, for the log.

        Raises:
            SkipConfigError: ``engines: skip`` and a step (or the validation) would need generation;
                or a bad value in ``config``.

        Example:
            >>> plan = SkipManager.engine_plan("rollout", range(1, 101))
            >>> plan.start  # no run, so no role serves a step: the engine starts
            True
        """
        if config is None:
            return _plan_engines(cls.skip_instances.get(role), role, steps, validation)
        _, _, instances, _ = cls._build(config, identity, dict(runtime or {}))
        try:
            return _plan_engines(instances.get(role), role, steps, validation)
        finally:
            for instance in instances.values():
                instance.close()

    @classmethod
    def engines_needed(cls, role: str, steps: Iterable[int] | None, *, validation: str | None = None,
                       config: Any = None, identity: RunIdentity | None = None,
                       runtime: dict[str, Any] | None = None) -> bool:
        """``engine_plan(...).start``: True when the run must start its inference engine.

        Example:
            >>> SkipManager.engines_needed("rollout", [1, 2, 3])
            True
        """
        return cls.engine_plan(role, steps, validation=validation, config=config, identity=identity,
                               runtime=runtime).start

    @classmethod
    def drift(cls, role: str) -> list[dict[str, Any]]:
        """The drift records of ``role`` under ``action: compare``: one per compared step, oldest first.

        Each record holds ``step``, ``prompts_equal``, ``token_match`` (the batch-mean token match of
        the lowest token field; None without token fields), ``worst_field`` with ``worst_match`` (its
        figure) and ``worst_delta`` (its largest ``|live - recorded|``), ``first_row``, ``passed`` and
        per-field figures; a step whose entry was damaged has ``damaged: True`` and ``reason``. The
        same record is written beside the entry (see :mod:`stepskip._drift`).

        Raises:
            SkipConfigError: no role of that name in this run.

        Example:
            >>> SkipManager.drift("rollout")
            []
        """
        skip = cls.skip_instances.get(role)
        if skip is None:
            if not cls.skip_instances:
                return []
            raise SkipConfigError(f"SkipManager.drift: no role {role!r} in this run; known roles: "
                                  f"{', '.join(sorted(cls.skip_instances))}")
        log = getattr(skip, "drift_log", None)
        return log.records() if log is not None else []

    @classmethod
    def stats(cls) -> dict[str, float]:
        """Counters of every enabled role as ``{"skip/{role}/{name}": value}``, ready for a metrics logger.

        Names: hits, misses, dumps, dump_failures, corrupt, load_seconds, dump_seconds,
        bytes_read, bytes_written, saved_seconds, rows_replayed, rows_generated; under ``action: compare``
        also compared, drifted and token_match (the last compared step's). Roles that are off are left out.
        """
        out: dict[str, float] = {}
        for name, skip in cls._serving.items():
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
        """Flush pending dumps, log one summary line per enabled role, release the roles and the memory
        kept for reuse (snapshot buffers, the idle pages of earlier hits)."""
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
        safe = sys.modules.get("stepskip._formats.safe")  # never imported just to be told to free nothing
        if safe is not None:
            safe.release_snapshot_buffers()
        pages = sys.modules.get("stepskip._formats.pages")
        if pages is not None:  # the idle pages of hits, and those given back later (batches still held)
            pages.POOL.release()

    @classmethod
    def reset(cls) -> None:
        """Flush pending dumps and return to the pre-``init`` defaults (every decorator a pass-through)."""
        cls.close()
        cls.config = None
        cls.step = -1
        cls.skip_instances = {}
        cls._serving = {}
        cls.run_id = None
        cls.identity = None
