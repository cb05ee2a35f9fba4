"""The HTTP app of ``stepskip view`` over a real threading server on 127.0.0.1: endpoints, the page's
files, and what a hostile URL can reach (nothing outside the listing, never a write)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest
from cli_caches import FIXTURE_RUN, ROWS, SAFE_RUN
from interrupts import view_command
from view_helpers import tree_state

from stepskip.view.data import ViewSource
from stepskip.view.server import make_server


@pytest.fixture(scope="module")
def server(view_cache):
    before = tree_state(view_cache)
    srv = make_server(ViewSource(str(view_cache)), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    thread.join()
    assert tree_state(view_cache) == before  # read-only: nothing in the cache changed, not even a time


def get(url: str, method: str = "GET") -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as res:
            return res.status, res.read(), res.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type", "")


def get_json(url: str) -> tuple[int, dict]:
    status, body, kind = get(url)
    assert kind == "application/json"
    return status, json.loads(body)


def test_binds_to_loopback_by_default(view_cache):
    srv = make_server(ViewSource(str(view_cache)), port=0)
    try:
        assert srv.server_address[0] == "127.0.0.1"
    finally:
        srv.server_close()


def test_the_page_and_its_files(server):
    status, body, kind = get(f"{server}/")
    assert status == 200 and kind.startswith("text/html") and b'<main id="app">' in body
    for name, kind_prefix in (("app.js", "text/javascript"), ("style.css", "text/css"),
                              ("chart.umd.min.js", "text/javascript")):
        status, body, kind = get(f"{server}/static/{name}")
        assert status == 200 and kind.startswith(kind_prefix) and body
    assert b"Chart.js v4" in get(f"{server}/static/chart.umd.min.js")[1]


def test_data_endpoints(server):
    status, runs = get_json(f"{server}/api/runs")
    assert status == 200 and SAFE_RUN in [r["name"] for r in runs["runs"]]
    status, page = get_json(f"{server}/api/step?run={SAFE_RUN}&role=rollout&step=2&limit=3&offset=3"
                            "&sort=reward&desc=1&filter=reward0")
    assert status == 200 and page["matched"] == ROWS // 2 and len(page["rows"]) == 1
    status, stats = get_json(f"{server}/api/stats?run={SAFE_RUN}&role=rollout&step=2")
    assert status == 200 and stats["rows"] == ROWS
    status, trend = get_json(f"{server}/api/trend?run={SAFE_RUN}&role=rollout")
    assert status == 200 and len(trend["steps"]) == 8
    status, cmp = get_json(f"{server}/api/compare?run={SAFE_RUN}&role=rollout&step=1&step2=2")
    assert status == 200 and cmp["total"] == ROWS // 2
    status, body = get_json(f"{server}/api/step?run={SAFE_RUN}&role=rollout&step=2&limit=x")
    assert status == 400 and "limit" in body["error"]
    status, body = get_json(f"{server}/api/step?run={SAFE_RUN}&role=rollout")
    assert status == 400 and "step" in body["error"]


def test_a_pickle_entry_without_allow_pickle_shows_the_reason(server):
    status, body = get_json(f"{server}/api/step?run={FIXTURE_RUN}&role=rollout&step=1")
    assert status == 422 and body["kind"] == "pickle" and "--allow-pickle" in body["error"]
    assert get_json(f"{server}/api/runs")[0] == 200  # the app is still up


@pytest.mark.parametrize("query", [
    "run=..&role=rollout&step=1",
    "run=../..&role=rollout&step=1",
    "run=%2Fetc&role=rollout&step=1",
    "run=/etc/passwd&role=rollout&step=1",
    f"run={SAFE_RUN}%2F..%2F..&role=rollout&step=1",
    f"run={SAFE_RUN.replace('/', '%2F')}%2F%2e%2e&role=rollout&step=1",
    "run=%2e%2e%2F%2e%2e&role=rollout&step=1",
    f"run={SAFE_RUN}&role=..&step=1",
    f"run={SAFE_RUN}&role=rollout&step=..%2F1",
    f"run={SAFE_RUN}&role=%2e%2e%2Frollout&step=1",
    f"run={SAFE_RUN}&role=rollout&step=%2Fetc%2Fpasswd",
])
def test_parameters_name_only_listed_entries(server, query):
    status, body = get_json(f"{server}/api/step?{query}")
    assert status == 404 and body["kind"] == "request"
    assert "root:" not in json.dumps(body)


@pytest.mark.parametrize("path", ["/static/../server.py", "/static/%2e%2e/server.py", "/static/..%2Fdata.py",
                                  "/static//etc/passwd", "/etc/passwd", "/static/%2Fetc%2Fpasswd", "/../../etc/passwd",
                                  "/static/chart.js-LICENSE.md", "/static/"])
def test_static_files_are_a_fixed_set(server, path):
    status, body, _ = get(f"{server}{path}")
    assert status == 404 and b"root:" not in body and b"import" not in body


def test_nothing_but_reads_is_accepted(server):
    for method in ("POST", "PUT", "DELETE"):
        status, _, _ = get(f"{server}/api/runs", method=method)
        assert status == 405


def test_the_view_command_prints_its_url_and_stops_on_ctrl_c(view_cache):
    before = tree_state(view_cache)
    with view_command(view_cache, "--port", "0") as view:
        assert view.url.startswith("http://127.0.0.1:")
        status, runs = get_json(f"{view.url}api/runs")
        assert status == 200 and SAFE_RUN in [r["name"] for r in runs["runs"]]
    assert tree_state(view_cache) == before


def test_the_view_command_refuses_a_tokenizer_it_cannot_load_offline(view_cache, tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from cli_run import stepskip

    result = stepskip("view", view_cache, "--tokenizer", tmp_path / "no-such-tokenizer")
    assert result.code == 2 and "cannot load a Hugging Face tokenizer" in result.err
    assert "no such directory" in result.err
    missing = stepskip("view", tmp_path / "nothing-here")
    assert missing.code == 2 and "no such file or directory" in missing.err


def test_the_view_command_refuses_a_live_window_below_a_second(view_cache):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from cli_run import stepskip

    result = stepskip("view", view_cache, "--follow", "--live-seconds", "0")
    assert result.code == 2 and "--live-seconds" in result.err
