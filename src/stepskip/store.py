"""Entries on disk: atomic commit, checksums, validity checks, leftovers — safe against a hostile cache.

An entry is a directory holding data files and ``meta.json``. A writer builds the whole entry
in a hidden temporary directory beside its final place (``.tmp-{name}-{token}``, the token
unique to the writer), syncs it, and publishes it with one ``rename``; so whatever instant the
writer dies, readers see no entry or a complete one. ``meta.json`` lists every data file with its
size and xxh3-64 checksum; readers check both. Leftover temporaries are never parsed as steps and
are removed once stale.

A cache may have been written by someone else, so readers trust nothing in it (docs/sharing.md,
"Threat model"): ``meta.json`` is bounded in size and depth and checked value by value
(:func:`check_meta`); file names are single path components; files are opened without following
symbolic links, must be regular files and are read for exactly their recorded size; directories
are walked without following links below the dump dir; deletions stay inside the entry being
replaced. A read sees one version of an entry even while writers replace it (:meth:`read_entry`).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import fcntl
import itertools
import json
import logging
import math
import mmap
import os
import re
import shutil
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast, overload

import xxhash

from stepskip._env import env_bytes
from stepskip.entries import FileBytes
from stepskip.errors import CacheMissError, CorruptEntryError, SkipConfigError

__all__ = [
    "EntryState", "Probe", "LocalStore", "FsspecStore", "open_store", "checksum", "check_meta", "check_dump_dir",
    "valid_name", "META_FILE", "MANIFEST_FILE", "TMP_PREFIX", "TRASH_PREFIX", "META_MAX_BYTES", "GRACE_SECONDS",
    "DirItem", "Tree", "may_hold_leftovers", "wall_time",
]

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
#: A V1 step's manifest on object stores (:mod:`stepskip.manifest`): the one object that commits the step.
MANIFEST_FILE = "step.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
STALE_SECONDS = 3600.0


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


_token = _Tokens()

#: ``meta.json`` larger than this is damage (ours are a few KiB): parsing stays cheap and bounded.
META_MAX_BYTES = 1 << 20
#: Nesting deeper than this in ``meta.json`` is damage (ours nest 3 levels).
META_MAX_DEPTH = 32
#: Bound on V1 inner entries a step may claim (``parameter_sync_step``, ``inner_idx``).
MAX_INNER_ENTRIES = 4096
#: Object stores keep a replaced entry's objects this long, for readers holding the old ``meta.json``.
GRACE_SECONDS = 600.0
NAME_MAX = 255  # bytes in one file name on Linux filesystems (ext4, xfs, btrfs, NFS)
_MAX_ATTEMPTS = 32  # reads of an entry that writers keep replacing, before it counts as damaged
_INT64_MAX = 2**63 - 1
# the names FsspecStore writers give data objects: {stem}.{12 hex token}{.suffix}; only these are deleted
_OBJECT_NAME = re.compile(r"^[^./\\\x00]+\.[0-9a-f]{12}(?:\.[^/\\\x00]+)?$")
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO cannot hang open()


class EntryState(enum.Enum):
    """What a look at an entry found (SPEC §6): damaged entries are regenerated, unreadable ones kept."""

    MISSING = "missing"
    PRESENT = "present"
    DAMAGED = "damaged"
    UNREADABLE = "unreadable"


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
    files: Mapping[str, bytes] | None = field(default=None, compare=False, repr=False)
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
    per 1,000 objects instead of a look at every entry (:meth:`FsspecStore.remove_leftovers`). Paths
    are given as the caller spells them (the ``root`` the tree was listed for, then ``/``-joined
    names): a path not at or below ``root`` has nothing in the tree.

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
        newest: float | None = None
        pending = [path.rstrip("/")]
        while pending:
            current = pending.pop()
            for name, item in self._children(current).items():
                if item is None:
                    pending.append(f"{current}/{name}")
                    continue
                if item.mtime is None:
                    return None  # a file of unknown age: it may be being written
                newest = item.mtime if newest is None else max(newest, item.mtime)
        return newest


def may_hold_leftovers(files: Mapping[str, DirItem], now: float, young: float) -> bool:
    """Whether an entry's listing (``files``: its objects by name) leaves room for an object
    :meth:`FsspecStore.remove_leftovers` could delete; False only when none can be.

    An object store's writer names every data object it writes with a token of its own write
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


def checksum(data: FileBytes) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def _nbytes(data: FileBytes) -> int:
    """The bytes a file of ``data`` holds (``len`` counts the items of a memoryview of wider items)."""
    return data.nbytes if isinstance(data, memoryview) else len(data)


def _contiguous(data: FileBytes) -> FileBytes:
    """``data`` as one run of bytes: a strided or Fortran-ordered memoryview copied in C order (what
    ``tobytes`` reads, as ``bytes(view)`` would); anything else as it is, uncopied."""
    return data.tobytes() if isinstance(data, memoryview) and not data.c_contiguous else data


# --------------------------------------------------------------------------- metadata checks


def valid_name(name: object) -> bool:
    """True when ``name`` can name an entry's file: one path component that cannot leave the entry.

    Example:
        >>> valid_name("data.json"), valid_name("../other/data.json"), valid_name("/etc/hostname")
        (True, False, False)
    """
    if not isinstance(name, str) or name in ("", ".", "..") or ".." in name:
        return False
    if "/" in name or "\\" in name or "\x00" in name:
        return False
    try:
        return len(name.encode("utf-8")) <= NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate
        return False


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Bound on an int where meta.json holds a number (a float can represent it; math.isfinite(10**400) overflows).
_MAX_NUMBER = 2**62


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -_MAX_NUMBER <= value <= _MAX_NUMBER  # no float conversion: a huge int must not overflow
    return isinstance(value, float) and math.isfinite(value)


def _shape_problem(meta: object, strings: bool = True) -> str | None:
    """Depth (and, with ``strings``, string) check over the whole document, iteratively (no recursion
    to exhaust)."""
    stack: list[tuple[object, int]] = [(meta, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{META_FILE} holds a string that is not valid Unicode"
            continue
        if isinstance(node, (dict, list)) and depth > META_MAX_DEPTH:
            return f"{META_FILE} nests deeper than {META_MAX_DEPTH} levels"
        if isinstance(node, dict):
            if strings:
                stack.extend((k, depth) for k in node)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)) or strings)
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)) or strings)
    return None


# a JSON escape of a UTF-16 surrogate: the only way a parsed meta.json can hold a string Python cannot encode
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _bounded_int(meta: Mapping[str, Any], key: str, low: int, high: int, file: str = META_FILE) -> str | None:
    """Why ``meta[key]`` (of the JSON document ``file``) is not an int from ``low`` to ``high``; None when
    it is, or when the key is absent."""
    if key not in meta:
        return None
    value = meta[key]
    if not _is_int(value) or not low <= value <= high:
        return f"{file}: {key} is {_show(value)}, expected an int from {low} to {high}"
    return None


def check_meta(meta: object) -> str | None:
    """Why ``meta`` (a parsed ``meta.json``) cannot be trusted, or None when every value it holds
    has the type and range stepskip writes.

    Checked: ``global_steps`` (int >= 0), ``format``/``run_id``/``role``/``stepskip_version`` (str),
    ``prompt_digest`` (str or null), ``generation_seconds``/``created_unix`` (null or a finite
    number >= 0), ``fingerprint`` (object), the V1 fields ``inner_idx``, ``num_trajectories`` and
    ``parameter_sync_step`` (bounded ints), ``files`` (single-component names to ``{bytes: int >= 0,
    checksum: str, object?: name}``), ``retired`` (names to times), nesting depth and strings.

    Returns:
        A reason naming the bad key and value, or None.

    Example:
        >>> check_meta({"global_steps": 3}) is None
        True
        >>> check_meta({"global_steps": 3, "format": ["safe"]})
        "meta.json: format is ['safe'], expected a string"
    """
    return _check_meta(meta, None)


def _check_meta(meta: object, raw: bytes | None) -> str | None:
    """:func:`check_meta`; given the ``raw`` document it skips the walks the bytes show needless."""
    if not isinstance(meta, dict):
        return f"{META_FILE} is not a JSON object"
    if raw is None:
        shape = _shape_problem(meta)
    else:
        shallow = raw.count(b"[") + raw.count(b"{") <= META_MAX_DEPTH  # cannot nest deeper than it has brackets
        strings = _SURROGATE_ESCAPE.search(raw) is not None
        shape = None if shallow and not strings else _shape_problem(meta, strings)
    if shape:
        return shape
    if "global_steps" not in meta:
        return f"{META_FILE} lacks global_steps"
    problem = _bounded_int(meta, "global_steps", 0, _INT64_MAX)
    if problem:
        return problem
    for key in ("format", "run_id", "role", "stepskip_version"):
        if key in meta and not isinstance(meta[key], str):
            return f"{META_FILE}: {key} is {_show(meta[key])}, expected a string"
    digest = meta.get("prompt_digest")
    if digest is not None and not isinstance(digest, str):
        return f"{META_FILE}: prompt_digest is {_show(digest)}, expected a string or null"
    for key in ("generation_seconds", "created_unix"):
        value = meta.get(key)
        if value is not None and not (_is_number(value) and value >= 0):
            return f"{META_FILE}: {key} is {_show(value)}, expected null or a finite number >= 0"
    if "fingerprint" in meta and meta["fingerprint"] is not None and not isinstance(meta["fingerprint"], dict):
        return f"{META_FILE}: fingerprint is {_show(meta['fingerprint'])}, expected an object"
    for key, low, high in (("inner_idx", 0, MAX_INNER_ENTRIES - 1), ("parameter_sync_step", 1, MAX_INNER_ENTRIES),
                           ("num_trajectories", 0, 2**31 - 1)):
        problem = _bounded_int(meta, key, low, high)
        if problem:
            return problem
    return _files_problem(meta.get("files")) or _retired_problem(meta.get("retired"))


def _files_problem(files: object) -> str | None:
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"{META_FILE} has a malformed file list: {_show(files)}"
    for name, info in files.items():
        if not valid_name(name) or name == META_FILE:
            return f"{META_FILE} names a file {_show(name)}, which is not a single file name inside the entry"
        if not isinstance(info, dict):
            return f"{META_FILE} has a malformed file list: {name} -> {_show(info)}"
        size = info.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= _INT64_MAX:
            return f"{META_FILE}: {name} has bytes {_show(size)}, expected an int >= 0"
        if not isinstance(info.get("checksum"), str):
            return f"{META_FILE}: {name} has checksum {_show(info.get('checksum'))}, expected a string"
        obj = info.get("object")
        if obj is not None and (not valid_name(obj) or obj == META_FILE):
            return f"{META_FILE}: {name} is stored as {_show(obj)}, which is not a single file name inside the entry"
    return None


def _retired_problem(retired: object) -> str | None:
    if retired is None:
        return None
    if not isinstance(retired, dict) or not all(valid_name(k) and _is_number(v) for k, v in retired.items()):
        return f"{META_FILE} has a malformed list of retired objects: {_show(retired)}"
    return None


def _load_json(raw: bytes, limit: int, file: str) -> tuple[Any, str]:
    """``(value, "")`` for at most ``limit`` bytes of JSON (the small documents of a cache: ``meta.json``,
    a step manifest), else ``(None, reason)`` naming ``file``; never raises."""
    if len(raw) > limit:
        return None, f"{file} is {len(raw)} bytes, more than the {limit} it may have"
    try:
        return json.loads(raw), ""
    except RecursionError:
        return None, f"{file} nests too deep: it nests deeper than the JSON parser allows"
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        return None, f"unreadable {file}: {err}"


def _parse_meta(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """``(meta, "")`` for a trustworthy ``meta.json``, else ``(None, reason)``; never raises."""
    meta, unparsed = _load_json(raw, META_MAX_BYTES, META_FILE)
    if unparsed:
        return None, unparsed
    try:
        reason = _check_meta(meta, raw)
    except (ArithmeticError, TypeError, ValueError, RecursionError) as err:  # hostile values a check missed: damage
        return None, f"{META_FILE} holds a value stepskip cannot check ({type(err).__name__}: {err})"
    return (None, reason) if reason else (meta, "")


def _object(name: str, info: Mapping[str, Any]) -> str:
    return str(info.get("object") or name)


def _meta_bytes(meta: Mapping[str, Any], listing: Mapping[str, Any],
                retired: Mapping[str, float] | None = None) -> bytes:
    body = dict(meta)
    body.pop("retired", None)  # only a store writes it (FsspecStore), from the entry it replaces
    body["files"] = dict(listing)
    if retired:
        body["retired"] = dict(retired)
    # one line: json's C encoder writes it (an indented document takes its pure-Python encoder, several times
    # slower: a measurable share of a one-sample entry's write)
    return json.dumps(body, sort_keys=True).encode("utf-8")


class _BadFile(Exception):
    """A file of an entry is there but unusable (a link, not regular, wrong size): damage."""


class _Raced(Exception):
    """The entry changed while it was read: read it again."""


# --------------------------------------------------------------------------- renameat2


def _load_renameat2() -> Any:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def _load_syncfs() -> Any:
    """libc's ``syncfs`` where it reports writeback errors (Linux 5.8 and later), else None."""
    release = os.uname().release if hasattr(os, "uname") else ""
    found = re.match(r"(\d+)\.(\d+)", release)
    if not sys.platform.startswith("linux") or found is None or (int(found[1]), int(found[2])) < (5, 8):
        return None  # older kernels' syncfs returns 0 even when writing back failed
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SYNCFS = _load_syncfs()
#: Batches with at least this many entries on one filesystem are made durable by one ``syncfs`` there
#: instead of an ``fsync`` per file and directory (see :meth:`LocalStore.write_entries`).
SYNCFS_MIN_ENTRIES = 4
#: ... and a batch is synced every this many staged entries, not once at its end: on ext4 each inode
#: created costs more the more inodes the running journal transaction already created (measured on
#: this project's VM: 0.03 ms a file right after a commit, 0.36 ms forty entries later, 1.5 ms
#: hundreds later), so many small entries are cheapest committed a few at a time.
SYNCFS_CHUNK_ENTRIES = 8
#: ``syncfs`` also writes back what other programs left dirty on the filesystem (a checkpoint being
#: saved, say): with more than this much dirty or under writeback in the whole system, a batch is
#: synced file by file instead, so that its commit never waits for someone else's gigabytes.
SYNCFS_MAX_DIRTY_BYTES = 64 << 20


def _dirty_bytes() -> int | None:
    """The system's dirty and writeback bytes (``/proc/meminfo``); None where it cannot be read."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            text = fh.read(1 << 14)
    except OSError:
        return None
    total, found = 0, 0
    for line in text.splitlines():
        if line.startswith((b"Dirty:", b"Writeback:")):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                total += int(parts[1]) * 1024
                found += 1
    return total if found == 2 else None


#: Filesystems whose ``syncfs`` writes back every file and reports writeback errors. Elsewhere (FUSE
#: mounts such as JuiceFS or gcsfuse: their kernel side returns 0 without asking the daemon; overlay
#: on older kernels) a batch keeps each file's own ``fsync``.
SYNCFS_FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs", "f2fs", "tmpfs"})
_FS_TYPES: dict[int, str | None] = {}


def _fs_type(device: int) -> str | None:
    """The type of the filesystem mounted from ``device`` (``/proc/self/mountinfo``); None if unknown."""
    if device not in _FS_TYPES:
        wanted, found = f"{os.major(device)}:{os.minor(device)}", None
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields, _, rest = line.partition(" - ")
                    parts = fields.split()
                    if len(parts) > 2 and parts[2] == wanted and rest.split():
                        found = rest.split()[0]
                        break
        except OSError:
            pass
        _FS_TYPES[device] = found
    return _FS_TYPES[device]


def _syncfs_pays() -> bool:
    """Whether one ``syncfs`` is the cheap way to make a batch durable just now."""
    if _SYNCFS is None:
        return False
    dirty = _dirty_bytes()
    return dirty is not None and dirty <= SYNCFS_MAX_DIRTY_BYTES
_RENAME_EXCHANGE = 2


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """Swap two existing names in ``dir_fd`` in one step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the call or the filesystem does not support it.
    """
    global _RENAMEAT2
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        _RENAMEAT2 = None  # remember: not supported here
        return False
    if err == errno.ENOENT:
        return False  # the old entry vanished meanwhile: a plain rename will do
    raise OSError(err, os.strerror(err), b)


# --------------------------------------------------------------------------- openat2


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _load_syscall() -> Any:
    import platform

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_SYSCALL = _load_syscall()
_SYS_OPENAT2 = 437  # the same number on every architecture (Linux >= 5.6)
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


def _openat2_dir(dir_fd: int, relative: str) -> int | None:
    """Open the directory ``relative`` below ``dir_fd`` in one call, refusing any symbolic link on the
    way (Linux ``openat2`` with ``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``).

    Returns None when the call is unavailable or failed for a reason the caller's component-wise
    walk should classify (a link, a file); raises FileNotFoundError for a missing component.
    """
    global _SYSCALL
    if _SYSCALL is None:
        return None
    how = _OpenHow(_O_DIR, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
    fd = _SYSCALL(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(relative)),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), relative)
    if err in (errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.E2BIG):
        _SYSCALL = None  # an older kernel or a seccomp filter: walk component by component from now on
    return None


# --------------------------------------------------------------------------- big files around the page cache


def _direct_write_bytes() -> int:
    return env_bytes("STEPSKIP_DIRECT_WRITE_BYTES", 4 << 20,
                     "e.g. 4194304, or 0 to write every file through the page cache", "using 4 MiB")


#: Files of at least this many bytes are written with ``O_DIRECT`` where the filesystem takes it
#: (environment variable ``STEPSKIP_DIRECT_WRITE_BYTES``, read at import; ``0`` turns it off). A
#: dump is synced before it is published anyway: written through the page cache, its bytes are
#: copied into fresh cache pages and then written back by the ``fsync``; written directly, they go
#: from the dump's memory to the disk once. On this project's 2-core VM, where a fresh page costs a
#: fault in the guest and one in the host, 10 MB took 7 ms that way against 10-40 ms, and 40 MB 30 ms
#: against 120-330 ms. The price: the file is not left in the page cache, so the first read of it
#: (a replay) comes from the disk.
DIRECT_WRITE_BYTES = _direct_write_bytes()
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux's; macOS has none
_DIRECT_ALIGN = 4096  # O_DIRECT's alignment of memory, offset and length on the usual filesystems
_DIRECT_STAGE_BYTES = 4 << 20
_direct_stage = threading.local()  # per thread: an aligned buffer that unaligned data is copied through


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _write_direct(fd: int, view: memoryview) -> memoryview:
    """Write the longest aligned head of ``view`` to ``fd`` with ``O_DIRECT``; what is left to write
    through the page cache (all of it where the filesystem refuses direct I/O).

    Data at an aligned address is written from where it lies; other data is copied through a
    reused aligned buffer, a chunk at a time. ``fd``'s flags are as they were on return. A direct
    write that fails leaves the rest to the page cache.
    """
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError:  # EINVAL: a filesystem without direct I/O (some FUSE ones)
        return view
    try:
        stage: memoryview | None = None
        if len(view) >= _DIRECT_ALIGN and _address(view) % _DIRECT_ALIGN:
            stage = getattr(_direct_stage, "buffer", None)
            if stage is None:
                # private: a forked child writing its own entries gets its own copy, not these pages
                mapping = mmap.mmap(-1, _DIRECT_STAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
                stage = _direct_stage.buffer = memoryview(mapping)
        while len(view) >= _DIRECT_ALIGN:
            size = len(view) - len(view) % _DIRECT_ALIGN
            if stage is None:
                chunk = view[:size]
            else:
                size = min(size, len(stage))
                stage[:size] = view[:size]
                chunk = stage[:size]
            written = os.write(fd, chunk)
            view = view[written:]
            if written % _DIRECT_ALIGN:
                break  # a short write off the alignment: the rest goes through the page cache
    except OSError:
        # EINVAL: a stricter alignment than 4 KiB; others: memory or a file direct I/O cannot take. A
        # failed write wrote nothing: the rest goes through the page cache, where a real error (a full
        # disk) fails the entry as any write error does
        pass
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return view


# --------------------------------------------------------------------------- the store interface


_FSYNC_THREADS = 16
_fsync_pool: ThreadPoolExecutor | None = None
_fsync_pool_pid = 0
_fsync_pool_lock = threading.Lock()


def _sync_pool() -> ThreadPoolExecutor:
    global _fsync_pool, _fsync_pool_pid
    if _fsync_pool is None or _fsync_pool_pid != os.getpid():  # a forked child has none of the pool's threads
        with _fsync_pool_lock:
            if _fsync_pool is None or _fsync_pool_pid != os.getpid():
                _fsync_pool = ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="stepskip-fsync")
                _fsync_pool_pid = os.getpid()
    return _fsync_pool


class _Syncs:
    """``fsync`` calls started side by side on a small pool, each fd closed once synced.

    Each file is synced by its own ``fsync``, exactly as one after another would: issued together,
    the filesystem commits them in one journal transaction instead of one each (ext4 and xfs group
    concurrent commits), which is most of the time a small entry costs. Started while the next
    entries are still being written, they also overlap that work.
    """

    def __init__(self) -> None:
        self._futures: list[Any] = []
        self._failed: dict[Any, OSError] = {}
        self._lock = threading.Lock()

    def _sync(self, key: Any, fd: int, close: bool) -> None:
        try:
            try:
                os.fsync(fd)
            finally:
                if close:
                    os.close(fd)  # NFS reports a deferred write error here: as much a failed sync
        except OSError as err:
            with self._lock:
                self._failed.setdefault(key, err)

    def start(self, key: Any, fds: Iterable[int], close: bool = True, pooled: bool = False) -> None:
        """Sync ``fds`` (closing them after, with ``close``); a failure is reported under ``key``.

        A lone fd is synced right here unless ``pooled`` (more are coming) or syncs are running.
        """
        fds = list(fds)
        taken = 0
        if len(fds) > 1 or self._futures or pooled:
            pool = _sync_pool()
            try:
                for fd in fds:
                    self._futures.append(pool.submit(self._sync, key, fd, close))
                    taken += 1
            except RuntimeError:  # the interpreter is shutting down (dumps pending at exit): sync the rest here
                pass
        for fd in fds[taken:]:
            self._sync(key, fd, close)

    def start_whole(self, fd: int, held: dict[int, list[int]]) -> Any:
        """``syncfs`` the filesystem of ``fd`` on the pool, then close the ``held`` fds (entry -> fds); should it
        fail, each of those fds gets its own ``fsync`` there instead. The future's result: whether the
        ``syncfs`` succeeded."""
        def run() -> bool:
            if _SYNCFS is not None and _SYNCFS(fd) == 0:
                for key, fds in held.items():
                    self.close(key, fds)
                return True
            for key, fds in held.items():
                for one in fds:
                    self._sync(key, one, True)
            return False

        try:
            future = _sync_pool().submit(run)
        except RuntimeError:  # the interpreter is shutting down (dumps pending at exit): sync here
            future = Future()
            future.set_result(run())
        self._futures.append(future)
        return future

    def close(self, key: Any, fds: Iterable[int]) -> None:
        """Close fds already made durable; a close error is reported under ``key`` as a failed sync would be."""
        for fd in fds:
            try:
                os.close(fd)
            except OSError as err:  # NFS reports a deferred write error here
                with self._lock:
                    self._failed.setdefault(key, err)

    def wait(self) -> dict[Any, OSError]:
        """Wait for every sync started; the first error of each key that had one."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
        return dict(self._failed)


def _fsync_all(fds: list[int]) -> dict[int, OSError]:
    """``fsync`` every fd side by side (see :class:`_Syncs`); the errors by fd (empty when all are durable)."""
    syncs = _Syncs()
    for fd in fds:
        syncs.start(fd, [fd], close=False, pooled=len(fds) > 1)
    return syncs.wait()


def _fsync_dir(fd: int) -> None:
    """Make a directory's new names durable; best effort (some filesystems refuse to sync a directory)."""
    try:
        os.fsync(fd)
    except OSError:
        pass


def _makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, each created directory's parent synced after its ``mkdir``."""
    parent = os.path.dirname(path.rstrip("/")) or "/"
    if parent != path and not os.path.isdir(parent):
        _makedirs_durable(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _fsync_dir(fd)
    finally:
        os.close(fd)


#: A directory's mtime this much older than a listing of it proves the listing complete: a later
#: change (on a filesystem whose timestamps are coarse, too) gives the directory another mtime.
SETTLED_NS = 2_000_000_000


def settled(version: tuple[int, ...] | None, listed_at_ns: int) -> bool:
    """Whether a listing taken at ``listed_at_ns`` (``time.time_ns()``) of a directory at ``version``
    (:meth:`LocalStore.dir_version`) may be reused for as long as the version stays the same (the
    caller also re-lists after its own writes and at least every so often: see
    :meth:`CachedRole.listed_steps`)."""
    return version is not None and listed_at_ns - version[2] >= SETTLED_NS


class _EntryStore:
    """What every store offers; entry logic shared by the stores lives in the module functions above."""

    #: Whether :meth:`publish_dir` can publish a directory of entries atomically (local stores).
    publishes_dirs = False

    def dir_version(self, path: str) -> tuple[int, ...] | None:
        """A value that changes whenever the names in directory ``path`` change; None where the store has
        none (object stores): listings are then never reused."""
        return None

    def forget_listings(self, path: str) -> None:
        """Drop any listing cached for ``path`` and below, so the next listing shows what others wrote since
        (object stores' clients cache listings; local directories are always listed afresh)."""

    def publish_dir(self, staging: str, path: str) -> None:
        """Publish a staged directory of entries as ``path`` at once (only where ``publishes_dirs``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot publish a directory atomically")

    def probe(self, path: str, legacy_files: Iterable[str] = (), keep: int = 0) -> Probe:
        """Classify the entry at ``path`` as missing, present or damaged without reading its data.

        An entry written by verl itself has a ``meta.json`` without a file list; it is present when
        one of ``legacy_files`` (verl's data file names) exists beside it. Never raises.

        ``keep``: a present entry whose listed files hold at most this many bytes together is read
        whole instead (local stores), its files kept in the probe (:attr:`Probe.files`), so that a
        :meth:`read_entry` given the probe needs no second look at the disk (the async role's
        one-sample hits).
        """
        return self._look(path, tuple(legacy_files), None, verify=False, read=False, keep=keep)[0]

    def read_entry(self, path: str, legacy_files: Iterable[str] = (),
                   names: Iterable[str] | Callable[[dict[str, Any]], Iterable[str]] | None = None,
                   verify: bool = True, pooled: _Pooled = False,
                   probe: Probe | None = None) -> tuple[dict[str, Any], dict[str, bytes | memoryview]]:
        """Check and read one entry as one version: its ``meta.json`` and the named data files.

        Unlike :meth:`probe` followed by :meth:`read_files`, the files read are those of the
        ``meta.json`` returned even while other writers replace the entry; a read that meets a
        newer version reads that version instead.

        Args:
            path: the entry directory.
            legacy_files: verl's data file names, for entries verl wrote (no file list).
            names: the data files to read; None for every listed one (every legacy file present);
                or a function given the checked ``meta`` of the version being read that returns
                them — it may also raise (a format or fidelity refusal, say) to stop the read
                before any data is read; it is called again should a newer version be read.
            verify: check each file's checksum (sizes are always checked).
            pooled: a store on local disk may return a big file as a memoryview of recycled pages
                (:mod:`stepskip.formats.pages`), for a decoder that reads buffers (format ``safe``);
                or a function asked once ``names`` has chosen the files (it knows the format then).
            probe: a :meth:`probe` of ``path`` just taken: where the store can tell that
                ``meta.json`` is still the very file that probe parsed (local stores: the same
                directory and file, size and times), and ``verify`` is on, its ``meta`` is used
                without parsing the file again. A probe that kept the entry's files (``keep``)
                is read from them: that version, as it was when probed. Any other case, and a kept
                file that does not match its checksum, reads ``meta.json`` afresh.

        Returns:
            ``(meta, {name: bytes})`` (memoryviews among them with ``pooled``).

        Raises:
            CacheMissError: there is no entry (never written, or removed meanwhile).
            CorruptEntryError: the entry is damaged: the message says how.

        Example:
            >>> meta, files = store.read_entry(path, names=["data.json"])  # doctest: +SKIP
        """
        wanted: _Names = names if names is None or callable(names) else list(names)
        if probe is not None and probe.files is not None and probe.path == path and probe.meta \
                and probe.state is EntryState.PRESENT:
            try:
                kept = _from_kept(probe.meta, probe.files, _resolve(wanted, probe.meta), verify)
            except OSError:  # from ``names``: the read below reports it as a read of the entry always did
                kept = None
            if kept is not None:
                return probe.meta, kept
        known = probe if verify and probe is not None and probe.state is EntryState.PRESENT and probe.stamp else None
        found, files = self._look(path, tuple(legacy_files), wanted, verify, read=True, pooled=pooled, known=known)
        if found.state is EntryState.DAMAGED and known is not None:
            # the reused meta.json may be stale (rewritten in place within the timestamps' granularity):
            # damage is only what a read of meta.json itself still finds
            found, files = self._look(path, tuple(legacy_files), wanted, verify, read=True, pooled=pooled)
        if found.state is EntryState.MISSING:
            raise CacheMissError(f"{path}: no entry there (never written, or removed meanwhile)")
        if found.state is EntryState.DAMAGED:
            raise CorruptEntryError(f"{path}: {found.reason}")
        return found.meta or {}, dict(files)

    def read_files(self, path: str, meta: Mapping[str, Any], names: Iterable[str], verify: bool) -> dict[str, bytes]:
        """Read the named data files of a present entry, checking sizes and (``verify``) checksums.

        Prefer :meth:`read_entry`, which cannot mix two versions of an entry being replaced.

        Raises:
            CorruptEntryError: a file is missing, truncated or does not match its checksum, or
                ``meta`` itself is ill-typed.
        """
        reason = _files_problem(meta.get("files"))  # the names and sizes this read trusts
        if reason:
            raise CorruptEntryError(f"{path}: {reason}")
        try:
            return self._read_listed(path, meta, list(names), verify)
        except _BadFile as err:
            raise CorruptEntryError(f"{path}: {err}") from None

    def is_dir(self, path: str) -> bool:
        """True when ``path`` is a directory reached without following a symbolic link in the store."""
        raise NotImplementedError

    def list_dir(self, path: str, dirs_only: bool = False) -> list[str]:
        """Names (not paths) directly under ``path``; empty when it does not exist or is a link.

        Args:
            path: the directory to list.
            dirs_only: only real subdirectories (symbolic links to directories are left out).
        """
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Delete a file or a whole directory; a missing path is fine. A symbolic link is removed
        itself, never its target; nothing inside a removed directory is followed either.

        Raises:
            OSError: ``path`` is spelled with ``..``, lies outside the root or is the root (object
                stores, which have no links to refuse instead), or reaching it would follow a
                symbolic link below the root; nothing is deleted then.
        """
        raise NotImplementedError

    def retire_entry(self, path: str) -> bool:
        """Remove one entry so that readers see it whole or not at all; returns False when none was there.

        Locally the entry is renamed to a ``.trash-`` sibling, then deleted without following any
        link (a linked entry loses its link, its target is untouched); on object stores its
        ``meta.json`` goes first, then its objects.

        Raises:
            OSError: as :meth:`remove`.
        """
        raise NotImplementedError

    def write_entry(self, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        raise NotImplementedError

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS, tree: Tree | None = None,
                         listed: list[str] | None = None) -> list[str]:
        """Delete what interrupted writes left in the entries under ``path`` once stale (see the stores).

        Args:
            path: the directory holding the entries.
            older_than: seconds since a leftover was last written before it counts as stale.
            tree: a :meth:`scan` covering ``path``, taken by the caller (listed here otherwise).
            listed: where a store lists ``path`` itself (local directories), every name it saw there is
                appended to this list, for a caller that needs the listing too; left alone elsewhere.

        Returns:
            The paths deleted.
        """
        raise NotImplementedError

    def scan(self, path: str) -> Tree | None:
        """Every file below ``path`` in one listing, where the store lists a whole tree cheaply (object
        stores: one request per 1,000 objects); None where it does not (local directories are
        listed one by one, which costs no requests)."""
        return None

    def may_hold_leftovers(self, path: str, tree: Tree | None, older_than: float = STALE_SECONDS) -> bool:
        """False only when ``tree`` shows that :meth:`remove_leftovers` would delete nothing under ``path``."""
        return True

    def read_small(self, path: str, limit: int) -> bytes | None:
        """The bytes of one small regular file (a step manifest), or None when there is none.

        Nothing is followed through a symbolic link and never more than ``limit + 1`` bytes are read.

        Raises:
            CorruptEntryError: ``path`` is a link, a directory or a special file, is larger than
                ``limit``, or cannot be read (the message says which).
        """
        raise NotImplementedError

    def put_small(self, path: str, data: bytes) -> None:
        """Write one small file so that readers see the old bytes or the new ones, never a mix
        (a rename locally, one PUT on object stores); the last writer wins.

        Raises:
            OSError: it could not be written.
        """
        raise NotImplementedError

    def _look(self, path: str, legacy_files: tuple[str, ...], names: _Names, verify: bool,
              read: bool, pooled: _Pooled = False, known: Probe | None = None, keep: int = 0
              ) -> tuple[Probe, Mapping[str, bytes | memoryview]]:
        raise NotImplementedError

    def _read_listed(self, path: str, meta: Mapping[str, Any], names: list[str], verify: bool) -> dict[str, bytes]:
        raise NotImplementedError

    def list_items(self, path: str) -> list[DirItem]:
        """What is directly under ``path`` with kind, size and time, links reported as links (never
        followed); empty when ``path`` is not a directory reached without following a link."""
        raise NotImplementedError

    def stat_item(self, path: str) -> DirItem | None:
        """``path`` itself, not followed if it is a link; None when it does not exist."""
        raise NotImplementedError


#: Whether a read may return big files in recycled pages: a flag, or a function asked once the files are chosen.
_Pooled = bool | Callable[[], bool]

#: A data file's contents: bytes, or a memoryview of recycled pages where a read asked for them.
_Data = TypeVar("_Data", bytes, memoryview, bytes | memoryview)

#: What a read wants: names, every file (None), or a function choosing names from the version read.
_Names = list[str] | Callable[[dict[str, Any]], Iterable[str]] | None


def _resolve(names: _Names, meta: dict[str, Any]) -> list[str] | None:
    return list(names(meta)) if callable(names) else names


def _check_files(meta: Mapping[str, Any], names: list[str] | None) -> list[str]:
    """The listed files to read; raises _BadFile for a name the entry does not list."""
    listed = meta["files"]
    wanted = list(listed) if names is None else names
    for name in wanted:
        if name not in listed:
            raise _BadFile(f"{name} is not listed in {META_FILE}")
    return wanted


def _from_kept(meta: dict[str, Any], kept: Mapping[str, bytes], names: list[str] | None,
               verify: bool) -> dict[str, bytes | memoryview] | None:
    """The files ``names`` chose, from those a probe kept (every listed file, its size checked then),
    each checked against its checksum with ``verify``; None when one is not listed or does not match
    (the caller then reads the entry afresh, which tells damage from a stale look)."""
    try:
        wanted = _check_files(meta, names)
        return {name: _verified(name, kept[name], meta["files"][name], verify) for name in wanted}
    except _BadFile:
        return None


def _verified(name: str, data: _Data, info: Mapping[str, Any], verify: bool) -> _Data:
    if verify and checksum(data) != info.get("checksum"):
        raise _BadFile(f"{name} does not match its checksum in {META_FILE}")
    return data


# --------------------------------------------------------------------------- local filesystem


def _local_path(path: str) -> str | None:
    """The filesystem path of a local dump dir or entry path, or None for an object-store URL."""
    for prefix in ("file://", "local://"):
        if path.startswith(prefix):
            return path[len(prefix):] or "/"
    return None if "://" in path else path


def _read_fd(fd: int, size: int, pooled: bool = False) -> bytes | memoryview:
    """Exactly ``size`` bytes from ``fd``: one allocation, never a byte past ``size``.

    With ``pooled``, a big file is read into recycled pages (:mod:`stepskip.formats.pages`) and
    comes back as a memoryview of them: a fresh buffer of its size would fault in every page.
    """
    if size == 0:
        return b""
    if pooled:
        from stepskip.formats.pages import POOL  # torch's and numpy's: only where a decoder asked for it

        pooled = size >= POOL.min_bytes
    if pooled:
        view = POOL.array((size,), "uint8").data  # the memoryview holds the array, and so the pages
        got = 0
        while got < size:
            count = os.readv(fd, [view[got:]])
            if not count:
                return view[:got]
            got += count
        return view
    data = os.read(fd, size)
    if len(data) == size or not data:
        return data
    chunks = [data]
    got = len(data)
    while got < size:
        chunk = os.read(fd, size - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


@overload
def _read_at(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
             pooled: Literal[False] = False) -> bytes: ...
@overload
def _read_at(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
             pooled: bool = False) -> bytes | memoryview: ...
def _read_at(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
             pooled: bool = False) -> bytes | memoryview:
    """Read a regular file of an entry directory without following links or reading past its size.

    Raises:
        FileNotFoundError: no such file (damage, or a concurrent removal: the caller tells).
        _BadFile: a link, a FIFO, a device, a directory, the wrong size, over ``limit``.
    """
    return _read_at_stat(dir_fd, name, expected, limit, pooled)[0]


def _read_at_stat(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
                  pooled: bool = False) -> tuple[bytes | memoryview, os.stat_result]:
    """:func:`_read_at`, with the status of the file read.

    Raises:
        FileNotFoundError: no such file (damage, or a concurrent removal: the caller tells).
        _BadFile: a link, a FIFO, a device, a directory, the wrong size, over ``limit``.
    """
    try:
        fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _BadFile(f"{name} is a symbolic link (links are not followed inside a cache)") from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name) from None
        raise _BadFile(f"cannot open {name}: {err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _BadFile(f"{name} is not a regular file")
        if expected is not None and st.st_size != expected:
            raise _BadFile(f"{name} has {st.st_size} bytes, {META_FILE} says {expected}")
        if limit is not None and st.st_size > limit:
            raise _BadFile(f"{name} is {st.st_size} bytes, more than the {limit} it may have")
        try:
            data = _read_fd(fd, st.st_size, pooled)
        except MemoryError:
            raise _BadFile(f"{name} ({st.st_size} bytes) does not fit in memory") from None
        except OSError as err:
            raise _BadFile(f"cannot read {name}: {err}") from None
        if len(data) != st.st_size:
            raise _BadFile(f"{name} ended after {len(data)} of its {st.st_size} bytes")
        return data, st
    finally:
        os.close(fd)


def _meta_stamp(dir_fd: int, st: os.stat_result) -> tuple[int, ...]:
    """What identifies one version of an entry's ``meta.json``: its directory and the file itself, with
    its size and times. A writer replaces an entry by renaming a new directory (a new inode) into place."""
    directory = os.fstat(dir_fd)
    return (directory.st_dev, directory.st_ino, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _known_meta(dir_fd: int, known: Probe) -> dict[str, Any] | None:
    """``known.meta`` when ``meta.json`` in ``dir_fd`` is still the file ``known`` parsed, else None.

    Only for a probe of an entry that lists its files (the reader then checks every file it reads
    against that listing: its size always, its checksum because reuse requires ``verify``).
    """
    st = _lstat_at(dir_fd, META_FILE)
    if st is None or not stat.S_ISREG(st.st_mode) or known.meta is None or known.meta.get("files") is None:
        return None
    return known.meta if _meta_stamp(dir_fd, st) == known.stamp else None


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _regular_size(dir_fd: int, name: str, expected: int) -> None:
    """Check a listed file by its metadata only; raises FileNotFoundError / _BadFile."""
    st = _lstat_at(dir_fd, name)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    if stat.S_ISLNK(st.st_mode):
        raise _BadFile(f"{name} is a symbolic link (links are not followed inside a cache)")
    if not stat.S_ISREG(st.st_mode):
        raise _BadFile(f"{name} is not a regular file")
    if st.st_size != expected:
        raise _BadFile(f"{name} has {st.st_size} bytes, {META_FILE} says {expected}")


def _remove_at(dir_fd: int, name: str) -> None:
    """Delete ``name`` in ``dir_fd``: a link is unlinked (its target untouched), a directory
    removed without following any link inside it."""
    st = _lstat_at(dir_fd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        # fd-based (shutil.rmtree(dir_fd=) exists on Linux since 3.3; typeshed omits it): never follows links
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)  # type: ignore[call-arg]
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


class _NotFollowed(NotADirectoryError):
    """A component of a path is a link or a file: the walk stops there."""

    def __init__(self, message: str, path: str, last: bool) -> None:
        super().__init__(errno.ENOTDIR, message, path)
        self.message = message
        self.last = last


class LocalStore(_EntryStore):
    """Entries on a local (or locally mounted shared) filesystem, published by directory rename.

    Every path below ``root`` (the dump dir, whose own location is trusted configuration) is walked
    one component at a time without following symbolic links; files and subdirectories of an
    entry are opened relative to the entry's opened directory, so a read cannot be pointed outside
    the dump dir or mix two versions of an entry.

    Args:
        root: the dump dir. Without one, only an entry's own directory and files are opened
            without following links (its parents are followed).
    """

    def __init__(self, root: str | None = None) -> None:
        self.root = self._abs(root) if root is not None else None

    @staticmethod
    def _abs(path: str) -> str:
        local = _local_path(path)
        return os.path.abspath(os.path.expanduser(local if local is not None else path))

    # ------------------------------------------------------------------ walking without links

    def _split(self, path: str) -> tuple[str, list[str]]:
        full = self._abs(path)
        root = self.root
        if root is not None and (full == root or full.startswith(root.rstrip("/") + "/")):
            return root, [p for p in full[len(root):].split("/") if p]
        parent, name = os.path.split(full)
        return parent or "/", [name] if name else []

    def _open_dir(self, path: str, create: bool = False) -> int:
        """An fd of the directory ``path``, reached without following links below the base.

        With ``create``, each missing directory is made and its name synced into its parent, except
        a hidden temporary as the last component (a V1 step's staging directory): :meth:`publish_dir`
        syncs it and the parent when it publishes it, and until then a crash may as well lose it.

        Raises:
            FileNotFoundError: a component does not exist (and ``create`` is False).
            _NotFollowed: a component is a symbolic link or not a directory.
        """
        base, parts = self._split(path)
        if create and not os.path.isdir(base):
            _makedirs_durable(base)
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        if len(parts) > 1 and not create:  # the common case in one system call; the walk below explains failures
            try:
                child = _openat2_dir(fd, "/".join(parts))
            except FileNotFoundError:
                os.close(fd)
                raise
            if child is not None:
                os.close(fd)
                return child
        for i, part in enumerate(parts):
            try:
                try:
                    child = os.open(part, _O_DIR, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(part, dir_fd=fd)
                    except FileExistsError:
                        pass
                    else:
                        if not (i == len(parts) - 1 and part.startswith(TMP_PREFIX)):
                            _fsync_dir(fd)  # the new name itself, not only what goes in it, survives a crash
                    child = os.open(part, _O_DIR, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ENOTDIR, errno.ELOOP):
                    where = "/".join([base.rstrip("/"), *parts[: i + 1]])
                    st = _lstat_at(fd, part)
                    link = st is not None and stat.S_ISLNK(st.st_mode)
                    os.close(fd)
                    what = ("is a symbolic link; stepskip does not follow links inside the dump dir "
                            "(point dump_dir at the real directory, or replace the link by a directory)"
                            if link else "is a file, not a directory")
                    raise _NotFollowed(f"{where} {what}", where, last=i == len(parts) - 1) from None
                os.close(fd)
                raise
            os.close(fd)
            fd = child
        return fd

    def _same_dir(self, dir_fd: int, path: str) -> bool:
        """True when ``path`` still names the directory open as ``dir_fd`` (not replaced or removed)."""
        try:
            fd = self._open_dir(path)
        except OSError:
            return False
        try:
            a, b = os.fstat(dir_fd), os.fstat(fd)
            return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        finally:
            os.close(fd)

    def _confined(self, path: str) -> tuple[int, str]:
        """``(fd of the parent, name)`` for deleting ``path``, its parent reached without following links
        below the root (the final component is never followed by the callers); refuses ``..``."""
        if ".." in path.split("/"):
            raise OSError(errno.EPERM, "refusing to delete a path spelled with '..'", path)
        parent, name = os.path.split(self._abs(path))
        if not name:
            raise OSError(errno.EPERM, "refusing to delete the filesystem root", path)
        return self._open_dir(parent or "/"), name

    # ------------------------------------------------------------------ reading

    def is_dir(self, path: str) -> bool:
        try:
            os.close(self._open_dir(path))
        except OSError:
            return False
        return True

    def list_dir(self, path: str, dirs_only: bool = False) -> list[str]:
        try:
            fd = self._open_dir(path)
        except OSError:
            return []
        try:
            with os.scandir(fd) as it:
                return [e.name for e in it if not dirs_only or e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        finally:
            os.close(fd)

    def dir_version(self, path: str) -> tuple[int, ...] | None:
        """``(device, inode, mtime in ns, ctime in ns)`` of the directory ``path`` (reached without
        following links): it changes whenever a name is added, removed or renamed there, on filesystems
        that keep directory times. None when it is not a directory.

        The ctime is there because tools that restore times (``rsync -a``, ``touch -r``) can set the
        mtime back but not the ctime. A listing taken when the mtime was already at least
        :data:`SETTLED_NS` old may be reused while the version does not change (see :func:`settled`);
        filesystems with fixed directory times (some FUSE mounts) are why callers re-list anyway.
        """
        try:
            fd = self._open_dir(path)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns

    def _read(self, path: str) -> bytes:
        """One whole regular file (no links followed), e.g. for tests and tools."""
        parent, name = os.path.split(self._abs(path))
        fd = self._open_dir(parent)
        try:
            return _read_at(fd, name, None)
        except _BadFile as err:
            raise OSError(errno.EINVAL, str(err), path) from None
        finally:
            os.close(fd)

    def _look(self, path: str, legacy_files: tuple[str, ...], names: _Names, verify: bool,
              read: bool, pooled: _Pooled = False, known: Probe | None = None, keep: int = 0
              ) -> tuple[Probe, Mapping[str, bytes | memoryview]]:
        for _ in range(_MAX_ATTEMPTS):
            try:
                dir_fd = self._open_dir(path)
            except FileNotFoundError:
                return Probe(EntryState.MISSING), {}
            except _NotFollowed as err:
                if err.last:
                    return Probe(EntryState.DAMAGED, reason=err.message), {}
                return Probe(EntryState.MISSING), {}  # no entry can exist below a file or a link
            except NotADirectoryError:
                return Probe(EntryState.MISSING), {}  # the dump dir itself lies below a file
            except OSError as err:
                return Probe(EntryState.DAMAGED, reason=f"cannot open {path}: {err}"), {}
            try:
                return self._look_at(dir_fd, path, legacy_files, names, verify, read, pooled, known, keep)
            except _Raced:
                known = None  # whatever that probe saw was replaced: read meta.json itself
                continue
            except OSError as err:  # e.g. a permission denied on one file: never an exception from a probe
                return Probe(EntryState.DAMAGED, reason=f"cannot read {path}: {err}"), {}
            finally:
                os.close(dir_fd)
        return Probe(EntryState.DAMAGED, reason=f"kept changing while read ({_MAX_ATTEMPTS} attempts)"), {}

    def _look_at(self, dir_fd: int, path: str, legacy_files: tuple[str, ...], names: _Names,
                 verify: bool, read: bool, pooled: _Pooled = False, known: Probe | None = None, keep: int = 0
                 ) -> tuple[Probe, Mapping[str, bytes | memoryview]]:
        meta = _known_meta(dir_fd, known) if known is not None else None
        stamp = known.stamp if meta is not None and known is not None else None
        if meta is None:
            try:
                raw, st = _read_at_stat(dir_fd, META_FILE, None, META_MAX_BYTES)
            except FileNotFoundError:
                if not self._same_dir(dir_fd, path):
                    raise _Raced() from None
                return Probe(EntryState.MISSING), {}
            except _BadFile as err:
                return Probe(EntryState.DAMAGED, reason=str(err)), {}
            meta, reason = _parse_meta(cast(bytes, raw))  # not pooled: bytes
            if meta is None:
                return Probe(EntryState.DAMAGED, reason=reason), {}
            stamp = _meta_stamp(dir_fd, st)
        names = _resolve(names, meta) if read else None
        try:
            if meta.get("files") is None:
                return self._look_legacy(dir_fd, path, meta, legacy_files, names, read)
            wanted = _check_files(meta, names) if read else []
            listed = meta["files"]
            if not read and keep and 0 < sum(info["bytes"] for info in listed.values()) <= keep:
                # a small entry read whole, through this directory: one version, no second look
                files = {name: _read_at(dir_fd, _object(name, info), info["bytes"]) for name, info in listed.items()}
                return Probe(EntryState.PRESENT, meta, stamp=stamp, files=files, path=path), {}
            for name, info in listed.items():
                if name not in wanted:
                    _regular_size(dir_fd, _object(name, info), info["bytes"])
            out: dict[str, bytes | memoryview] = {}
            into_pages = pooled() if callable(pooled) else pooled
            for name in wanted:
                info = listed[name]
                data = _read_at(dir_fd, _object(name, info), info["bytes"], pooled=into_pages)
                out[name] = _verified(name, data, info, verify)
            return Probe(EntryState.PRESENT, meta, stamp=stamp), out
        except (FileNotFoundError, _BadFile) as err:
            if not self._same_dir(dir_fd, path):
                raise _Raced() from None  # replaced or removed while we read: look again
            if isinstance(err, FileNotFoundError):
                return Probe(EntryState.DAMAGED, meta, reason=f"missing data file {err.filename}"), {}
            return Probe(EntryState.DAMAGED, meta, reason=str(err)), {}

    def _look_legacy(self, dir_fd: int, path: str, meta: dict[str, Any], legacy_files: tuple[str, ...],
                     names: list[str] | None, read: bool) -> tuple[Probe, dict[str, bytes]]:
        present = [n for n in legacy_files if valid_name(n) and (st := _lstat_at(dir_fd, n)) is not None
                   and stat.S_ISREG(st.st_mode)]
        if not present:
            if not self._same_dir(dir_fd, path):
                raise _Raced()
            return Probe(EntryState.DAMAGED, meta, reason="no data file beside meta.json"), {}
        out = {}
        if read:
            for name in (present if names is None else names):
                if not valid_name(name):
                    raise _BadFile(f"{name!r} is not a file name inside the entry")
                try:
                    out[name] = _read_at(dir_fd, name, None)
                except FileNotFoundError:
                    continue  # verl's entries hold one of their formats' files, not all of them
        return Probe(EntryState.PRESENT, meta), out

    def _read_listed(self, path: str, meta: Mapping[str, Any], names: list[str], verify: bool) -> dict[str, bytes]:
        try:
            dir_fd = self._open_dir(path)
        except OSError as err:
            raise CorruptEntryError(f"{path} cannot be read: {err}") from err
        try:
            listed = meta.get("files")
            out: dict[str, bytes] = {}
            for name in names:
                if listed is None:
                    if not valid_name(name):
                        raise _BadFile(f"{name!r} is not a file name inside the entry")
                    try:
                        out[name] = _read_at(dir_fd, name, None)
                    except FileNotFoundError:
                        continue
                    continue
                info = listed.get(name)
                if info is None:
                    raise _BadFile(f"{name} is not listed in {META_FILE}")
                try:
                    data = _read_at(dir_fd, _object(name, info), info["bytes"])
                except FileNotFoundError:
                    raise _BadFile(f"{path}/{name} is missing") from None
                out[name] = _verified(name, data, info, verify)
            return out
        finally:
            os.close(dir_fd)

    def read_small(self, path: str, limit: int) -> bytes | None:
        parent, name = os.path.split(self._abs(path))
        try:
            fd = self._open_dir(parent)
        except OSError:  # no parent, or one reached through a link or a file: nothing to read there
            return None
        try:
            return _read_at(fd, name, None, limit)
        except FileNotFoundError:
            return None
        except _BadFile as err:
            raise CorruptEntryError(f"{path}: {err}") from None
        finally:
            os.close(fd)

    def _entry_place(self, path: str, files: Mapping[str, FileBytes]) -> tuple[str, str]:
        """The parent directory and name of what is written at ``path`` (an entry or a small file),
        each of ``files`` checked to be one plain file name other than the metadata file's.

        Raises:
            OSError: ``EINVAL``, naming the bad name.
        """
        for file_name in files:
            if not valid_name(file_name) or file_name == META_FILE:
                raise OSError(errno.EINVAL, f"cannot store a data file named {file_name!r}: "
                                            "it must be one file name (no '/', '..', NUL)", path)
        parent, name = os.path.split(self._abs(path))
        if not valid_name(name):
            raise OSError(errno.EINVAL, f"{name!r} cannot name an entry", path)
        return parent, name

    def put_small(self, path: str, data: bytes) -> None:
        parent, name = self._entry_place(path, {})
        parent_fd = self._open_dir(parent, create=True)
        tmp = f"{TMP_PREFIX}{name}-{_token()}"
        try:
            self._write_file(parent_fd, tmp, data)
            os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            _fsync_dir(parent_fd)  # the rename itself durable, as for an entry
        finally:
            _remove_at(parent_fd, tmp)  # gone already when renamed
            os.close(parent_fd)

    # ------------------------------------------------------------------ writing

    def write_entry(self, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        """Publish an entry atomically; returns the bytes written (0 if another writer won and
        ``overwrite`` is False).

        Raises:
            OSError: the entry could not be written (a bad file name, a link in the way, a full
                disk ...); nothing partial is left behind.
        """
        parent, name = self._entry_place(path, files)
        parent_fd = self._open_dir(parent, create=True)
        tmp = f"{TMP_PREFIX}{name}-{_token()}"
        try:
            os.mkdir(tmp, dir_fd=parent_fd)
            try:
                fds = [os.open(tmp, _O_DIR, dir_fd=parent_fd)]
                try:
                    total = self._write_files(fds[0], files, meta, fds)
                    failed = _fsync_all(fds)  # every file and the directory, synced side by side
                    if failed:
                        raise next(iter(failed.values()))
                finally:
                    for fd in fds:
                        os.close(fd)
                if not self._publish(parent_fd, tmp, name, path, overwrite):
                    return 0
                _fsync_dir(parent_fd)
                return total
            finally:
                _remove_at(parent_fd, tmp)  # gone already when published
        finally:
            os.close(parent_fd)

    def write_entries(self, entries: Iterable[tuple[str, Mapping[str, FileBytes], Mapping[str, Any]]]
                      ) -> list[int | Exception]:
        """Publish several entries with the fsyncs batched, not the guarantees (many small entries).

        Every file of every entry is written, then all are synced, then each entry is published by
        its own rename, then each parent directory is synced once: each entry is durable before it
        becomes visible and is published whole, as with :meth:`write_entry`, for a fraction of the
        system calls when entries are small (the fully async role writes one per sample).

        Where Linux's ``syncfs`` reports writeback errors (5.8 and later), a filesystem holding at
        least :data:`SYNCFS_MIN_ENTRIES` entries of the batch is synced by one ``syncfs`` instead of
        one ``fsync`` per file and directory (four per entry of format ``safe``): every file written
        before it is durable when it returns 0, as after each file's own ``fsync``. A long batch is
        synced every :data:`SYNCFS_CHUNK_ENTRIES` entries or more as it is staged (creating files slows
        down the longer a filesystem goes unsynced), each ``syncfs`` on the sync pool while the next
        entries are staged, one at a time; after one fails, the rest of the batch is synced file by
        file. The renames still wait for the whole batch. Should it fail,
        those entries' files are synced one by one, so a failure still costs only the entries it
        hit. (``syncfs`` also writes back what other programs left dirty on that filesystem: it is
        used only while the system holds at most :data:`SYNCFS_MAX_DIRTY_BYTES` dirty, and only on the
        filesystems of :data:`SYNCFS_FILESYSTEMS`.)

        Returns:
            Per entry, in order: the bytes written, or the exception that kept it from being written
            (nothing partial of it is left behind); one entry's failure does not stop the others.
        """
        staged: list[tuple[int, str, str, str, int] | Exception] = []
        parents: dict[str, int] = {}
        syncs = _Syncs()
        published: set[int] = set()
        held: dict[int, list[int]] = {}  # fds left for one syncfs of their filesystem
        running: Any = None  # the syncfs of earlier entries, running while the next ones are staged
        whole = _SYNCFS is not None
        try:
            for i, (path, files, meta) in enumerate(entries):
                try:
                    parent_fd, tmp, name, path, total, fds = self._stage(path, files, meta, parents)
                except Exception as err:  # reported for this entry alone
                    staged.append(err)
                    continue
                staged.append((parent_fd, tmp, name, path, total))
                if not whole:  # synced (and closed) side by side while the next entries are written
                    syncs.start(i, fds)
                    continue
                held[i] = fds
                if len(held) >= SYNCFS_CHUNK_ENTRIES and (running is None or running.done()):
                    # a failed syncfs may have taken the error of a file written while it ran: trust none after it
                    whole = running is None or running.result()
                    running = self._sync_held(held, staged, syncs, whole, background=True)
            if running is not None and not running.result():
                whole = False
            self._sync_held(held, staged, syncs, whole)
            failed = syncs.wait()  # every file and directory of every entry: then the renames
            results: list[int | Exception] = []
            for i, item in enumerate(staged):
                if isinstance(item, Exception):
                    results.append(item)
                    continue
                parent_fd, tmp, name, path, total = item
                try:
                    if i in failed:
                        raise failed[i]
                    self._publish(parent_fd, tmp, name, path, True)
                    published.add(i)
                    results.append(total)
                except Exception as err:  # reported for this entry alone, as when staging
                    _remove_at(parent_fd, tmp)
                    results.append(err)
            _fsync_all(list(set(parents.values())))  # the renames: best effort, as in write_entry
            return results
        finally:
            for fds in held.values():  # ``entries`` raised before they were synced
                syncs.close(None, fds)
            syncs.wait()  # every fd closed, also when ``entries`` itself raised
            for i, item in enumerate(staged):
                if not isinstance(item, Exception) and i not in published:
                    _remove_at(item[0], item[1])  # nothing partial stays behind (gone already when published)
            for fd in parents.values():
                os.close(fd)

    @staticmethod
    def _sync_held(held: dict[int, list[int]], staged: list[Any], syncs: _Syncs, whole: bool = True,
                   background: bool = False) -> Any:
        """Make the ``held`` fds of staged entries durable: one ``syncfs`` per filesystem holding at
        least :data:`SYNCFS_MIN_ENTRIES` of them (each entry's fds then closed), else, and should the
        ``syncfs`` fail, an ``fsync`` per fd; each fd leaves ``held`` once handed over. ``whole``
        false: an ``fsync`` per fd.

        With ``background``, when every held entry is on one filesystem, its ``syncfs`` runs on the
        sync pool (registered with ``syncs``) and its future is returned: the caller stages the next
        entries meanwhile and starts no other ``syncfs`` before this one is done. Otherwise None,
        everything handed over as without it.
        """
        by_device: dict[int, list[int]] = {}
        devices: dict[int, int] = {}
        whole = whole and _syncfs_pays()
        for i in held:
            parent_fd = staged[i][0]
            if parent_fd not in devices:
                devices[parent_fd] = os.fstat(parent_fd).st_dev  # the entry's directory is made in its parent
            by_device.setdefault(devices[parent_fd], []).append(i)
        for device, keys in by_device.items():
            # the parent was opened before any file of the batch was written there: its syncfs reports any
            # writeback error since (the kernel samples the filesystem's error state when a file is opened)
            usable = whole and len(keys) >= SYNCFS_MIN_ENTRIES and _fs_type(device) in SYNCFS_FILESYSTEMS
            if usable and background and len(by_device) == 1:
                return syncs.start_whole(staged[keys[0]][0], {i: held.pop(i) for i in keys})
            if usable and _SYNCFS is not None and _SYNCFS(staged[keys[0]][0]) == 0:
                for i in keys:
                    syncs.close(i, held.pop(i))
                continue
            for i in keys:
                syncs.start(i, held.pop(i), pooled=True)
        return None

    def _stage(self, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
               parents: dict[str, int]) -> tuple[int, str, str, str, int, list[int]]:
        """Write an entry's files into its temporary directory, unsynced; the open fds to sync."""
        parent, name = self._entry_place(path, files)
        if parent not in parents:
            parents[parent] = self._open_dir(parent, create=True)
        parent_fd = parents[parent]
        tmp = f"{TMP_PREFIX}{name}-{_token()}"
        os.mkdir(tmp, dir_fd=parent_fd)
        fds: list[int] = []
        try:
            tmp_fd = os.open(tmp, _O_DIR, dir_fd=parent_fd)
            try:
                total = self._write_files(tmp_fd, files, meta, fds)
            except BaseException:
                os.close(tmp_fd)
                raise
            fds.append(tmp_fd)
            return parent_fd, tmp, name, path, total, fds
        except BaseException:
            for fd in fds:
                os.close(fd)
            _remove_at(parent_fd, tmp)
            raise

    @classmethod
    def _write_files(cls, dir_fd: int, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                     fds: list[int]) -> int:
        """Create an entry's files and its ``meta.json`` (their sizes and checksums listed) in ``dir_fd``,
        unsynced, each fd appended to ``fds`` once open; the bytes written."""
        listing: dict[str, dict[str, Any]] = {}
        total = 0
        for file_name, data in files.items():
            data = _contiguous(data)  # the bytes written and checksummed are the same ones
            fds.append(cls._write_unsynced(dir_fd, file_name, data))
            size = _nbytes(data)
            listing[file_name] = {"bytes": size, "checksum": checksum(data)}
            total += size
        meta_bytes = _meta_bytes(meta, listing)
        fds.append(cls._write_unsynced(dir_fd, META_FILE, meta_bytes))
        return total + len(meta_bytes)

    @classmethod
    def _write_file(cls, dir_fd: int, name: str, data: bytes) -> None:
        """Create ``name`` in ``dir_fd`` holding ``data``, synced and closed."""
        fd = cls._write_unsynced(dir_fd, name, data)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _write_unsynced(dir_fd: int, name: str, data: FileBytes) -> int:
        """Create ``name`` in ``dir_fd`` holding ``data``; the open fd, for the caller to sync and close."""
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                     dir_fd=dir_fd)
        try:
            view = memoryview(data).cast("B")
            if _O_DIRECT and DIRECT_WRITE_BYTES and len(view) >= DIRECT_WRITE_BYTES:
                view = _write_direct(fd, view)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _publish(parent_fd: int, tmp: str, name: str, path: str, overwrite: bool) -> bool:
        for _ in range(16):
            try:
                os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
                return True
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
                    raise
            if not overwrite:
                return False
            if _exchange(parent_fd, tmp, name):  # readers see the old entry, then the new one, never a gap
                _remove_at(parent_fd, tmp)  # the old entry (or a link or file that stood there)
                return True
            trash = f"{TRASH_PREFIX}{name}-{_token()}"
            try:
                os.rename(name, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            except FileNotFoundError:
                continue  # another writer moved it away first; try again
            _remove_at(parent_fd, trash)
        raise OSError(errno.EBUSY, f"could not publish {path}: too many concurrent writers")

    #: Whole directories of entries can be published at once (:meth:`publish_dir`).
    publishes_dirs = True

    def publish_dir(self, staging: str, path: str) -> None:
        """Publish the directory ``staging`` (a ``.tmp-`` sibling of ``path`` holding complete entries)
        as ``path`` in one step, replacing what was there: readers see the old directory or the new
        one, never a mix (a V1 step's inner entries, all written by one run).

        Raises:
            OSError: ``staging`` is not a hidden temporary beside ``path``, or cannot be published.
        """
        parent, name = os.path.split(self._abs(path))
        staging_parent, tmp = os.path.split(self._abs(staging))
        if staging_parent != parent or not tmp.startswith(TMP_PREFIX) or not valid_name(name):
            raise OSError(errno.EINVAL, f"{staging} is not a {TMP_PREFIX} directory beside {path}", path)
        parent_fd = self._open_dir(parent)
        try:
            tmp_fd = os.open(tmp, _O_DIR, dir_fd=parent_fd)
            try:
                os.fsync(tmp_fd)  # the entries' own renames into it are durable before it is published
            finally:
                os.close(tmp_fd)
            self._publish(parent_fd, tmp, name, path, overwrite=True)
            _fsync_dir(parent_fd)
        finally:
            os.close(parent_fd)

    # ------------------------------------------------------------------ deleting

    def remove(self, path: str) -> None:
        try:
            parent_fd, name = self._confined(path)
        except FileNotFoundError:
            return
        try:
            st = _lstat_at(parent_fd, name)
            if st is not None and stat.S_ISDIR(st.st_mode) and not name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                self._retire_at(parent_fd, name)
            else:
                _remove_at(parent_fd, name)
        finally:
            os.close(parent_fd)

    def retire_entry(self, path: str) -> bool:
        try:
            parent_fd, name = self._confined(path)
        except FileNotFoundError:
            return False
        try:
            if _lstat_at(parent_fd, name) is None:
                return False
            self._retire_at(parent_fd, name)
            return True
        finally:
            os.close(parent_fd)

    @staticmethod
    def _retire_at(parent_fd: int, name: str) -> None:
        """Rename to a ``.trash-`` sibling (readers see the entry whole or gone), then delete that."""
        trash = f"{TRASH_PREFIX}{name}-{_token()}"
        try:
            os.rename(name, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except FileNotFoundError:
            return
        _remove_at(parent_fd, trash)

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS, tree: Tree | None = None,
                         listed: list[str] | None = None) -> list[str]:
        """Delete temporaries and trash under ``path`` (one level) older than ``older_than`` seconds
        (one listing, whose names go to ``listed`` when given, and a ``stat`` of each temporary;
        ``tree`` is not used)."""
        removed: list[str] = []
        try:
            dir_fd = self._open_dir(path)
        except OSError:
            return removed
        try:
            now = time.time()
            with os.scandir(dir_fd) as it:
                seen = [e.name for e in it]
            if listed is not None:
                listed.extend(seen)
            for name in [n for n in seen if n.startswith((TMP_PREFIX, TRASH_PREFIX))]:
                st = _lstat_at(dir_fd, name)
                if st is None or now - st.st_mtime < older_than:
                    continue
                _remove_at(dir_fd, name)
                removed.append(f"{path.rstrip('/')}/{name}")
        finally:
            os.close(dir_fd)
        return removed

    def list_items(self, path: str) -> list[DirItem]:
        try:
            fd = self._open_dir(path)
        except OSError:
            return []
        try:
            with os.scandir(fd) as it:
                names = [e.name for e in it]
            return [_local_item(n, st) for n in names if (st := _lstat_at(fd, n)) is not None]
        except OSError:
            return []
        finally:
            os.close(fd)

    def stat_item(self, path: str) -> DirItem | None:
        full = self._abs(path).rstrip("/") or "/"
        if self.root is not None and full == self.root.rstrip("/"):
            try:  # the root is configuration the user gave: it is looked at as it is
                return _local_item(os.path.basename(full), os.stat(full))
            except OSError:
                return None
        parent, name = os.path.split(full)
        try:
            fd = self._open_dir(parent or "/")
        except OSError:
            return None
        try:
            st = _lstat_at(fd, name)
            return None if st is None else _local_item(name, st)
        finally:
            os.close(fd)


def _local_item(name: str, st: os.stat_result) -> DirItem:
    mode = st.st_mode
    kind = ("link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "other")
    return DirItem(name, kind, st.st_size if kind == "file" else 0, st.st_mtime)


# --------------------------------------------------------------------------- fsspec (object stores)


#: The wall clock of object stores' grace periods and staleness (a module attribute so tests can move it).
_clock = time.time


def wall_time() -> float:
    """The time object stores judge grace periods and staleness by (``time.time``, unless a test moved it)."""
    return _clock()



class FsspecStore(_EntryStore):
    """Entries on any fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...), shared by many nodes.

    Object stores have no directory rename, so a commit is: write each data object under a name
    unique to this writer (``data.<token>.safetensors``), then ``meta.json`` — one atomic PUT that
    names exactly those objects. A reader follows ``meta.json``, so it never mixes two writers'
    files. The objects of the replaced entry are not deleted at once: the new ``meta.json`` lists
    them as ``retired`` with the time, and a later writer (or :meth:`remove_leftovers`) deletes
    them once ``grace_seconds`` have passed, so that a reader holding the old ``meta.json`` still
    finds them. Objects no ``meta.json`` names (a crashed writer's) are removed once stale. Only
    objects named as this class names them are ever deleted, and only inside the entry.

    Args:
        fs: the fsspec filesystem.
        root: the dump dir (URL or path); :meth:`remove` refuses anything outside it.
        grace_seconds: how long replaced objects stay readable.
        clock: the time source (the wall clock, :func:`wall_time`), injectable for tests.
    """

    def __init__(self, fs: Any, root: str | None = None, grace_seconds: float = GRACE_SECONDS,
                 clock: Callable[[], float] | None = None) -> None:
        self.fs = fs
        self.root = self._p(root).rstrip("/") if root is not None else None
        self.grace_seconds = float(grace_seconds)
        self.clock: Callable[[], float] = wall_time if clock is None else clock

    def _p(self, path: str) -> str:
        return str(self.fs._strip_protocol(path))

    # ------------------------------------------------------------------ primitives

    def _read(self, path: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(self._p(path)))
        except IsADirectoryError as err:
            raise FileNotFoundError(path) from err

    def _read_exact(self, path: str, size: int) -> bytes:
        """An object's bytes, at most ``size + 1`` fetched; raises FileNotFoundError / _BadFile."""
        p = self._p(path)
        name = p.rsplit("/", 1)[-1]
        try:
            if size == 0:
                actual = int(self.fs.size(p))
                if actual:
                    raise _BadFile(f"{name} has {actual} bytes, {META_FILE} says 0")
                return b""
            data = bytes(self.fs.cat_file(p, start=0, end=size + 1))
        except IsADirectoryError:
            raise _BadFile(f"{name} is not a file") from None
        except MemoryError:
            raise _BadFile(f"{name} ({size} bytes) does not fit in memory") from None
        if len(data) != size:
            raise _BadFile(f"{name} has {'more than ' if len(data) > size else ''}{len(data)} bytes, "
                           f"{META_FILE} says {size}")
        return data

    def _read_bounded(self, path: str, limit: int) -> bytes:
        """At most ``limit + 1`` bytes of the object at ``path``: one ranged read, so an object larger
        than its bound is never fetched whole (the caller sees it is too large).

        Raises:
            FileNotFoundError, IsADirectoryError, NotADirectoryError: no object there.
            OSError: the read failed (an empty object whose byte range a server refuses reads as b"").
        """
        p = self._p(path)
        try:
            return bytes(self.fs.cat_file(p, start=0, end=limit + 1))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise
        except OSError:
            try:
                empty = self.fs.size(p) == 0
            except OSError:
                empty = False
            if empty:  # some servers refuse a byte range of an empty object
                return b""
            raise

    def _read_meta(self, path: str) -> bytes:
        try:
            return self._read_bounded(f"{path}/{META_FILE}", META_MAX_BYTES)
        except IsADirectoryError as err:
            raise FileNotFoundError(self._p(f"{path}/{META_FILE}")) from err

    def _size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def _isfile(self, path: str) -> bool:
        try:
            return bool(self.fs.isfile(self._p(path)))
        except OSError:
            return False

    def is_dir(self, path: str) -> bool:
        try:
            return bool(self.fs.isdir(self._p(path)))
        except OSError:
            return False

    def list_dir(self, path: str, dirs_only: bool = False) -> list[str]:
        root = self._p(path).rstrip("/")
        try:
            entries = self.fs.ls(root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = set()
        for e in entries:
            full = str(e.get("name", "")).rstrip("/")
            if full == root or (dirs_only and e.get("type") != "directory"):
                continue
            names.add(full.rsplit("/", 1)[-1])
        return sorted(names)

    # ------------------------------------------------------------------ reading

    def _look(self, path: str, legacy_files: tuple[str, ...], names: _Names, verify: bool,
              read: bool, pooled: _Pooled = False, known: Probe | None = None, keep: int = 0
              ) -> tuple[Probe, Mapping[str, bytes | memoryview]]:
        # ``known`` is not used: an object's version cannot be told without fetching it again
        try:
            raw = self._read_meta(path)
        except (FileNotFoundError, NotADirectoryError):
            if self._isfile(path):
                return Probe(EntryState.DAMAGED, reason=f"{path} is a file, not an entry directory"), {}
            return Probe(EntryState.MISSING), {}
        except OSError as err:
            return Probe(EntryState.DAMAGED, reason=f"cannot read {path}/{META_FILE}: {err}"), {}
        for _ in range(_MAX_ATTEMPTS):
            meta, reason = _parse_meta(raw)
            if meta is None:
                return Probe(EntryState.DAMAGED, reason=reason), {}
            try:
                return self._look_version(path, meta, legacy_files, names, verify, read)
            except (FileNotFoundError, _BadFile) as err:
                failure: Exception = err
            except OSError as err:  # a network or permission error: never an exception from a probe
                return Probe(EntryState.DAMAGED, meta, reason=f"cannot read {path}: {err}"), {}
            # a reader holding an older meta.json than the store's: read the current version instead
            try:
                now = self._read_meta(path)
            except (FileNotFoundError, NotADirectoryError):
                return Probe(EntryState.MISSING), {}
            except OSError as err:
                return Probe(EntryState.DAMAGED, meta, reason=f"cannot read {path}/{META_FILE}: {err}"), {}
            if now == raw:
                if isinstance(failure, FileNotFoundError):
                    missing = str(failure.filename or failure).rsplit("/", 1)[-1]
                    return Probe(EntryState.DAMAGED, meta, reason=f"missing data file {missing}"), {}
                return Probe(EntryState.DAMAGED, meta, reason=str(failure)), {}
            raw = now
        return Probe(EntryState.DAMAGED, reason=f"kept changing while read ({_MAX_ATTEMPTS} attempts)"), {}

    def _look_version(self, path: str, meta: dict[str, Any], legacy_files: tuple[str, ...], names: _Names,
                      verify: bool, read: bool) -> tuple[Probe, dict[str, bytes]]:
        names = _resolve(names, meta) if read else None
        listed = meta.get("files")
        if listed is None:
            present = [n for n in legacy_files if valid_name(n) and self._isfile(f"{path}/{n}")]
            if not present:
                return Probe(EntryState.DAMAGED, meta, reason="no data file beside meta.json"), {}
            out = {}
            if read:
                for name in (present if names is None else names):
                    if not valid_name(name):
                        raise _BadFile(f"{name!r} is not a file name inside the entry")
                    try:
                        out[name] = self._read(f"{path}/{name}")
                    except FileNotFoundError:
                        continue
            return Probe(EntryState.PRESENT, meta), out
        wanted = _check_files(meta, names) if read else []
        for name, info in listed.items():
            if name in wanted:
                continue
            try:
                size = self._size(f"{path}/{_object(name, info)}")
            except IsADirectoryError:
                raise _BadFile(f"{name} is not a file") from None
            if size != info["bytes"]:
                raise _BadFile(f"{name} has {size} bytes, {META_FILE} says {info['bytes']}")
        out = {}
        for name in wanted:
            info = listed[name]
            out[name] = _verified(name, self._read_exact(f"{path}/{_object(name, info)}", info["bytes"]), info, verify)
        return Probe(EntryState.PRESENT, meta), out

    def _read_listed(self, path: str, meta: Mapping[str, Any], names: list[str], verify: bool) -> dict[str, bytes]:
        listed = meta.get("files")
        out: dict[str, bytes] = {}
        for name in names:
            if listed is None:
                if not valid_name(name):
                    raise _BadFile(f"{name!r} is not a file name inside the entry")
                try:
                    out[name] = self._read(f"{path}/{name}")
                except FileNotFoundError:
                    continue
                continue
            info = listed.get(name)
            if info is None:
                raise _BadFile(f"{name} is not listed in {META_FILE}")
            try:
                data = self._read_exact(f"{path}/{_object(name, info)}", info["bytes"])
            except FileNotFoundError:
                raise _BadFile(f"{path}/{name} is missing") from None
            out[name] = _verified(name, data, info, verify)
        return out

    def read_small(self, path: str, limit: int) -> bytes | None:
        try:
            data = self._read_bounded(path, limit)
        except (FileNotFoundError, NotADirectoryError):
            if self.is_dir(path):
                raise CorruptEntryError(f"{path} is a directory, not a file") from None
            return None
        except IsADirectoryError:
            raise CorruptEntryError(f"{path} is a directory, not a file") from None
        except OSError as err:
            raise CorruptEntryError(f"cannot read {path}: {err}") from err
        if len(data) > limit:
            raise CorruptEntryError(f"{path} is more than the {limit} bytes it may have")
        return data

    def put_small(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(path), data)

    # ------------------------------------------------------------------ writing

    def write_entry(self, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        """Publish an entry: unique data objects first, ``meta.json`` last (see the class docstring)."""
        for name in files:
            if not valid_name(name) or name == META_FILE:
                raise OSError(errno.EINVAL, f"cannot store a data file named {name!r}: "
                                            "it must be one file name (no '/', '..', NUL)", path)
        previous = self.probe(path)
        if previous.state is EntryState.PRESENT and not overwrite:
            return 0
        token = uuid.uuid4().hex[:12]
        listing: dict[str, dict[str, Any]] = {}
        written: list[str] = []
        total = 0
        try:
            for name, data in files.items():
                data = _contiguous(data)
                stem, dot, suffix = name.partition(".")
                obj = f"{stem}.{token}{dot}{suffix}"
                # fsspec's object stores take bytes (a pooled memoryview is copied once, next to an upload)
                self.fs.pipe_file(self._p(f"{path}/{obj}"), data if isinstance(data, bytes) else bytes(data))
                written.append(obj)
                listing[name] = {"bytes": _nbytes(data), "checksum": checksum(data), "object": obj}
                total += _nbytes(data)
            keep, expired = self._retire(previous.meta, set(written))
            meta_bytes = _meta_bytes(meta, listing, keep)
            self.fs.pipe_file(self._p(f"{path}/{META_FILE}"), meta_bytes)
        except BaseException:
            for obj in written:  # nothing names them: remove what we can, leftovers handle the rest
                try:
                    self._delete_object(path, obj)
                except OSError:
                    pass
            raise
        for obj in expired:
            try:
                self._delete_object(path, obj)
            except OSError as err:  # left for a later writer or remove_leftovers
                logger.debug("could not delete replaced object %s/%s: %s", path, obj, err)
        return total + len(meta_bytes)

    def _retire(self, previous: Mapping[str, Any] | None, new: set[str]) -> tuple[dict[str, float], list[str]]:
        """Which objects of the replaced entry stay (``retired``, with when) and which may go now.

        Only objects the replaced ``meta.json`` names and that carry this class's naming pattern are
        considered: whatever else a damaged or planted ``meta.json`` names is never deleted.
        """
        keep: dict[str, float] = {}
        expired: list[str] = []
        if not previous:  # probe() returns no meta for an ill-typed meta.json: nothing it names is touched
            return keep, expired
        now = self.clock()
        candidates: dict[str, float] = {}
        for name, info in (previous.get("files") or {}).items():
            candidates[_object(name, info)] = now
        for obj, when in (previous.get("retired") or {}).items():
            candidates.setdefault(obj, float(when))
        for obj, when in candidates.items():
            if obj in new or not _OBJECT_NAME.match(obj):
                continue
            if now - when >= self.grace_seconds:
                expired.append(obj)
            else:
                keep[obj] = when
        return keep, expired

    def _delete_object(self, path: str, obj: str) -> None:
        if not _OBJECT_NAME.match(obj) or not valid_name(obj):
            raise OSError(errno.EPERM, f"refusing to delete {obj!r}: not an object stepskip wrote", path)
        try:
            self.fs.rm_file(self._p(f"{path}/{obj}"))
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------ deleting

    def _confined(self, path: str) -> str:
        p = self._p(path).rstrip("/")
        parts = p.split("/")
        if any(part in ("", ".", "..") for part in parts[1:]):
            raise OSError(errno.EPERM, "refusing to delete a path with '.' or '..' components", path)
        if self.root is not None and not p.startswith(self.root + "/"):
            raise OSError(errno.EPERM, f"refusing to delete outside the dump dir {self.root}", path)
        return p

    def remove(self, path: str) -> None:
        p = self._confined(path)
        try:
            if self.fs.isfile(p):
                self.fs.rm_file(p)
                return
        except FileNotFoundError:
            return
        self._remove_tree(p)

    def _remove_tree(self, p: str) -> None:
        try:
            found = self.fs.find(p, withdirs=True, detail=True)
        except FileNotFoundError:
            return
        prefix = p + "/"
        inside = {str(k).rstrip("/"): v for k, v in found.items() if str(k).startswith(prefix)}
        # commit points first (manifests, then meta.json): readers see a miss, never a step without its data
        files = sorted((k for k, v in inside.items() if v.get("type") != "directory"),
                       key=lambda k: (not k.endswith("/" + MANIFEST_FILE), not k.endswith("/" + META_FILE)))
        for key in files:
            try:
                self.fs.rm_file(key)
            except FileNotFoundError:
                pass
        for key in sorted((k for k, v in inside.items() if v.get("type") == "directory"), key=len, reverse=True) + [p]:
            try:
                self.fs.rmdir(key)
            except (OSError, NotImplementedError):
                pass  # object stores have no directories to remove

    def retire_entry(self, path: str) -> bool:
        p = self._confined(path)
        try:
            exists = bool(self.fs.exists(p))
        except OSError:
            exists = False
        if not exists:
            return False
        self.remove(path)
        return True

    def scan(self, path: str) -> Tree:
        """Every object below ``path``, from one recursive listing (one request per 1,000 objects on S3)."""
        root = self._p(path).rstrip("/")
        try:
            found = self.fs.find(root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            found = {}
        files: dict[str, DirItem] = {}
        for key, info in dict(found).items():
            key = str(key)
            if key.endswith("/") or not key.startswith(root + "/") or not isinstance(info, Mapping):
                continue  # a directory marker, or something outside the listed prefix
            item = self._item(info)
            if item.kind == "file":
                files[key[len(root) + 1:]] = item
        return Tree(path, files)

    def may_hold_leftovers(self, path: str, tree: Tree | None, older_than: float = STALE_SECONDS) -> bool:
        if tree is None or not tree.covers(path):
            return True
        now, young = self.clock(), min(self.grace_seconds, older_than)
        return any(may_hold_leftovers(tree.files(f"{path}/{name}"), now, young) for name in tree.dirs(path))

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS, tree: Tree | None = None,
                         listed: list[str] | None = None) -> list[str]:
        """Delete, in the entries under ``path``, replaced objects past their grace period and stale
        objects that no ``meta.json`` names; only objects with the names this class writes.

        One recursive listing (``tree``, or :meth:`scan` here) shows every entry's objects with their
        times; only the entries it leaves room for a leftover in (:func:`may_hold_leftovers`: objects
        of more than one write, not all written just now) are probed, so the clean-up costs a bounded
        number of requests, not a few per entry.
        """
        if tree is None or not tree.covers(path):
            tree = self.scan(path)
        removed = []
        now, young = self.clock(), min(self.grace_seconds, older_than)
        for step in tree.dirs(path):
            entry = f"{path.rstrip('/')}/{step}"
            objects = tree.files(entry)
            if not may_hold_leftovers(objects, now, young):
                continue
            probe = self.probe(entry)
            if probe.state is not EntryState.PRESENT or not isinstance((probe.meta or {}).get("files"), dict):
                continue
            assert probe.meta is not None
            named = {_object(n, i) for n, i in probe.meta["files"].items()}
            retired = probe.meta.get("retired") or {}
            for name in sorted(objects):
                if name in named or not _OBJECT_NAME.match(name):
                    continue
                if name in retired:
                    if now - float(retired[name]) < self.grace_seconds:
                        continue
                else:
                    modified = objects[name].mtime  # the listing's time: an object written since is not in it
                    if modified is None or now - modified < older_than:
                        continue
                self._delete_object(entry, name)
                removed.append(f"{entry}/{name}")
        return removed

    def _item(self, info: Mapping[str, Any]) -> DirItem:
        name = str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        kind = {"directory": "dir", "file": "file"}.get(str(info.get("type")), "other")
        size = info.get("size") if kind == "file" else 0
        return DirItem(name, kind, size if isinstance(size, int) else 0, _info_time(info))

    def forget_listings(self, path: str) -> None:
        # Only the listings of path and below: its parents' (the run directory's) stay, and the cache is
        # walked down from path's own cached listing, so a call costs the subtree, not every cached key
        # (an index calls this once per step). Without a cached listing of path there is no walk to
        # take: every key is looked at then, as below-path listings may still be cached.
        root = self._p(path).rstrip("/")
        cache = getattr(self.fs, "dircache", None)
        if cache is None:
            return
        try:
            if root not in cache:
                for key in [k for k in list(cache) if str(k).startswith(root + "/")]:
                    cache.pop(key, None)
                return
            pending = [root]
            while pending:
                key = pending.pop()
                for info in cache.pop(key, None) or ():
                    name = str(info.get("name", "")).rstrip("/") if isinstance(info, Mapping) else ""
                    if name.startswith(key + "/") and info.get("type") == "directory":
                        pending.append(name)
        except Exception as err:  # a filesystem whose cache cannot be dropped: listings are fresh already
            logger.debug("could not drop the cached listings of %s: %s", path, err)

    def list_items(self, path: str) -> list[DirItem]:
        root = self._p(path).rstrip("/")
        try:
            infos = self.fs.ls(root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        items: dict[str, DirItem] = {}
        for info in infos:
            if str(info.get("name", "")).rstrip("/") != root:
                item = self._item(info)
                items.setdefault(item.name, item)
        return [items[n] for n in sorted(items)]

    def stat_item(self, path: str) -> DirItem | None:
        try:
            return self._item(self.fs.info(self._p(path)))
        except (FileNotFoundError, NotADirectoryError):
            return None


def _info_time(info: Mapping[str, Any]) -> float | None:
    """The modification time in an fsspec ``info`` dict, whatever the filesystem calls it."""
    for key in ("mtime", "LastModified", "created", "updated"):
        value = info.get(key)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        try:
            return float(value)
        except (TypeError, ValueError):
            continue
    return None


# --------------------------------------------------------------------------- opening and checking a dump dir


def open_store(dump_dir: str, storage_options: Mapping[str, Any] | None = None, *,
               grace_seconds: float = GRACE_SECONDS) -> _EntryStore:
    """The store for ``dump_dir``: local paths (also ``file://``, ``local://``) get :class:`LocalStore`,
    other URLs :class:`FsspecStore`.

    Raises:
        SkipConfigError: the URL's filesystem is not installed or not known to fsspec.

    Example:
        >>> type(open_store("/tmp/dump")).__name__, type(open_store("memory://bucket/dump")).__name__
        ('LocalStore', 'FsspecStore')
    """
    local = _local_path(dump_dir)
    if local is not None:
        return LocalStore(root=local)
    try:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(dump_dir, **dict(storage_options or {}))
    except (ImportError, ValueError) as err:
        raise SkipConfigError(
            f"dump_dir = {dump_dir!r}: cannot open this URL ({err}); install the filesystem's package "
            "(e.g. `pip install stepskip[s3]` for s3://) or use a local path"
        ) from err
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if {"file", "local"} & set(protocols):  # a local filesystem behind a URL: walk it as one
        return LocalStore(root=fs._strip_protocol(dump_dir))
    return FsspecStore(fs, root=dump_dir, grace_seconds=grace_seconds)


def check_dump_dir(dump_dir: str, storage_options: Mapping[str, Any] | None = None, *, key: str = "dump_dir",
                   entry_dir: str | None = None) -> None:
    """Check at startup that a dump dir can be used, with an error that names the key and the fix.

    Local dump dirs must be directories this process can list and enter (or not exist yet, below
    a directory); every name the cache creates below it must fit in a file name (255 bytes).
    Object-store URLs are only checked for their filesystem being installed.

    Args:
        dump_dir: the configured dump dir.
        storage_options: fsspec options for URLs.
        key: the configuration key to name in errors (e.g. ``skip.rollout.dump_dir``).
        entry_dir: a path below ``dump_dir`` the cache will create (e.g. a role's project dir);
            its components are checked for length.

    Raises:
        SkipConfigError: the dump dir cannot be read or created, or a name is too long.

    Example:
        >>> check_dump_dir("/tmp/stepskip-doc", key="skip.rollout.dump_dir")
    """
    local = _local_path(dump_dir)
    if local is None:
        open_store(dump_dir, storage_options)
        return
    root = os.path.abspath(os.path.expanduser(local))
    if entry_dir is not None:
        target = LocalStore._abs(entry_dir)
        below = target[len(root):] if target.startswith(root.rstrip("/") + "/") else target
        for part in [p for p in below.split("/") if p]:
            size = len(part.encode("utf-8", "surrogateescape"))
            if size > NAME_MAX:
                raise SkipConfigError(
                    f"{key} = {dump_dir!r}: the cache would create a directory named {part[:40]!r}... of {size} "
                    f"bytes, more than the {NAME_MAX} bytes a file name may have; shorten trainer.experiment_name "
                    "and trainer.project_name (joined into that name)")
    for part in [p for p in root.split("/") if p]:
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise SkipConfigError(f"{key} = {dump_dir!r}: the component {part[:40]!r}... is longer than "
                                  f"{NAME_MAX} bytes; choose a shorter dump_dir")
    existing = root
    while True:
        try:
            st = os.stat(existing)
            break
        except (FileNotFoundError, NotADirectoryError):  # not there yet (or below a file: said below)
            parent = os.path.dirname(existing)
            if parent == existing:
                return
            existing = parent
        except OSError as err:
            raise SkipConfigError(f"{key} = {dump_dir!r}: cannot look at {existing}: {err.strerror}; make it "
                                  "accessible to this user (chmod/chown) or choose another dump_dir") from err
    if not stat.S_ISDIR(st.st_mode):
        raise SkipConfigError(f"{key} = {dump_dir!r}: {existing} is a file, not a directory; "
                              "remove it or choose another dump_dir")
    if existing == root and not os.access(root, os.R_OK | os.X_OK):
        raise SkipConfigError(f"{key} = {dump_dir!r}: this process ({_whoami()}) cannot list or enter the "
                              "directory; make it readable (e.g. `chmod u+rx`) or choose another dump_dir")
    if existing != root and not os.access(existing, os.W_OK | os.X_OK):
        raise SkipConfigError(f"{key} = {dump_dir!r} does not exist, and this process ({_whoami()}) cannot "
                              f"create it inside {existing}; create it, or choose a writable dump_dir")


def _whoami() -> str:
    return f"uid {os.getuid()}" if hasattr(os, "getuid") else "this user"
