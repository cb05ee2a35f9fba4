"""Two V1 recorders of one step end with ONE complete step, all its inner entries from one run
real recorder processes, interleaved deterministically on events (each waits
for the other's signal, never for time)."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from v1_recorders import config, record_step

from stepskip import SkipManager
from stepskip._storage import open_store
from stepskip.tq import InProcessTQClient

CTX = multiprocessing.get_context("spawn")
WAIT = 300  # seconds; only a hung child ever reaches it


def project_dir(dump_dir):
    return Path(dump_dir) / "default_experiment_name_default_project_name" / "GBS4_N2_in0_out0"


def run_ids(dump_dir):
    step = project_dir(dump_dir) / "1"
    return [json.loads((step / i / "meta.json").read_text())["run_id"] for i in ("0", "1")]


def staged(dump_dir):
    return sorted(p.name for p in project_dir(dump_dir).iterdir() if p.name.startswith(".tmp-"))


def recorder(dump_dir, before_first=None, after_first=None, before_second=None, after_second=None, crash=False):
    results = CTX.Queue()
    process = CTX.Process(target=record_step, args=(str(dump_dir), before_first, after_first, before_second,
                                                    after_second, results, crash))
    process.start()
    return process, results


def test_interleaved_recorders_leave_one_complete_step(tmp_path):
    # A writes inner 0; B writes inner 0 and 1; then A writes inner 1. Written in place the step would end
    # with inner 0 from B and inner 1 from A: never complete. Staged, each run publishes its step whole.
    a_first, b_done, release_a = CTX.Event(), CTX.Event(), CTX.Event()
    a, a_results = recorder(tmp_path, after_first=a_first, before_second=release_a)
    b, b_results = recorder(tmp_path, before_first=a_first, after_second=b_done)
    a_run, b_run = a_results.get(timeout=WAIT), b_results.get(timeout=WAIT)
    assert b_done.wait(WAIT)
    b.join(WAIT)
    assert b.exitcode == 0
    assert run_ids(tmp_path) == [b_run, b_run]  # B's step, whole, while A is still recording
    assert len(staged(tmp_path)) == 1  # A's inner 0, out of sight
    release_a.set()
    a.join(WAIT)
    assert a.exitcode == 0
    assert run_ids(tmp_path) == [a_run, a_run]  # A published last: its whole step, nothing of B's left
    assert staged(tmp_path) == []
    cached = config(str(tmp_path))
    cached["skip"]["rollout_tq"]["action"] = "cache"
    SkipManager.init(cached, tq_client=InProcessTQClient())
    assert SkipManager.skip_instances["rollout_tq"].has_v1_cache(1)


def test_a_recorder_that_dies_midway_does_not_spoil_the_other(tmp_path):
    a_first = CTX.Event()
    a, a_results = recorder(tmp_path, after_first=a_first, crash=True)
    b, b_results = recorder(tmp_path, before_first=a_first)
    a_results.get(timeout=WAIT)
    b_run = b_results.get(timeout=WAIT)
    a.join(WAIT)
    b.join(WAIT)
    assert b.exitcode == 0
    assert run_ids(tmp_path) == [b_run, b_run]
    assert len(staged(tmp_path)) == 1  # the dead recorder's inner 0: a leftover


def test_a_crashed_recorder_leaves_only_a_stale_temporary(tmp_path):
    crashed, results = recorder(tmp_path, crash=True)
    results.get(timeout=WAIT)
    crashed.join(WAIT)
    project = project_dir(tmp_path)
    (name,) = staged(tmp_path)
    assert (project / name / "0" / "meta.json").is_file()
    assert not (project / "1").exists()  # nothing half-written is visible as the step
    store = open_store(str(tmp_path))
    assert store.remove_leftovers(str(project), older_than=3600) == []  # not stale yet: it may still be written
    assert store.remove_leftovers(str(project), older_than=0) == [f"{project}/{name}"]
    assert list(project.iterdir()) == []
