"""Entries on disk: atomic commit, checksums, validity checks, leftovers.

An entry is a directory holding data files and ``meta.json``. A writer builds the whole entry
in a hidden temporary directory beside its final place (``.tmp-{name}-{uuid}``), syncs it, and
publishes it with one ``rename``; so whatever instant the writer dies, readers see no entry or
a complete one. ``meta.json`` lists every data file with its size and xxh3-64 checksum; readers
check both. Leftover temporaries are never parsed as steps and are removed once stale.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import xxhash

from stepskip.errors import CorruptEntryError, SkipConfigError

__all__ = [
    "EntryState", "Probe", "LocalStore", "FsspecStore", "open_store", "checksum", "META_FILE", "TMP_PREFIX",
    "TRASH_PREFIX",
]

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
STALE_SECONDS = 3600.0


class EntryState(enum.Enum):
    """What a look at an entry found (SPEC §6): damaged entries are regenerated, unreadable ones kept."""

    MISSING = "missing"
    PRESENT = "present"
    DAMAGED = "damaged"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Probe:
    """What a cheap look at an entry found (no data read, no checksum computed)."""

    state: EntryState
    meta: dict[str, Any] | None = None
    reason: str = ""


def checksum(data: bytes | memoryview) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


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
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the call or the filesystem does not support it.
    """
    global _RENAMEAT2
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        _RENAMEAT2 = None  # remember: not supported here
        return False
    if err == errno.ENOENT:
        return False  # the old entry vanished meanwhile: a plain rename will do
    raise OSError(err, os.strerror(err), b)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _EntryStore:
    """All entry logic (probe, verified reads), written against a few filesystem primitives."""

    def _read(self, path: str) -> bytes:  # raises FileNotFoundError / NotADirectoryError / OSError
        raise NotImplementedError

    def _size(self, path: str) -> int:
        raise NotImplementedError

    def _isfile(self, path: str) -> bool:
        raise NotImplementedError

    def list_dir(self, path: str) -> list[str]:
        """Names (not paths) directly under ``path``; empty when it does not exist."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Delete a file or a whole directory; a missing path is fine."""
        raise NotImplementedError

    def write_entry(self, path: str, files: Mapping[str, bytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        raise NotImplementedError

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS) -> list[str]:
        raise NotImplementedError

    @staticmethod
    def _object(name: str, info: Mapping[str, Any]) -> str:
        return str(info.get("object") or name)

    def probe(self, path: str, legacy_files: Iterable[str] = ()) -> Probe:
        """Classify the entry at ``path`` as missing, present or damaged without reading its data.

        An entry written by verl itself has a ``meta.json`` without a file list; it is present when
        one of ``legacy_files`` (verl's data file names) exists beside it.
        """
        meta_path = f"{path}/{META_FILE}"
        try:
            raw = self._read(meta_path)
        except FileNotFoundError:
            return Probe(EntryState.MISSING)
        except NotADirectoryError:
            if self._isfile(path):
                return Probe(EntryState.DAMAGED, reason=f"{path} is a file, not an entry directory")
            return Probe(EntryState.MISSING)  # a parent is a file: no entry can exist there
        except OSError as err:
            return Probe(EntryState.DAMAGED, reason=f"cannot read {meta_path}: {err}")
        try:
            meta = json.loads(raw)
        except ValueError as err:
            return Probe(EntryState.DAMAGED, reason=f"unreadable {META_FILE}: {err}")
        if not isinstance(meta, dict) or "global_steps" not in meta:
            return Probe(EntryState.DAMAGED, reason=f"{META_FILE} lacks global_steps")
        files = meta.get("files")
        if files is None:
            if any(self._isfile(f"{path}/{name}") for name in legacy_files):
                return Probe(EntryState.PRESENT, meta)
            return Probe(EntryState.DAMAGED, meta, reason="no data file beside meta.json")
        if not isinstance(files, dict) or not all(isinstance(i, dict) for i in files.values()):
            return Probe(EntryState.DAMAGED, meta, reason=f"{META_FILE} has a malformed file list")
        for name, info in files.items():
            try:
                size = self._size(f"{path}/{self._object(name, info)}")
            except OSError:
                return Probe(EntryState.DAMAGED, meta, reason=f"missing data file {name}")
            if size != info.get("bytes"):
                reason = f"{name} has {size} bytes, meta.json says {info.get('bytes')}"
                return Probe(EntryState.DAMAGED, meta, reason=reason)
        return Probe(EntryState.PRESENT, meta)

    def read_files(self, path: str, meta: Mapping[str, Any], names: Iterable[str], verify: bool) -> dict[str, bytes]:
        """Read the named data files of a present entry, checking sizes and (``verify``) checksums.

        Raises:
            CorruptEntryError: a file is missing, truncated or does not match its checksum.
        """
        listed = meta.get("files")
        out: dict[str, bytes] = {}
        for name in names:
            info = listed.get(name) if listed is not None else {}
            if info is None:
                raise CorruptEntryError(f"{path}/{name} is not listed in {META_FILE}")
            file_path = f"{path}/{self._object(name, info)}"
            try:
                data = self._read(file_path)
            except FileNotFoundError:
                if listed is None:
                    continue
                raise CorruptEntryError(f"{file_path} is missing") from None
            except OSError as err:
                raise CorruptEntryError(f"cannot read {file_path}: {err}") from err
            if listed is not None:
                if len(data) != info.get("bytes"):
                    raise CorruptEntryError(f"{file_path} has {len(data)} bytes, {META_FILE} says {info.get('bytes')}")
                if verify and checksum(data) != info.get("checksum"):
                    raise CorruptEntryError(f"{file_path} does not match its checksum in {META_FILE}")
            out[name] = data
        return out


def _meta_bytes(meta: Mapping[str, Any], listing: Mapping[str, Any]) -> bytes:
    body = dict(meta)
    body["files"] = dict(listing)
    return json.dumps(body, indent=1, sort_keys=True).encode("utf-8")


class LocalStore(_EntryStore):
    """Entries on a local (or locally mounted shared) filesystem, published by directory rename."""

    def _read(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def _size(self, path: str) -> int:
        return os.path.getsize(path)

    def _isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def write_entry(self, path: str, files: Mapping[str, bytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        """Publish an entry atomically; returns the bytes written (0 if another writer won and
        ``overwrite`` is False).

        Raises:
            OSError: the entry could not be written; nothing partial is left behind.
        """
        parent, name = os.path.split(path.rstrip("/"))
        os.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/{TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
        os.mkdir(tmp)
        try:
            listing: dict[str, dict[str, Any]] = {}
            total = 0
            for file_name, data in files.items():
                self._write_file(f"{tmp}/{file_name}", data)
                listing[file_name] = {"bytes": len(data), "checksum": checksum(data)}
                total += len(data)
            meta_bytes = _meta_bytes(meta, listing)
            self._write_file(f"{tmp}/{META_FILE}", meta_bytes)
            _fsync_dir(tmp)
            if not self._publish(tmp, path, overwrite):
                return 0
            _fsync_dir(parent)
            return total + len(meta_bytes)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def _write_file(path: str, data: bytes) -> None:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())

    def _publish(self, tmp: str, path: str, overwrite: bool) -> bool:
        parent, name = os.path.split(path.rstrip("/"))
        for _ in range(16):
            try:
                os.rename(tmp, path)
                return True
            except OSError as err:
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
                    raise
            if not overwrite:
                return False
            if _exchange(tmp, path):  # readers see the old entry, then the new one, never a gap
                self.remove(tmp)
                return True
            trash = f"{parent}/{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                continue  # another writer moved it away first; try again
            self.remove(trash)
        raise OSError(errno.EBUSY, f"could not publish {path}: too many concurrent writers")

    def list_dir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS) -> list[str]:
        """Delete temporaries and trash under ``path`` (one level) older than ``older_than`` seconds."""
        removed = []
        now = time.time()
        for name in self.list_dir(path):
            if not name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                continue
            full = f"{path}/{name}"
            try:
                if now - os.path.getmtime(full) < older_than:
                    continue
            except OSError:
                continue
            self.remove(full)
            removed.append(full)
        return removed


class FsspecStore(_EntryStore):
    """Entries on any fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...), shared by many nodes.

    Object stores have no directory rename, so a commit is: write each data object under a name
    unique to this writer (``data.<token>.safetensors``), then ``meta.json`` — one atomic PUT that
    names exactly those objects — then delete the objects the replaced ``meta.json`` named. A
    reader follows ``meta.json``, so it never mixes two writers' files; objects no ``meta.json``
    names are leftovers, removed once stale.
    """

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def _p(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def _read(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(self._p(path))
        except IsADirectoryError as err:
            raise FileNotFoundError(path) from err

    def _size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def _isfile(self, path: str) -> bool:
        return bool(self.fs.isfile(self._p(path)))

    def list_dir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(self._p(path), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        root = self._p(path).rstrip("/")
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != root})

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(self._p(path), recursive=True)
        except FileNotFoundError:
            pass

    def write_entry(self, path: str, files: Mapping[str, bytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        """Publish an entry: unique data objects first, ``meta.json`` last (see the class docstring)."""
        previous = self.probe(path)
        if previous.state is EntryState.PRESENT and not overwrite:
            return 0
        token = uuid.uuid4().hex[:12]
        listing: dict[str, dict[str, Any]] = {}
        written: list[str] = []
        try:
            for name, data in files.items():
                stem, dot, suffix = name.partition(".")
                obj = f"{stem}.{token}{dot}{suffix}"
                self.fs.pipe_file(self._p(f"{path}/{obj}"), data)
                written.append(obj)
                listing[name] = {"bytes": len(data), "checksum": checksum(data), "object": obj}
            meta_bytes = _meta_bytes(meta, listing)
            self.fs.pipe_file(self._p(f"{path}/{META_FILE}"), meta_bytes)
        except BaseException:
            for obj in written:  # nothing names them: remove what we can, leftovers handle the rest
                try:
                    self.remove(f"{path}/{obj}")
                except OSError:
                    pass
            raise
        old = (previous.meta or {}).get("files") if previous.meta else None
        if isinstance(old, dict):
            keep = {info["object"] for info in listing.values()}
            for name, info in old.items():
                obj = self._object(name, info) if isinstance(info, dict) else name
                if obj not in keep:
                    self.remove(f"{path}/{obj}")
        return sum(len(d) for d in files.values()) + len(meta_bytes)

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS) -> list[str]:
        """Delete stale objects of the entries under ``path`` that their ``meta.json`` does not name."""
        removed = []
        now = time.time()
        for step in self.list_dir(path):
            entry = f"{path}/{step}"
            probe = self.probe(entry)
            if probe.state is not EntryState.PRESENT or not isinstance((probe.meta or {}).get("files"), dict):
                continue
            named = {self._object(n, i) for n, i in probe.meta["files"].items()} | {META_FILE}
            for name in self.list_dir(entry):
                if name in named:
                    continue
                modified = self._modified(f"{entry}/{name}")
                if modified is not None and now - modified >= older_than:
                    self.remove(f"{entry}/{name}")
                    removed.append(f"{entry}/{name}")
        return removed

    def _modified(self, path: str) -> float | None:
        try:
            info = self.fs.info(self._p(path))
        except OSError:
            return None
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


def open_store(dump_dir: str, storage_options: Mapping[str, Any] | None = None) -> _EntryStore:
    """The store for ``dump_dir``: local paths get :class:`LocalStore`, URLs :class:`FsspecStore`.

    Raises:
        SkipConfigError: the URL's filesystem is not installed or not known to fsspec.
    """
    if "://" not in dump_dir or dump_dir.startswith("file://"):
        return LocalStore()
    try:
        import fsspec

        fs, _ = fsspec.core.url_to_fs(dump_dir, **dict(storage_options or {}))
    except (ImportError, ValueError) as err:
        raise SkipConfigError(
            f"dump_dir = {dump_dir!r}: cannot open this URL ({err}); install the filesystem's package "
            "(e.g. `pip install stepskip[s3]` for s3://) or use a local path"
        ) from err
    return FsspecStore(fs)
