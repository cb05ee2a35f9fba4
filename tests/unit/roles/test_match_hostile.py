"""``action: match`` over an entry whose metadata and data disagree: ``meta["row_prompts"]``
names more rows than the data holds (a crafted or damaged cache, checksums recomputed by whoever wrote
it). The entry is counted corrupt, dropped from the prompt index, never deleted, and the groups it was
to serve are generated; nothing reaches the trainer."""

from __future__ import annotations

import json

import pytest
from skip_configs import run_path
from test_match import N, Rollout, config, prompts_for, record_call, run

from stepskip import SkipManager
from stepskip._storage import open_store


def plant_short_data(dump_dir, step: int, donor_step: int) -> dict:
    """Give step ``step`` the data of ``donor_step`` (fewer rows) under its own meta (its row_prompts):
    a checksum-valid entry whose metadata and data disagree."""
    store = open_store(str(dump_dir))
    path, donor = str(run_path(dump_dir) / str(step)), str(run_path(dump_dir) / str(donor_step))
    meta, _ = store.read_entry(path)
    _, files = store.read_entry(donor)
    kept = {k: v for k, v in meta.items() if k not in ("files", "retired")}
    store.write_entry(path, files, kept)
    return kept


@pytest.mark.parametrize("async_dump", [False, True])
def test_row_prompts_naming_more_rows_than_the_data_are_damage_not_a_crash(tmp_path, async_dump):
    run(tmp_path, batch_prompts=4, order=[1, 2, 3, 4], steps=1, seed=0, epoch="a")  # step 1: 8 rows
    SkipManager.reset()
    # step 2: prompt 9's entry (2 rows); then step 1 gets those 2 rows under its own 8-row meta
    record_call(tmp_path, Rollout(seed=1), step=2, ids=[9], epoch="y")
    planted = plant_short_data(tmp_path, step=1, donor_step=2)
    assert len(planted["row_prompts"]) == 4 * N
    before = sorted(p.name for p in (run_path(tmp_path) / "1").iterdir())

    SkipManager.init(config(tmp_path, async_dump=async_dump))
    rollout = Rollout(seed=5)
    SkipManager.set_step(3)
    out = rollout.generate_sequences(prompts_for([4, 1], "b"))  # both recorded only in the damaged entry
    SkipManager.flush()
    assert [ids[::N] for ids in rollout.seen] == [[4, 1]]  # generated, in live order
    assert out.batch["responses"][:, 0].tolist() == [i * 100 for i in (4, 1) for _ in range(N)]
    stats = SkipManager.stats()
    assert stats["skip/rollout/corrupt"] == 1
    assert stats["skip/rollout/rows_generated"] == 2 * N
    assert stats["skip/rollout/rows_replayed"] == 0
    assert sorted(p.name for p in (run_path(tmp_path) / "1").iterdir()) == before  # kept, not deleted
    index = SkipManager.skip_instances["rollout"].match_index.prompts
    assert str(run_path(tmp_path) / "1") not in {where[0] for where in index.groups.values()}


def test_a_damaged_entry_only_costs_its_own_groups(tmp_path):
    run(tmp_path, batch_prompts=2, order=[1, 2], steps=1, seed=0, epoch="a")
    SkipManager.reset()
    for step, ids in ((2, [3]), (3, [5, 6])):
        record_call(tmp_path, Rollout(seed=step), step=step, ids=ids, epoch="r")
    recorded = json.loads((run_path(tmp_path) / "3" / "meta.json").read_text())
    plant_short_data(tmp_path, step=1, donor_step=2)

    SkipManager.init(config(tmp_path))
    rollout = Rollout(seed=7)
    SkipManager.set_step(4)
    rollout.generate_sequences(prompts_for([5, 1, 6], "b"))
    SkipManager.flush()
    assert [ids[::N] for ids in rollout.seen] == [[1]]  # 5 and 6 come from the intact step 3
    stats = SkipManager.stats()
    assert (stats["skip/rollout/corrupt"], stats["skip/rollout/rows_replayed"]) == (1, 2 * N)
    assert recorded["row_prompts"]  # step 3 untouched


def record_then_damage_step_1(tmp_path):
    """Step 1 records groups 1 and 2, step 2 group 3; step 1's data is then replaced by step 2's
    (one group where its meta names two, checksums valid)."""
    run(tmp_path, batch_prompts=2, order=[1, 2], steps=1, seed=0, epoch="a")
    SkipManager.reset()
    record_call(tmp_path, Rollout(seed=2), step=2, ids=[3], epoch="r")
    plant_short_data(tmp_path, step=1, donor_step=2)


def test_under_match_a_damaged_entry_never_stops_the_run_even_when_every_prompt_was_in_it(tmp_path):
    record_then_damage_step_1(tmp_path)
    replayer, _ = run(tmp_path, batch_prompts=2, order=[2, 1], steps=1, seed=3, epoch="c")
    assert [ids[::N] for ids in replayer.seen] == [[2, 1]]


def test_recording_over_a_damaged_entry_of_the_live_step_writes_a_consistent_one(tmp_path):
    """The live step's own entry is the damaged one: its groups are generated and the step's entry is
    rewritten from this call alone (a damaged entry is regenerated), never merged into a new mismatch."""
    record_then_damage_step_1(tmp_path)
    for order in ([2, 1], [7, 8]):  # the damaged entry holds the call's groups, or none of them
        replayer, _ = run(tmp_path, batch_prompts=2, order=order, steps=1, seed=3, epoch="c")
        assert [ids[::N] for ids in replayer.seen] == [order]
        assert SkipManager.stats()["skip/rollout/corrupt"] == 1  # once, whether it was read to serve or to merge
        SkipManager.reset()
        meta = json.loads((run_path(tmp_path) / "1" / "meta.json").read_text())
        assert len(meta["row_prompts"]) == 2 * N  # this call's rows only: a consistent entry
        again, _ = run(tmp_path, batch_prompts=2, order=order, steps=1, seed=4, epoch="d")
        assert again.seen == []  # which serves them
        SkipManager.reset()
        plant_short_data(tmp_path, step=1, donor_step=2)
