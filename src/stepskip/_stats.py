"""Per-role counters, the metrics hook behind ``SkipManager.stats()``."""

from __future__ import annotations

import threading

__all__ = ["RoleStats", "STAT_NAMES", "COMPARE_STAT_NAMES"]

STAT_NAMES = (
    "hits", "misses", "dumps", "dump_failures", "corrupt",
    "load_seconds", "dump_seconds", "bytes_read", "bytes_written", "saved_seconds",
    "rows_replayed", "rows_generated", "unavailable",
)
#: The figures of a role under ``action: compare``: steps compared, steps that drifted, and the token
#: match (batch mean) of the last compared step that had token fields.
COMPARE_STAT_NAMES = ("compared", "drifted", "token_match")


class RoleStats:
    """Thread-safe counters of one role (dumps finish on a background thread)."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys((*STAT_NAMES, *extra), 0.0)

    def declare(self, *names: str) -> None:
        """Add counters of names known only when the role starts (``hits_from/{i}``: a hit read from a
        layered cache, :mod:`stepskip._reading.layers`), at zero; those already there are kept."""
        with self._lock:
            for name in names:
                self._values.setdefault(name, 0.0)

    def add(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                self._values[name] += value

    def set(self, **values: float) -> None:
        """Replace figures that are not counters (the last compared step's token match)."""
        with self._lock:
            self._values.update(values)

    def __getitem__(self, name: str) -> float:
        return self._values[name]

    def snapshot(self, role: str) -> dict[str, float]:
        """``{"skip/{role}/{name}": value}`` for every counter."""
        with self._lock:
            return {f"skip/{role}/{name}": value for name, value in self._values.items()}
