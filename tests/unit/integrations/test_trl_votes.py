"""How the ranks of a TRL trainer vote (hit or miss, start vLLM or not): through one gloo group per trainer.

A real ``torch.distributed`` gloo process group of one process serves here. A GPU job's default group
is NCCL, which cannot run on this machine: ``get_backend`` answering ``"nccl"`` stands in for it, so
that the integration makes a gloo group of its own, as it does on GPUs.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

pytest.importorskip("trl")

from stepskip.integrations import trl as integration  # noqa: E402


class Trainer:
    """What the vote reads of a trainer: nothing but its identity (a group is kept per trainer)."""


@pytest.fixture
def process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_with_a_gloo_default_group_the_votes_use_it(process_group):
    assert integration._gloo_group(Trainer()) is None
    assert integration._highest_of_ranks([2, -1, 5], None) == [2, -1, 5]


def test_with_another_default_backend_each_trainer_gets_one_gloo_group_for_all_its_votes(process_group,
                                                                                         monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    made = []
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append(k) or new_group(*a, **k))
    trainer, other = Trainer(), Trainer()
    group = integration._gloo_group(trainer)  # the vLLM decision in __init__
    assert integration._gloo_group(trainer) is group  # enable_stepskip, and every later vote
    assert integration._gloo_group(other) is not group
    assert made == [{"backend": "gloo"}] * 2  # one per trainer
    assert integration._highest_of_ranks([0, 3], group) == [0, 3]


def test_without_torch_distributed_a_multi_process_trainer_is_a_clear_error():
    with pytest.raises(integration.SkipConfigError, match="torchrun or accelerate launch"):
        integration._gloo_group(Trainer())
