"""A store that refuses every change: what a role configured ``read_only: true`` reads through, and
what every layer of a layered cache (``sources``, ``replay_from``) is read through.

The role itself never asks for a write there (its misses are not recorded, its start-up leaves
temporaries alone, a layer is only read); this store makes sure of it below every caller: a write,
a publication, a removal or a clean-up reaching it raises instead of touching the store.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

from stepskip._storage.base import Tree
from stepskip._storage.entries import EntryStore
from stepskip._storage.meta import STALE_SECONDS
from stepskip._entries import FileBytes

__all__ = ["ReadOnlyStore"]


class ReadOnlyStore(EntryStore):
    """An :class:`EntryStore` over the same backend that reads as it does and changes nothing.

    Args:
        store: the store to read through.
        why: what made it read-only, named in the refusal (``"skip.rollout.read_only is true"``).

    Example:
        >>> from stepskip._storage.memory import MemoryBackend
        >>> store = ReadOnlyStore(EntryStore(MemoryBackend()), why="skip.rollout.read_only is true")
        >>> store.put_small("/run/hints", b"{}")
        Traceback (most recent call last):
        ...
        PermissionError: [Errno 30] skip.rollout.read_only is true: nothing is written there: '/run/hints'
    """

    def __init__(self, store: EntryStore, why: str) -> None:
        super().__init__(store.backend, grace_seconds=store.grace_seconds, clock=store.clock)
        self.why = why

    def __repr__(self) -> str:
        return f"ReadOnlyStore({type(self.backend).__name__}, root={self.root!r})"

    def _refuse(self, path: str) -> NoReturn:
        raise PermissionError(errno.EROFS, f"{self.why}: nothing is written there", path)

    def write_entry(self, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        self._refuse(path)

    def write_entries(self, entries: Iterable[tuple[str, Mapping[str, FileBytes], Mapping[str, Any]]]
                      ) -> list[int | Exception]:
        return [PermissionError(errno.EROFS, f"{self.why}: nothing is written there", path)
                for path, _, _ in entries]

    def put_small(self, path: str, data: bytes) -> None:
        self._refuse(path)

    def publish_dir(self, staging: str, path: str) -> None:
        self._refuse(path)

    def remove(self, path: str) -> None:
        self._refuse(path)

    def retire_entry(self, path: str) -> bool:
        self._refuse(path)

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS, tree: Tree | None = None,
                         listed: list[str] | None = None) -> list[str]:
        self._refuse(path)
