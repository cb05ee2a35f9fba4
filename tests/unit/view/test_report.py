"""``stepskip report``: one self-contained HTML file holding the views' data (no server, no network)."""

from __future__ import annotations

import json
import re
import time
import sys
from pathlib import Path

from cli_caches import FIXTURE_RUN, ROWS, SAFE_RUN, V1_RUN
from view_helpers import tree_state

from stepskip.view.data import ViewSource
from stepskip.view.report import build_report

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_run import stepskip  # noqa: E402


def embedded(html: str) -> dict:
    match = re.search(r"<script>window\.STEPSKIP_REPORT = (.*?);</script>", html, flags=re.S)
    assert match, "no inlined data"
    return json.loads(match.group(1))


def test_the_report_inlines_everything(view_cache):
    html = build_report(ViewSource(str(view_cache)), max_rows=5)
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing fetched: all inlined
    assert "Chart.js v4" in html and "function queryRows" in html and ".charts {" in html
    data = embedded(html)
    page = data["steps"][f"{SAFE_RUN}|rollout|1"]
    assert page["total"] == ROWS and len(page["rows"]) == 5 and page["truncated"]
    assert data["stats"][f"{SAFE_RUN}|rollout|1"]["rows"] == ROWS  # distributions use every row
    assert [s["step"] for s in data["trends"][f"{SAFE_RUN}|rollout"]["steps"]] == [1, 2, 3, 4, 5, 6, 8, 10]
    assert data["steps"][f"{V1_RUN}|rollout_tq|2"]["total"] == 8
    assert data["steps"][f"{FIXTURE_RUN}|rollout|1"]["kind"] == "pickle"  # the reason, not a crash
    safe = next(r for r in data["listing"]["runs"] if r["name"] == SAFE_RUN)["roles"][0]["steps"]
    assert [s["rows"] for s in safe] == [ROWS] * len(safe)  # from the decoded steps: meta.json does not say


def test_cache_text_cannot_end_the_inlined_script(tmp_path, view_cache):
    from stepskip.view.report import _script_json

    text = _script_json({"prompt": "</script><script>alert(1)</script>\u2028<!--"})
    assert "</" not in text and "<!--" not in text and "\u2028" not in text
    assert json.loads(text) == {"prompt": "</script><script>alert(1)</script>\u2028<!--"}


def test_report_command_writes_the_file_and_never_into_the_cache(view_cache, tmp_path):
    before = tree_state(view_cache)
    out = tmp_path / "report.html"
    result = stepskip("report", view_cache / SAFE_RUN, "-o", out)
    assert result.code == 0, result
    assert out.stat().st_size > 200_000 and SAFE_RUN in embedded(out.read_text())["listing"]["runs"][0]["name"]
    inside = stepskip("report", view_cache, "-o", view_cache / "report.html")
    assert inside.code == 2 and "inside the cache" in inside.err
    assert tree_state(view_cache) == before


def test_report_of_a_missing_directory_is_a_clear_error(tmp_path):
    result = stepskip("report", tmp_path / "nope", "-o", tmp_path / "r.html")
    assert result.code == 2 and "no such file or directory" in result.err


def test_a_report_carries_absolute_times_in_utc(view_cache):
    """A report is read later than it was written: its times are ISO-8601 UTC, never ages."""
    data = embedded(build_report(ViewSource(str(view_cache)), max_rows=1))
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"
    assert re.fullmatch(iso, data["created"])
    steps = [s for run in data["listing"]["runs"] for role in run["roles"] for s in role["steps"]]
    assert steps and all(re.fullmatch(iso, s["recorded_utc"]) for s in steps)
    first = steps[0]
    assert first["recorded_utc"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(first["time"]))
