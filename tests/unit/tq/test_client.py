"""The in-process queue's semantics (its parity with the real one is in tests/integration/tq)."""

from __future__ import annotations

import inspect
import types

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from stepskip.tq import InProcessTQClient, TQClient


def td(**columns):
    rows = len(next(iter(columns.values())))
    return TensorDict(columns, batch_size=[rows])


def test_rows_come_back_jagged_scalars_dense_and_objects_as_stacks():
    tq = InProcessTQClient()
    fields = td(ids=torch.arange(6).reshape(2, 3), score=torch.tensor([0.5, 1.5]))
    fields.set("msg", NonTensorStack.from_list([{"r": 1}, "two"]))
    tq.kv_batch_put(keys=["a", "b"], partition_id="train", fields=fields, tags=[{"s": 1}, {"s": 2}])
    got = tq.kv_batch_get(keys=["b", "a"], partition_id="train")
    assert got["ids"].is_nested and [r.tolist() for r in got["ids"].unbind()] == [[3, 4, 5], [0, 1, 2]]
    assert not got["score"].is_nested and got["score"].tolist() == [1.5, 0.5]
    assert got["msg"] == ["two", {"r": 1}]


def test_get_returns_common_fields_and_skips_missing_keys(caplog):
    tq = InProcessTQClient()
    tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=td(x=torch.tensor([1, 2])), tags=[{}, {}])
    tq.kv_batch_put(keys=["a"], partition_id="p", fields=td(y=torch.tensor([9])))
    assert list(tq.kv_batch_get(keys=["a", "b"], partition_id="p").keys()) == ["x"]
    got = tq.kv_batch_get(keys=["a", "gone"], partition_id="p")
    assert got.batch_size == torch.Size([1]) and "not found" in caplog.text
    assert tq.kv_batch_get(keys=["a"], partition_id="p", select_fields=["nope"]).batch_size == torch.Size([0])
    tq.kv_batch_put(keys=["t"], partition_id="p", tags=[{"is_prompt": True}])
    with pytest.raises(ValueError, match="not ready"):
        tq.kv_batch_get(keys=["t"], partition_id="p")


def test_column_wise_puts_add_fields_and_merge_tags():
    tq = InProcessTQClient()
    tq.kv_batch_put(keys=["a"], partition_id="p", fields=td(x=torch.ones(1, 2)), tags=[{"status": "running"}])
    meta = tq.kv_batch_put(keys=["a"], partition_id="p", fields=td(y=torch.zeros(1)),
                           tags=[{"status": "finished", "n": 1}])
    assert meta.fields == ["x", "y"] and meta.tags == [{"status": "finished", "n": 1}]
    tq.kv_batch_put(keys=["a"], partition_id="p", tags=[{"extra": True}])
    assert tq.kv_list("p") == {"p": {"a": {"status": "finished", "n": 1, "extra": True}}}
    assert set(tq.kv_batch_get(keys="a", partition_id="p").keys()) == {"x", "y"}
    assert list(tq.kv_batch_get(keys="a", partition_id="p", select_fields="y").keys()) == ["y"]


def test_partitions_are_separate_and_clear_removes_keys():
    tq = InProcessTQClient()
    tq.kv_batch_put(keys=["a"], partition_id="train", tags=[{"t": 1}])
    tq.kv_batch_put(keys=["a"], partition_id="val", tags=[{"t": 2}])
    assert tq.kv_list() == {"train": {"a": {"t": 1}}, "val": {"a": {"t": 2}}}
    tq.kv_clear(keys=["a"], partition_id="train")
    assert tq.kv_list("train") == {"train": {}}
    assert tq.kv_list("never") == {}
    with pytest.raises(ValueError):
        tq.kv_batch_get(keys=["a"], partition_id="train")


def test_bad_puts_are_refused():
    tq = InProcessTQClient()
    with pytest.raises(ValueError):
        tq.kv_batch_put(keys=["a"], partition_id="p")
    with pytest.raises(ValueError):
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", tags=[{}])
    with pytest.raises(ValueError):
        tq.kv_batch_put(keys=["a", "b"], partition_id="p", fields=td(x=torch.ones(3)))
    with pytest.raises(ValueError, match="duplicated"):
        tq.kv_batch_put(keys=["a", "a"], partition_id="p", tags=[{}, {}])
    with pytest.raises(TypeError):
        tq.kv_batch_put(keys=["a"], partition_id="p", fields={"x": torch.ones(1)})
    with pytest.raises(TypeError):
        tq.kv_batch_put(keys=("a",), partition_id="p", tags=[{}])
    with pytest.raises(ValueError, match="empty"):
        tq.kv_clear(keys=[], partition_id="p")
    batch_wide = td(x=torch.ones(1))
    batch_wide.set_non_tensor("c", "same")
    with pytest.raises(TypeError):
        tq.kv_batch_put(keys=["a"], partition_id="p", fields=batch_wide)
    assert tq.kv_list() == {}  # nothing half-written


def test_the_in_process_client_is_a_tq_client():
    assert isinstance(InProcessTQClient(), TQClient)
    # a module offering the two functions (as the transfer_queue module does) is one too; half of it is not
    both = types.SimpleNamespace(kv_batch_put=lambda **kw: None, kv_batch_get=lambda **kw: None)
    assert isinstance(both, TQClient)
    assert not isinstance(types.SimpleNamespace(kv_batch_put=lambda **kw: None), TQClient)


@pytest.mark.parametrize("name", ["kv_batch_put", "kv_batch_get"])
def test_the_in_process_client_accepts_every_argument_of_the_protocol(name):
    """The role calls with keywords: each one the protocol names, with its default, the client takes."""
    wanted = inspect.signature(getattr(TQClient, name)).parameters
    offered = inspect.signature(getattr(InProcessTQClient, name)).parameters
    for param in wanted.values():
        assert param.name in offered, f"InProcessTQClient.{name} lacks {param.name!r}"
        assert offered[param.name].default == param.default, f"{name}({param.name}=...) default differs"
