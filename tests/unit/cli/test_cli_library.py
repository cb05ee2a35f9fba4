"""The CLI's library side in process (fast): step ranges, durations, help texts, demo forwarding, convert failures."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
from cli_caches import SAFE_RUN

from stepskip.cli import main
from stepskip.cli.convert import convert_cache
from stepskip.cli.errors import CliError
from stepskip.cli.prune import parse_duration, parse_steps
from stepskip.cache import open_cache as open_index
from stepskip.config import StepSet
from stepskip._index import compress_steps

COMMANDS = ("ls", "info", "verify", "prune", "convert", "show")


@pytest.mark.parametrize("steps, spec", [
    ([], ""),
    ([3], "3"),
    ([1, 2, 3, 4, 5, 8, 10, 11, 12], "1-5,8,10-12"),
    ([2, 4, 6, 10], "2-6:2,10"),
    ([1, 3], "1,3"),
    ([10, 20, 30, 40, 41], "10-40:10,41"),
    ([5, 1, 5, 2], "1-2,5"),
])
def test_compress_steps_writes_ranges_that_parse_back(steps, spec):
    assert compress_steps(steps) == spec
    if steps:
        parsed = StepSet.parse(spec.split(","))
        assert [s for s in range(50) if s in parsed] == sorted(set(steps))


def test_durations_and_step_specs():
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90s") == 90 and parse_duration("0") == 0
    assert parse_duration("1.5h") == 5400 and parse_duration("2w") == 14 * 86400
    for bad in ("7", "7 days", "-1d", "d"):
        with pytest.raises(CliError, match="90s, 30m, 12h, 7d, 2w"):
            parse_duration(bad)
    spec = parse_steps("1,2,10-20:5")
    assert [s for s in range(30) if s in spec] == [1, 2, 10, 15, 20]
    assert 123456 in parse_steps("all")
    with pytest.raises(CliError, match="--steps"):
        parse_steps("1,x")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(command, capsys):
    assert main([command, "--help"]) == 0
    text = capsys.readouterr().out
    assert f"Usage: stepskip {command}" in text
    assert "Examples" in text and f"stepskip {command} " in text


def test_demo_forwards_every_argument(monkeypatch, capsys):
    seen = []
    fake = types.ModuleType("stepskip.pipelines.demo")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "stepskip.pipelines.demo", fake)
    args = ["--runs", "1", "skip.rollout.steps=[1,2]", "--help", "-x", "positional"]
    assert main(["demo", *args]) == 3
    assert seen == [args]


def test_demo_without_the_pipelines_module_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "stepskip.pipelines.demo", None)
    assert main(["demo", "--runs", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "stepskip.pipelines.demo" in err and "stepskip[pipelines]" in err


def test_convert_reports_entries_the_target_format_cannot_hold(pristine_cache, tmp_path):
    report = convert_cache(open_index(str(pristine_cache / SAFE_RUN)), open_index(str(tmp_path / "out")), to="verl")
    failed = {e.source.rsplit("/", 2)[-2] + "/" + e.source.rsplit("/", 1)[-1] for e in report.failed}
    assert failed == {"reward/1", "reward/2"}  # a stage role's TensorDict: verl has no file for it
    assert all("DataProto-like" in e.error for e in report.failed)
    assert len(report.converted) == 8 and not report.ok
    assert (tmp_path / "out" / SAFE_RUN / "1" / "gen_batch.dp").exists()  # DST is a dump dir: same layout
    assert not (tmp_path / "out" / SAFE_RUN / "reward").exists()  # nothing partial left


def test_the_python_example_of_the_docs_cli_page_runs(pristine_cache, capsys):
    page = (Path(__file__).resolve().parents[3] / "docs" / "cli.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "CacheIndex" in b)
    exec(compile(block.replace("~/.verl/rollout_dump", str(pristine_cache)), "cli.md", "exec"), {})
    assert f"{SAFE_RUN} rollout 1-6,8,10" in capsys.readouterr().out
