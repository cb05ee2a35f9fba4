"""``stepskip view --follow``: steps a live run records show up in the listing without a restart, only the
runs that changed are scanned again, and the listing marks the runs being written."""

from __future__ import annotations

import os
import time

from cli_caches import record_rollout

from stepskip.view.data import ViewSource
from stepskip.view.server import handle_api

RUN_A = "exp_a/GBS4_N2_in8_out6"
RUN_B = "exp_b/GBS4_N2_in8_out6"


def steps_of(source: ViewSource, run: str) -> list[int]:
    [role] = next(r for r in source.listing()["runs"] if r["name"] == run)["roles"]
    return [s["step"] for s in role["steps"]]


def test_new_steps_appear_and_only_the_changed_run_is_scanned_again(tmp_path):
    record_rollout(tmp_path, "a", [1])
    record_rollout(tmp_path, "b", [1])
    source = ViewSource(str(tmp_path), follow=True)
    listing = source.listing()
    assert listing["follow"]["seconds"] > 0 and listing["live_seconds"] == 600
    before = source.follow()
    untouched = source.run(RUN_B)
    assert source.follow(now=time.time() + 2)["version"] == before["version"]  # nothing changed: nothing bumped

    record_rollout(tmp_path, "a", [2])  # the run goes on while the page is open
    after = source.follow(now=time.time() + 4)
    assert after["version"] > before["version"]
    assert steps_of(source, RUN_A) == [1, 2] and steps_of(source, RUN_B) == [1]
    assert source.run(RUN_B) is untouched  # not scanned again
    assert source.step_page(RUN_A, "rollout", 2)["total"] == 8
    status, body = handle_api(source, "/api/follow", {})
    assert status == 200 and body["version"] == after["version"]


def test_a_run_is_being_written_while_it_records_or_stages_a_step(tmp_path):
    record_rollout(tmp_path, "a", [1])
    record_rollout(tmp_path, "b", [1])
    source = ViewSource(str(tmp_path), follow=True, live_seconds=60)
    now = time.time()
    assert source.follow(now=now)["live"] == [RUN_A, RUN_B]  # both just recorded a step
    assert {r["name"]: r["live"] for r in source.listing()["runs"]} == {RUN_A: True, RUN_B: True}
    later = now + 3600
    assert source.follow(now=later)["live"] == []
    staging = tmp_path / RUN_A / ".tmp-2-0123456789ab"  # step 2 being built before its rename into place
    staging.mkdir()
    os.utime(staging, (later, later))
    assert source.follow(now=later + 1)["live"] == [RUN_A]
    assert source.follow(now=later + 3600)["live"] == []  # an old staging directory is a leftover, not a writer


def test_without_follow_the_page_does_not_poll(tmp_path):
    record_rollout(tmp_path, "a", [1])
    listing = ViewSource(str(tmp_path)).listing()
    assert listing["follow"] is None
    step = listing["runs"][0]["roles"][0]["steps"][0]
    assert step["recorded_utc"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(step["time"]))


def test_a_vanished_cache_keeps_the_last_listing(tmp_path):
    import shutil

    record_rollout(tmp_path / "dump", "a", [1])
    source = ViewSource(str(tmp_path / "dump"), follow=True)
    version = source.follow()["version"]
    shutil.rmtree(tmp_path / "dump")
    assert source.follow(now=time.time() + 2)["version"] == version
    assert steps_of(source, RUN_A) == [1]
