"""Generic stage roles: cache any function's return value at trainer steps, by configuration alone.

``skip.<name>: {kind: stage, enable: true, steps: [...]}`` plus
``@SkipManager.annotate(role="<name>")`` on the stage function (reward, reference log-probs,
advantages ...). Entries live in ``{project_dir}/{name}/{step}/`` (every role outside verl's
own layout has its own directory).
"""

from __future__ import annotations

from typing import Any, ClassVar

from stepskip.config import StageSkipConfig
from stepskip.roles.cached import CachedRole

__all__ = ["StageSkip", "StageSkipConfig"]


class StageSkip(CachedRole):
    """Caches the return value of any stage function (Batch, DataProto, TensorDict, dict, tensor)."""

    config_class: ClassVar[type[Any]] = StageSkipConfig
