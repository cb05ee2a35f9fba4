"""Removing entries so that readers never see half of one."""

from __future__ import annotations

import os
import uuid

from stepskip.cli.scan import is_leftover
from stepskip.store import TRASH_PREFIX, LocalStore

__all__ = ["retire"]


def retire(store: LocalStore, path: str) -> None:
    """Remove an entry or step directory: first renamed to a ``.trash-*`` sibling, then deleted.

    The rename makes the entry vanish at once, so a reader sees it whole or not at all, never a
    directory with some files already deleted (which it would report as corrupt). Should the
    deletion itself be interrupted, the ``.trash-*`` leftover is removed by ``stepskip verify
    --repair`` or by the next run's clean-up.

    Args:
        store: the store holding ``path``.
        path: the directory to remove; leftovers (``.tmp-*``, ``.trash-*``) are deleted directly.

    Example:
        >>> retire(LocalStore(), "/tmp/dump/exp_proj/GBS4_N2_in8_out6/3")  # doctest: +SKIP
    """
    parent, name = os.path.split(path.rstrip("/"))
    if is_leftover(name) or not os.path.isdir(path):
        store.remove(path)
        return
    trash = f"{parent}/{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return  # already gone
    store.remove(trash)
