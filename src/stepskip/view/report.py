"""``stepskip report``: the views of ``stepskip view`` as one self-contained HTML file.

The page's script, style and charting library are inlined, and so is the data: the listing, every
step's rows (cut at ``max_rows`` per step), distributions and trends. Opening the file needs no
server and no network; the table, filters, search and comparisons run in the page on that data.

Example:
    >>> write_report(ViewSource("~/.verl/rollout_dump/exp_proj/GBS64_N8_in8_out8"), "report.html")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from stepskip.view.data import EntryProblem, ViewSource
from stepskip.view.server import _json_safe, static_file

__all__ = ["DEFAULT_MAX_ROWS", "build_report", "write_report"]

logger = logging.getLogger(__name__)

#: Rows kept per step in a report (a report is attached to bug reports: it stays a few MiB).
DEFAULT_MAX_ROWS = 1000


def _script_json(value: Any) -> str:
    """JSON that is safe inside ``<script>``: no ``</script>``, ``<!--`` or line separators can end it early."""
    text = json.dumps(_json_safe(value), allow_nan=False, separators=(",", ":"))
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def build_report(source: ViewSource, max_rows: int = DEFAULT_MAX_ROWS) -> str:
    """The HTML of a report over every run, role and step of ``source``.

    Args:
        source: the cache (or run directory) to report on.
        max_rows: rows kept per step (distributions and trends still use every row).

    Returns:
        The whole page, scripts and data inlined.
    """
    listing = source.listing()  # which steps exist; taken again below, when every step's rows are known
    steps: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    trends: dict[str, Any] = {}
    for run in listing["runs"]:
        for role in run["roles"]:
            for step in role["steps"]:
                key = f"{run['name']}|{role['role']}|{step['step']}"
                try:
                    page = source.step_page(run["name"], role["role"], step["step"], limit=max_rows)
                    stats[key] = source.step_stats(run["name"], role["role"], step["step"])
                except EntryProblem as err:
                    steps[key] = {"error": str(err), "kind": err.kind}
                    continue
                page["truncated"] = page["total"] > len(page["rows"])
                steps[key] = page
            trends[f"{run['name']}|{role['role']}"] = source.trend(run["name"], role["role"])
    data = {"listing": _with_rows(source.listing(), steps), "steps": steps, "stats": stats, "trends": trends,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    html = static_file("index.html").decode()
    inline = {
        '<link rel="stylesheet" href="/static/style.css">': f"<style>\n{static_file('style.css').decode()}\n</style>",
        '<script src="/static/chart.umd.min.js"></script>': _inline_script(static_file("chart.umd.min.js").decode()),
        '<script src="/static/app.js"></script>': _inline_script(static_file("app.js").decode()),
        "<!--DATA-->": f"<script>window.STEPSKIP_REPORT = {_script_json(data)};</script>",
    }
    for tag, replacement in inline.items():
        if tag not in html:
            raise RuntimeError(f"the page template lost {tag!r}: view/static/index.html and report.py disagree")
        html = html.replace(tag, replacement)
    return html.replace("<title>stepskip view</title>", "<title>stepskip report</title>")


def _with_rows(listing: dict[str, Any], steps: dict[str, Any]) -> dict[str, Any]:
    """Every step's row count from its decoded page (the report read them all; meta.json rarely says)."""
    for run in listing["runs"]:
        for role in run["roles"]:
            for step in role["steps"]:
                page = steps.get(f"{run['name']}|{role['role']}|{step['step']}", {})
                if step["rows"] is None and "total" in page:
                    step["rows"] = page["total"]
    return listing


def _inline_script(code: str) -> str:
    # A script's text ends at the first "</script"; the vendored code is checked never to hold one.
    if "</script" in code.lower():
        code = code.replace("</script", "<\\/script").replace("</SCRIPT", "<\\/SCRIPT")
    return f"<script>\n{code}\n</script>"


def write_report(source: ViewSource, output: str | Path, max_rows: int = DEFAULT_MAX_ROWS) -> Path:
    """Write :func:`build_report` to ``output`` (never inside the cache: the caller chooses the path).

    Returns:
        The path written.
    """
    path = Path(output).expanduser()
    path.write_text(build_report(source, max_rows), encoding="utf-8")
    logger.info("wrote %s (%d bytes)", path, path.stat().st_size)
    return path
