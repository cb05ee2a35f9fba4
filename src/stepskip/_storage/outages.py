"""Store outages: a store that did not answer is not a store that answered with damage.

An object store fails in two ways that look alike to a reader. It may answer, with bytes that are
wrong (a data object gone, a checksum that does not match): the entry is damaged. Or it may not
answer at all (a timeout, a refused or dropped connection, a 5xx): the entry may be perfectly valid,
and regenerating over it would destroy a recording for a network blip. Backends that talk to a
remote store turn the second kind into :class:`StoreOutage`; the entry is then *unavailable*.

The decision is by exception type, over the whole cause chain (s3fs re-raises a 503 as an
``OSError(EIO)`` whose cause is botocore's ``ClientError``). Nothing here imports a client library:
its classes are recognised by module and name, so this costs nothing where none is installed.
"""

from __future__ import annotations

import errno

__all__ = ["StoreOutage", "outage_of", "describe"]


class StoreOutage(OSError):
    """The store could not be reached or did not answer (timeout, connection error, 5xx): nothing is known
    about the entry. ``cause`` is the client's own error; the message names it."""

    def __init__(self, path: str, cause: BaseException) -> None:
        super().__init__(errno.EIO, f"the store did not answer for {path}: {describe(cause)}", path)
        self.cause = cause

    def __reduce__(self) -> tuple[object, ...]:  # an OSError subclass with its own arguments: rebuilt from them
        return (StoreOutage, (str(self.filename), self.cause))


# errnos of a network that did not carry the request (a refused, reset or timed-out connection)
_NETWORK_ERRNOS = frozenset(getattr(errno, name) for name in (
    "ECONNREFUSED", "ECONNRESET", "ECONNABORTED", "ETIMEDOUT", "EHOSTUNREACH", "ENETUNREACH", "ENETDOWN",
    "EHOSTDOWN", "EPIPE", "ENOTCONN", "EREMOTEIO") if hasattr(errno, name))

# (module prefix, class name) of client errors that mean "no answer": botocore's connection and HTTP
# errors (timeouts, closed connections, streaming errors) and aiohttp's connection and payload errors
_NO_ANSWER = frozenset({
    ("botocore.", "HTTPClientError"), ("botocore.", "ConnectionError"), ("botocore.", "IncompleteReadError"),
    ("aiobotocore.", "HTTPClientError"), ("aiohttp.", "ClientConnectionError"), ("aiohttp.", "ClientPayloadError"),
    ("aiohttp.", "ServerTimeoutError"), ("urllib3.", "ProtocolError"), ("urllib3.", "TimeoutError"),
    ("requests.", "ConnectionError"), ("requests.", "Timeout"),
})

# S3 error codes of a store that answered "not now" (503 SlowDown, 500 InternalError ...); a RequestTimeout
# (400) is the server giving up on a slow connection, as much an outage as a client timeout
_BUSY_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeTooSkewed",
                         "OperationAborted", "Throttling", "ThrottlingException", "503", "500", "502", "504"})

_CHAIN_DEPTH = 8


def outage_of(err: BaseException) -> BaseException | None:
    """The error in ``err``'s cause chain that says the store did not answer, or None (an answer: a missing
    object, a denied request, bytes that are wrong).

    Example:
        >>> outage_of(TimeoutError("read timed out")) is not None
        True
        >>> outage_of(FileNotFoundError("s3://b/run/3/meta.json")) is None
        True
    """
    seen: set[int] = set()
    current: BaseException | None = err
    for _ in range(_CHAIN_DEPTH):
        if current is None or id(current) in seen:
            return None
        seen.add(id(current))
        if _no_answer(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def _no_answer(err: BaseException) -> bool:
    if isinstance(err, StoreOutage):
        return True
    if isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False  # the store answered
    if isinstance(err, (TimeoutError, ConnectionError)):  # socket.timeout, asyncio's and fsspec's timeouts too
        return True
    if isinstance(err, OSError) and err.errno in _NETWORK_ERRNOS:
        return True
    status = _http_status(err)
    if status is not None:
        return status >= 500 or _error_code(err) in _BUSY_CODES
    for cls in type(err).__mro__:
        if any(cls.__module__.startswith(module) and cls.__name__ == name for module, name in _NO_ANSWER):
            return True
    return False


def _http_status(err: BaseException) -> int | None:
    """The HTTP status of a client error that carries its response (botocore's ``ClientError``), else None."""
    response = getattr(err, "response", None)
    if not isinstance(response, dict):
        return None
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    if isinstance(status, int) and not isinstance(status, bool):
        return status
    return 0 if _error_code(err) else None


def _error_code(err: BaseException) -> str:
    response = getattr(err, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    code = error.get("Code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else ""


def describe(err: BaseException) -> str:
    """``TypeName: message`` of a client error on one line, the HTTP status included where there is one."""
    status = _http_status(err)
    text = " ".join(str(err).split()) or "no message"
    if status:
        text = f"HTTP {status}: {text}"
    return f"{type(err).__name__}: {text}"
