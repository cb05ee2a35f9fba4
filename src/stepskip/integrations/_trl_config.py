"""The ``skip.trl_generate`` section on its own, importable without TRL (the docs site reads it at build time).

:mod:`stepskip.integrations.trl` registers the role under this config class and re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from stepskip.config import SkipRoleConfig

__all__ = ["TrlGenerateConfig"]


@dataclass
class TrlGenerateConfig(SkipRoleConfig):
    """``skip.trl_generate``: the role's section, as every role's, with TRL's defaults.

    ``restore_rng`` is on (TRL shuffles the generated batch with the global torch generator right
    after generating) and ``rebind_keys`` is empty (TRL's calls carry no identity columns).

    Example:
        >>> TrlGenerateConfig(enable=True, steps=[1, 2]).restore_rng
        True
    """

    section: ClassVar[str] = "skip.trl_generate"

    rebind_keys: list[str] = field(default_factory=list)
    restore_rng: bool = True
