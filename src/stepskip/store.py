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

__all__ = ["EntryState", "LocalStore", "open_store", "META_FILE", "checksum"]

logger = logging.getLogger(__name__)

META_FILE = "meta.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
STALE_SECONDS = 3600.0


class EntryState(enum.Enum):
    MISSING = "missing"
    PRESENT = "present"
    DAMAGED = "damaged"


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


class LocalStore:
    """Entries on a local (or locally mounted shared) filesystem."""

    def probe(self, path: str, legacy_files: Iterable[str] = ()) -> Probe:
        """Classify the entry at ``path`` as missing, present or damaged without reading its data.

        An entry written by verl itself has a ``meta.json`` without a file list; it is present when
        one of ``legacy_files`` (verl's data file names) exists beside it.
        """
        meta_path = f"{path}/{META_FILE}"
        try:
            with open(meta_path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return Probe(EntryState.MISSING)
        except NotADirectoryError:
            if os.path.isfile(path):
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
            if any(os.path.isfile(f"{path}/{name}") for name in legacy_files):
                return Probe(EntryState.PRESENT, meta)
            return Probe(EntryState.DAMAGED, meta, reason="no data file beside meta.json")
        if not isinstance(files, dict):
            return Probe(EntryState.DAMAGED, meta, reason=f"{META_FILE} has a malformed file list")
        for name, info in files.items():
            try:
                size = os.path.getsize(f"{path}/{name}")
            except OSError:
                return Probe(EntryState.DAMAGED, meta, reason=f"missing data file {name}")
            if size != info.get("bytes"):
                return Probe(EntryState.DAMAGED, meta, reason=f"{name} has {size} bytes, meta.json says {info.get('bytes')}")
        return Probe(EntryState.PRESENT, meta)

    def read_files(self, path: str, meta: Mapping[str, Any], names: Iterable[str], verify: bool) -> dict[str, bytes]:
        """Read the named data files of a present entry, checking sizes and (``verify``) checksums.

        Raises:
            CorruptEntryError: a file is missing, truncated or does not match its checksum.
        """
        listed = meta.get("files")
        out: dict[str, bytes] = {}
        for name in names:
            file_path = f"{path}/{name}"
            try:
                with open(file_path, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                if listed is None:
                    continue
                raise CorruptEntryError(f"{file_path} is missing") from None
            except OSError as err:
                raise CorruptEntryError(f"cannot read {file_path}: {err}") from err
            if listed is not None:
                info = listed.get(name)
                if info is None:
                    raise CorruptEntryError(f"{file_path} is not listed in {META_FILE}")
                if len(data) != info.get("bytes"):
                    raise CorruptEntryError(f"{file_path} has {len(data)} bytes, {META_FILE} says {info.get('bytes')}")
                if verify and checksum(data) != info.get("checksum"):
                    raise CorruptEntryError(f"{file_path} does not match its checksum in {META_FILE}")
            out[name] = data
        return out

    def write_entry(self, path: str, files: Mapping[str, bytes], meta: Mapping[str, Any], overwrite: bool = True) -> int:
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
            body = dict(meta)
            body["files"] = listing
            meta_bytes = json.dumps(body, indent=1, sort_keys=True).encode("utf-8")
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


def open_store(dump_dir: str) -> LocalStore:
    """The store for ``dump_dir``."""
    if "://" in dump_dir and not dump_dir.startswith("file://"):
        raise SkipConfigError(
            f"dump_dir = {dump_dir!r}: object-store URLs are not supported by this version of stepskip; "
            "use a local or mounted path"
        )
    return LocalStore()
