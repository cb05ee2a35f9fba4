"""``action: match`` behind a store that does not answer: an entry the matcher cannot read is not served,
its groups are generated, and the step's regenerated rows are not written over it. The store is the
in-memory backend with reads refused on demand (tests/support/outage_backend.py): it stands in for an
object store that does not answer; the real-socket tests in tests/integration/storage cover the fsspec path."""

from __future__ import annotations

import pytest
import torch
from outage_backend import OutageBackend, outage_store, snapshot

from stepskip import Batch, SkipManager

ROWS = 4


class Rollout:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        tokens = prompts.batch["input_ids"]
        return Batch.from_dict(tensors={"responses": tokens * 100 + self.calls},
                               non_tensors={"uid": list(prompts.non_tensor_batch["uid"])})


def prompts(epoch: str) -> Batch:
    tokens = torch.tensor([[i, i + 1] for i in range(ROWS)])
    return Batch.from_dict(tensors={"input_ids": tokens, "attention_mask": torch.ones_like(tokens)},
                           non_tensors={"uid": [f"{epoch}-{i}" for i in range(ROWS)]})


def init(dump_dir: str) -> None:
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": "all", "action": "match", "dump_dir": dump_dir,
                                           "async_dump": False}}})


@pytest.fixture
def dump_dir():
    with outage_store() as root:
        yield root


def test_an_entry_behind_an_outage_is_not_served_nor_written_over(dump_dir):
    init(dump_dir)
    SkipManager.set_step(1)
    Rollout().generate_sequences(prompts("rec"))
    SkipManager.flush()
    SkipManager.reset()
    before = snapshot(dump_dir)
    assert any(path.endswith("/1/meta.json") for path in before)

    init(dump_dir)
    SkipManager.skip_instances["rollout"].match_index.refresh()  # indexed while the store answers
    OutageBackend.down = staticmethod(lambda path: path.endswith("/1"))
    rollout = Rollout()
    SkipManager.set_step(1)
    out = rollout.generate_sequences(prompts("live"))
    SkipManager.flush()
    assert OutageBackend.refused and rollout.calls == 1  # its groups were generated
    assert torch.equal(out.batch["responses"], prompts("x").batch["input_ids"] * 100 + 1)
    stats = SkipManager.stats()
    assert stats["skip/rollout/unavailable"] >= 1 and stats["skip/rollout/dumps"] == 0
    assert snapshot(dump_dir) == before  # not one byte written over the entry
