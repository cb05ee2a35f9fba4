"""Which store errors are outages (the store did not answer) and which are answers (damage, a missing
object): decided by exception type over the cause chain, as the clients raise them (real classes of
botocore and aiohttp, built as the clients build them)."""

from __future__ import annotations

import errno

import pytest

from stepskip._storage.outages import StoreOutage, outage_of


def client_error(status: int, code: str) -> Exception:
    ClientError = pytest.importorskip("botocore.exceptions").ClientError  # the S3 extra (absent in verl's env)

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "GetObject")


def translated(err: Exception) -> OSError:
    """An error as s3fs re-raises a ClientError it has no mapping for: OSError(EIO) caused by it."""
    out = OSError(errno.EIO, str(err))
    out.__cause__ = err
    return out


def outages() -> list[Exception]:
    pytest.importorskip("botocore")
    aiohttp = pytest.importorskip("aiohttp")
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    return [
        TimeoutError("timed out"), ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
        OSError(errno.ETIMEDOUT, "timed out"), OSError(errno.ECONNRESET, "reset"),
        ReadTimeoutError(endpoint_url="http://s3"), EndpointConnectionError(endpoint_url="http://s3"),
        ConnectionClosedError(endpoint_url="http://s3"), aiohttp.ServerDisconnectedError(),
        aiohttp.ClientPayloadError("cut"), client_error(503, "ServiceUnavailable"), client_error(500, "InternalError"),
        translated(client_error(503, "SlowDown")), StoreOutage("s3://b/x", TimeoutError("t")),
    ]


def answers() -> list[Exception]:
    pytest.importorskip("botocore")
    return [
        FileNotFoundError("s3://b/run/3/meta.json"), PermissionError("denied"), OSError(errno.EIO, "bad sector"),
        translated(client_error(404, "NoSuchKey")), client_error(403, "AccessDenied"), ValueError("bad"),
    ]


def test_outages_are_told_apart_from_answers():
    assert [type(e).__name__ for e in outages() if outage_of(e) is None] == []
    assert [type(e).__name__ for e in answers() if outage_of(e) is not None] == []


def test_the_store_error_is_named_and_a_cycle_in_the_chain_ends():
    err = translated(client_error(503, "ServiceUnavailable"))
    outage = StoreOutage("s3://b/x", outage_of(err) or err)
    assert "ClientError" in str(outage) and "HTTP 503" in str(outage) and "s3://b/x" in str(outage)
    a, b = OSError(errno.EIO, "a"), OSError(errno.EIO, "b")
    a.__cause__, b.__cause__ = b, a
    assert outage_of(a) is None
