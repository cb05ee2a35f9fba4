"""Whether this process can use a dump dir: write into it (local), reach it at all (object stores).

Both are start-up questions. An action that records into a directory it cannot write would log a
dump failure at every step and replay nothing later; an object store that refuses the credentials
or does not answer would fail the first call deep inside its client library. Asked once at
``SkipManager.init``, each becomes one :class:`~stepskip.errors.SkipConfigError` that names the key
and the fix. The command line turns the same failures into a one-line error.
"""

from __future__ import annotations

import errno
import os
import tempfile

from stepskip.errors import SkipConfigError
from stepskip._layout import is_url, normalize_location

__all__ = ["check_writable", "is_store_access_error", "describe_store_access_error"]

# Where the failure of an object store's client comes from when it is not an OSError: its
# credentials, its HTTP layer or its SDK (s3fs, gcsfs and adlfs raise these through).
_CLIENT_MODULES = ("botocore.", "aiobotocore.", "aiohttp.", "google.auth.", "google.api_core.", "gcsfs.",
                   "azure.core.", "azure.identity.", "adlfs.")
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


def check_writable(dump_dir: str, path: str, *, key: str, fix: str) -> None:
    """Refuse a local dump dir that exists but cannot be written where the role will write.

    The deepest directory of ``path`` (the role's run directory) that exists at or below
    ``dump_dir`` gets a temporary file, removed at once (on Linux it never has a name): mode bits,
    access lists, read-only mounts and squashed root on network filesystems all answer as a real
    write would, which ``os.access`` does not (root passes it whatever the mode). A ``dump_dir`` that
    does not exist yet is not looked at here (nothing would be created outside it).

    Args:
        dump_dir: the local dump dir (absolute).
        path: where the role writes, at or below ``dump_dir``.
        key: the configuration key to name (``skip.rollout.dump_dir``).
        fix: how to use the cache without writing, e.g. ``set skip.rollout.action = replay``.

    Raises:
        SkipConfigError: the write was refused (permissions, a read-only filesystem).

    Example:
        >>> import tempfile
        >>> check_writable(tempfile.gettempdir(), tempfile.gettempdir() + "/run", key="skip.rollout.dump_dir",
        ...                fix="set skip.rollout.action = replay")
    """
    root = os.path.abspath(dump_dir)
    current = os.path.abspath(path)
    if current != root and not current.startswith(root.rstrip("/") + "/"):
        current = root
    while not os.path.lexists(current):
        if current == root:
            return
        current = os.path.dirname(current)
    if not os.path.isdir(current):
        return  # a file in the way: the store's own checks and the dump say so
    try:
        with tempfile.TemporaryFile(dir=current, prefix=".stepskip-probe-"):
            pass
    except OSError as err:
        if err.errno not in _DENIED:
            return  # a full disk or a flaky mount may recover; each failed dump is logged
        who = f"uid {os.geteuid()}" if hasattr(os, "geteuid") else "this user"
        raise SkipConfigError(
            f"{key} = {dump_dir!r}: this process ({who}) cannot write in {current} ({err.strerror}), so no "
            f"step would be recorded; make it writable (chmod/chown, a read-write mount), choose another "
            f"dump_dir, or, to replay the entries already there without writing, {fix}"
        ) from err


def is_store_access_error(err: BaseException) -> bool:
    """True for a failure to reach or be let into storage (credentials, network, permission),
    rather than a missing path or a bug.

    Example:
        >>> is_store_access_error(PermissionError("Forbidden")), is_store_access_error(FileNotFoundError("x"))
        (True, False)
    """
    from stepskip._storage.outages import StoreOutage

    if isinstance(err, StoreOutage):
        return True
    if isinstance(err, (PermissionError, ConnectionError, TimeoutError)):
        return True
    return any(cls.__module__.startswith(_CLIENT_MODULES) for cls in type(err).__mro__)


def describe_store_access_error(url: str, err: BaseException) -> str:
    """One line for storage that cannot be reached or read: where, the cause, what to check.

    Example:
        >>> describe_store_access_error("s3://bucket/dump", PermissionError("Forbidden"))  # doctest: +ELLIPSIS
        's3://bucket/dump: cannot reach the object store (PermissionError: Forbidden); check ...'
    """
    from stepskip._storage.outages import StoreOutage

    if isinstance(err, StoreOutage):  # the client's own error says what went wrong
        err = err.cause
    cause = f"{type(err).__name__}: {' '.join(str(err).split()) or 'no message'}"
    if not is_url(normalize_location(url)):
        return f"{url}: this process cannot access it ({cause}); check its permissions or pass another path"
    return (f"{url}: cannot reach the object store ({cause}); check its credentials (environment, profile, "
            "storage options) and its endpoint (client_kwargs.endpoint_url), and that they give access to "
            "this bucket and prefix")
