"""The byte-level storage interface: what a backend offers, what it declares it can do, and the records it returns.

A backend is a few primitives over one kind of storage (:class:`Backend`): list a directory, look
at a path, read one version of an entry (:class:`PinnedEntry`), stage an entry beside its place and
publish it (:class:`Staging`), put a small file whole, delete. What it can do beyond that is
declared in :class:`Capabilities`, which callers ask instead of testing a backend's type. Everything
about entries themselves (``meta.json`` checks, checksums, race retries, leftovers) is written once,
above every backend, in :class:`stepskip._storage.entries.EntryStore`.
"""

from __future__ import annotations

import enum
import itertools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from stepskip._entries import FileBytes

__all__ = [
    "EntryState", "Probe", "DirItem", "Tree", "Capabilities", "Allocator", "Backend", "PinnedEntry", "Staging",
    "Batch", "BadFile", "Raced", "NotAnEntry", "token", "settled", "newest_below", "SETTLED_NS",
]

#: Where a read puts a big file: given its size, a writable buffer of exactly that many bytes (the
#: caller's recycled memory, say), or None for an ordinary ``bytes``.
Allocator = Callable[[int], "memoryview | None"]


class BadFile(Exception):
    """A file of an entry is there but unusable (a link, not regular, the wrong size): damage."""


class Raced(Exception):
    """The entry changed while it was read: read it again."""


class NotAnEntry(Exception):
    """No entry can be at a path: ``reason`` says why; ``damaged`` tells damage (a link or a file where the
    entry's directory should be) from a path where there is simply none (one below a file, say)."""

    def __init__(self, reason: str, damaged: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.damaged = damaged


class _Tokens:
    """Unique 12-hex-digit suffixes for the temporary names of one process, without a system call each.

    ``uuid4`` reads the kernel's random source once per name: on the dump worker's thread that is one
    more release of the GIL, per small entry, to a caller that keeps it for a while. Here a random
    prefix is drawn once per process (again in a forked child, which would otherwise repeat its
    parent's names) and a counter follows it: names never repeat within 2**24 of one process, and two
    processes share a prefix with a chance of 1 in 2**24.
    """

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._prefix = os.urandom(3).hex()
        self._count = itertools.count(int.from_bytes(os.urandom(3), "little"))

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._count) & 0xFFFFFF:06x}"


#: A fresh suffix for a temporary name: ``token()``.
token = _Tokens()

class EntryState(enum.Enum):
    """What a look at an entry found: damaged entries are regenerated, unreadable ones kept, unavailable ones
    (the store did not answer: :mod:`~stepskip._storage.outages`) neither read nor written over."""

    MISSING = "missing"
    PRESENT = "present"
    DAMAGED = "damaged"
    UNREADABLE = "unreadable"
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Probe:
    """What a cheap look at an entry found (no data read, no checksum computed).

    ``stamp`` identifies the file version of ``meta.json`` that was read (local stores): a read
    given this probe reuses its ``meta`` instead of parsing the file again while the stamp is the same.
    ``files``: the listed data files, read with ``meta.json`` through the same open directory (one
    version), when the probe of the entry at ``path`` was asked to ``keep`` an entry this small; sizes
    checked, checksums not yet.
    """

    state: EntryState
    meta: dict[str, Any] | None = None
    reason: str = ""
    stamp: tuple[int, ...] | None = field(default=None, compare=False, repr=False)
    files: Mapping[str, bytes | memoryview] | None = field(default=None, compare=False, repr=False)
    path: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DirItem:
    """One name in a directory, as seen without following symbolic links.

    Args:
        name: the name (one path component).
        kind: ``dir``, ``file``, ``link`` (a symbolic link, never followed) or ``other`` (a FIFO, a device ...).
        size: bytes of a file (0 for anything else).
        mtime: the modification time, when the store knows it.
    """

    name: str
    kind: str
    size: int = 0
    mtime: float | None = None


class Tree:
    """What one recursive listing of a directory found: every file below it, with its size and time.

    An object store lists a whole prefix in one request per 1,000 objects, so a start-up clean-up
    that decides from a tree which entries may hold leftovers costs a bounded number of requests
    per 1,000 objects instead of a look at every entry
    (:meth:`~stepskip._storage.entries.EntryStore.remove_leftovers`). Paths are given as the caller
    spells them (the ``root`` the tree was listed for, then ``/``-joined names): a path not at or
    below ``root`` has nothing in the tree.

    Args:
        root: the listed directory.
        files: path relative to ``root`` (``/``-joined names) -> the file found there.

    Example:
        >>> tree = Tree("s3://b/run", {"3/meta.json": DirItem("meta.json", "file", 9, 1.0)})
        >>> tree.dirs("s3://b/run"), sorted(tree.files("s3://b/run/3"))
        (['3'], ['meta.json'])
    """

    def __init__(self, root: str, files: Mapping[str, DirItem]) -> None:
        self.root = root.rstrip("/")
        self._dirs: dict[str, dict[str, DirItem | None]] = {"": {}}  # relative dir -> name -> file (None: a dir)
        for rel, item in files.items():
            parts = rel.split("/")
            if any(part in ("", ".", "..") for part in parts):
                continue  # not a name a cache holds: ignored, never a path to act on
            for depth in range(len(parts)):
                parent = "/".join(parts[:depth])
                children = self._dirs.setdefault(parent, {})
                if depth == len(parts) - 1:
                    children.setdefault(parts[depth], item)
                else:
                    children[parts[depth]] = None
                    self._dirs.setdefault("/".join(parts[:depth + 1]), {})

    def _relative(self, path: str) -> str | None:
        path = path.rstrip("/")
        if path == self.root:
            return ""
        return path[len(self.root) + 1:] if path.startswith(self.root + "/") else None

    def covers(self, path: str) -> bool:
        """True when ``path`` is the listed directory or lies below it."""
        return self._relative(path) is not None

    def _children(self, path: str) -> dict[str, DirItem | None]:
        rel = self._relative(path)
        return {} if rel is None else self._dirs.get(rel, {})

    def dirs(self, path: str) -> list[str]:
        """The names of the directories directly in ``path`` (sorted)."""
        return sorted(name for name, item in self._children(path).items() if item is None)

    def files(self, path: str) -> dict[str, DirItem]:
        """The files directly in ``path``, by name."""
        return {name: item for name, item in self._children(path).items() if item is not None}

    def newest(self, path: str) -> float | None:
        """The newest modification time of the files below ``path``; None when one has no time or there are none."""
        return newest_below(path, self._items)

    def _items(self, path: str) -> list[DirItem]:
        # Everything given as a file stays one, whatever kind it claims: only the names above a file
        # are directories of the tree.
        return [DirItem(name, "dir") if item is None else item if item.kind != "dir" else replace(item, kind="file")
                for name, item in self._children(path).items()]


def newest_below(path: str, items: Callable[[str], Iterable[DirItem]]) -> float | None:
    """The newest modification time of what lies below directory ``path``.

    A link counts as a file (never followed), and a directory whose name is not one plain name
    (empty, ``.``, ``..`` or holding ``/``) is not entered, so the walk stays below ``path`` and ends.

    Args:
        path: the directory to walk.
        items: lists one directory: what is directly in it, as seen without following links.

    Returns:
        The newest time found; None when one file has no time (it may be being written) or there is none.

    Example:
        >>> listing = {"/r": [DirItem("a", "dir"), DirItem("x", "file", 1, 5.0)],
        ...            "/r/a": [DirItem("y", "file", 1, 7.0)]}
        >>> newest_below("/r", lambda d: listing.get(d, []))
        7.0
    """
    newest: float | None = None
    pending = [path.rstrip("/")]
    while pending:
        current = pending.pop()
        for item in items(current):
            if item.kind == "dir":
                if item.name not in ("", ".", "..") and "/" not in item.name:
                    pending.append(f"{current}/{item.name}")  # any other name could lead out of path, or back
                continue
            if item.mtime is None:
                return None  # a file of unknown age: it may be being written
            newest = item.mtime if newest is None else max(newest, item.mtime)
    return newest


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond the primitives every backend has; callers ask these, never its type.

    Args:
        atomic_dir_publish: a staged directory is published in one step, whole or not at all (a
            rename): entries are written by :meth:`Backend.stage`, and a directory of entries can be
            published at once (:meth:`Backend.publish_dir`). Without it an entry is committed by
            writing its ``meta.json`` last, over data objects named for their write (object stores).
        batched_fsync: making many small entries durable together costs much less than one by one
            (:meth:`Backend.batch`): callers gather small entries into batches.
        cheap_tree_scan: one listing shows a whole tree (:meth:`Backend.scan`), cheaper than a look
            at each directory (object stores: one request per 1,000 objects).
        version_stamps: a pinned entry can tell, by metadata alone, that its ``meta.json`` is still
            the very file a probe parsed (:meth:`PinnedEntry.meta_stamp`), so a read after a probe
            need not parse it again.
        dir_versions: a directory's names have a version (:meth:`Backend.dir_version`), so a listing
            may be reused while the version stays the same.
        local_files: entries are plain files on this machine, reachable by path from another process
            (a helper process may write them given the root).

    Example:
        >>> Capabilities(atomic_dir_publish=True).cheap_tree_scan
        False
    """

    atomic_dir_publish: bool = False
    batched_fsync: bool = False
    cheap_tree_scan: bool = False
    version_stamps: bool = False
    dir_versions: bool = False
    local_files: bool = False


class PinnedEntry(ABC):
    """One version of the entry at :attr:`path`: every file read through it belongs to the same version,
    even while writers replace the entry (an open directory locally; the ``meta.json`` read, whose
    data objects are named for their write, on object stores).

    Reads raise ``FileNotFoundError`` for a file that is not there and :class:`BadFile` for one that
    is unusable; :meth:`replaced` then tells damage from a read that raced a writer.
    """

    path: str

    @abstractmethod
    def read_meta(self) -> tuple[bytes, tuple[int, ...] | None]:
        """The bytes of this version's ``meta.json`` (at most :data:`~stepskip._storage.meta.META_MAX_BYTES`
        plus one: more is damage) and its stamp (None without :attr:`Capabilities.version_stamps`)."""

    def meta_stamp(self) -> tuple[int, ...] | None:
        """The stamp of ``meta.json`` as it is now, without reading it; None when it cannot be told
        (no such regular file, or no :attr:`Capabilities.version_stamps`)."""
        return None

    @abstractmethod
    def read(self, name: str, size: int | None, allocator: Allocator | None = None) -> bytes | memoryview:
        """The file ``name`` (a stored name, one path component): exactly ``size`` bytes, never one more
        read (None: whatever it holds). ``allocator`` may provide the memory of a big file."""

    @abstractmethod
    def check(self, name: str, size: int) -> None:
        """Check by metadata alone that ``name`` is a regular file of ``size`` bytes."""

    @abstractmethod
    def has_file(self, name: str) -> bool:
        """Whether ``name`` is a regular file of this entry (never raises)."""

    @abstractmethod
    def absent(self) -> str:
        """Called when ``meta.json`` is not there: why that is damage, or "" when there is simply no
        entry. Raises :class:`Raced` when the entry was replaced meanwhile."""

    @abstractmethod
    def replaced(self) -> bool:
        """Called after a read failed: whether a newer version took this one's place (the failure then
        says nothing about the entry; :meth:`reopen` pins the newer one). Raises :class:`NotAnEntry`
        when the entry is gone."""

    @abstractmethod
    def reopen(self) -> PinnedEntry:
        """The entry at :attr:`path` as it is now (after :meth:`replaced` or :class:`Raced`)."""

    def close(self) -> None:
        """Release what pins this version."""


class Staging(ABC):
    """An entry being written in a hidden place beside its final one, invisible to readers until
    :meth:`publish` (backends with :attr:`Capabilities.atomic_dir_publish`)."""

    @abstractmethod
    def write(self, name: str, data: FileBytes) -> None:
        """Create the file ``name`` (one path component) holding ``data`` (one run of bytes)."""

    @abstractmethod
    def sync(self) -> None:
        """Make every file written durable (raises the first failure)."""

    @abstractmethod
    def publish(self, overwrite: bool) -> bool:
        """Put the staged entry in its place whole; False when one is there and ``overwrite`` is off."""

    @abstractmethod
    def discard(self) -> None:
        """Remove what was staged and not published, and release what the staging holds (idempotent)."""


class Batch:
    """Entries staged together, made durable together, then published one by one
    (:meth:`~stepskip._storage.entries.EntryStore.write_entries`).

    This one syncs each entry on its own; a backend with :attr:`Capabilities.batched_fsync` returns
    its own from :meth:`Backend.batch`.

    Args:
        backend: where the entries are staged.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._stagings: list[Staging] = []
        self._failed: dict[int, OSError] = {}

    def stage(self, path: str) -> Staging:
        """Start writing the entry at ``path``."""
        staging = self.backend.stage(path)
        self._stagings.append(staging)
        return staging

    def staged(self, key: int, staging: Staging) -> None:
        """Every file of entry ``key`` is written: it may be made durable from now on."""
        try:
            staging.sync()
        except OSError as err:
            self._failed[key] = err

    def sync(self) -> dict[int, OSError]:
        """Wait until every staged entry is durable; the failures by key."""
        return dict(self._failed)

    def published(self) -> None:
        """Every entry that could be is published: make the publishing itself durable."""

    def close(self) -> None:
        """Discard what was staged and not published, and release the batch (also after an error)."""
        for staging in self._stagings:
            staging.discard()


class Backend(ABC):
    """Byte-level primitives over one kind of storage, addressed by ``/``-joined paths.

    A backend never interprets an entry: :class:`~stepskip._storage.entries.EntryStore` does, the same
    way over every backend. Paths are given as callers spell them (a local path, a URL); ``root`` is
    the dump dir, outside which nothing is deleted. Optional primitives raise ``NotImplementedError``
    unless :attr:`capabilities` declares them.
    """

    #: What this backend can do beyond the primitives (an instance may narrow or widen its class's).
    capabilities: Capabilities = Capabilities()
    #: The dump dir, as this backend spells it; None when it was opened without one.
    root: str | None = None

    @classmethod
    @abstractmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any]) -> Backend:
        """The backend of dump dir ``url`` (see :func:`~stepskip._storage.registry.register_backend`)."""

    # ------------------------------------------------------------------ looking

    @abstractmethod
    def names(self, path: str, dirs_only: bool = False) -> list[str]:
        """Names directly under ``path`` (only real subdirectories with ``dirs_only``); empty when it is not
        a directory reached without following a link."""

    @abstractmethod
    def items(self, path: str) -> list[DirItem]:
        """What is directly under ``path``, links reported as links; empty as for :meth:`names`."""

    @abstractmethod
    def stat(self, path: str) -> DirItem | None:
        """``path`` itself, not followed if it is a link; None when it does not exist."""

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` is a directory reached without following a link."""
        item = self.stat(path)
        return item is not None and item.kind == "dir"

    def scan(self, path: str) -> Tree | None:
        """Every file below ``path`` in one listing (:attr:`Capabilities.cheap_tree_scan`); None otherwise."""
        return None

    def dir_version(self, path: str) -> tuple[int, ...] | None:
        """A value that changes whenever the names in directory ``path`` change, its third field the
        directory's mtime in ns (:attr:`Capabilities.dir_versions`); None otherwise."""
        return None

    def forget_listings(self, path: str) -> None:
        """Drop whatever listing of ``path`` and below this backend keeps, so the next one is fresh."""

    # ------------------------------------------------------------------ reading

    @abstractmethod
    def open_entry(self, path: str) -> PinnedEntry:
        """Pin the entry at ``path`` as it is now (nothing may be read yet).

        Raises:
            FileNotFoundError: nothing is there.
            NotAnEntry: no entry can be there (a link, a file, a path below a file).
        """

    @abstractmethod
    def read_file(self, path: str, limit: int) -> bytes | None:
        """The bytes of one small regular file, never more than ``limit + 1`` read; None when there is none.

        Raises:
            BadFile: a link, a directory, a special file, or one that cannot be read (the message says).
        """

    # ------------------------------------------------------------------ writing

    @abstractmethod
    def put_file(self, path: str, data: FileBytes) -> None:
        """Write one file so that readers see the old bytes or the new ones, never a mix."""

    def stage(self, path: str) -> Staging:
        """Start writing the entry at ``path`` (:attr:`Capabilities.atomic_dir_publish`).

        Raises:
            OSError: ``EINVAL`` when the last component cannot name an entry; any error making the place.
        """
        raise NotImplementedError(f"{type(self).__name__} has no atomic directory publish")

    def batch(self) -> Batch:
        """A batch of entries to stage, make durable together and publish (see :class:`Batch`)."""
        return Batch(self)

    def publish_dir(self, staging: str, path: str) -> None:
        """Publish the directory ``staging`` (a hidden sibling of ``path``) as ``path`` in one step
        (:attr:`Capabilities.atomic_dir_publish`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot publish a directory atomically")

    # ------------------------------------------------------------------ deleting

    def delete(self, path: str) -> None:
        """Delete one file (a data object being retired); a missing one is fine."""
        self.remove(path)

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete a file or a whole directory without following links; a missing path is fine.

        Raises:
            OSError: ``path`` is spelled with ``..``, or lies outside ``root`` where the backend confines
                deletes, or reaching it would follow a link; nothing is deleted then.
        """

    @abstractmethod
    def retire(self, path: str) -> bool:
        """Remove one entry so that readers see it whole or not at all; False when none was there."""


#: A directory's mtime this much older than a listing of it proves the listing complete: a later
#: change (on a filesystem whose timestamps are coarse, too) gives the directory another mtime.
SETTLED_NS = 2_000_000_000


def settled(version: tuple[int, ...] | None, listed_at_ns: int) -> bool:
    """Whether a listing taken at ``listed_at_ns`` (``time.time_ns()``) of a directory at ``version``
    (:meth:`Backend.dir_version`: its third field is the directory's mtime in ns) may be reused for as
    long as the version stays the same (the caller also re-lists after its own writes and at least
    every so often: see :meth:`CachedRole.listed_steps`)."""
    return version is not None and listed_at_ns - version[2] >= SETTLED_NS
