"""Object stores a process cannot use, for real: an S3 server that refuses every credential, an
endpoint nothing answers on, and an environment with no credentials at all."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# moto in server mode with its IAM simulation on from the first request: it knows no access key,
# so every signed request is answered 403 (InvalidAccessKeyId), as AWS answers unknown credentials.
_REFUSING_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%s" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the test closes stdin
server.stop()
"""

CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                        "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                        "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")


@contextmanager
def refusing_s3() -> Iterator[str]:
    """The endpoint URL of an S3 server that refuses every credential."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = subprocess.Popen([sys.executable, "-c", _REFUSING_SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    assert server.stdin is not None and server.stdout is not None
    try:
        address = server.stdout.readline().strip()
        assert address, "the moto server did not start"
        yield f"http://{address}"
    finally:
        server.stdin.close()
        server.wait(timeout=120)


@contextmanager
def closed_endpoint() -> Iterator[str]:
    """The URL of a local port that refuses connections: bound, so nothing else takes it, never listened on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec options for ``endpoint``; one attempt per request, so a refused connection fails at once."""
    return {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True,
            "config_kwargs": {"retries": {"max_attempts": 1}}}


def bad_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials that no server knows."""
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASTEPSKIPUNKNOWN0")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-secret-anyone-knows")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials anywhere botocore looks: environment, shared files, instance metadata."""
    for name in CREDENTIAL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
