"""Per-role counters, the metrics hook behind ``SkipManager.stats()``."""

from __future__ import annotations

import threading

__all__ = ["RoleStats", "STAT_NAMES"]

STAT_NAMES = (
    "hits", "misses", "dumps", "dump_failures", "corrupt",
    "load_seconds", "dump_seconds", "bytes_read", "bytes_written", "saved_seconds",
    "rows_replayed", "rows_generated",
)


class RoleStats:
    """Thread-safe counters of one role (dumps finish on a background thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(STAT_NAMES, 0.0)

    def add(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                self._values[name] += value

    def __getitem__(self, name: str) -> float:
        return self._values[name]

    def snapshot(self, role: str) -> dict[str, float]:
        """``{"skip/{role}/{name}": value}`` for every counter."""
        with self._lock:
            return {f"skip/{role}/{name}": value for name, value in self._values.items()}
