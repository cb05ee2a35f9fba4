"""Every command on an object store it cannot use: one line on stderr naming the URL and the cause, exit
code 2 (a usage problem, not a finding about a cache). Real stores only (see
tests/support/unreachable_stores.py); the commands run in process, so a traceback fails the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_run import stepskip
from unreachable_stores import bad_credentials, closed_endpoint, no_credentials, refusing_s3, s3_options

URL = "s3://stepskip-cache/dump"
RUN = f"{URL}/exp_proj/GBS4_N2_in8_out6"


def option_args(endpoint: str) -> list[str]:
    options = s3_options(endpoint)
    return ["-o", f"client_kwargs.endpoint_url={endpoint}", "-o", "skip_instance_cache=true",
            "-o", f"config_kwargs.retries.max_attempts={options['config_kwargs']['retries']['max_attempts']}"]


def assert_one_line_exit_2(result, url: str, cause: str) -> None:
    assert result.code == 2, result
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result
    assert lines[0].startswith(f"error: {url}: cannot reach the object store ({cause}"), result
    assert "Traceback" not in result.err + result.out


@pytest.fixture
def unreachable_endpoint() -> Iterator[str]:
    with closed_endpoint() as endpoint:
        yield endpoint


#: Commands whose storage option has only its long name (``report``'s ``-o`` is its output file).
LONG_NAME_ONLY = {"view", "report"}


@pytest.mark.parametrize("command", [
    ["ls", URL], ["ls", URL, "--json"], ["verify", URL], ["info", f"{RUN}/1"], ["show", RUN, "--step", "1"],
    ["prune", RUN, "--keep-last", "1", "--dry-run"], ["view", URL, "--port", "0"], ["report", URL],
    ["rerun", URL, "--stage", "reward", "--fn", "stepskip.rerun:grpo_advantages"],
], ids=lambda command: " ".join(command[:1] + command[2:]))
def test_an_endpoint_that_does_not_answer(command, unreachable_endpoint, monkeypatch, tmp_path):
    bad_credentials(monkeypatch)  # never checked: nothing answers
    opts = option_args(unreachable_endpoint)
    if command[0] in LONG_NAME_ONLY:
        opts = [o.replace("-o", "--storage-option") if o == "-o" else o for o in opts]
    result = stepskip(*command, *opts, cwd=tmp_path)  # report would write report.html here
    assert_one_line_exit_2(result, command[1], "EndpointConnectionError")
    assert list(tmp_path.iterdir()) == []  # nothing written on the local side


def test_refused_credentials(monkeypatch):
    bad_credentials(monkeypatch)
    with refusing_s3() as endpoint:
        result = stepskip("ls", URL, *option_args(endpoint))
    assert_one_line_exit_2(result, URL, "PermissionError")


def test_no_credentials(monkeypatch, tmp_path: Path):
    no_credentials(monkeypatch, tmp_path)
    with closed_endpoint() as endpoint:  # botocore gives up before connecting
        result = stepskip("ls", URL, *option_args(endpoint))
    assert_one_line_exit_2(result, URL, "NoCredentialsError: Unable to locate credentials")


def test_convert_names_the_store_it_cannot_reach_not_the_local_side(unreachable_endpoint, monkeypatch, tmp_path: Path):
    bad_credentials(monkeypatch)
    result = stepskip("convert", URL, str(tmp_path / "out"), "--to", "verl", *option_args(unreachable_endpoint))
    assert_one_line_exit_2(result, URL, "EndpointConnectionError")
