"""Which failures mean "this storage cannot be used" (a one-line error) and which are bugs or missing
paths (left to their own handling), and the wording of the one line."""

from __future__ import annotations

import pytest

from stepskip._access import describe_store_access_error, is_store_access_error


def test_client_library_failures_are_access_errors():
    exceptions = pytest.importorskip("botocore.exceptions")
    for err in (exceptions.NoCredentialsError(), exceptions.EndpointConnectionError(endpoint_url="http://x"),
                exceptions.ClientError({"Error": {"Code": "InvalidAccessKeyId"}}, "ListObjectsV2")):
        assert is_store_access_error(err), err


@pytest.mark.parametrize("err", [PermissionError(13, "Permission denied"), ConnectionRefusedError(111, "refused"),
                                 TimeoutError("timed out")])
def test_refusals_and_silences_are_access_errors(err):
    assert is_store_access_error(err)


@pytest.mark.parametrize("err", [FileNotFoundError(2, "no such file"), ValueError("bad"), KeyError("k"),
                                 TypeError("a bug"), OSError(28, "No space left on device")])
def test_missing_paths_and_bugs_are_not(err):
    assert not is_store_access_error(err)


def test_the_line_names_the_url_and_the_cause_on_one_line():
    line = describe_store_access_error("s3://b/p", ConnectionError("Could not connect\n  to http://h:1/"))
    assert line.startswith("s3://b/p: cannot reach the object store (ConnectionError: Could not connect to http://h:1/)")
    assert "\n" not in line


def test_a_local_path_is_not_called_an_object_store():
    line = describe_store_access_error("/data/cache", PermissionError(13, "Permission denied"))
    assert line.startswith("/data/cache: this process cannot access it (PermissionError: ")
    assert "object store" not in line
