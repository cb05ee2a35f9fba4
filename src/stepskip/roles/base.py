"""The role protocol: ``SkipAction``, ``BaseSkip`` and the role registry."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from stepskip.config import SkipRoleConfig, StepSet

__all__ = ["SkipAction", "BaseSkip", "register_skip", "SKIP_REGISTRY"]


class SkipAction(str, enum.Enum):
    """What a role does on an eligible step.

    ``CACHE``: load the exact step, else generate and dump. ``REPEAT``: load the nearest
    available step. ``RANDOM``: load a seeded random available step. ``REPLAY``: load the exact
    step or raise :class:`CacheMissError`. ``RECORD``: always generate and overwrite. ``EMPTY``:
    reserved, as in verl.
    """

    CACHE = "cache"
    REPEAT = "repeat"
    RANDOM = "random"
    EMPTY = "empty"
    REPLAY = "replay"
    RECORD = "record"

    @classmethod
    def parse(cls, value: Any) -> SkipAction:
        """The action named ``value``; the error lists the valid names."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(a.value for a in cls)
            raise ValueError(f"Unsupported action {value!r}; valid actions: {allowed}") from None


class BaseSkip:
    """Base class of every skip role.

    One instance per role is shared by every call of the decorated function, including calls
    that overlap in async pipelines: keep per-call state out of ``self``.

    Args:
        local_config: the role's section (``skip.<role>``), a :class:`SkipRoleConfig` or any
            object with ``enable``, ``dump_dir``, ``steps`` and ``action`` attributes.
        global_config: the whole training config.

    Raises:
        ValueError: the configured action is not in ``support_actions``.
    """

    support_actions: ClassVar[list[SkipAction]] = []
    support_online_step: ClassVar[bool] = False
    config_class: ClassVar[type[SkipRoleConfig]] = SkipRoleConfig
    name: str = ""

    def __init__(self, local_config: Any, global_config: Any) -> None:
        self.local_config = local_config
        self.global_config = global_config
        self.action = SkipAction.parse(local_config.action)
        self.enable = bool(local_config.enable)
        self.dump_dir = local_config.dump_dir
        step_set = getattr(local_config, "step_set", None)
        if not isinstance(step_set, StepSet):
            step_set = StepSet.parse(local_config.steps)
        self.step_set = step_set
        self.steps = step_set.fast()  # what `step in self.steps` tests on every decorated call
        self.run_id = ""
        self.runtime: dict[str, Any] = {}
        if self.action not in self.support_actions:
            supported = ", ".join(a.value for a in self.support_actions)
            raise ValueError(f"Unsupported action: {self.action.value!r} for {type(self).__name__}; "
                             f"supported actions: {supported}")

    def is_enabled(self) -> bool:
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
