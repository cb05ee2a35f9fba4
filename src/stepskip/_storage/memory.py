"""The in-memory backend: a tree of directories and files in this process, for tests.

As the local backend: an entry is staged in a hidden ``.tmp-`` directory beside its place and swapped
in whole; a pinned entry holds the directory it opened; directories have versions. Each
``MemoryBackend()`` has a tree of its own; those opened by URL (a scheme given by
:func:`~stepskip._storage.registry.register_backend`) share one per process.

Example:
    >>> from stepskip._storage import EntryStore
    >>> store = EntryStore(MemoryBackend(root="/dump"))
    >>> store.write_entry("/dump/run/0", {"data.json": b"[]"}, {"global_steps": 0})
    99
    >>> store.list_dir("/dump/run")
    ['0']
"""

from __future__ import annotations

import errno
import itertools
import threading
import time
from collections.abc import Mapping
from typing import Any

from stepskip._storage.base import (
    Allocator,
    Backend,
    BadFile,
    Capabilities,
    DirItem,
    NotAnEntry,
    PinnedEntry,
    Raced,
    Staging,
    token,
)
from stepskip._storage.meta import META_FILE, META_MAX_BYTES, TMP_PREFIX, valid_name
from stepskip._entries import FileBytes

__all__ = ["MemoryBackend"]

_inodes = itertools.count(1)


class _File:
    def __init__(self, data: bytes) -> None:
        self.data, self.mtime, self.ino = data, time.time(), next(_inodes)


class _Dir:
    def __init__(self) -> None:
        self.children: dict[str, _Dir | _File] = {}
        self.ino = next(_inodes)
        self.changed_ns = time.time_ns()

    def set(self, name: str, node: _Dir | _File | None) -> None:
        if node is None:
            self.children.pop(name, None)
        else:
            self.children[name] = node
        self.changed_ns = time.time_ns()


_SHARED = (_Dir(), threading.RLock())  # the tree of every backend opened by URL, and its lock


def _parts(path: str) -> list[str]:
    """The names along ``path`` (a ``scheme://`` prefix dropped); ``EINVAL`` for ``.`` or ``..``."""
    _, sep, rest = path.partition("://")
    parts = [p for p in (rest if sep else path).split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise OSError(errno.EINVAL, "a path with '.' or '..' components", path)
    return parts


class MemoryBackend(Backend):
    """Entries in memory (see the module). ``root``: the dump dir, outside which nothing is removed."""

    capabilities = Capabilities(atomic_dir_publish=True, version_stamps=True, dir_versions=True)

    def __init__(self, root: str | None = None, *, _shared: bool = False) -> None:
        self.root = root.rstrip("/") if root is not None else None
        self._top, self._lock = _SHARED if _shared else (_Dir(), threading.RLock())

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any]) -> MemoryBackend:
        return cls(url, _shared=True)

    def _node(self, path: str) -> _Dir | _File | None:
        """What is at ``path``; None when nothing is (or the path goes through a file, or has '..')."""
        try:
            parts = _parts(path)
        except OSError:
            return None
        node: _Dir | _File = self._top
        for part in parts:
            if not isinstance(node, _Dir) or part not in node.children:
                return None
            node = node.children[part]
        return node

    def _dir(self, path: str, create: bool = False) -> _Dir:
        node = self._top
        for part in _parts(path):
            child = node.children.get(part)
            if child is None and create:
                child = _Dir()
                node.set(part, child)
            if child is None:
                raise FileNotFoundError(errno.ENOENT, "no such directory", path)
            if not isinstance(child, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, f"{part} is a file, not a directory", path)
            node = child
        return node

    def _place(self, path: str, create: bool = True) -> tuple[_Dir, str]:
        parts = _parts(path)
        if not parts or not valid_name(parts[-1]):
            raise OSError(errno.EINVAL, f"{parts[-1] if parts else path!r} cannot name an entry", path)
        return self._dir("/" + "/".join(parts[:-1]), create), parts[-1]

    # ------------------------------------------------------------------ looking

    def names(self, path: str, dirs_only: bool = False) -> list[str]:
        return [item.name for item in self.items(path) if not dirs_only or item.kind == "dir"]

    def items(self, path: str) -> list[DirItem]:
        with self._lock:
            node = self._node(path)
            return [_item(name, child) for name, child in node.children.items()] if isinstance(node, _Dir) else []

    def stat(self, path: str) -> DirItem | None:
        node = self._node(path)
        return None if node is None else _item(path.rstrip("/").rsplit("/", 1)[-1], node)

    def dir_version(self, path: str) -> tuple[int, ...] | None:
        node = self._node(path)
        return (0, node.ino, node.changed_ns, node.changed_ns) if isinstance(node, _Dir) else None

    # ------------------------------------------------------------------ reading

    def open_entry(self, path: str) -> MemoryEntry:
        with self._lock:
            try:
                return MemoryEntry(self, path, self._dir(path))
            except NotADirectoryError as err:
                node = self._node(path)
                raise NotAnEntry(f"{path} is a file, not a directory", damaged=isinstance(node, _File)) from err

    def read_file(self, path: str, limit: int) -> bytes | None:
        node = self._node(path)
        if isinstance(node, _Dir):
            raise BadFile(f"{path} is a directory, not a file")
        if node is not None and len(node.data) > limit:
            raise BadFile(f"{path} is more than the {limit} bytes it may have")
        return None if node is None else node.data

    # ------------------------------------------------------------------ writing

    def put_file(self, path: str, data: FileBytes) -> None:
        with self._lock:
            parent, name = self._place(path)
            if isinstance(parent.children.get(name), _Dir):
                raise IsADirectoryError(errno.EISDIR, "a directory is there", path)
            parent.set(name, _File(bytes(data)))

    def stage(self, path: str) -> MemoryStaging:
        with self._lock:
            parent, name = self._place(path)
            return MemoryStaging(self, path, parent, name)

    def publish_dir(self, staging: str, path: str) -> None:
        with self._lock:
            parent, name = self._place(path, create=False)
            tmp_parent, tmp = self._place(staging, create=False)
            node = parent.children.get(tmp)
            if tmp_parent is not parent or not tmp.startswith(TMP_PREFIX) or not isinstance(node, _Dir):
                raise OSError(errno.EINVAL, f"{staging} is not a {TMP_PREFIX} directory beside {path}", path)
            parent.set(tmp, None)
            parent.set(name, node)

    # ------------------------------------------------------------------ deleting

    def _confined(self, path: str) -> tuple[_Dir, str]:
        parts = _parts(path)
        if self.root is not None:
            root = _parts(self.root)
            if len(parts) <= len(root) or parts[:len(root)] != root:
                raise OSError(errno.EPERM, f"refusing to delete outside the dump dir {self.root}", path)
        if not parts:
            raise OSError(errno.EPERM, "refusing to delete the root", path)
        return self._dir("/" + "/".join(parts[:-1])), parts[-1]

    def remove(self, path: str) -> None:
        self.retire(path)

    def retire(self, path: str) -> bool:
        with self._lock:
            try:
                parent, name = self._confined(path)
            except (FileNotFoundError, NotADirectoryError):
                return False  # below a file or nothing: nothing to remove
            found = name in parent.children
            parent.set(name, None)
            return found


class MemoryEntry(PinnedEntry):
    """An entry's directory node as it was when opened: a replacement puts another node in its place."""

    def __init__(self, backend: MemoryBackend, path: str, node: _Dir) -> None:
        self.backend, self.path, self.node = backend, path, node

    def _file(self, name: str) -> _File:
        node = self.node.children.get(name)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", name)
        if not isinstance(node, _File):
            raise BadFile(f"{name} is not a regular file")
        return node

    def read_meta(self) -> tuple[bytes, tuple[int, ...] | None]:
        node = self._file(META_FILE)
        if len(node.data) > META_MAX_BYTES:
            raise BadFile(f"{META_FILE} is {len(node.data)} bytes, more than the {META_MAX_BYTES} it may have")
        return node.data, (self.node.ino, node.ino)

    def meta_stamp(self) -> tuple[int, ...] | None:
        node = self.node.children.get(META_FILE)
        return (self.node.ino, node.ino) if isinstance(node, _File) else None

    def read(self, name: str, size: int | None, allocator: Allocator | None = None) -> bytes | memoryview:
        data = self._file(name).data
        if size is not None and len(data) != size:
            raise BadFile(f"{name} has {len(data)} bytes, {META_FILE} says {size}")
        view = allocator(len(data)) if allocator is not None and data else None
        if view is None:
            return data
        view[:] = data
        return view

    def check(self, name: str, size: int) -> None:
        self.read(name, size)

    def has_file(self, name: str) -> bool:
        return isinstance(self.node.children.get(name), _File)

    def absent(self) -> str:
        if self.replaced():
            raise Raced()
        return ""

    def replaced(self) -> bool:
        return self.backend._node(self.path) is not self.node

    def reopen(self) -> MemoryEntry:
        return self.backend.open_entry(self.path)


class MemoryStaging(Staging):
    """A directory node built under a ``.tmp-`` name beside the entry, then swapped into its place."""

    def __init__(self, backend: MemoryBackend, path: str, parent: _Dir, name: str) -> None:
        self.backend, self.path, self.parent, self.name = backend, path, parent, name
        self.node, self.tmp, self.done = _Dir(), f"{TMP_PREFIX}{name}-{token()}", False
        parent.set(self.tmp, self.node)

    def write(self, name: str, data: FileBytes) -> None:
        if name in self.node.children:
            raise FileExistsError(errno.EEXIST, "already written", name)
        self.node.set(name, _File(bytes(data)))

    def sync(self) -> None:
        """Memory is as durable as it gets."""

    def publish(self, overwrite: bool) -> bool:
        with self.backend._lock:
            if self.name in self.parent.children and not overwrite:
                return False
            self.parent.set(self.tmp, None)
            self.parent.set(self.name, self.node)
            self.done = True
            return True

    def discard(self) -> None:
        with self.backend._lock:
            if not self.done and self.parent.children.get(self.tmp) is self.node:
                self.parent.set(self.tmp, None)
            self.done = True


def _item(name: str, node: _Dir | _File) -> DirItem:
    if isinstance(node, _Dir):
        return DirItem(name, "dir", 0, node.changed_ns / 1e9)
    return DirItem(name, "file", len(node.data), node.mtime)
