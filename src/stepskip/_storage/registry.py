"""Which backend stores a dump dir: looked up by the URL's scheme, and the checks a dump dir passes at start-up.

Plain paths and ``file://`` / ``local://`` URLs go to the local backend; a scheme a backend was
registered for (:func:`register_backend`) to that backend; any other scheme to fsspec, which knows
``s3://``, ``gs://``, ``memory://`` and more once their packages are installed.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from stepskip._storage.base import Backend
from stepskip._storage.entries import EntryStore
from stepskip._storage.fsspec import FsspecBackend
from stepskip._storage.local import LocalBackend, local_path
from stepskip._storage.meta import GRACE_SECONDS, NAME_MAX
from stepskip.errors import SkipConfigError

__all__ = ["register_backend", "registered_schemes", "backend_class", "open_store", "check_dump_dir"]

_BACKENDS: dict[str, type[Backend]] = {"file": LocalBackend, "local": LocalBackend}
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")


def register_backend(scheme: str, cls: type[Backend] | None) -> type[Backend] | None:
    """Store dump dirs whose URL starts with ``scheme://`` with backend ``cls`` (None: no longer).

    Args:
        scheme: a URL scheme (lower-case letters, digits, ``+``, ``-``, ``.``).
        cls: a :class:`~stepskip._storage.base.Backend` subclass; its ``from_url`` opens a dump dir.

    Returns:
        The backend registered for ``scheme`` before, if any.

    Raises:
        SkipConfigError: ``scheme`` is not a scheme, or ``cls`` is not a backend class.

    Example:
        >>> from stepskip._storage.memory import MemoryBackend
        >>> register_backend("mem", MemoryBackend) is None
        True
        >>> type(open_store("mem://bucket/dump").backend).__name__
        'MemoryBackend'
        >>> register_backend("mem", None).__name__
        'MemoryBackend'
    """
    if not isinstance(scheme, str) or not _SCHEME.match(scheme):
        raise SkipConfigError(f"register_backend: scheme {scheme!r} is not a URL scheme "
                              "(lower-case letters, digits, '+', '-', '.'; e.g. 'mem')")
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise SkipConfigError(f"register_backend: {cls!r} is not a Backend subclass (stepskip._storage.Backend)")
    previous = _BACKENDS.pop(scheme, None)
    if cls is not None:
        _BACKENDS[scheme] = cls
    return previous


def registered_schemes() -> list[str]:
    """The schemes a backend was registered for (sorted); any other goes to fsspec.

    Example:
        >>> registered_schemes()
        ['file', 'local']
    """
    return sorted(_BACKENDS)


def backend_class(url: str) -> type[Backend]:
    """The backend class for dump dir ``url``: by its scheme, local for plain paths, fsspec otherwise.

    Example:
        >>> backend_class("/tmp/dump").__name__, backend_class("s3://bucket/dump").__name__
        ('LocalBackend', 'FsspecBackend')
    """
    scheme = url.partition("://")[0] if "://" in url else "file"
    return _BACKENDS.get(scheme, FsspecBackend)


def open_store(dump_dir: str, storage_options: Mapping[str, Any] | None = None, *,
               grace_seconds: float = GRACE_SECONDS) -> EntryStore:
    """The store for ``dump_dir``, over the backend its scheme names (:func:`backend_class`).

    Raises:
        SkipConfigError: no backend can open the URL (the message names the schemes there are).

    Example:
        >>> type(open_store("/tmp/dump").backend).__name__, type(open_store("memory://bucket/dump").backend).__name__
        ('LocalBackend', 'FsspecBackend')
    """
    backend = backend_class(dump_dir).from_url(dump_dir, dict(storage_options or {}))
    return EntryStore(backend, grace_seconds=grace_seconds)


def check_dump_dir(dump_dir: str, storage_options: Mapping[str, Any] | None = None, *, key: str = "dump_dir",
                   entry_dir: str | None = None) -> None:
    """Check at startup that a dump dir can be used, with an error that names the key and the fix.

    Local dump dirs must be directories this process can list and enter (or not exist yet, below
    a directory); every name the cache creates below it must fit in a file name (255 bytes).
    Other URLs are only checked for a backend being able to open them.

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
    local = local_path(dump_dir)
    if local is None:
        open_store(dump_dir, storage_options)
        return
    root = os.path.abspath(os.path.expanduser(local))
    if entry_dir is not None:
        target = LocalBackend.absolute(entry_dir)
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
