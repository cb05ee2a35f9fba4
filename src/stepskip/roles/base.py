"""The role protocol: ``SkipAction``, ``BaseSkip``, the run context a role is bound to, the registry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from stepskip.config import SkipRoleConfig, StepSet
from stepskip.errors import SkipConfigError
from stepskip._identity import RunIdentity
from stepskip._policies import SkipAction

__all__ = ["SkipAction", "BaseSkip", "RunContext", "TwoPhaseRole", "register_skip", "SKIP_REGISTRY"]


@dataclass(frozen=True)
class RunContext:
    """What a role learns when ``SkipManager.init`` binds it to a run.

    Args:
        name: the role's name (its key under ``skip``).
        run_id: the run's random id, recorded in every entry it writes.
        identity: the run's identity (directory shape and fingerprint).
        runtime: live objects passed to ``SkipManager.init(config, **runtime)``.
    """

    name: str
    run_id: str
    identity: RunIdentity = field(default_factory=RunIdentity)
    runtime: Mapping[str, Any] = field(default_factory=dict)


class BaseSkip:
    """Base class of every skip role: the protocol verl's own skip roles speak.

    One instance per role is shared by every call of the decorated function, including calls
    that overlap in async pipelines: keep per-call state out of ``self``. The constructor only
    reads configuration (no I/O); :meth:`bind` then tells the role its name, run and runtime
    objects, once, before any call.

    Args:
        local_config: the role's section (``skip.<role>``): a :class:`SkipRoleConfig`, a mapping or
            any object with ``enable``, ``dump_dir``, ``steps`` and ``action`` attributes; it is
            normalised once into ``config_class`` and kept as ``local_config``.
        global_config: the whole training config.

    Raises:
        ValueError: the configured action is not in ``support_actions`` (a :class:`SkipConfigError`).
    """

    support_actions: ClassVar[list[SkipAction]] = []
    support_online_step: ClassVar[bool] = False
    config_class: ClassVar[type[Any]] = SkipRoleConfig
    name: str = ""

    def __init__(self, local_config: Any, global_config: Any) -> None:
        config_class = self.config_class if isinstance(self.config_class, type) else SkipRoleConfig
        if issubclass(config_class, SkipRoleConfig):
            local_config = config_class.coerce(local_config)
        self.local_config = local_config
        self.global_config = global_config
        section = getattr(local_config, "section", "skip.<role>")
        self.action = SkipAction.parse(local_config.action, f"{section}.action")
        if self.action not in self.support_actions:
            supported = ", ".join(a.value for a in self.support_actions)
            raise SkipConfigError(f"Unsupported action: {section}.action = {self.action.value!r} for "
                                  f"{type(self).__name__}; supported actions: {supported}")
        self.enable = bool(local_config.enable)
        self.dump_dir = local_config.dump_dir
        step_set = getattr(local_config, "step_set", None)
        if not isinstance(step_set, StepSet):
            step_set = StepSet.parse(local_config.steps, f"{section}.steps")
        self.step_set = step_set
        #: The configured ``steps``, as verl's roles expose them.
        self.steps: list[Any] = list(local_config.steps) if isinstance(local_config.steps, (list, tuple)) \
            else [local_config.steps]
        self._step_lookup = step_set.fast()  # what the decorators test on every call (C-level ``in``)
        self.run_id = ""
        self.identity = RunIdentity()
        self.runtime: Mapping[str, Any] = {}

    def bind(self, context: RunContext) -> None:
        """Attach the role to a run; ``SkipManager.init`` calls it once, before any decorated call."""
        self.name = context.name
        self.run_id = context.run_id
        self.identity = context.identity
        self.runtime = dict(context.runtime)

    def is_enabled(self) -> bool:
        """Whether the role serves calls; consulted once, when ``SkipManager.init`` binds it."""
        return self.enable

    def meet_precondition(self, step: int, func: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        """True when ``step`` should be served by :meth:`warp_function` instead of ``func``."""
        raise NotImplementedError("meet_precondition is not implemented")

    def warp_function(self, step: int, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Return what the call would have returned, without calling ``func``."""
        raise NotImplementedError("warp_function is not implemented")

    def prepare_data(self, step: int, result: Any, *args: Any, **kwargs: Any) -> None:
        """Keep ``result`` of a call that ran (a miss) so later runs can skip ``step``."""
        raise NotImplementedError("prepare_data is not implemented")

    def extract_step(self, *args: Any, **kwargs: Any) -> int:
        """The step of one call, for roles with ``support_online_step``."""
        raise NotImplementedError("extract_step is not implemented")

    def would_replay(self, step: int) -> bool:
        """True when a call at ``step`` would be served from the cache (see ``SkipManager.will_replay``)."""
        return False

    def close(self) -> None:
        """Release what the role holds; called by ``SkipManager.close``."""


@runtime_checkable
class TwoPhaseRole(Protocol):
    """A role that ``SkipManager.annotate_tq`` drives: a submit phase that injects a cached step into a
    queue (or submits the prompts and marks the step for recording), and a sample phase that saves what
    was sampled. ``rollout_tq`` is one; ``annotate_tq`` checks a role against this protocol when it first
    serves it.
    """

    action: SkipAction

    def meet_precondition(self, step: int) -> bool:
        """True when the submit phase of ``step`` is served from the cache."""
        ...

    def inject(self, step: int, new_prompt_uids: list[str], partition_id: str = "train", prompts: Any = None) -> None:
        """The submit phase's cached result: put the cached step into the queue under ``new_prompt_uids``."""
        ...

    def begin_recording(self, step: int, prompts: Any = None) -> None:
        """The submit phase's miss: the step's samples are to be saved as they are drawn."""
        ...

    def match_inject(self, step: int, prompts: Any, partition_id: str = "train") -> Any:
        """``action: match``'s submit phase: inject the recorded prompt groups; the prompts left to submit."""
        ...

    def should_save(self, step: int, partition_id: str | None = "train") -> bool:
        """True when a sample of ``step`` drawn from ``partition_id`` must be saved."""
        ...

    def save_sample(self, step: int, sampled: Any) -> None:
        """The sample phase: save what was sampled as the step's next inner entry."""
        ...

    def compare_submit(self, step: int, prompts: Any) -> None:
        """``action: compare``'s submit phase: the batch goes to rollout; a recorded step is read to compare."""
        ...

    def compare_sample(self, step: int, sampled: Any) -> None:
        """``action: compare``'s sample phase: compare what was sampled with the recorded step."""
        ...

    def has_v1_cache(self, step: int) -> bool:
        """True when the action would load a complete cached step for ``step``."""
        ...

    def maybe_load_and_inject(self, step: int, new_prompt_uids: list[str], partition_id: str = "train",
                              prompts: Any = None) -> bool:
        """The submit phase in one call: inject the cached step, or mark it for recording (False)."""
        ...


SKIP_REGISTRY: dict[str, type[BaseSkip]] = {}

_S = TypeVar("_S", bound=type[BaseSkip])


def register_skip(name: str) -> Callable[[_S], _S]:
    """Class decorator registering a skip role under ``name`` (the key of ``skip.<name>``).

    Example:
        >>> @register_skip("my_stage")
        ... class MySkip(BaseSkip):
        ...     support_actions = [SkipAction.CACHE]
        >>> SKIP_REGISTRY["my_stage"] is MySkip
        True
        >>> del SKIP_REGISTRY["my_stage"]
    """

    def decorator(cls: _S) -> _S:
        SKIP_REGISTRY[name] = cls
        if not cls.__dict__.get("name"):
            cls.name = name
        return cls

    return decorator
