"""Helpers of the view tests (a module of its own: several test folders have a conftest)."""

from __future__ import annotations

from pathlib import Path


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """Every path below ``root`` with its size and modification time: equal before and after means untouched."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}
