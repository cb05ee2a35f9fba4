"""The fsspec backend: entries on any fsspec filesystem (``s3://``, ``gs://``, ``memory://`` ...), shared by
many nodes.

Object stores have no directory rename, so entries are committed ``meta.json`` last over data
objects named for their write (:mod:`stepskip._storage.objects`); a version of an entry is the
``meta.json`` read, and a read that fails re-reads it to tell damage from a writer's replacement.
Every read is bounded: an object is fetched by a byte range one past its expected size, so one
larger than it should be is never fetched whole. A read or a listing the store did not answer (a
timeout, a connection error, a 5xx) raises :class:`~stepskip._storage.outages.StoreOutage`, never an
error that reads as damage or as an empty directory.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from stepskip._storage.base import Backend, Capabilities, DirItem, Tree
from stepskip._storage.meta import MANIFEST_FILE, META_FILE
from stepskip._storage.objects import ObjectBackend, is_write_named
from stepskip._storage.outages import StoreOutage, outage_of
from stepskip._entries import FileBytes
from stepskip.errors import SkipConfigError

__all__ = ["FsspecBackend"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class FsspecBackend(ObjectBackend):
    """Bytes on an fsspec filesystem (see the module).

    Args:
        fs: the fsspec filesystem.
        root: the dump dir (URL or path); :meth:`remove` refuses anything outside it.
    """

    capabilities = Capabilities(cheap_tree_scan=True)

    def __init__(self, fs: Any, root: str | None = None) -> None:
        self.fs = fs
        self.root = self.key(root).rstrip("/") if root is not None else None

    @classmethod
    def from_url(cls, url: str, storage_options: Mapping[str, Any]) -> Backend:
        """The backend of ``url``: a local filesystem behind a URL is walked as a local path.

        Raises:
            SkipConfigError: fsspec cannot open ``url`` (its filesystem is not installed or not known).
        """
        try:
            import fsspec

            fs, _ = fsspec.core.url_to_fs(url, **dict(storage_options))
        except (ImportError, ValueError) as err:
            from stepskip._storage.registry import registered_schemes

            raise SkipConfigError(
                f"dump_dir = {url!r}: cannot open this URL ({err}); stepskip's backends take "
                f"{', '.join(s + '://' for s in registered_schemes())} and plain paths, and fsspec every other "
                "scheme it knows: install the filesystem's package (e.g. `pip install stepskip[s3]` for s3://) "
                "or use a local path"
            ) from err
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        if {"file", "local"} & set(protocols):
            from stepskip._storage.local import LocalBackend

            return LocalBackend(fs._strip_protocol(url))
        return cls(fs, root=url)

    def key(self, path: str) -> str:
        """``path`` as the filesystem names it (its protocol stripped)."""
        return str(self.fs._strip_protocol(path))

    def fresh(self, path: str) -> str:
        """``path``'s key, with what the filesystem remembers of its listings of it and of the directories
        above it dropped: the next look asks the store. Filesystems such as s3fs answer ``ls`` and ``info``
        from listings taken earlier in the process, for as long as it runs; another node's writes and
        deletions since would stay unseen (``repeat`` replaying an older step than the newest recorded).
        """
        key = self.key(path)
        self.fs.invalidate_cache(key)
        return key

    def _listed(self, path: str) -> Mapping[str, Any] | None:
        """What a listing the filesystem holds says of the data object at ``path``, when it names it.

        A data object is named for the write that made it and never changes, so a listing that names it
        is still right about its size; one that does not name it may predate it, and is not believed.
        """
        key = self.key(path)
        parent, _, name = key.rpartition("/")
        if not is_write_named(name):
            return None
        try:
            listing = getattr(self.fs, "dircache", {}).get(parent)
        except Exception:  # a cache this backend does not know the shape of: ask the store
            return None
        for info in listing or ():
            if isinstance(info, Mapping) and str(info.get("name", "")).rstrip("/") == key:
                return info
        return None

    # ------------------------------------------------------------------ bytes

    def get(self, path: str, end: int | None = None) -> bytes:
        if end is None:
            return bytes(_answered(path, self.fs.cat_file, self.key(path)))
        return bytes(_answered(path, self.fs.cat_file, self.key(path), start=0, end=end))

    def size(self, path: str) -> int:
        listed = self._listed(path)
        if listed is not None and listed.get("type") == "file" and isinstance(listed.get("size"), int):
            return int(listed["size"])
        return int(_answered(path, self.fs.size, self.fresh(path)))

    def is_file(self, path: str) -> bool:
        # not fsspec's isfile, which answers False for any failure, an outage included
        listed = self._listed(path)
        if listed is not None and listed.get("type") == "file":
            return True
        try:
            return bool(_answered(path, self.fs.info, self.fresh(path)).get("type") == "file")
        except StoreOutage:
            raise
        except OSError:
            return False

    # ------------------------------------------------------------------ looking

    def is_dir(self, path: str) -> bool:
        try:
            return bool(_answered(path, self.fs.isdir, self.fresh(path)))
        except StoreOutage:
            raise
        except OSError:
            return False

    def _ls(self, path: str) -> list[Mapping[str, Any]]:
        root = self.fresh(path).rstrip("/")
        try:
            listed = _answered(path, self.fs.ls, root, detail=True)
            return [i for i in listed if str(i.get("name", "")).rstrip("/") != root]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def names(self, path: str, dirs_only: bool = False) -> list[str]:
        return sorted({_name(i) for i in self._ls(path) if not dirs_only or i.get("type") == "directory"})

    def items(self, path: str) -> list[DirItem]:
        items: dict[str, DirItem] = {}
        for info in self._ls(path):
            items.setdefault(_name(info), _item(info))
        return [items[n] for n in sorted(items)]

    def stat(self, path: str) -> DirItem | None:
        try:
            return _item(_answered(path, self.fs.info, self.fresh(path)))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def scan(self, path: str) -> Tree:
        """Every object below ``path``, from one recursive listing (one request per 1,000 objects on S3)."""
        root = self.key(path).rstrip("/")
        try:
            found = _answered(path, self.fs.find, root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            found = {}
        files: dict[str, DirItem] = {}
        for key, info in dict(found).items():
            key = str(key)
            if key.endswith("/") or not key.startswith(root + "/") or not isinstance(info, Mapping):
                continue  # a directory marker, or something outside the listed prefix
            item = _item(info)
            if item.kind == "file":
                files[key[len(root) + 1:]] = item
        return Tree(path, files)

    def forget_listings(self, path: str) -> None:
        # Only the listings of path and below: its parents' (the run directory's) stay, and the cache is
        # walked down from path's own cached listing, so a call costs the subtree, not every cached key
        # (an index calls this once per step). Without a cached listing of path there is no walk to
        # take: every key is looked at then, as below-path listings may still be cached.
        root = self.key(path).rstrip("/")
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

    # ------------------------------------------------------------------ writing and deleting

    def put_file(self, path: str, data: FileBytes) -> None:
        # fsspec's object stores take bytes (a pooled memoryview is copied once, next to an upload)
        self.fs.pipe_file(self.key(path), data if isinstance(data, bytes) else bytes(data))

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(self.key(path))
        except FileNotFoundError:
            pass

    def _confined(self, path: str) -> str:
        p = self.key(path).rstrip("/")
        parts = p.split("/")
        if any(part in ("", ".", "..") for part in parts[1:]):
            raise OSError(errno.EPERM, "refusing to delete a path with '.' or '..' components", path)
        if self.root is not None and not p.startswith(self.root + "/"):
            raise OSError(errno.EPERM, f"refusing to delete outside the dump dir {self.root}", path)
        return p

    def remove(self, path: str) -> None:
        p = self._confined(path)
        self.fs.invalidate_cache(p)  # what is there now, not what a listing held earlier
        try:
            if self.fs.isfile(p):
                self.fs.rm_file(p)
                return
        except FileNotFoundError:
            return
        try:
            found = self.fs.find(p, withdirs=True, detail=True)
        except FileNotFoundError:
            return
        inside = {str(k).rstrip("/"): v for k, v in found.items() if str(k).startswith(p + "/")}
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

    def retire(self, path: str) -> bool:
        """Delete the entry's ``meta.json`` first (readers see a miss from then on), then its objects."""
        p = self._confined(path)
        self.fs.invalidate_cache(p)
        try:
            exists = bool(self.fs.exists(p))
        except OSError:
            exists = False
        if not exists:
            return False
        self.remove(path)
        return True


def _answered(path: str, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``call(*args, **kwargs)``, a failure of the store to answer for ``path`` raised as :class:`StoreOutage`
    (any other error as it is)."""
    try:
        return call(*args, **kwargs)
    except StoreOutage:
        raise
    except Exception as err:
        cause = outage_of(err)
        if cause is not None:
            raise StoreOutage(path, cause) from err
        raise


def _name(info: Mapping[str, Any]) -> str:
    return str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]


def _item(info: Mapping[str, Any]) -> DirItem:
    name = _name(info)
    kind = {"directory": "dir", "file": "file"}.get(str(info.get("type")), "other")
    size = info.get("size") if kind == "file" else 0
    return DirItem(name, kind, size if isinstance(size, int) else 0, _info_time(info))


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
