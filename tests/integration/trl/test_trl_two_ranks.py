"""stepskip inside the real TRL ``GRPOTrainer`` on 2 processes (``torchrun``, gloo on CPU): entries per
rank, the world size in the run's identity, and ranks that agree on every hit or miss.

Each run ends as a user's script should (``trl_run.py``): a barrier, the trainer released, then
``destroy_process_group``, and the interpreter's normal exit. Destroying the group while the trainer
lives left about 1 run in 10 aborting at exit ("terminate called without an active exception",
SIGABRT: 4 of 40 with stepskip on). Core dumps show a gloo worker thread (``pt_gloo_runloop``)
destroying the last barrier's work, and through it a TRL all_gather's work whose tensors it must
hand back to Python, while the main thread is in ``Py_FinalizeEx``: CPython ends a thread that takes
the GIL then, inside a noexcept destructor. The DDP wrapper holds the group, so its threads outlive
``destroy_process_group``. A 15-line torch-only script (gloo, a held group, all_gather, barrier,
destroy, exit) aborts the same way in 8 of 39 runs, and in none of 40 when it drops the group before
exiting: torch's teardown, not stepskip (pytorch/pytorch#179291). With the trainer released first
the group's threads are joined before exit: 40 of 40 runs clean.
"""

from __future__ import annotations

import json
import shutil

import pytest
from trl_support import copy_cache, entries, logs_without_timings, run_trl, skip_section

pytestmark = pytest.mark.heavy

ARGS = {"per_device_train_batch_size": 2}


def test_each_rank_stores_its_own_entries_under_the_world_size(recording_2ranks):
    cache, recorded = recording_2ranks
    assert [r["error"] for r in recorded] == [None, None]
    assert entries(cache) == {step: ["c0-r0", "c0-r1"] for step in (1, 2, 3)}
    assert [p.name for p in cache.glob("*/*")] == ["GBS1_N4_in0_out8_W2"]


def test_one_ranks_missing_entry_makes_both_regenerate_that_step_and_logs_equal_the_recording(
        recording_2ranks, tmp_path):
    cache, recorded = recording_2ranks
    replay_cache = copy_cache(cache, tmp_path)
    (missing,) = replay_cache.glob("*/*/trl_generate/2/c0-r1")
    shutil.rmtree(missing)
    replayed, _ = run_trl(tmp_path, skip_section(replay_cache), ranks=2, args=ARGS, name="replay")
    for rank in (0, 1):
        assert replayed[rank]["error"] is None
        assert replayed[rank]["generated_steps"] == [2, 4]  # step 2 on both ranks, though rank 0 had it
        assert [c["hit"] for c in replayed[rank]["calls"]] == [True, False, True, False]
        assert logs_without_timings(replayed[rank]) == logs_without_timings(recorded[rank])
    assert replayed[0]["stats"]["skip/trl_generate/hits"] == 2
    assert replayed[0]["stats"]["skip/trl_generate/misses"] == 1
    assert entries(replay_cache)[2] == ["c0-r0", "c0-r1"]  # regenerated and recorded again


def test_one_process_against_a_2_rank_cache_is_a_miss(recording_2ranks, tmp_path):
    cache, _ = recording_2ranks
    replay_cache = copy_cache(cache, tmp_path)
    result, _ = run_trl(tmp_path, skip_section(replay_cache), args={"per_device_train_batch_size": 4}, name="one")
    assert result["error"] is None
    assert result["generated_steps"] == [1, 2, 3, 4]
    assert result["stats"]["skip/trl_generate/hits"] == 0
    assert sorted(p.name for p in replay_cache.glob("*/*")) == ["GBS1_N4_in0_out8", "GBS1_N4_in0_out8_W2"]


def test_one_ranks_unreadable_entry_stops_both_ranks_with_errors_not_a_hang(recording_2ranks, tmp_path):
    cache, _ = recording_2ranks
    replay_cache = copy_cache(cache, tmp_path)
    (meta_path,) = replay_cache.glob("*/*/trl_generate/1/c0-r1/meta.json")
    meta = json.loads(meta_path.read_text())
    meta["format"] = "a-format-from-the-future"
    meta_path.write_text(json.dumps(meta))
    replayed, _ = run_trl(tmp_path, skip_section(replay_cache), ranks=2, args=ARGS, name="unreadable")
    assert "UnreadableEntryError" in replayed[1]["error"]["mro"]
    assert "a-format-from-the-future" in replayed[1]["error"]["message"]
    assert "SkipConfigError" in replayed[0]["error"]["mro"]
    assert "another rank cannot use its entry of step 1" in replayed[0]["error"]["message"]
    assert replayed[0]["generated_steps"] == replayed[1]["generated_steps"] == []
    assert json.loads(meta_path.read_text())["format"] == "a-format-from-the-future"  # kept, not regenerated over
