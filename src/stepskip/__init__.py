"""stepskip: record the rollouts of chosen RL training steps once, replay them on later runs.

The public names below are the whole API (see SPEC §1); everything else is private.
"""

import logging

from stepskip._version import __version__
from stepskip.batch import Batch
from stepskip.config import (
    AsyncRolloutSkipConfig,
    RolloutSkipConfig,
    RolloutTqSkipConfig,
    SkipManagerConfig,
)
from stepskip.errors import CacheMissError, CorruptEntryError, SkipConfigError
from stepskip.manager import SkipManager
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

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "__version__",
    "SkipManager",
    "SkipAction",
    "BaseSkip",
    "register_skip",
    "SKIP_REGISTRY",
    "SkipManagerConfig",
    "RolloutSkipConfig",
    "RolloutTqSkipConfig",
    "AsyncRolloutSkipConfig",
    "SkipConfigError",
    "CacheMissError",
    "CorruptEntryError",
    "RolloutSkip",
    "RolloutTqSkip",
    "AsyncRolloutSkip",
    "parse_async_rollout_sample_step",
    "Batch",
]
