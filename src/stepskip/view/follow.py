"""What ``stepskip view --follow`` watches: which runs changed since the last look, and which are being written.

Looking costs a few directory listings per run (the run directory and its roles' directories:
names, kinds and times), never a ``meta.json`` read; only a run whose listing changed is scanned again.

A run is *being written* when its newest step was recorded less than ``live_seconds`` ago, or when
a write is under way in it: a staging directory (``.tmp-*``, where a step is built before it is
renamed into place) modified less than ``live_seconds`` ago. A staging directory older than that is
what an interrupted writer left, and does not count.

Example:
    >>> signature, staged = run_signature(CacheIndex("/data/rollout_dump").store, run_path)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from stepskip._storage import TMP_PREFIX

__all__ = ["FOLLOW_SECONDS", "LIVE_SECONDS", "is_live", "run_signature"]

#: How often the page asks whether the cache changed (seconds).
FOLLOW_SECONDS = 2.0
#: How recently a run must have recorded a step (or staged one) to count as being written (seconds).
LIVE_SECONDS = 600.0
#: Names listed per directory for a signature (a directory holding more is compared by its first ones).
_MAX_NAMES = 100_000


def _items(store: Any, path: str) -> list[tuple[str, str, float | None, int]]:
    return sorted((i.name, i.kind, i.mtime, i.size) for i in store.list_items(path)[:_MAX_NAMES])


def run_signature(store: Any, path: str) -> tuple[tuple[Any, ...], float | None]:
    """A run directory's listing and those of its subdirectories (roles, drift records), and the newest
    modification time of a staging directory in them (None when there is none).

    Equal signatures: no step appeared, vanished or was rewritten since (as far as directory times tell).
    """
    parts: list[Any] = []
    staged: float | None = None
    top = _items(store, path)
    parts.append(tuple(top))
    for name, kind, mtime, _ in top:
        if name.startswith(TMP_PREFIX):
            staged = max(staged or 0.0, mtime or 0.0)
        if kind != "dir" or name.isdigit() or (name.startswith(".") and name != ".stepskip-drift"):
            continue
        inner = _items(store, f"{path}/{name}")
        parts.append((name, tuple(inner)))
        for child, _, child_mtime, _ in inner:
            if child.startswith(TMP_PREFIX):
                staged = max(staged or 0.0, child_mtime or 0.0)
    return tuple(parts), staged


def is_live(newest_step: float | None, staged: float | None, now: float, live_seconds: float = LIVE_SECONDS) -> bool:
    """Whether a run counts as being written (see the module's description).

    Example:
        >>> is_live(1000.0, None, now=1100.0), is_live(1000.0, None, now=5000.0), is_live(None, 4900.0, now=5000.0)
        (True, False, True)
    """
    recent = [t for t in (newest_step, staged) if t]
    return any(now - t <= live_seconds for t in recent)
