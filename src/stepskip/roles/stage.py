"""Generic stage roles: cache any function's return value at trainer steps, by configuration alone.

``skip.<name>: {kind: stage, enable: true, steps: [...]}`` plus
``@SkipManager.annotate(role="<name>")`` on the stage function (reward, reference log-probs,
advantages ...). Entries live in ``{project_dir}/{name}/{step}/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from stepskip.config import SkipRoleConfig
from stepskip.errors import SkipConfigError
from stepskip.roles.rollout import RolloutSkip

__all__ = ["StageSkip", "StageSkipConfig"]


@dataclass
class StageSkipConfig(SkipRoleConfig):
    """``skip.<name>`` with ``kind: stage``; the same fields as every role."""

    section: ClassVar[str] = "skip.<stage>"

    kind: str = "stage"
    role_name: str = field(default="", init=False, repr=False)

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.kind != "stage":
            raise SkipConfigError(f"{where}.kind = {self.kind!r} is not valid; allowed values: stage")

    def bind(self, where: str) -> None:
        if where.startswith("skip.") and where != self.section:
            self.role_name = where[len("skip."):]


class StageSkip(RolloutSkip):
    """Caches the return value of any stage function (Batch, DataProto, TensorDict, dict, tensor)."""

    config_class = StageSkipConfig

    def _subdir(self) -> str | None:
        return getattr(self.local_config, "role_name", "") or self.name or "stage"
