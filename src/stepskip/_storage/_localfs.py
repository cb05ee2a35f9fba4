"""Local entries through open directories: the fd-level half of :mod:`stepskip._storage.local`.

- reading: an entry's directory is opened once and its files relative to it (:class:`LocalEntry`),
  so all belong to one version;
- writing: each entry is built in a hidden ``.tmp-`` directory beside its place, synced, then
  renamed into place, swapped with the entry it replaces where the kernel can, so readers never see
  a gap (:class:`LocalStaging`); batches of small entries buy their durability together
  (:class:`LocalBatch`).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, Protocol

from stepskip._storage import _linux
from stepskip._storage._linux import (
    O_DIR,
    Syncs,
    exchange,
    fsync_all,
    fsync_dir,
    lstat_at,
    read_at_stat,
    regular_size,
    remove_at,
    sync_held,
    write_unsynced,
)
from stepskip._storage.base import Allocator, Batch, PinnedEntry, Raced, Staging, token
from stepskip._storage.meta import META_FILE, META_MAX_BYTES, TMP_PREFIX, TRASH_PREFIX
from stepskip._entries import FileBytes

__all__ = ["LocalEntry", "LocalStaging", "LocalBatch", "publish_rename", "publish_dir_at", "put_at", "retire_at"]


class Directories(Protocol):
    """What these need of the local backend: where an entry goes, its directory opened, an entry pinned."""

    def place(self, path: str) -> tuple[str, str]: ...

    def open_dir(self, path: str, create: bool = False) -> int: ...

    def same_dir(self, dir_fd: int, path: str) -> bool: ...

    def open_entry(self, path: str) -> LocalEntry: ...


class LocalEntry(PinnedEntry):
    """An entry's directory, open: its files are opened relative to it, so all belong to one version."""

    def __init__(self, backend: Directories, path: str, fd: int) -> None:
        self.backend, self.path, self.fd = backend, path, fd

    def read_meta(self) -> tuple[bytes, tuple[int, ...] | None]:
        raw, st = read_at_stat(self.fd, META_FILE, None, META_MAX_BYTES)
        return raw, self._stamp(st)  # type: ignore[return-value]  # read without an allocator: bytes

    def _stamp(self, st: os.stat_result) -> tuple[int, ...]:
        # a writer replaces an entry by renaming a new directory (a new inode) into place
        directory = os.fstat(self.fd)
        return (directory.st_dev, directory.st_ino, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def meta_stamp(self) -> tuple[int, ...] | None:
        st = lstat_at(self.fd, META_FILE)
        return None if st is None or not stat.S_ISREG(st.st_mode) else self._stamp(st)

    def read(self, name: str, size: int | None, allocator: Allocator | None = None) -> bytes | memoryview:
        return read_at_stat(self.fd, name, size, None, allocator)[0]

    def check(self, name: str, size: int) -> None:
        regular_size(self.fd, name, size)

    def has_file(self, name: str) -> bool:
        st = lstat_at(self.fd, name)
        return st is not None and stat.S_ISREG(st.st_mode)

    def absent(self) -> str:
        if not self.backend.same_dir(self.fd, self.path):
            raise Raced()
        return ""

    def replaced(self) -> bool:
        return not self.backend.same_dir(self.fd, self.path)

    def reopen(self) -> LocalEntry:
        return self.backend.open_entry(self.path)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalStaging(Staging):
    """An entry written into a hidden ``.tmp-`` directory beside its place, renamed into place once synced.

    Args:
        path: the entry's path.
        parent_fd: its parent directory, open (closed on :meth:`discard` with ``own_parent``).
        name: its name in the parent.
        own_parent: whether this staging closes ``parent_fd``.
        sync_parent: sync the parent after publishing (a batch syncs each parent once instead).
    """

    def __init__(self, path: str, parent_fd: int, name: str, own_parent: bool = False,
                 sync_parent: bool = True) -> None:
        self.path, self.parent_fd, self.name = path, parent_fd, name
        self.own_parent, self.sync_parent = own_parent, sync_parent
        self.tmp = f"{TMP_PREFIX}{name}-{token()}"
        self.published = False
        os.mkdir(self.tmp, dir_fd=parent_fd)
        try:
            self.fds = [os.open(self.tmp, O_DIR, dir_fd=parent_fd)]  # the directory first, then its files
        except BaseException:
            remove_at(parent_fd, self.tmp)
            raise

    def write(self, name: str, data: FileBytes) -> None:
        self.fds.append(write_unsynced(self.fds[0], name, data))

    def take_fds(self) -> list[int]:
        """The open fds of the staged directory and its files, handed over to be synced and closed."""
        fds, self.fds = self.fds, []
        return fds

    def sync(self) -> None:
        fds = self.take_fds()
        try:
            failed = fsync_all(fds)  # every file and the directory, synced side by side
            if failed:
                raise next(iter(failed.values()))
        finally:
            for fd in fds:
                os.close(fd)

    def publish(self, overwrite: bool) -> bool:
        if not publish_rename(self.parent_fd, self.tmp, self.name, self.path, overwrite):
            return False
        self.published = True
        if self.sync_parent:
            fsync_dir(self.parent_fd)
        return True

    def discard(self) -> None:
        for fd in self.take_fds():
            os.close(fd)
        if not self.published and self.parent_fd >= 0:
            remove_at(self.parent_fd, self.tmp)
            self.published = True  # nothing left to remove
        if self.own_parent and self.parent_fd >= 0:
            os.close(self.parent_fd)
        self.parent_fd = -1


class LocalBatch(Batch):
    """Small entries written together: every file of every entry is written, then all are synced, then
    each entry is published by its own rename, then each parent directory is synced once.

    Each entry is durable before it becomes visible, as one written alone, for a fraction of the
    system calls. Where ``syncfs`` reports writeback errors, a filesystem holding at least
    :data:`~stepskip._storage._linux.SYNCFS_MIN_ENTRIES` entries of the batch is synced by one
    ``syncfs`` instead of an ``fsync`` per file and directory; a long batch is synced every
    :data:`~stepskip._storage._linux.SYNCFS_CHUNK_ENTRIES` entries as it is staged (creating files
    slows down the longer a filesystem goes unsynced), each ``syncfs`` on the sync pool while the next
    entries are staged; after one fails, the rest is synced file by file. The renames wait for the
    whole batch. (``syncfs`` also writes back what other programs left dirty: it is used only while
    the system holds little dirty data, and only on the filesystems of
    :data:`~stepskip._storage._linux.SYNCFS_FILESYSTEMS`.)
    """

    def __init__(self, backend: Any) -> None:
        super().__init__(backend)
        self.local: Directories = backend
        self.parents: dict[str, int] = {}  # parent directory -> its fd, shared by the batch's entries
        self.parent_of: dict[int, int] = {}  # entry -> the fd of its parent
        self.syncs = Syncs()
        self.held: dict[int, list[int]] = {}  # fds left for one syncfs of their filesystem
        self.running: Any = None  # the syncfs of earlier entries, running while the next ones are staged
        self.whole = _linux.syncfs_available()

    def stage(self, path: str) -> LocalStaging:
        parent, name = self.local.place(path)
        if parent not in self.parents:
            self.parents[parent] = self.local.open_dir(parent, create=True)
        staging = LocalStaging(path, self.parents[parent], name, sync_parent=False)
        self._stagings.append(staging)
        return staging

    def staged(self, key: int, staging: Staging) -> None:
        assert isinstance(staging, LocalStaging)
        fds = staging.take_fds()
        self.parent_of[key] = staging.parent_fd
        if not self.whole:  # synced (and closed) side by side while the next entries are written
            self.syncs.start(key, fds)
            return
        self.held[key] = fds
        if len(self.held) >= _linux.SYNCFS_CHUNK_ENTRIES and (self.running is None or self.running.done()):
            # a failed syncfs may have taken the error of a file written while it ran: trust none after it
            self.whole = self.running is None or self.running.result()
            self.running = sync_held(self.held, self.parent_of, self.syncs, self.whole, background=True)

    def sync(self) -> dict[int, OSError]:
        if self.running is not None and not self.running.result():
            self.whole = False
        sync_held(self.held, self.parent_of, self.syncs, self.whole)
        return self.syncs.wait()  # every file and directory of every entry: then the renames

    def published(self) -> None:
        fsync_all(list(set(self.parents.values())))  # the renames: best effort, as for one entry

    def close(self) -> None:
        for fds in self.held.values():  # the entries' source raised before they were synced
            self.syncs.close(None, fds)
        self.held.clear()
        self.syncs.wait()  # every fd closed, also when the source itself raised
        super().close()  # nothing partial stays behind
        for fd in self.parents.values():
            os.close(fd)
        self.parents.clear()


def publish_rename(parent_fd: int, tmp: str, name: str, path: str, overwrite: bool) -> bool:
    """Rename the staged ``tmp`` to ``name``; an entry already there is swapped out (readers see the old
    one, then the new one, never a gap) or moved to the trash. False when one is there and not
    ``overwrite``."""
    for _ in range(16):
        try:
            os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            return True
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
                raise
        if not overwrite:
            return False
        if exchange(parent_fd, tmp, name):
            remove_at(parent_fd, tmp)  # the old entry (or a link or file that stood there)
            return True
        trash = f"{TRASH_PREFIX}{name}-{token()}"
        try:
            os.rename(name, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        except FileNotFoundError:
            continue  # another writer moved it away first; try again
        remove_at(parent_fd, trash)
    raise OSError(errno.EBUSY, f"could not publish {path}: too many concurrent writers")


def retire_at(parent_fd: int, name: str) -> None:
    """Rename to a ``.trash-`` sibling (readers see the entry whole or gone), then delete that."""
    trash = f"{TRASH_PREFIX}{name}-{token()}"
    try:
        os.rename(name, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    except FileNotFoundError:
        return
    remove_at(parent_fd, trash)


def put_at(parent_fd: int, name: str, data: FileBytes) -> None:
    """Write the file ``name`` in ``parent_fd`` so that readers see the old bytes or the new ones: a
    synced temporary renamed over it, the rename itself made durable as an entry's is."""
    tmp = f"{TMP_PREFIX}{name}-{token()}"
    try:
        fd = write_unsynced(parent_fd, tmp, data)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        fsync_dir(parent_fd)
    finally:
        remove_at(parent_fd, tmp)  # gone already when renamed


def publish_dir_at(parent_fd: int, tmp: str, name: str, path: str) -> None:
    """Publish the staged directory ``tmp`` (complete entries) as ``name`` in ``parent_fd``, replacing what
    was there: the entries' own renames into it are made durable first, the publishing after."""
    tmp_fd = os.open(tmp, O_DIR, dir_fd=parent_fd)
    try:
        os.fsync(tmp_fd)
    finally:
        os.close(tmp_fd)
    publish_rename(parent_fd, tmp, name, path, overwrite=True)
    fsync_dir(parent_fd)
