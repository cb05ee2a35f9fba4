"""``stepskip view`` and ``stepskip report`` in a real browser (headless Chromium), on a cache recorded by the
reference colocated pipeline (roles rollout and reward), a copy of it as a second run (one step damaged), a
120-row step, a step of the reference V1 pipeline (role rollout_tq: padded responses with their
response_mask, stored jagged) and verl's own fixture cache (rollout and rollout_tq, pickle-based). The view
runs as the real console command in a subprocess; screenshots are saved under tests/artifacts/view/."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

import pytest
from browser import Browser, LivePage, find_chromium

from stepskip import SkipManager
from stepskip.view.data import ViewSource

TESTS = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(TESTS / "integration" / "pipelines"))
sys.path.insert(0, str(TESTS / "unit" / "cli"))

from cli_caches import base_config, record_rollout, rollout_batch  # noqa: E402
from interrupts import view_command  # noqa: E402
from pipeline_helpers import SMALL, skip_overrides  # noqa: E402

RUN = "colocated_stepskip_pipelines/GBS4_N4_in5_out12"
COPY = "copy_stepskip_pipelines/GBS4_N4_in5_out12"
BIG = "exp_big/GBS4_N2_in8_out6"
FX = "fx_verl/GBS4_N2_in8_out6"
V1 = "v1_stepskip_pipelines/GBS4_N4_in5_out12"


class BigLoop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        return rollout_batch(SkipManager.step, rows=120)


@pytest.fixture(scope="module")
def dump(tmp_path_factory) -> Path:
    from stepskip.pipelines.colocated import ColocatedTrainer
    from stepskip.pipelines.runtime import load_config

    root = tmp_path_factory.mktemp("browser") / "dump"
    skip = skip_overrides("rollout", root, [1, 2, 3]) + [
        "skip.reward.enable=true", f"skip.reward.dump_dir={root}", "skip.reward.steps=[1,2,3]"]
    ColocatedTrainer(load_config("colocated", [*SMALL, *skip])).fit()
    SkipManager.reset()
    shutil.copytree(root / "colocated_stepskip_pipelines", root / "copy_stepskip_pipelines")
    # step 1 of the run compared with a live rollout of another policy: its drift record lies beside it
    ColocatedTrainer(load_config("colocated", [*SMALL, "trainer.total_training_steps=1",
                                               "actor_rollout_ref.model.init_seed=7",
                                               *skip_overrides("rollout", root, [1], action="compare")])).fit()
    SkipManager.reset()
    data = root / COPY / "3" / "data.safetensors"
    data.write_bytes(data.read_bytes()[:40])  # damaged: truncated
    config = base_config(root, "exp", "big")
    config["skip"]["rollout"] = {"enable": True, "dump_dir": str(root), "steps": [1], "async_dump": False}
    SkipManager.init(config)
    SkipManager.set_step(1)
    BigLoop().generate_sequences(None)
    SkipManager.close()
    SkipManager.reset()
    shutil.copytree(TESTS / "fixtures" / "verl" / "cache" / "fx_verl", root / "fx_verl")
    from stepskip.pipelines.v1 import run as run_v1

    run_v1(load_config("v1", [*SMALL, "trainer.total_training_steps=1", "trainer.val_before_train=false",
                              *skip_overrides("rollout_tq", root, [1])]))
    SkipManager.reset()
    return root


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Browser:
    return Browser(find_chromium(), tmp_path_factory.mktemp("chromium-profile"))


@pytest.fixture(scope="module")
def truth(dump) -> ViewSource:
    """The data layer read directly: what the page must show."""
    return ViewSource(str(dump), allow_pickle=True)


@pytest.fixture(scope="module")
def server(dump):
    """``stepskip view DUMP --port 0 --allow-pickle`` as a real process; Ctrl-C (SIGINT) stops it."""
    with view_command(dump, "--port", "0", "--allow-pickle") as view:
        assert view.url.startswith("http://127.0.0.1:")
        yield view.url


def at(base: str, view: str, **params) -> str:
    return f"{base}#/{view}?{urlencode(params, doseq=True)}"


def test_runs_roles_and_steps(server, browser):
    page = browser.dom(server)
    assert page.ready()
    sections = {s.attrs["data-run"]: s for s in page.root.find_all("section")}
    assert set(sections) == {RUN, COPY, BIG, FX, V1}
    run = sections[RUN]
    assert [t.attrs["data-role"] for t in run.find_all("table")] == ["rollout", "reward"]
    steps = run.find("table", data_role="rollout").find_all("tr")[1:]
    assert [tr.attrs["data-step"] for tr in steps] == ["1", "2", "3"]
    assert "safe" in steps[0].text and "stepskip" in steps[0].text
    damaged = sections[COPY].find("tr", data_step="3")
    assert damaged.attrs["class"] == "bad" and "damaged" in damaged.text
    fx_roles = [t.attrs["data-role"] for t in sections[FX].find_all("table")]
    assert fx_roles == ["rollout", "rollout_tq"] and "v1 (1 inner)" in sections[FX].find("tr", data_step="3").text
    browser.screenshot(server, "runs")


def test_one_step_table_and_distributions(server, browser, truth):
    url = at(server, "step", run=RUN, role="rollout", step=2)
    page = browser.dom(url)
    assert page.ready()
    expected = truth.step_page(RUN, "rollout", 2, limit=100)
    table = page.root.find("table", id="rows")
    assert table.attrs["data-total"] == "16"
    rows = page.table_rows("rows")
    assert [r["i"] for r in rows] == [str(r["i"]) for r in expected["rows"]]
    assert [r["length"] for r in rows] == [str(r["length"]) for r in expected["rows"]]
    # the rollout holds no reward: it is joined from the reward stage role of the same step
    assert expected["reward_source"].startswith("reward role")
    assert all(r["reward"] != "–" for r in rows)
    assert [r["group"] for r in rows] == [r["group"] for r in expected["rows"]]
    for chart_id in ("reward-hist", "length-hist"):
        canvas = page.root.find("canvas", id=chart_id)
        assert int(canvas.attrs["data-points"]) > 0  # Chart.js drew it
    lengths = truth.step_stats(RUN, "rollout", 2)["length"]["histogram"]
    assert page.root.find("canvas", id="length-hist").attrs["data-points"] == str(len(lengths["counts"]))
    browser.screenshot(url, "step")


def test_filters_sorting_and_search(server, browser, truth):
    page = browser.dom(at(server, "step", run=RUN, role="rollout", step=1, filter="lenmax", sort="length", desc="1"))
    rows = page.table_rows("rows")
    expected = truth.step_page(RUN, "rollout", 1, filters=["lenmax"])
    assert len(rows) == expected["matched"] > 0 and all(r["length"] == "12" for r in rows)
    assert f"of {expected['matched']} (filtered from 16)" in page.root.find("span", id="page-info").text
    zero = browser.dom(at(server, "step", run=RUN, role="rollout", step=1, filter="reward0")).table_rows("rows")
    assert len(zero) == truth.step_page(RUN, "rollout", 1, filters=["reward0"])["matched"]
    assert all(float(r["reward"]) == 0 for r in zero)
    ordered = browser.dom(at(server, "step", run=RUN, role="rollout", step=1, sort="length")).table_rows("rows")
    assert [int(r["length"]) for r in ordered] == sorted(int(r["length"]) for r in ordered)
    group = truth.step_page(RUN, "rollout", 1)["rows"][5]["group"]
    found = browser.dom(at(server, "step", run=RUN, role="rollout", step=1, q=group)).table_rows("rows")
    assert len(found) == 4 and {r["group"] for r in found} == {group}


def test_a_large_step_is_paged(server, browser):
    page = browser.dom(at(server, "step", run=BIG, role="rollout", step=1))
    assert len(page.table_rows("rows")) == 50 and "rows 1–50 of 120" in page.root.find("span", id="page-info").text
    assert page.root.find("button", id="next").attrs.get("disabled") is None
    last = browser.dom(at(server, "step", run=BIG, role="rollout", step=1, offset=100))
    assert [r["i"] for r in last.table_rows("rows")] == [str(i) for i in range(100, 120)]
    assert last.root.find("button", id="next").attrs.get("disabled") is not None
    with urllib.request.urlopen(f"{server}api/step?{urlencode({'run': BIG, 'role': 'rollout', 'step': 1})}") as res:
        assert len(json.load(res)["rows"]) == 50  # the server sends one page, never the whole step


def test_trend_across_steps(server, browser, truth):
    url = at(server, "trend", run=RUN, role="rollout")
    page = browser.dom(url)
    assert page.ready()
    for chart_id in ("reward-trend", "length-trend"):
        assert page.root.find("canvas", id=chart_id).attrs["data-points"] == str(4 * 3)  # mean, p10, p50, p90
    rows = page.root.find("table", id="trend").find_all("tr")[1:]
    expected = truth.trend(RUN, "rollout")["steps"]
    assert [tr.attrs["data-step"] for tr in rows] == ["1", "2", "3"]
    for tr, step in zip(rows, expected):
        cells = [td.text for td in tr.find_all("td")]  # step, rows, reward mean, reward p50, length mean ...
        assert float(cells[4]) == pytest.approx(step["length"]["mean"], abs=1e-3)
        assert float(cells[2]) == pytest.approx(step["reward"]["mean"], abs=1e-3)  # joined from the reward role
    browser.screenshot(url, "trend")


def test_two_steps_and_two_runs_side_by_side(server, browser, truth):
    url = at(server, "compare", run=RUN, role="rollout", step=1, step2=2)
    page = browser.dom(url)
    groups = page.root.find("div", id="groups").find_all("div", **{"class": "side"})
    expected = truth.compare((RUN, "rollout", 1), (RUN, "rollout", 2))
    assert len(groups) == expected["total"] == 4
    for node, group in zip(groups, expected["groups"]):
        assert group["a"]["group"] in node.text and group["b"]["group"] in node.text
    browser.screenshot(url, "compare")
    runs = browser.dom(at(server, "compare", run=RUN, role="rollout", step=2, run2=COPY, step2=2))
    for node in runs.root.find("div", id="groups").find_all("div", **{"class": "side"}):
        a, b = node.find_all("div", **{"class": "group"})
        assert a.text.split("·")[0] == b.text.split("·")[0]  # the same GRPO group on both sides


def test_a_compared_step_shows_its_drift_record_beside_the_recorded_data(server, browser, truth):
    url = at(server, "step", run=RUN, role="rollout", step=1)
    page = browser.dom(url)
    assert page.ready()
    [record] = truth.step_page(RUN, "rollout", 1)["drift"]
    panel = page.root.find("section", id="drift")
    verdict = panel.find("div", data_passed="1" if record["passed"] else "0")
    assert f"step 1 {'matches' if record['passed'] else 'drifted from'} its recording" in verdict.text
    assert f"worst field {record['worst_field']}" in verdict.text
    fields = [tr.attrs["data-field"] for tr in panel.find("table").find_all("tr")[1:]]
    assert fields == list(record["fields"])
    worst = record["fields"][record["worst_field"]]
    sides = panel.find_all("div", **{"class": "side"})
    shown = [s for s in sides if s.attrs["data-field"] == record["worst_field"]]
    assert len(shown) == len(worst["examples"]) > 0  # divergent rows, recorded and live side by side
    assert "recorded" in shown[0].text and "live" in shown[0].text
    if record["token_match"] is not None and record["token_match"] < 1:  # and those of the tokens that differ
        assert any(s.attrs["data-field"] == "responses" for s in sides)
    assert page.table_rows("rows")  # the recorded rows are still there, below it
    runs = browser.dom(server)
    assert "compared" in runs.root.find("section", data_run=RUN).find("tr", data_step="1").text
    browser.screenshot(url, "drift")


def test_a_trajectorys_log_prob_strip_and_the_equal_reward_groups(server, browser, truth):
    """The colocated pipeline records rollout_log_probs: one row's strip opens from the URL, one cell per
    response token, colored by a class picked from its value; token texts such as "</s>" stay text."""
    marked = [i for i in range(16) if any("<" in t["t"] for t in truth.token_strip(RUN, "rollout", 2, i)["tokens"])]
    row = marked[0]  # a response with "<pad>" or "</s>" among its tokens
    url = at(server, "step", run=RUN, role="rollout", step=2, strip=row)
    page = browser.dom(url)
    assert page.ready()
    expected = truth.token_strip(RUN, "rollout", 2, row)
    strip = page.root.find("section", id="strip")
    assert strip.attrs["data-row"] == str(row)
    assert strip.attrs["data-column"] == expected["column"] == "rollout_log_probs"
    cells = strip.find_all("span")
    cells = [c for c in cells if "tok" in c.attrs.get("class", "").split()]
    assert [c.text for c in cells] == [t["t"] for t in expected["tokens"]] and len(cells) == expected["count"] > 0
    assert [float(c.attrs["data-v"]) for c in cells] == pytest.approx([t["v"] for t in expected["tokens"]])
    assert all(any(k.startswith("lp") for k in c.attrs["class"].split()) and not c.children for c in cells)
    assert any(c.text.startswith("<") for c in cells)  # as text: no element came of it
    assert "character tokenizer" in page.root.find("span", id="decoded-by").text
    assert len(page.root.find("table", id="rows").find_all("button")) == 16  # a strip for every row
    groups = truth.step_stats(RUN, "rollout", 2)["groups"]
    pill = page.root.find("span", id="equal-groups")
    assert (pill.attrs["data-equal"], pill.attrs["data-groups"]) == (str(groups["equal"]), str(groups["groups"]))
    assert groups["groups"] == 4  # 4 prompts, 4 samples each
    trend = browser.dom(at(server, "trend", run=RUN, role="rollout"))
    total = truth.trend(RUN, "rollout")["groups"]
    assert f"{total['equal']} of {total['groups']}" in trend.root.find("p", id="groups-total").text
    cells = [tr.find("td", data_col="groups").text for tr in trend.root.find("table", id="trend").find_all("tr")[1:]]
    assert cells == [f"{s['groups']['equal']} of {s['groups']['groups']}" for s in truth.trend(RUN, "rollout")["steps"]]
    browser.screenshot(url, "strip")


def test_follow_shows_the_steps_a_live_run_records(browser, tmp_path):
    """``stepskip view --follow`` with the page open: a step recorded meanwhile appears in the run list without
    a reload (the page's own "stepskip:updated" event is awaited), and the run is marked as being written."""
    dump = tmp_path / "dump"
    record_rollout(dump, "live", [1])
    run = "exp_live/GBS4_N2_in8_out6"
    with view_command(dump, "--port", "0", "--follow") as view:
        page = LivePage(browser.binary, tmp_path / "profile")
        try:
            page.open(view.url)
            assert page.wait("""new Promise(done => {
                const ready = () => document.body.getAttribute("data-ready") === "1";
                if (ready()) return done(true);
                new MutationObserver(() => ready() && done(true)).observe(document.body, { attributes: true });
            })""")
            assert page.wait(f"document.querySelector('section[data-run=\"{run}\"]').getAttribute('data-live')") == "1"
            assert page.wait("[...document.querySelectorAll('tr[data-step]')].map(tr => tr.dataset.step)") == ["1"]
            page.wait("window.notReloaded = true")

            record_rollout(dump, "live", [2])  # the run records its next step while the page is open

            row = page.wait("""new Promise(done => {
                const row = () => document.querySelector('tr[data-step="2"]');
                if (row()) return done(row().textContent);
                document.addEventListener("stepskip:updated", () => row() && done(row().textContent));
            })""")
            assert "safe" in row and "ok" in row
            assert page.wait("[...document.querySelectorAll('tr[data-step]')].map(tr => tr.dataset.step)") == ["1", "2"]
            assert page.wait("window.notReloaded === true && document.body.dataset.follow") == "1"
        finally:
            page.close()


def test_verl_fixture_v1_entries_and_a_damaged_step(server, browser, truth):
    page = browser.dom(at(server, "step", run=FX, role="rollout", step=1))
    assert len(page.table_rows("rows")) == truth.step_page(FX, "rollout", 1)["total"] == 8
    v1 = browser.dom(at(server, "step", run=FX, role="rollout_tq", step=3))
    rows = v1.table_rows("rows")
    expected = truth.step_page(FX, "rollout_tq", 3, limit=100)["rows"]
    assert len(rows) == len(expected) and rows and "tags" in rows[0]
    assert [r["key"] for r in rows] == [r["key"] for r in expected]  # the trajectories' queue keys
    assert [r["group"] for r in rows] == [r["group"] for r in expected]
    broken = browser.dom(at(server, "step", run=COPY, role="rollout", step=3))
    assert broken.ready()
    error = broken.root.find("div", **{"class": "error"})
    assert error.attrs["data-error-kind"] == "damaged" and "3" in error.text


def test_the_report_in_a_browser_without_network(dump, browser, truth, tmp_path):
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "stepskip", "report", str(dump), "-o", str(out), "--allow-pickle"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    base = out.as_uri()
    offline = ["--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]  # any fetch would fail
    page = browser.dom(base, *offline)
    assert page.ready() and {s.attrs["data-run"] for s in page.root.find_all("section")} == {RUN, COPY, BIG, FX, V1}
    times = [td.text for td in page.root.find("section", data_run=RUN).find_all("td", data_col="recorded")]
    steps = truth.listing()["runs"][[r["name"] for r in truth.listing()["runs"]].index(RUN)]["roles"]
    assert times == [s["recorded_utc"] for role in steps for s in role["steps"]]  # absolute, in UTC: not "32 s ago"
    assert all(t.endswith("Z") and "T" in t for t in times) and "created" in page.root.find("span", id="root").text
    step = browser.dom(at(base, "step", run=RUN, role="rollout", step=2, filter="lenmax"))
    expected = truth.step_page(RUN, "rollout", 2, filters=["lenmax"])
    assert len(step.table_rows("rows")) == expected["matched"]
    assert int(step.root.find("canvas", id="reward-hist").attrs["data-points"]) > 0
    big = browser.dom(at(base, "step", run=BIG, role="rollout", step=1, offset=50))
    assert [r["i"] for r in big.table_rows("rows")] == [str(i) for i in range(50, 100)]
    trend = browser.dom(at(base, "trend", run=RUN, role="rollout"))
    assert trend.root.find("canvas", id="length-trend").attrs["data-points"] == "12"
    cmp = browser.dom(at(base, "compare", run=RUN, role="rollout", step=2, run2=COPY, step2=2))
    assert len(cmp.root.find("div", id="groups").find_all("div", **{"class": "side"})) == 4
    offline_step = browser.dom(at(base, "step", run=FX, role="rollout", step=1), *offline)
    assert offline_step.ready() and len(offline_step.table_rows("rows")) == 8
    browser.screenshot(at(base, "step", run=RUN, role="rollout", step=2), "report-step")


# ------------------------------------------------------------------ no other origin reads the cache


def blocked(page) -> list[str]:
    """Console lines saying the browser blocked something the page asked for (its security headers at work)."""
    return [line for line in page.console if "Content Security Policy" in line or "blocked" in line.lower()]


def test_every_view_runs_under_the_security_headers(server, browser):
    """The page's own scripts, styles, data and charts all load under its Content-Security-Policy."""
    views = [at(server, "step", run=RUN, role="rollout", step=2), at(server, "trend", run=RUN, role="rollout"),
             at(server, "compare", run=RUN, role="rollout", step=1, step2=2)]
    for url in (server, *views):
        page = browser.dom(url)
        assert page.ready() and blocked(page) == [], (url, page.console)
    step = browser.dom(at(server, "step", run=RUN, role="rollout", step=2))
    assert int(step.root.find("canvas", id="reward-hist").attrs["data-points"]) > 0
    assert len(step.table_rows("rows")) == 16


def test_the_console_shows_what_the_policy_blocks(dump, browser):
    """The check above can fail: the same page under a policy that forbids its stylesheet logs the violation."""
    import threading

    import stepskip.view.server as view_server

    strict = (("Content-Security-Policy", "default-src 'none'; script-src 'self'; connect-src 'self'"),)
    original = view_server.SECURITY_HEADERS
    view_server.SECURITY_HEADERS = strict
    srv = view_server.make_server(ViewSource(str(dump), allow_pickle=True), "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        page = browser.dom(f"http://127.0.0.1:{srv.port}/")
    finally:
        view_server.SECURITY_HEADERS = original
        srv.shutdown()
        srv.server_close()
        thread.join()
    assert any("style.css" in line for line in blocked(page)), page.console


#: Chromium flags under which attacker.example resolves to 127.0.0.1: where a DNS rebinding attack ends.
REBOUND = ("--no-proxy-server", "--host-resolver-rules=MAP attacker.example 127.0.0.1")


def test_a_site_that_rebinds_its_name_to_this_machine_reads_nothing(server, browser, tmp_path):
    """A page of attacker.example whose name now points at 127.0.0.1 is, to the browser, same-origin with the
    view under that name: everything it could fetch is what these loads show, and it is nothing."""
    port = int(server.split(":")[2].split("/")[0])
    fresh = Browser(browser.binary, tmp_path / "profile")
    page = fresh.dom(f"http://attacker.example:{port}/", *REBOUND)
    assert not page.ready() and RUN not in page.html and "<section" not in page.html
    assert "answers only to the address it was started on" in page.html
    data = fresh.dom(f"http://attacker.example:{port}/api/runs", *REBOUND)
    assert RUN not in data.html and FX not in data.html and "answers only to" in data.html
    control = fresh.dom(f"http://localhost:{port}/", *REBOUND)
    assert control.ready() and {s.attrs["data-run"] for s in control.root.find_all("section")} == {RUN, COPY, BIG, FX, V1}


@pytest.fixture(scope="module")
def remote(dump):
    """``stepskip view DUMP --host 0.0.0.0 --port 0 --allow-pickle``: the URL it prints (with the token) and the
    note it writes."""
    with view_command(dump, "--host", "0.0.0.0", "--port", "0", "--allow-pickle") as view:
        assert "?token=" in view.url
        yield view.url, view.proc.stderr.readline()


def test_a_server_other_machines_reach_opens_from_its_printed_url(remote, browser, tmp_path, truth):
    """The printed URL carries the token once; the page's own requests then carry only the cookie it set."""
    url, note = remote
    assert url.startswith("http://127.0.0.1:") and "token" in note and "0.0.0.0" in note
    fresh = Browser(browser.binary, tmp_path / "profile")
    page = fresh.dom(url)
    assert page.ready() and {s.attrs["data-run"] for s in page.root.find_all("section")} == {RUN, COPY, BIG, FX, V1}
    assert blocked(page) == [], page.console
    step = fresh.dom(at(url, "step", run=RUN, role="rollout", step=2))
    assert step.ready() and len(step.table_rows("rows")) == truth.step_page(RUN, "rollout", 2)["total"]
    assert int(step.root.find("canvas", id="reward-hist").attrs["data-points"]) > 0
    fresh.screenshot(url, "token-runs")


def test_a_server_other_machines_reach_shows_nothing_without_its_token(remote, browser, tmp_path):
    url, _ = remote
    base, token = url.split("?token=")
    fresh = Browser(browser.binary, tmp_path / "profile")
    for attempt in (base, f"{base}?token={token[:-2]}", f"{base}api/runs", at(base, "step", run=RUN, role="rollout",
                                                                                   step=2)):
        page = fresh.dom(attempt)
        assert not page.ready() and RUN not in page.html and "<section" not in page.html, attempt
        assert "token" in page.html


#: Appended to a copy of a report: once a view is complete, the width of the step table's cells by column,
#: and how far the table reaches, go into <body> attributes the dumped DOM carries.
MEASURE = """<script>
setInterval(() => {
  if (document.body.getAttribute("data-ready") !== "1" || !document.getElementById("rows")) return;
  const widths = {};
  for (const td of document.querySelectorAll("#rows tr:nth-child(2) td")) {
    widths[td.dataset.col] = td.getBoundingClientRect().width;
  }
  document.body.setAttribute("data-widths", JSON.stringify(widths));
  document.body.setAttribute("data-table-right", String(document.getElementById("rows").getBoundingClientRect().right));
}, 50);
</script>"""


def test_a_v1_step_counts_response_tokens_and_gives_its_text_room(dump, browser, truth, tmp_path):
    """The V1 pipeline pads every response to 12 tokens and stores them jagged with their response_mask: the
    page counts response tokens (not the padding) and its text columns are not squeezed by the long queue
    keys and tags of V1 rows."""
    from stepskip._index import CacheIndex

    index = CacheIndex(str(dump / V1))
    value = index.read_step(next(s for s in index.runs()[0].steps if s.step == 1))
    masks = value["tensordict"]["response_mask"]
    assert masks.is_nested and {len(m) for m in masks.unbind()} == {12}  # padded, stored jagged
    lengths = {str(k): int(m.sum()) for k, m in zip(value["keys"], masks.unbind())}
    assert min(lengths.values()) < 12  # some responses ended early: padding would show as response tokens

    expected = truth.step_page(V1, "rollout_tq", 1, limit=100)
    assert expected["length_source"] == "response_mask"
    assert {r["key"]: r["length"] for r in expected["rows"]} == lengths
    report = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "stepskip", "report", str(dump), "-o", str(report), "--allow-pickle"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    measured = tmp_path / "measured.html"
    measured.write_text(report.read_text().replace("</body>", MEASURE + "</body>"))
    url = at(measured.as_uri(), "step", run=V1, role="rollout_tq", step=1)
    page = browser.dom(url)
    assert page.ready()
    rows = page.table_rows("rows")
    assert {r["key"]: int(r["length"]) for r in rows} == lengths
    assert "response length: mean" in page.body.text and f"max {max(lengths.values())}" in page.body.text
    widths = json.loads(page.body.attrs["data-widths"])
    assert {"key", "group", "prompt", "response", "tags"} <= set(widths)
    assert widths["response"] >= 240  # room for a line of text, not three token ids
    assert widths["response"] > max(widths["key"], widths["group"], widths["tags"])
    assert float(page.body.attrs["data-table-right"]) <= 1280  # the window: nothing pushed out of view
    browser.screenshot(url, "v1-step")
