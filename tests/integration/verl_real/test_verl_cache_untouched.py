"""A cache verl 0.9.1 wrote is never modified by a stepskip run or a `stepskip` command, in verl's environment.

cache_untouched_side.py runs, in .venv-verl (tensordict 0.10.0), the ``rollout`` role under every
action but ``record`` with and without ``allow_pickle``, then every CLI command (``prune`` only as
``--dry-run``, ``convert`` onto the cache itself only without ``--overwrite``). The cache is a copy
of tests/fixtures/verl/cache, whose files verl's own code wrote. The rollout the role wraps is a
stand-in that counts its calls (no inference server here); verl's own decorated method is
exercised by test_install.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")
FIXTURE_CACHE = ROOT / "tests" / "fixtures" / "verl" / "cache"
VERL_STEPS = ("1", "2", "3")  # the steps verl wrote; 4 is new, written by stepskip on a cache miss

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VERL_PYTHON),
                       reason="verl 0.9.1 environment not built (run `make verl-env`)"),
]


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    base = tmp_path_factory.mktemp("untouched")
    cache, other = base / "cache", base / "other"
    shutil.copytree(FIXTURE_CACHE, cache)
    before = digests(cache)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("STEPSKIP_VERL", None)
    done = subprocess.run([VERL_PYTHON, "-W", "ignore", str(HERE / "cache_untouched_side.py"), str(cache), str(other)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {"before": before, "after": digests(cache), "report": json.loads(done.stdout.strip().splitlines()[-1]),
            "other": other}


def test_every_file_verl_wrote_is_unchanged(outcome):
    before, after = outcome["before"], outcome["after"]
    assert before, "the fixture cache is empty"
    assert {name: after.get(name) for name in before} == before


def test_nothing_is_added_inside_verls_step_directories(outcome):
    run, hints = "fx_verl/GBS4_N2_in8_out6/", "fx_verl/.stepskip-index/"  # and the writers' prompt hints
    added = sorted(set(outcome["after"]) - set(outcome["before"]))
    assert all(name.startswith(hints) or (name.startswith(run) and name[len(run):].split("/")[0] not in VERL_STEPS)
               for name in added), added


def test_the_roles_replayed_verls_entries_instead_of_regenerating_them(outcome):
    roles = outcome["report"]["roles"]
    for action in ("repeat", "random", "replay"):
        got = roles[f"{action}/allow_pickle=True"]
        assert got["calls"] == 0 and got["dumps"] == 0, (action, got)
        assert got["steps"]["1"] == got["steps"]["2"] == "returned", (action, got)
    cache = roles["cache/allow_pickle=True"]
    assert cache["hits"] == 2 and cache["calls"] == 1 and cache["dumps"] == 1  # only step 4 was generated
    for action in ("repeat", "random", "replay", "cache"):
        got = roles[f"{action}/allow_pickle=False"]
        assert got["calls"] == 0, (action, got)
        for step in ("1", "2"):  # intact but not readable without allow_pickle: a clear error, no regeneration
            assert got["steps"][step].startswith("config error") and "allow_pickle" in got["steps"][step]


def test_cli_commands_ran_and_read_the_entries(outcome):
    commands = outcome["report"]["commands"]
    assert all(c["exception"] is None for c in commands), [c for c in commands if c["exception"]]
    by_args = {" ".join(c["args"][:1] + c["args"][2:]): c for c in commands}
    for flags in ("", " --allow-pickle"):
        for variant in ("", " --deep", " --repair --grace 0s", " --repair --deep --grace 0s"):
            assert by_args[f"verify{variant}{flags}"]["exit_code"] == 0, by_args[f"verify{variant}{flags}"]
    for step in VERL_STEPS:
        assert by_args[f"show --step {step} --allow-pickle"]["exit_code"] == 0
    converted = [c for c in commands if c["args"][0] == "convert" and "--allow-pickle" in c["args"]
                 and str(outcome["other"]) in c["args"][2]]
    assert [c["exit_code"] for c in converted] == [0, 0], converted
