"""Skip roles: the base protocol, the cached-role core and the built-in roles (importing this registers them)."""

from stepskip.roles.base import SKIP_REGISTRY, BaseSkip, RunContext, SkipAction, TwoPhaseRole, register_skip
from stepskip.roles.cached import CachedRole
from stepskip.roles.rollout import AsyncRolloutSkip, RolloutSkip, parse_async_rollout_sample_step
from stepskip.roles.rollout_tq import RolloutTqSkip
from stepskip.roles.stage import StageSkip, StageSkipConfig

__all__ = [
    "SKIP_REGISTRY", "BaseSkip", "CachedRole", "RunContext", "SkipAction", "TwoPhaseRole", "register_skip",
    "RolloutSkip", "RolloutTqSkip", "AsyncRolloutSkip", "parse_async_rollout_sample_step", "StageSkip",
    "StageSkipConfig",
]
