"""stepskip: record the rollouts of chosen RL training steps once, replay them on later runs.

The public names below are the whole API, with :mod:`stepskip.cache` for scripts that read caches;
everything else is private. They are imported on first use, so tools that only read caches (the
``stepskip`` command line) start without loading torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from stepskip._logging import install_fallback
from stepskip._version import __version__

# Warnings reach stderr until the application configures logging (then only its handlers get them).
install_fallback(__name__)

_WHERE = {
    "SkipManager": "stepskip._manager",
    "SkipAction": "stepskip.roles",
    "BaseSkip": "stepskip.roles",
    "register_skip": "stepskip.roles",
    "SKIP_REGISTRY": "stepskip.roles",
    "SkipManagerConfig": "stepskip.config",
    "RolloutSkipConfig": "stepskip.config",
    "RolloutTqSkipConfig": "stepskip.config",
    "AsyncRolloutSkipConfig": "stepskip.config",
    "SkipConfigError": "stepskip.errors",
    "CacheMissError": "stepskip.errors",
    "CorruptEntryError": "stepskip.errors",
    "RolloutSkip": "stepskip.roles",
    "RolloutTqSkip": "stepskip.roles",
    "AsyncRolloutSkip": "stepskip.roles",
    "parse_async_rollout_sample_step": "stepskip.roles",
    "Batch": "stepskip._batch",
    "SkipRoleConfig": "stepskip.config",
    "RunIdentity": "stepskip._identity",
    "UnreadableEntryError": "stepskip.errors",
    "StepskipError": "stepskip.errors",
}

__all__ = [
    "__version__", "SkipManager", "SkipAction", "BaseSkip", "register_skip", "SKIP_REGISTRY", "SkipManagerConfig",
    "RolloutSkipConfig", "RolloutTqSkipConfig", "AsyncRolloutSkipConfig", "SkipConfigError", "CacheMissError",
    "CorruptEntryError", "RolloutSkip", "RolloutTqSkip", "AsyncRolloutSkip", "parse_async_rollout_sample_step",
    "Batch", "SkipRoleConfig", "RunIdentity", "UnreadableEntryError", "StepskipError",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stepskip' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from stepskip._batch import Batch
    from stepskip.config import (
        AsyncRolloutSkipConfig,
        RolloutSkipConfig,
        RolloutTqSkipConfig,
        SkipManagerConfig,
        SkipRoleConfig,
    )
    from stepskip.errors import (
        CacheMissError,
        CorruptEntryError,
        SkipConfigError,
        StepskipError,
        UnreadableEntryError,
    )
    from stepskip._identity import RunIdentity
    from stepskip._manager import SkipManager
    from stepskip.roles import (
        SKIP_REGISTRY,
        AsyncRolloutSkip,
        BaseSkip,
        RolloutSkip,
        RolloutTqSkip,
        SkipAction,
        parse_async_rollout_sample_step,
        register_skip,
    )
