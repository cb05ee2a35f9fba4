"""Row selection and concatenation keep jagged tensors jagged and non-tensor stacks intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip.tq import concat_rows, select_rows


def jagged(rows):
    return torch.nested.as_nested_tensor([torch.as_tensor(r) for r in rows], layout=torch.jagged)


def sample_td():
    td = TensorDict({"j": jagged([[1, 2], [3], [4, 5, 6]]), "d": torch.tensor([[0, 1], [2, 3], [4, 5]]),
                     "sub": TensorDict({"x": torch.tensor([7.0, 8.0, 9.0])}, batch_size=[3])}, batch_size=[3])
    td.set("msg", NonTensorStack(*(NonTensorData(data={"i": i}, batch_size=[]) for i in range(3)), batch_size=[3]))
    td.set_non_tensor("flag", "all-rows")
    return td


def test_select_rows_any_order_with_repeats():
    out = select_rows(sample_td(), [2, 0, 2, 1])
    assert out.batch_size == torch.Size([4])
    assert out["j"].is_nested and out["j"].layout == torch.jagged
    assert [r.tolist() for r in out["j"].unbind()] == [[4, 5, 6], [1, 2], [4, 5, 6], [3]]
    assert out["d"].tolist() == [[4, 5], [0, 1], [4, 5], [2, 3]]
    assert out["sub", "x"].tolist() == [9.0, 7.0, 9.0, 8.0]
    assert out["msg"] == [{"i": 2}, {"i": 0}, {"i": 2}, {"i": 1}]
    assert out.get("flag").data == "all-rows"


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=8), data=st.data())
def test_select_jagged_matches_per_row_reference(lengths, data):
    rows = [torch.arange(n) + 10 * i for i, n in enumerate(lengths)]
    nt = torch.nested.nested_tensor_from_jagged(torch.cat(rows), torch.tensor([0, *np.cumsum(lengths)]))
    index = data.draw(st.lists(st.integers(0, len(lengths) - 1), min_size=1, max_size=12))
    out = select_rows(nt, index)
    assert out.layout == torch.jagged
    assert [r.tolist() for r in out.unbind()] == [rows[i].tolist() for i in index]


def test_selected_jagged_rows_are_a_copy_even_when_consecutive():
    """Rows picked in their recorded order are one contiguous run: copied once, still not a view."""
    nt = jagged([[1, 2], [3], [4, 5, 6]])
    for index in ([0, 1, 2], [1, 2], [2, 0, 1], []):
        out = select_rows(nt, index)
        if index:
            out.values().fill_(0)
        assert [r.tolist() for r in nt.unbind()] == [[1, 2], [3], [4, 5, 6]]
        assert out.offsets().tolist() == np.cumsum([0] + [[2, 1, 3][i] for i in index]).tolist()


def test_select_rows_of_plain_columns():
    cols = {"t": torch.arange(3), "a": np.array(["x", "y", "z"], dtype=object), "l": [{"a": 1}, None, "s"]}
    out = select_rows(cols, [1, 1, 0])
    assert out["t"].tolist() == [1, 1, 0]
    assert out["a"].tolist() == ["y", "y", "x"]
    assert out["l"] == [None, None, {"a": 1}]


def test_concat_rows_joins_jagged_and_non_tensor_columns():
    a, b = sample_td(), select_rows(sample_td(), [1])
    out = concat_rows([a, b])
    assert out.batch_size == torch.Size([4])
    assert out["j"].layout == torch.jagged
    assert [r.tolist() for r in out["j"].unbind()] == [[1, 2], [3], [4, 5, 6], [3]]
    assert out["msg"] == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 1}]
    assert out["sub", "x"].tolist() == [7.0, 8.0, 9.0, 8.0]


def test_select_rows_rejects_unknown_types():
    with pytest.raises(TypeError):
        select_rows(object(), [0])
