"""Entries where no directory can be published atomically (object stores): how they are committed and read.

A commit is: write each data object under a name unique to this write (``data.<token>.safetensors``),
then ``meta.json``, one atomic PUT that names exactly those objects. A reader follows ``meta.json``,
so it never mixes two writers' files. The objects of the replaced entry are not deleted at once:
the new ``meta.json`` lists them as ``retired`` with the time, and a later writer (or
:func:`remove_leftovers`) deletes them once the grace period has passed, so that a reader holding
the old ``meta.json`` still finds them. Objects no ``meta.json`` names (a crashed writer's) are
removed once stale. Only objects named as a writer here names them are ever deleted, and only
inside their entry.

A version of an entry is the ``meta.json`` read (:class:`ObjectEntry`): a read that fails reads it
again, to tell damage from a writer's replacement. Every read is bounded: an object is fetched by a
byte range one past its expected size, so one larger than it should be is never fetched whole.
"""

from __future__ import annotations

import errno
import logging
import re
import time
import uuid
from abc import abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stepskip._storage.base import Allocator, Backend, BadFile, DirItem, EntryState, NotAnEntry, PinnedEntry, Tree
from stepskip._storage.meta import (
    META_FILE,
    META_MAX_BYTES,
    checksum,
    contiguous,
    meta_bytes,
    nbytes,
    stored_name,
    valid_name,
)
from stepskip._storage.outages import StoreOutage
from stepskip._entries import FileBytes

if TYPE_CHECKING:
    from stepskip._storage.entries import EntryStore

__all__ = [
    "ObjectBackend", "ObjectEntry", "write_entry", "remove_leftovers", "may_hold_leftovers", "wall_time",
    "read_bounded", "read_exact", "is_write_named",
]

logger = logging.getLogger(__name__)

# the names writers give data objects: {stem}.{12 hex token}{.suffix}; only these are deleted
_OBJECT_NAME = re.compile(r"^[^./\\\x00]+\.[0-9a-f]{12}(?:\.[^/\\\x00]+)?$")


def is_write_named(name: str) -> bool:
    """Whether ``name`` is a data object's name as a writer gives it (``{stem}.{token}{.suffix}``): an object
    made by one write that never changes afterwards."""
    return _OBJECT_NAME.match(name) is not None

#: The wall clock of object stores' grace periods and staleness (a module attribute so tests can move it).
_clock = time.time


def wall_time() -> float:
    """The time object stores judge grace periods and staleness by (``time.time``, unless a test moved it)."""
    return _clock()


class ObjectBackend(Backend):
    """A backend of objects, read whole or by a byte range from their start: entries on it are pinned by
    their ``meta.json`` (:class:`ObjectEntry`); its subclass supplies :meth:`get`, :meth:`size` and
    :meth:`is_file` besides :class:`~stepskip._storage.base.Backend`'s primitives."""

    @abstractmethod
    def get(self, path: str, end: int | None = None) -> bytes:
        """The object at ``path``: its bytes up to ``end`` (exclusive), all of them without ``end``.

        Raises:
            FileNotFoundError, IsADirectoryError, NotADirectoryError: no object there.
            OSError: the read failed.
        """

    @abstractmethod
    def size(self, path: str) -> int:
        """The size of the object at ``path`` (errors as :meth:`get`)."""

    @abstractmethod
    def is_file(self, path: str) -> bool:
        """Whether an object is at ``path`` (never raises)."""

    def open_entry(self, path: str) -> ObjectEntry:
        return ObjectEntry(self, path)

    def read_file(self, path: str, limit: int) -> bytes | None:
        try:
            data = read_bounded(self, path, limit)
        except (FileNotFoundError, NotADirectoryError):
            if self.is_dir(path):
                raise BadFile(f"{path} is a directory, not a file") from None
            return None
        except IsADirectoryError:
            raise BadFile(f"{path} is a directory, not a file") from None
        except StoreOutage:
            raise  # no answer is not damage
        except OSError as err:
            raise BadFile(f"cannot read {path}: {err}") from err
        if len(data) > limit:
            raise BadFile(f"{path} is more than the {limit} bytes it may have")
        return data


def read_bounded(backend: ObjectBackend, path: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the object at ``path``: one ranged read, so an object larger than its
    bound is never fetched whole (the caller sees it is too large).

    Raises:
        FileNotFoundError, IsADirectoryError, NotADirectoryError: no object there.
        OSError: the read failed (an empty object whose byte range a server refuses reads as b"").
    """
    try:
        return backend.get(path, limit + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, StoreOutage):
        raise
    except OSError:
        try:
            empty = backend.size(path) == 0
        except OSError:
            empty = False
        if empty:  # some servers refuse a byte range of an empty object
            return b""
        raise


def read_exact(backend: ObjectBackend, path: str, size: int) -> bytes:
    """An object's bytes, at most ``size + 1`` fetched; raises FileNotFoundError / BadFile."""
    name = path.rsplit("/", 1)[-1]
    try:
        if size == 0:
            actual = backend.size(path)
            if actual:
                raise BadFile(f"{name} has {actual} bytes, {META_FILE} says 0")
            return b""
        data = backend.get(path, size + 1)
    except IsADirectoryError:
        raise BadFile(f"{name} is not a file") from None
    except MemoryError:
        raise BadFile(f"{name} ({size} bytes) does not fit in memory") from None
    if len(data) != size:
        raise BadFile(f"{name} has {'more than ' if len(data) > size else ''}{len(data)} bytes, "
                      f"{META_FILE} says {size}")
    return data


class ObjectEntry(PinnedEntry):
    """The version of an entry its ``meta.json`` names: read once, and again only after a failed read."""

    def __init__(self, backend: ObjectBackend, path: str, raw: bytes | None = None) -> None:
        self.backend, self.path, self.raw = backend, path, raw
        self.fresh: bytes | None = None

    def _meta(self) -> bytes:
        try:
            return read_bounded(self.backend, f"{self.path}/{META_FILE}", META_MAX_BYTES)
        except (IsADirectoryError, NotADirectoryError) as err:
            raise FileNotFoundError(f"{self.path}/{META_FILE}") from err

    def read_meta(self) -> tuple[bytes, tuple[int, ...] | None]:
        if self.raw is None:
            self.raw = self._meta()
        return self.raw, None

    def read(self, name: str, size: int | None, allocator: Allocator | None = None) -> bytes:
        path = f"{self.path}/{name}"
        if size is not None:
            return read_exact(self.backend, path, size)
        try:
            return self.backend.get(path)
        except IsADirectoryError as err:
            raise FileNotFoundError(path) from err

    def check(self, name: str, size: int) -> None:
        try:
            actual = self.backend.size(f"{self.path}/{name}")
        except IsADirectoryError:
            raise BadFile(f"{name} is not a file") from None
        if actual != size:
            raise BadFile(f"{name} has {actual} bytes, {META_FILE} says {size}")

    def has_file(self, name: str) -> bool:
        return self.backend.is_file(f"{self.path}/{name}")

    def absent(self) -> str:
        return f"{self.path} is a file, not an entry directory" if self.backend.is_file(self.path) else ""

    def replaced(self) -> bool:
        # a reader holding an older meta.json than the store's reads the current version instead
        try:
            self.fresh = self._meta()
        except FileNotFoundError:
            raise NotAnEntry(f"{self.path} was removed") from None
        return self.fresh != self.raw

    def reopen(self) -> ObjectEntry:
        return ObjectEntry(self.backend, self.path, self.fresh)


def write_entry(store: EntryStore, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                overwrite: bool) -> int:
    """Publish an entry: unique data objects first, ``meta.json`` last; the bytes written (0 when one is
    there and not ``overwrite``)."""
    backend = store.backend
    previous = store.probe(path)
    if previous.state is EntryState.PRESENT and not overwrite:
        return 0
    if previous.state is EntryState.UNAVAILABLE:  # what is there may be valid: never written over unseen
        raise StoreOutage(path, OSError(errno.EIO, previous.reason))
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
