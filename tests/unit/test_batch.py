"""``Batch``: the tensors accessor and row-wise concatenation (SPEC §3's container)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from stepskip import Batch


def test_tensors_is_the_tensordict():
    b = Batch.from_dict(tensors={"ids": torch.arange(6).reshape(2, 3)}, non_tensors={"uid": ["a", "b"]})
    assert b.tensors is b.batch
    assert b.tensors["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_tensors_of_a_batch_without_tensors_is_a_clear_error():
    b = Batch.from_dict(non_tensors={"uid": ["a", "b"]})
    assert b.batch is None  # the attribute itself keeps its None
    with pytest.raises(ValueError, match=r"no tensors.*\['uid'\].*Batch.from_dict\(tensors="):
        b.tensors


def test_concat_joins_rows_and_keeps_the_first_meta_info():
    first = Batch.from_dict(tensors={"x": torch.zeros(2, 3)}, non_tensors={"uid": ["a", "b"]}, meta_info={"k": 1})
    second = Batch.from_dict(tensors={"x": torch.ones(1, 3)}, non_tensors={"uid": ["c"]}, meta_info={"k": 2})
    joined = Batch.concat([first, second])
    assert isinstance(joined.batch, TensorDict) and joined.batch.batch_size == torch.Size([3])
    assert joined.tensors["x"].sum().item() == 3.0
    assert joined["uid"].tolist() == ["a", "b", "c"] and joined.meta_info == {"k": 1}


def test_concat_without_tensors_in_one_part_has_none():
    with_tensors = Batch.from_dict(tensors={"x": torch.zeros(1)}, non_tensors={"uid": ["a"]})
    without = Batch.from_dict(non_tensors={"uid": ["b"]})
    joined = Batch.concat([with_tensors, without])
    assert joined.batch is None and joined["uid"].tolist() == ["a", "b"] and len(joined) == 2
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])
