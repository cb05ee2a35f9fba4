"""format 'safe': freeze takes only a private snapshot; the encoding runs in encode (the background worker).

verl's rows share non-tensor objects across the n samples of a prompt (``np.repeat`` of object
arrays); the snapshot copies each shared object once, and what is replayed must still equal what
was returned even when the caller changes those objects after the call.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip import Batch
from stepskip.errors import UnstorableValueError
from stepskip._formats.safe import SafeFormat, _Deferred, release_snapshot_buffers
from stepskip._formats.snapshot import snapshot_object_array, snapshot_value

Exact = Callable[[Any, Any], None]
FMT = SafeFormat()


def repeated(values: list[Any], n: int) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return np.repeat(column, n)


def verl_batch(n: int = 4) -> Batch:
    raw = repeated([[{"role": "user", "content": f"q{g}"}] for g in range(3)], n)
    reward = repeated([{"ground_truth": str(g), "style": "rule", "extra": {"tags": [g, "t"]}} for g in range(3)], n)
    assert raw[0] is raw[1]
    return Batch(
        batch=TensorDict({"ids": torch.arange(3 * n * 4).reshape(3 * n, 4)}, batch_size=[3 * n]),
        non_tensor_batch={"uid": repeated([f"u{g}" for g in range(3)], n), "raw_prompt": raw, "reward_model": reward,
                          "index": repeated([0, 1, 2], n)},
        meta_info={"timing": {"gen": 1.5}, "lists": [[1, 2], (3, 4)]},
    )


def test_shared_objects_are_snapshot_even_when_changed_right_after_freeze(exact: Exact) -> None:
    value = verl_batch()
    expected = copy.deepcopy(value)
    frozen = FMT.freeze(value, copy=True)
    value.non_tensor_batch["raw_prompt"][0].append({"role": "assistant", "content": "late"})  # all n rows share it
    value.non_tensor_batch["raw_prompt"][5][0]["content"] = "changed"
    value.non_tensor_batch["reward_model"][0]["extra"]["tags"].append("x")
    value.non_tensor_batch["uid"][1] = "other"
    value.meta_info["lists"][0].append(3)
    exact(FMT.decode(FMT.encode(frozen)), expected)


def test_the_snapshot_copies_each_shared_object_once() -> None:
    column = verl_batch().non_tensor_batch["raw_prompt"]
    snap = snapshot_object_array(column, "raw", FMT_CHECK)
    assert snap[0] is snap[1] and snap[0] is not column[0]  # one private copy for the rows that shared one
    assert snap[0][0] is not column[0][0]
    assert snap[0][0]["content"] is column[0][0]["content"]  # immutable leaves are shared, not copied
    plain = np.array(["a", "b"], dtype=object)
    assert snapshot_object_array(plain, "p", FMT_CHECK) is not plain  # the array itself is always copied


def FMT_CHECK(tensor: torch.Tensor, path: str) -> None:  # noqa: N802 - used like a constant
    if tensor.is_complex():
        raise UnstorableValueError(f"{path}: complex")


def test_freeze_leaves_the_encoding_to_encode_and_encode_is_repeatable() -> None:
    frozen = FMT.freeze(verl_batch(), copy=True)
    assert frozen.deferred
    first = FMT.encode(frozen)
    assert not frozen.deferred
    assert FMT.encode(frozen) == first
    assert FMT.encode(FMT.freeze(verl_batch(), copy=False)) == first  # the same bytes with or without copy


def _deferred_in_walk_order(node: Any) -> list[tuple[int, str]]:
    """Where a walk of the whole tree meets a deferred value: (id of its node, key)."""
    found: list[tuple[int, str]] = []
    if isinstance(node, dict):
        for key, child in node.items():
            if isinstance(child, _Deferred):
                found.append((id(node), key))
            else:
                found.extend(_deferred_in_walk_order(child))
    elif isinstance(node, list):
        for child in node:
            found.extend(_deferred_in_walk_order(child))
    return found


def test_freeze_records_every_deferred_value_in_tree_order_and_encode_fills_each(exact: Exact) -> None:
    """encode finds the deferred values through ``Frozen.holders`` instead of walking the tree: they must be
    all of them, in the walk's order (the order their tensors are named in), or values stay unencoded."""
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    td.set("msg", NonTensorStack(*(NonTensorData(data={"m": [i]}, batch_size=[]) for i in range(2)), batch_size=[2]))
    td.set("tag", NonTensorData({"k": "v"}, batch_size=[2]))
    value = {"first": verl_batch(), "td": td, "plain": {"list": [1, {"t": torch.ones(2)}], "s": "x", "n": 3},
             "array": np.array([[1, "a"], [{"d": 1}, None]], dtype=object), "last": [torch.arange(2)]}
    expected = copy.deepcopy(value)
    frozen = FMT.freeze(value, copy=True)
    walked = _deferred_in_walk_order(frozen.tree)
    assert len(walked) >= 9  # meta_info, 4 object columns, msg, tag, plain['list'], array, last
    assert [(id(node), key) for node, key in frozen.holders] == walked
    files = FMT.encode(frozen)
    assert frozen.holders == [] and _deferred_in_walk_order(frozen.tree) == []
    assert files == FMT.encode(FMT.freeze(copy.deepcopy(expected), copy=False))
    exact(FMT.decode(files), expected)


def test_shared_rows_are_stored_once_and_share_again_after_a_hit(exact: Exact) -> None:
    """Rows that share one object (verl's repeat) store it once and share one again when decoded;
    the same values held by a copy per row decode to equal, unshared rows."""
    shared = verl_batch()
    copied = copy.deepcopy(shared)
    for key, column in copied.non_tensor_batch.items():
        rows = np.empty(len(column), dtype=object)
        rows[:] = [copy.deepcopy(v) for v in column]
        copied.non_tensor_batch[key] = rows
    assert copied.non_tensor_batch["raw_prompt"][0] is not copied.non_tensor_batch["raw_prompt"][1]
    once, per_row = FMT.encode(FMT.freeze(shared, copy=True)), FMT.encode(FMT.freeze(copied, copy=True))
    assert json.loads(bytes(once["data.json"]))["version"] == 4
    assert len(once["data.json"]) < len(per_row["data.json"])
    assert once["data.safetensors"] == per_row["data.safetensors"]
    from_shared, from_copies = FMT.decode(dict(once)), FMT.decode(dict(per_row))
    exact(from_shared, copied)
    exact(from_copies, copied)
    for key, column in shared.non_tensor_batch.items():
        if isinstance(column[0], (dict, list)):
            assert (from_shared.non_tensor_batch[key][0] is from_shared.non_tensor_batch[key][1]) == \
                (column[0] is column[1]), key
            assert from_copies.non_tensor_batch[key][0] is not from_copies.non_tensor_batch[key][1], key


def test_tensors_and_arrays_inside_shared_objects_are_cloned_and_stored_per_row(exact: Exact) -> None:
    t, a = torch.arange(3), np.arange(2.0)
    value = Batch(non_tensor_batch={"obj": repeated([{"t": t, "a": a, "s": np.float32(1.5)}], 3)})
    expected = Batch(non_tensor_batch={"obj": repeated([{"t": torch.arange(3), "a": np.arange(2.0),
                                                         "s": np.float32(1.5)}], 3)})
    frozen = FMT.freeze(value, copy=True)
    t.add_(10)
    a[:] = -1
    out = FMT.decode(FMT.encode(frozen))
    exact(out, expected)
    assert out.non_tensor_batch["obj"][0]["t"] is not out.non_tensor_batch["obj"][1]["t"]


def test_non_tensor_columns_of_tensordicts_and_meta_are_snapshot(exact: Exact) -> None:
    rows = [{"m": [1]}, {"m": [2]}]
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    td.set("msg", NonTensorStack(*(NonTensorData(data=r, batch_size=[]) for r in rows), batch_size=[2]))
    value = {"td": td, "meta": {"k": [1, {"d": "e"}]}, "tags": [{"s": 1}]}
    expected = copy.deepcopy(value)
    frozen = FMT.freeze(value, copy=True)
    rows[0]["m"].append(9)
    value["meta"]["k"][1]["d"] = "changed"
    value["tags"][0]["s"] = 2
    exact(FMT.decode(FMT.encode(frozen)), expected)


@pytest.mark.parametrize("copy_", [True, False])
def test_unstorable_values_are_still_refused_at_freeze_time_naming_the_field(copy_: bool) -> None:
    class Custom:
        pass

    shared = repeated([[{"role": "user", "content": Custom()}]], 4)
    with pytest.raises(UnstorableValueError, match=r"non_tensor_batch\['raw'\]\[0\]\[0\]\['content'\]"):
        FMT.freeze(Batch(non_tensor_batch={"raw": shared}), copy=copy_)
    with pytest.raises(UnstorableValueError, match=r"meta_info\['k'\]"):
        FMT.freeze(Batch(meta_info={"k": [bytearray(b"x")]}), copy=copy_)
    with pytest.raises(UnstorableValueError, match="complex"):
        FMT.freeze(Batch(non_tensor_batch={"t": repeated([torch.zeros(1, dtype=torch.complex64)], 2)}), copy=copy_)


def test_snapshot_value_shares_immutables_and_copies_containers() -> None:
    value = {"a": ("x", [1, 2]), "b": {3, 4}, "c": b"raw", "d": np.int64(5)}
    snap = snapshot_value(value, "v", FMT_CHECK)
    assert snap == value and snap is not value
    assert snap["a"][1] is not value["a"][1] and snap["c"] is value["c"] and snap["d"] is value["d"]
    assert snapshot_value(value, "v", FMT_CHECK, copy=False) is value


def big_batch(value: int) -> Batch:
    rows = 512  # 512 x 512 int64 = 2 MiB per tensor: above POOL_MIN_BYTES
    return Batch(batch=TensorDict({"ids": torch.full((rows, 512), value), "mask": torch.ones(rows, 512).bool()[:, :300],
                                   "small": torch.arange(rows)}, batch_size=[rows]),
                 non_tensor_batch={"uid": np.array([str(i) for i in range(rows)], dtype=object)})


def test_large_snapshots_reuse_the_memory_of_encoded_ones_without_mixing_them_up(exact: Exact) -> None:
    release_snapshot_buffers()
    first = FMT.freeze(big_batch(1), copy=True)
    first_ptr = first.tensors["t0"].data_ptr()
    first_files = FMT.encode(first)
    assert first.tensors == {}  # its buffers went back to the pool
    second = FMT.freeze(big_batch(2), copy=True)
    assert second.tensors["t0"].data_ptr() == first_ptr  # the next snapshot of that size took the buffer
    assert FMT.encode(first) == first_files  # the encoded bytes are kept, not re-read from the buffer
    exact(FMT.decode(FMT.encode(second)), big_batch(2))
    exact(FMT.decode(first_files), big_batch(1))
    assert release_snapshot_buffers() == 512 * 512 * 8  # the ids tensor; the small ones are plain clones


def test_an_unencoded_snapshot_keeps_its_buffers(exact: Exact) -> None:
    release_snapshot_buffers()
    held = FMT.freeze(big_batch(3), copy=True)
    FMT.encode(FMT.freeze(big_batch(4), copy=True))
    other = FMT.freeze(big_batch(5), copy=True)
    assert other.tensors["t0"].data_ptr() != held.tensors["t0"].data_ptr()
    exact(FMT.decode(FMT.encode(held)), big_batch(3))
    exact(FMT.decode(FMT.encode(other)), big_batch(5))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool, torch.bfloat16, torch.uint16])
def test_small_tensors_are_snapshot_into_their_own_contiguous_memory(dtype: torch.dtype) -> None:
    """Small CPU tensors are copied by numpy where it holds the dtype (torch otherwise): either way the
    snapshot is C-ordered, owns its memory and keeps the values the tensor had at freeze time."""
    base = (torch.arange(24) % 5).to(dtype).reshape(4, 6)
    value = {"t": base.t(), "grad": torch.arange(6.0, requires_grad=True)}
    frozen = SafeFormat().freeze(value, copy=True)
    snapshot = frozen.tensors
    kept = {name: t.clone() for name, t in snapshot.items()}
    for t in snapshot.values():
        assert t.is_contiguous() and not t.requires_grad
    assert {(t.dtype, tuple(t.shape)) for t in snapshot.values()} == {(dtype, (6, 4)), (torch.float32, (6,))}
    with torch.no_grad():
        base.zero_() if dtype != torch.bool else base.logical_not_()
        value["grad"].add_(1)
    assert all(torch.equal(snapshot[name], kept[name]) for name in snapshot)
    out = SafeFormat().decode(SafeFormat().encode(frozen))
    assert torch.equal(out["t"], (torch.arange(24) % 5).to(dtype).reshape(4, 6).t())
    assert torch.equal(out["grad"], torch.arange(6.0))


def test_only_tensors_numpy_cannot_hold_are_cloned_by_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small plain CPU tensor is copied by numpy: no torch call, which would release the GIL to the
    dump worker at every tensor of a miss. bfloat16 has no numpy dtype and goes through ``clone``."""
    cloned: list[torch.dtype] = []
    clone = torch.Tensor.clone

    def counting_clone(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        cloned.append(self.dtype)
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    value = {"ids": torch.arange(12).reshape(2, 6), "mask": torch.ones(2, 6, dtype=torch.bool),
             "logp": torch.zeros(2, 6), "bf": torch.ones(2, 6, dtype=torch.bfloat16)}
    frozen = SafeFormat().freeze(value, copy=True)
    assert cloned == [torch.bfloat16]
    assert all(torch.equal(frozen.tensors[ref], t) for ref, t in zip(frozen.tensors, value.values()))
