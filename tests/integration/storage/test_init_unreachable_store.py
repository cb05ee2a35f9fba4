"""``SkipManager.init`` with an object store it cannot use: one SkipConfigError naming the key and the
cause, before any step runs. Real stores only: a moto S3 server refusing the credentials, a local port
nothing listens on, and no credentials at all (see tests/support/unreachable_stores.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from unreachable_stores import bad_credentials, closed_endpoint, no_credentials, refusing_s3, s3_options

from stepskip import SkipConfigError, SkipManager


@pytest.fixture(scope="module")
def refusing_endpoint() -> Iterator[str]:
    with refusing_s3() as endpoint:
        yield endpoint


@pytest.fixture
def unreachable_endpoint() -> Iterator[str]:
    with closed_endpoint() as endpoint:
        yield endpoint


def init_error(role: str, body: dict[str, Any]) -> str:
    with pytest.raises(SkipConfigError) as info:
        SkipManager.init({"skip": {role: {"enable": True, "steps": [1], **body}}})
    message = str(info.value)
    assert "\n" not in message  # one line, whatever the client library said
    assert SkipManager.skip_instances == {}  # nothing started
    return message


@pytest.mark.parametrize(("role", "extra"), [("rollout", {}), ("rollout_tq", {}), ("reward", {"kind": "stage"})])
def test_refused_credentials_name_the_role_key_and_the_cause(role, extra, refusing_endpoint, monkeypatch):
    bad_credentials(monkeypatch)
    message = init_error(role, {**extra, "dump_dir": "s3://stepskip-cache/dump",
                                "storage_options": s3_options(refusing_endpoint)})
    assert message.startswith(f"skip.{role}.dump_dir = s3://stepskip-cache/dump: cannot reach the object store")
    assert "PermissionError" in message and "Access Key Id" in message
    assert "credentials" in message and "endpoint_url" in message


def test_no_credentials_at_all(refusing_endpoint, monkeypatch, tmp_path: Path):
    no_credentials(monkeypatch, tmp_path)
    message = init_error("rollout", {"dump_dir": "s3://stepskip-cache/dump",
                                     "storage_options": s3_options(refusing_endpoint)})
    assert "skip.rollout.dump_dir" in message and "NoCredentialsError" in message


def test_an_endpoint_that_does_not_answer(unreachable_endpoint, monkeypatch):
    bad_credentials(monkeypatch)  # never checked: nothing answers
    message = init_error("rollout", {"dump_dir": "s3://stepskip-cache/dump",
                                     "storage_options": s3_options(unreachable_endpoint)})
    assert "skip.rollout.dump_dir" in message and "EndpointConnectionError" in message
    assert unreachable_endpoint in message


def test_a_replay_only_role_is_refused_the_same_way(unreachable_endpoint, monkeypatch):
    bad_credentials(monkeypatch)
    message = init_error("rollout", {"dump_dir": "s3://stepskip-cache/dump", "action": "replay",
                                     "storage_options": s3_options(unreachable_endpoint)})
    assert "skip.rollout.dump_dir" in message
