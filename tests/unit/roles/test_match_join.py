"""``action: match`` over recorded entries that cannot be joined with the live rows or with each other
(another version's columns): the entry is counted corrupt, forgotten by the prompt index, kept on disk,
and its groups are generated; the live generation is never lost and nothing but the library's typed
errors reaches the trainer.

The rollout is a stand-in for an inference server (none can run here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from skip_configs import run_path
from tensordict import TensorDict
from test_match import N, Rollout, config, prompts_for, record_call

from stepskip import Batch, SkipManager
from stepskip.errors import UnreadableEntryError


class WideRollout(Rollout):
    """Another version of the rollout: one more response column (a trailing shape the live rows lack)."""

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        ids = prompts.batch["input_ids"][:, 0].tolist()
        self.seen.append(ids)
        responses = torch.cat([prompts.batch["input_ids"] * 100, torch.zeros(len(ids), 2, dtype=torch.long)], dim=1)
        return Batch.from_dict(tensors={"responses": responses},
                               non_tensors={"uid": list(prompts.non_tensor_batch["uid"])})


class ShortColumnRollout(Rollout):
    """A crafted result: every tensor row, but a non-tensor column holding one item."""

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        ids = prompts.batch["input_ids"][:, 0].tolist()
        self.seen.append(ids)
        responses = torch.cat([prompts.batch["input_ids"] * 100, torch.zeros(len(ids), 1, dtype=torch.long)], dim=1)
        uid = np.empty(1, dtype=object)
        uid[0] = "only-one"
        result = Batch(batch=TensorDict({"responses": responses}, batch_size=[len(ids)]))
        result.non_tensor_batch["uid"] = uid  # after construction, which would refuse it
        return result


def replay(tmp_path, step: int, ids: list[int]) -> tuple[Rollout, Batch, dict]:
    SkipManager.init(config(tmp_path))
    rollout = Rollout(seed=9)
    SkipManager.set_step(step)
    out = rollout.generate_sequences(prompts_for(ids, "live"))
    SkipManager.flush()
    stats = SkipManager.stats()
    return rollout, out, stats


def assert_live(out: Batch, ids: list[int]) -> None:
    assert out.batch["responses"][:, 0].tolist() == [i * 100 for i in ids for _ in range(N)]
    assert out.batch["responses"].shape[1] == 4
    assert out.non_tensor_batch["uid"].tolist() == [f"live-{i}" for i in ids for _ in range(N)]


def test_an_entry_that_does_not_join_the_live_rows_is_regenerated_not_a_crash(tmp_path):
    record_call(tmp_path, WideRollout(seed=0), step=1, ids=[1, 2])
    before = sorted(p.name for p in (run_path(tmp_path) / "1").iterdir())
    rollout, out, stats = replay(tmp_path, step=2, ids=[3, 1])  # 1 is recorded, but wide; 3 is not
    assert [ids[::N] for ids in rollout.seen] == [[3], [1]]  # the first generation kept, 1 generated after
    assert_live(out, [3, 1])
    assert stats["skip/rollout/corrupt"] == 1
    assert stats["skip/rollout/rows_replayed"] == 0
    assert sorted(p.name for p in (run_path(tmp_path) / "1").iterdir()) == before  # kept, not deleted
    SkipManager.reset()
    again, out, _ = replay(tmp_path, step=3, ids=[1, 3])  # the step 2 entry now serves both
    assert again.seen == []
    assert_live(out, [1, 3])


def test_entries_that_do_not_join_each_other_cost_only_the_odd_one_before_generation(tmp_path):
    record_call(tmp_path, Rollout(seed=0), step=1, ids=[1, 2, 3])
    record_call(tmp_path, WideRollout(seed=0), step=2, ids=[4])
    rollout, out, stats = replay(tmp_path, step=3, ids=[1, 4, 2, 5])
    assert [ids[::N] for ids in rollout.seen] == [[4, 5]]  # one call: the odd entry was dropped before it
    assert_live(out, [1, 4, 2, 5])
    assert stats["skip/rollout/corrupt"] == 1
    assert stats["skip/rollout/rows_replayed"] == 2 * N


def test_a_non_tensor_column_of_the_wrong_length_is_refused_by_name_not_an_index_error(tmp_path):
    """Its files match their checksums but do not decode into a consistent batch (``Batch`` refuses a
    column of another length, as verl's ``DataProto`` does): an unreadable entry, said by name and
    left untouched, never an IndexError from selecting its rows."""
    record_call(tmp_path, ShortColumnRollout(seed=0), step=1, ids=[1, 2])
    before = {p.name: p.read_bytes() for p in (run_path(tmp_path) / "1").iterdir()}
    with pytest.raises(UnreadableEntryError, match="non-tensor column 'uid' holds 1 rows, the batch 4"):
        replay(tmp_path, step=2, ids=[2, 3])
    assert {p.name: p.read_bytes() for p in (run_path(tmp_path) / "1").iterdir()} == before
