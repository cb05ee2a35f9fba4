"""Storage: entries over byte-level backends (private; the roles, the index and the tools use it).

- :mod:`~stepskip._storage.base`: the :class:`Backend` protocol, its :class:`Capabilities`, and the
  records a look returns (:class:`Probe`, :class:`DirItem`, :class:`Tree`);
- :mod:`~stepskip._storage.entries`: :class:`EntryStore`, everything about entries, once;
- :mod:`~stepskip._storage.meta`: what ``meta.json`` may hold, checked value by value;
- :mod:`~stepskip._storage.objects`: committing entries where no directory publishes atomically;
- one backend per file: :mod:`~stepskip._storage.local` (with the system calls of
  :mod:`~stepskip._storage._linux` and the staging of :mod:`~stepskip._storage._localfs`),
  :mod:`~stepskip._storage.fsspec` and :mod:`~stepskip._storage.memory`;
- :mod:`~stepskip._storage.registry`: the backend of a dump dir, by its URL's scheme.
"""

from __future__ import annotations

from stepskip._storage.base import (
    SETTLED_NS,
    Allocator,
    Backend,
    Capabilities,
    DirItem,
    EntryState,
    PinnedEntry,
    Probe,
    Staging,
    Tree,
    settled,
)
from stepskip._storage.entries import EntryStore
from stepskip._storage.fsspec import FsspecBackend
from stepskip._storage.local import LocalBackend
from stepskip._storage.memory import MemoryBackend
from stepskip._storage.meta import (
    GRACE_SECONDS,
    MANIFEST_FILE,
    MAX_INNER_ENTRIES,
    META_FILE,
    META_MAX_BYTES,
    STALE_SECONDS,
    TMP_PREFIX,
    TRASH_PREFIX,
    check_meta,
    checksum,
    valid_name,
)
from stepskip._storage.objects import may_hold_leftovers, wall_time
from stepskip._storage.registry import backend_class, check_dump_dir, open_store, register_backend, registered_schemes

__all__ = [
    "Allocator", "Backend", "Capabilities", "DirItem", "EntryState", "EntryStore", "FsspecBackend", "LocalBackend",
    "MemoryBackend", "PinnedEntry", "Probe", "Staging", "Tree", "SETTLED_NS", "GRACE_SECONDS", "MANIFEST_FILE",
    "MAX_INNER_ENTRIES", "META_FILE", "META_MAX_BYTES", "STALE_SECONDS", "TMP_PREFIX", "TRASH_PREFIX",
    "backend_class", "check_dump_dir", "check_meta", "checksum", "may_hold_leftovers", "open_store",
    "register_backend", "registered_schemes", "settled", "valid_name", "wall_time",
]
