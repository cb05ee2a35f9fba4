"""Entries a store did not answer for (a timeout, a refused connection, a 5xx): what a role keeps of them.

Such an entry may be perfectly valid, so it is never treated as damage: the call that met it counts
as a miss (``unavailable``), its generated result is returned, and that result is never written over
the entry. The paths are kept only until the next call of their step, which asks the store again.
"""

from __future__ import annotations

import logging
from typing import Any

from stepskip._policies import SkipAction

__all__ = ["Withheld"]

logger = logging.getLogger(__name__)


class Withheld:
    """The entry paths of a role whose store did not answer during their step's call.

    Args:
        owner: the role (its ``name``, ``action`` and ``stats``).

    Example:
        >>> from types import SimpleNamespace
        >>> from stepskip._stats import RoleStats
        >>> withheld = Withheld(SimpleNamespace(name="rollout", action=SkipAction.CACHE, stats=RoleStats()))
        >>> withheld.mark(3, "/d/run/3", "ReadTimeoutError")
        >>> "/d/run/3" in withheld, withheld.release("/d/run/3"), "/d/run/3" in withheld
        (True, True, False)
        >>> withheld.mark(4, "/d/run/4/1", "ReadTimeoutError")
        >>> withheld.under("/d/run/4"), withheld.under("/d/run/44")
        (True, False)
    """

    __slots__ = ("owner", "_paths")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self._paths: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self._paths)

    def __contains__(self, path: str) -> bool:
        return path in self._paths

    def mark(self, step: int, path: str, reason: str) -> None:
        """The store did not answer for the entry at ``path`` during the call at ``step``: counted and logged;
        the call's result is not written over it (see :meth:`release`)."""
        owner = self.owner
        self._paths.add(path)
        owner.stats.add(unavailable=1)
        if owner.action is SkipAction.REPLAY:
            logger.error("%s unavailable: step %d: %s", owner.name, step, reason)
        else:
            logger.warning("%s unavailable: step %d counts as a miss: %s; it is generated, and its result is "
                           "returned but not written over the entry at %s", owner.name, step, reason, path)

    def forget(self, path: str) -> None:
        """A new call at the step of ``path``: whether its store answers is decided afresh."""
        self._paths.discard(path)

    def under(self, directory: str) -> bool:
        """Whether an entry at or below ``directory`` is withheld (a V1 step: any of its inner entries)."""
        prefix = directory.rstrip("/") + "/"
        return any(p == directory or p.startswith(prefix) for p in self._paths)

    def forget_under(self, directory: str) -> None:
        """A new call of the step at ``directory``: whether the store answers for its entries is decided afresh."""
        prefix = directory.rstrip("/") + "/"
        self._paths = {p for p in self._paths if p != directory and not p.startswith(prefix)}

    def release(self, path: str) -> bool:
        """Whether the result generated for the entry at ``path`` must not be written (it is then forgotten)."""
        if path not in self._paths:
            return False
        self._paths.discard(path)
        return True
