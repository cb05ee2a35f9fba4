"""``Batch``: the tensors accessor and row-wise concatenation."""

from __future__ import annotations

import numpy as np
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


def test_a_non_tensor_column_of_another_length_than_the_rows_is_refused():
    """As verl's ``DataProto`` checks its columns: a decoder handing back such a batch would give the
    trainer rows that do not line up (a crafted entry); it is a decoding failure instead."""
    tensors = TensorDict({"ids": torch.zeros(3, 2)}, batch_size=[3])
    with pytest.raises(ValueError, match="non-tensor column 'uid' holds 1 rows, the batch 3"):
        Batch(batch=tensors, non_tensor_batch={"uid": np.array(["a"], dtype=object)})
    with pytest.raises(ValueError, match="'score' is a int, not one item per row"):
        Batch(batch=tensors, non_tensor_batch={"score": 7})
    assert len(Batch(batch=tensors, non_tensor_batch={"uid": np.array(["a", "b", "c"], dtype=object)})) == 3
    assert Batch(non_tensor_batch={"scalar": np.array(3.5)}).batch is None  # no tensors: nothing to line up with


def test_a_safe_entry_whose_column_is_short_does_not_decode():
    from stepskip.errors import CorruptEntryError
    from stepskip._formats.safe import SafeFormat

    fmt = SafeFormat()
    value = Batch.from_dict(tensors={"ids": torch.zeros(3, 2)}, non_tensors={"uid": ["a", "b", "c"]})
    value.non_tensor_batch["uid"] = value.non_tensor_batch["uid"][:1]  # after construction, which checks
    files = fmt.encode(fmt.freeze(value, copy=True))
    with pytest.raises(CorruptEntryError, match="non-tensor column 'uid' holds 1 rows, the batch 3"):
        fmt.decode(files)
