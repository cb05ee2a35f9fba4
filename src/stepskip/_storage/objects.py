"""Committing entries where no directory can be published atomically (object stores).

A commit is: write each data object under a name unique to this write (``data.<token>.safetensors``),
then ``meta.json``, one atomic PUT that names exactly those objects. A reader follows ``meta.json``,
so it never mixes two writers' files. The objects of the replaced entry are not deleted at once:
the new ``meta.json`` lists them as ``retired`` with the time, and a later writer (or
:func:`remove_leftovers`) deletes them once the grace period has passed, so that a reader holding
the old ``meta.json`` still finds them. Objects no ``meta.json`` names (a crashed writer's) are
removed once stale. Only objects named as a writer here names them are ever deleted, and only
inside their entry.
"""

from __future__ import annotations

import errno
import logging
import re
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stepskip._storage.base import DirItem, EntryState, Tree
from stepskip._storage.meta import META_FILE, checksum, contiguous, meta_bytes, nbytes, stored_name, valid_name
from stepskip.entries import FileBytes

if TYPE_CHECKING:
    from stepskip._storage.entries import EntryStore

__all__ = ["write_entry", "remove_leftovers", "may_hold_leftovers", "wall_time"]

logger = logging.getLogger(__name__)

# the names writers give data objects: {stem}.{12 hex token}{.suffix}; only these are deleted
_OBJECT_NAME = re.compile(r"^[^./\\\x00]+\.[0-9a-f]{12}(?:\.[^/\\\x00]+)?$")

#: The wall clock of object stores' grace periods and staleness (a module attribute so tests can move it).
_clock = time.time


def wall_time() -> float:
    """The time object stores judge grace periods and staleness by (``time.time``, unless a test moved it)."""
    return _clock()


def write_entry(store: EntryStore, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                overwrite: bool) -> int:
    """Publish an entry: unique data objects first, ``meta.json`` last; the bytes written (0 when one is
    there and not ``overwrite``)."""
    backend = store.backend
    previous = store.probe(path)
    if previous.state is EntryState.PRESENT and not overwrite:
        return 0
    token = uuid.uuid4().hex[:12]
    listing: dict[str, dict[str, Any]] = {}
    written: list[str] = []
    total = 0
    try:
        for name, data in files.items():
            data = contiguous(data)
            stem, dot, suffix = name.partition(".")
            obj = f"{stem}.{token}{dot}{suffix}"
            backend.put_file(f"{path}/{obj}", data)
            written.append(obj)
            listing[name] = {"bytes": nbytes(data), "checksum": checksum(data), "object": obj}
            total += nbytes(data)
        keep, expired = _retire(previous.meta, set(written), store.clock, store.grace_seconds)
        body = meta_bytes(meta, listing, keep)
        backend.put_file(f"{path}/{META_FILE}", body)
    except BaseException:
        for obj in written:  # nothing names them: remove what we can, leftovers handle the rest
            try:
                _delete_object(store, path, obj)
            except OSError:
                pass
        raise
    for obj in expired:
        try:
            _delete_object(store, path, obj)
        except OSError as err:  # left for a later writer or remove_leftovers
            logger.debug("could not delete replaced object %s/%s: %s", path, obj, err)
    return total + len(body)


def _retire(previous: Mapping[str, Any] | None, new: set[str], clock: Any,
            grace_seconds: float) -> tuple[dict[str, float], list[str]]:
    """Which objects of the replaced entry stay (``retired``, with when) and which may go now.

    Only objects the replaced ``meta.json`` names and that carry a writer's naming pattern are
    considered: whatever else a damaged or planted ``meta.json`` names is never deleted.
    """
    keep: dict[str, float] = {}
    expired: list[str] = []
    if not previous:  # a probe returns no meta for an ill-typed meta.json: nothing it names is touched
        return keep, expired
    now = clock()
    candidates: dict[str, float] = {}
    for name, info in (previous.get("files") or {}).items():
        candidates[stored_name(name, info)] = now
    for obj, when in (previous.get("retired") or {}).items():
        candidates.setdefault(obj, float(when))
    for obj, when in candidates.items():
        if obj in new or not _OBJECT_NAME.match(obj):
            continue
        if now - when >= grace_seconds:
            expired.append(obj)
        else:
            keep[obj] = when
    return keep, expired


def _delete_object(store: EntryStore, path: str, obj: str) -> None:
    if not _OBJECT_NAME.match(obj) or not valid_name(obj):
        raise OSError(errno.EPERM, f"refusing to delete {obj!r}: not an object stepskip wrote", path)
    store.backend.delete(f"{path}/{obj}")


def may_hold_leftovers(files: Mapping[str, DirItem], now: float, young: float) -> bool:
    """Whether an entry's listing (``files``: its objects by name) leaves room for an object
    :func:`remove_leftovers` could delete; False only when none can be.

    A writer names every data object it writes with a token of its own write
    (``{stem}.{token}{.suffix}``), and only such objects are ever deleted, when ``meta.json`` does
    not name them (a replaced version, or a crashed writer's). So nothing can be deleted from an
    entry without a ``meta.json``, or whose objects are all of one write (the one its ``meta.json``
    names, else the entry is damaged and nothing is deleted from it either); nor when every
    tokened object was modified less than ``young`` seconds before ``now`` (a replaced object is
    kept for the grace period after its replacement, an unnamed one until stale, both later than
    the object's own time). An object without a time, or with one ahead of ``now``, may be old.

    Example:
        >>> item = DirItem("x", "file", 1, 100.0)
        >>> may_hold_leftovers({"meta.json": item, "data.0123456789ab.json": item}, 200.0, 600.0)
        False
        >>> may_hold_leftovers({"meta.json": item, "data.0123456789ab.json": item,
        ...                     "data.ba9876543210.json": item}, 1000.0, 600.0)
        True
    """
    if META_FILE not in files:
        return False  # no entry there: nothing in it is deleted (a probe finds it missing)
    writes: set[str] = set()
    tokened: list[DirItem] = []
    for name, item in files.items():
        if _OBJECT_NAME.match(name):
            writes.add(name.split(".", 2)[1])
            tokened.append(item)
        elif name != META_FILE:
            writes.add("")  # files without a token (copied from a local cache, or foreign): one more write
    if len(writes) < 2:
        return False
    return any(item.mtime is None or not 0 <= now - item.mtime < young for item in tokened)


def remove_leftovers(store: EntryStore, path: str, older_than: float, tree: Tree | None) -> list[str]:
    """Delete, in the entries under ``path``, replaced objects past their grace period and stale objects
    that no ``meta.json`` names; only objects with the names writers here give them.

    One recursive listing (``tree``, or one taken here) shows every entry's objects with their times;
    only the entries it leaves room for a leftover in (:func:`may_hold_leftovers`: objects of more
    than one write, not all written just now) are probed, so the clean-up costs a bounded number of
    requests, not a few per entry.
    """
    if tree is None or not tree.covers(path):
        tree = store.backend.scan(path)
        if tree is None:
            return []
    removed = []
    now, young = store.clock(), min(store.grace_seconds, older_than)
    for step in tree.dirs(path):
        entry = f"{path.rstrip('/')}/{step}"
        objects = tree.files(entry)
        if not may_hold_leftovers(objects, now, young):
            continue
        probe = store.probe(entry)
        if probe.state is not EntryState.PRESENT or not isinstance((probe.meta or {}).get("files"), dict):
            continue
        assert probe.meta is not None
        named = {stored_name(n, i) for n, i in probe.meta["files"].items()}
        retired = probe.meta.get("retired") or {}
        for name in sorted(objects):
            if name in named or not _OBJECT_NAME.match(name):
                continue
            if name in retired:
                if now - float(retired[name]) < store.grace_seconds:
                    continue
            else:
                modified = objects[name].mtime  # the listing's time: an object written since is not in it
                if modified is None or now - modified < older_than:
                    continue
            _delete_object(store, entry, name)
            removed.append(f"{entry}/{name}")
    return removed


def entries_may_hold_leftovers(store: EntryStore, path: str, tree: Tree, older_than: float) -> bool:
    """Whether ``tree`` leaves room for :func:`remove_leftovers` to delete something under ``path``."""
    now, young = store.clock(), min(store.grace_seconds, older_than)
    return any(may_hold_leftovers(tree.files(f"{path}/{name}"), now, young) for name in tree.dirs(path))
