"""Linux system calls and file-descriptor work for the local backend: kept apart so that the backend
reads as what it does, not how the kernel is asked.

- ``openat2`` (a whole path below a directory in one call, refusing every symbolic link), with a
  component-wise walk where it is missing;
- ``renameat2(RENAME_EXCHANGE)``: an entry swapped for its replacement with no instant without one;
- ``syncfs`` (Linux 5.8 and later, where it reports writeback errors): a batch of small entries
  made durable by one call instead of an ``fsync`` per file, on filesystems where that holds;
- ``O_DIRECT`` writes of big files, around the page cache;
- a small pool of threads issuing ``fsync`` calls side by side;
- reading and writing files relative to an open directory, never following a link, never reading
  past a file's expected size.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import shutil
import stat
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from stepskip._env import env_bytes
from stepskip._storage.base import Allocator, BadFile, DirItem
from stepskip._storage.meta import META_FILE, TMP_PREFIX
from stepskip._entries import FileBytes

O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # NONBLOCK: a FIFO cannot hang open()


# --------------------------------------------------------------------------- renameat2, syncfs


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
#: instead of an ``fsync`` per file and directory (see :class:`~stepskip._storage.local.LocalBatch`).
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


def syncfs_pays() -> bool:
    """Whether one ``syncfs`` is the cheap way to make a batch durable just now."""
    if _SYNCFS is None:
        return False
    dirty = _dirty_bytes()
    return dirty is not None and dirty <= SYNCFS_MAX_DIRTY_BYTES


_RENAME_EXCHANGE = 2


def exchange(dir_fd: int, a: str, b: str) -> bool:
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


def openat2_dir(dir_fd: int, relative: str) -> int | None:
    """Open the directory ``relative`` below ``dir_fd`` in one call, refusing any symbolic link on the
    way (Linux ``openat2`` with ``RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH``).

    Returns None when the call is unavailable or failed for a reason the caller's component-wise
    walk should classify (a link, a file); raises FileNotFoundError for a missing component.
    """
    global _SYSCALL
    if _SYSCALL is None:
        return None
    how = _OpenHow(O_DIR, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_BENEATH)
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


# --------------------------------------------------------------------------- fsync, side by side


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


class Syncs:
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


def fsync_all(fds: list[int]) -> dict[int, OSError]:
    """``fsync`` every fd side by side (see :class:`Syncs`); the errors by fd (empty when all are durable)."""
    syncs = Syncs()
    for fd in fds:
        syncs.start(fd, [fd], close=False, pooled=len(fds) > 1)
    return syncs.wait()


def fsync_dir(fd: int) -> None:
    """Make a directory's new names durable; best effort (some filesystems refuse to sync a directory)."""
    try:
        os.fsync(fd)
    except OSError:
        pass


def makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, each created directory's parent synced after its ``mkdir``."""
    parent = os.path.dirname(path.rstrip("/")) or "/"
    if parent != path and not os.path.isdir(parent):
        makedirs_durable(parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync_dir(fd)
    finally:
        os.close(fd)


#: A directory's mtime this much older than a listing of it proves the listing complete: a later


# --------------------------------------------------------------------------- files relative to an open directory


def read_fd(fd: int, size: int, allocator: Allocator | None = None) -> bytes | memoryview:
    """Exactly ``size`` bytes from ``fd``: one allocation, never a byte past ``size``.

    ``allocator`` may give the memory (a big file read into recycled pages comes back as a memoryview
    of them: a fresh buffer of its size would fault in every page).
    """
    if size == 0:
        return b""
    view = allocator(size) if allocator is not None else None
    if view is not None:
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


def read_at_stat(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
                 allocator: Allocator | None = None) -> tuple[bytes | memoryview, os.stat_result]:
    """Read a regular file of an entry directory without following links or reading past its size;
    with the status of the file read.

    Raises:
        FileNotFoundError: no such file (damage, or a concurrent removal: the caller tells).
        BadFile: a link, a FIFO, a device, a directory, the wrong size, over ``limit``.
    """
    try:
        fd = os.open(name, O_FILE, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise BadFile(f"{name} is a symbolic link (links are not followed inside a cache)") from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name) from None
        raise BadFile(f"cannot open {name}: {err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadFile(f"{name} is not a regular file")
        if expected is not None and st.st_size != expected:
            raise BadFile(f"{name} has {st.st_size} bytes, {META_FILE} says {expected}")
        if limit is not None and st.st_size > limit:
            raise BadFile(f"{name} is {st.st_size} bytes, more than the {limit} it may have")
        try:
            data = read_fd(fd, st.st_size, allocator)
        except MemoryError:
            raise BadFile(f"{name} ({st.st_size} bytes) does not fit in memory") from None
        except OSError as err:
            raise BadFile(f"cannot read {name}: {err}") from None
        if len(data) != st.st_size:
            raise BadFile(f"{name} ended after {len(data)} of its {st.st_size} bytes")
        return data, st
    finally:
        os.close(fd)


def read_at(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
            allocator: Allocator | None = None) -> bytes | memoryview:
    """:func:`read_at_stat` without the status."""
    return read_at_stat(dir_fd, name, expected, limit, allocator)[0]


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    """The status of ``name`` in ``dir_fd``, not followed if it is a link; None when it is not there."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def regular_size(dir_fd: int, name: str, expected: int) -> None:
    """Check a listed file by its metadata only; raises FileNotFoundError / BadFile."""
    st = lstat_at(dir_fd, name)
    if st is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    if stat.S_ISLNK(st.st_mode):
        raise BadFile(f"{name} is a symbolic link (links are not followed inside a cache)")
    if not stat.S_ISREG(st.st_mode):
        raise BadFile(f"{name} is not a regular file")
    if st.st_size != expected:
        raise BadFile(f"{name} has {st.st_size} bytes, {META_FILE} says {expected}")


def remove_at(dir_fd: int, name: str) -> None:
    """Delete ``name`` in ``dir_fd``: a link is unlinked (its target untouched), a directory
    removed without following any link inside it."""
    st = lstat_at(dir_fd, name)
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


def write_unsynced(dir_fd: int, name: str, data: FileBytes) -> int:
    """Create ``name`` in ``dir_fd`` holding ``data`` (big files with ``O_DIRECT`` where the filesystem
    takes it); the open fd, for the caller to sync and close."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
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


def syncfs_available() -> bool:
    """Whether this kernel's ``syncfs`` reports writeback errors (Linux 5.8 and later)."""
    return _SYNCFS is not None


def sync_held(held: dict[int, list[int]], parents: dict[int, int], syncs: Syncs, whole: bool = True,
              background: bool = False) -> Any:
    """Make the ``held`` fds of staged entries (entry -> fds; ``parents``: entry -> the fd of the directory
    it is staged in) durable: one ``syncfs`` per filesystem holding at least :data:`SYNCFS_MIN_ENTRIES`
    of them (each entry's fds then closed), else, and should the ``syncfs`` fail, an ``fsync`` per fd;
    each fd leaves ``held`` once handed over. ``whole`` false: an ``fsync`` per fd.

    With ``background``, when every held entry is on one filesystem, its ``syncfs`` runs on the sync
    pool (registered with ``syncs``) and its future is returned: the caller stages the next entries
    meanwhile and starts no other ``syncfs`` before this one is done. Otherwise None, everything
    handed over as without it.
    """
    by_device: dict[int, list[int]] = {}
    devices: dict[int, int] = {}
    whole = whole and syncfs_pays()
    for i in held:
        parent_fd = parents[i]
        if parent_fd not in devices:
            devices[parent_fd] = os.fstat(parent_fd).st_dev  # the entry's directory is made in its parent
        by_device.setdefault(devices[parent_fd], []).append(i)
    for device, keys in by_device.items():
        # the parent was opened before any file of the batch was written there: its syncfs reports any
        # writeback error since (the kernel samples the filesystem's error state when a file is opened)
        usable = whole and len(keys) >= SYNCFS_MIN_ENTRIES and _fs_type(device) in SYNCFS_FILESYSTEMS
        if usable and background and len(by_device) == 1:
            return syncs.start_whole(parents[keys[0]], {i: held.pop(i) for i in keys})
        if usable and _SYNCFS is not None and _SYNCFS(parents[keys[0]]) == 0:
            for i in keys:
                syncs.close(i, held.pop(i))
            continue
        for i in keys:
            syncs.start(i, held.pop(i), pooled=True)
    return None


class NotFollowed(NotADirectoryError):
    """A component of a path is a link or a file: the walk stops there (``last``: at the final one)."""

    def __init__(self, message: str, path: str, last: bool) -> None:
        super().__init__(errno.ENOTDIR, message, path)
        self.message = message
        self.last = last


def open_below(base: str, parts: list[str], create: bool = False) -> int:
    """An fd of the directory ``parts`` below ``base``, reached without following a link: one ``openat2``
    where the kernel has it, else (and to explain a failure) component by component.

    With ``create``, each missing directory is made and its name synced into its parent, except a
    hidden temporary as the last component (its publisher syncs it).

    Raises:
        FileNotFoundError: a component does not exist (and ``create`` is False).
        NotFollowed: a component is a symbolic link or not a directory.
    """
    if create and not os.path.isdir(base):
        makedirs_durable(base)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if len(parts) > 1 and not create:  # the common case in one system call; the walk below explains failures
        try:
            child = openat2_dir(fd, "/".join(parts))
        except FileNotFoundError:
            os.close(fd)
            raise
        if child is not None:
            os.close(fd)
            return child
    for i, part in enumerate(parts):
        try:
            try:
                child = os.open(part, O_DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    if not (i == len(parts) - 1 and part.startswith(TMP_PREFIX)):
                        fsync_dir(fd)  # the new name itself, not only what goes in it, survives a crash
                child = os.open(part, O_DIR, dir_fd=fd)
        except OSError as err:
            if err.errno in (errno.ENOTDIR, errno.ELOOP):
                where = "/".join([base.rstrip("/"), *parts[: i + 1]])
                st = lstat_at(fd, part)
                link = st is not None and stat.S_ISLNK(st.st_mode)
                os.close(fd)
                what = ("is a symbolic link; stepskip does not follow links inside the dump dir "
                        "(point dump_dir at the real directory, or replace the link by a directory)"
                        if link else "is a file, not a directory")
                raise NotFollowed(f"{where} {what}", where, last=i == len(parts) - 1) from None
            os.close(fd)
            raise
        os.close(fd)
        fd = child
    return fd



def dir_item(name: str, st: os.stat_result) -> DirItem:
    """What a status says of ``name`` (links reported as links)."""
    mode = st.st_mode
    kind = ("link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode)
            else "other")
    return DirItem(name, kind, st.st_size if kind == "file" else 0, st.st_mtime)
