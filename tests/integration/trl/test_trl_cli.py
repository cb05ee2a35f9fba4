"""A cache the real TRL ``GRPOTrainer`` recorded, through the commands: a copy older than ``verify``'s
grace period comes out of ``stepskip verify --repair`` and ``stepskip prune`` byte for byte, and
``ls``, ``info``, ``show`` and the viewer report every step as present. The commands run in process
(typer's test runner); the recordings are the session's (``conftest.py``), on one rank and on two."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from trl_support import copy_cache, entries

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "cli"))  # the in-process CLI runner

from cli_run import stepskip  # noqa: E402

pytestmark = pytest.mark.heavy

AGE = 3 * 3600.0  # older than verify's default --grace of 1h


def backdate(root: Path) -> None:
    when = time.time() - AGE
    for path in [root, *root.rglob("*")]:
        os.utime(path, (when, when), follow_symlinks=False)


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(params=["1rank", "2ranks"])
def old_copy(request, tmp_path):
    """``(cache, run directory, {step: entry names})``: a copy of a recording, every file three hours old."""
    cache, _ = request.getfixturevalue("recording" if request.param == "1rank" else "recording_2ranks")
    cache = copy_cache(cache, tmp_path)
    (run,) = cache.glob("*/*")
    backdate(cache)
    return cache, run, entries(cache)


def test_repair_and_prune_leave_every_trl_entry_as_it_was(old_copy):
    cache, run, recorded = old_copy
    assert recorded and all(recorded.values())
    before = snapshot(cache)
    verified = stepskip("verify", cache, "--repair", "--json")
    assert verified.code == 0, verified
    assert verified.json()["repaired"] == [] and verified.json()["problems"] == []
    assert verified.json()["entries"] == sum(len(names) for names in recorded.values())
    for criterion in (["--older-than", "1h"], ["--keep-last", str(len(recorded))], ["--steps", "99"]):
        pruned = stepskip("prune", run, *criterion, "--json")
        assert pruned.code == 0, pruned
        assert pruned.json()["removed"] == [], (criterion, pruned)
    assert snapshot(cache) == before


def test_ls_info_show_and_view_report_every_trl_step(old_copy):
    cache, run, recorded = old_copy
    listed = stepskip("ls", cache, "--json")
    assert listed.code == 0, listed
    (listing,) = listed.json()["runs"]
    assert listing["problems"] == 0
    assert [(r["role"], r["steps"], r["invalid_steps"], r["entries"]) for r in listing["roles"]] == [
        ("trl_generate", sorted(recorded), [], sum(len(names) for names in recorded.values()))]
    text = stepskip("ls", cache)
    assert text.code == 0 and "invalid" not in text.out and "problem" not in text.out, text

    for step, names in recorded.items():
        info = stepskip("info", run / "trl_generate" / str(step), "--json")
        assert info.code == 0, info
        data = info.json()
        assert (data["kind"], data["issues"], data["note"]) == ("calls", [], None)
        assert [Path(e["path"]).name for e in data["entries"]] == names
        assert {e["state"] for e in data["entries"]} == {"present"}
        shown = stepskip("show", run / "trl_generate" / str(step), "--rows", "1000", "--json")
        assert shown.code == 0, shown
        stored = [row for name in names for row in completions(run / "trl_generate" / str(step) / name)]
        assert [r["response"] for r in shown.json()["rows"]] == stored
        assert data["rows"] == len(stored)

    from stepskip.view.data import ViewSource

    source = ViewSource(str(cache))
    (view_run,) = source.listing()["runs"]
    (role,) = view_run["roles"]
    assert (role["role"], role["valid_steps"], role["invalid_steps"]) == ("trl_generate", sorted(recorded), [])
    first = min(recorded)
    page = source.step_page(view_run["name"], "trl_generate", first, limit=500)
    stored = [row for name in recorded[first] for row in completions(run / "trl_generate" / str(first) / name)]
    assert [r["response"] for r in page["rows"]] == stored


def completions(entry: Path) -> list[list[int]]:
    """The completion ids a call's entry holds, decoded by its format's codec from the files it lists."""
    from stepskip._formats import get_format

    meta = json.loads((entry / "meta.json").read_text())
    ids, _ = get_format(meta["format"]).decode({name: (entry / name).read_bytes() for name in meta["files"]})
    return ids
