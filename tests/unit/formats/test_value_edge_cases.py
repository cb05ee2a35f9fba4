"""Values that round-trip exactly or are refused by name at dump time, never anything in between.

``uint16``/``uint32``/``uint64`` tensors (listed as supported), lone surrogates in strings, NaN
payloads, infinities and ``-0.0`` in float arrays held in object columns, meta_info that contains
itself, meta-device and sparse tensors, ragged list columns; and the codec thread pool, which
must run each item of a non-idempotent step exactly once.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from stepskip import Batch
from stepskip.errors import UnstorableValueError
from stepskip._formats import safe as safe_module
from stepskip._formats.safe import SafeFormat
from stepskip._formats.verl import VerlFormat

Exact = Callable[[Any, Any], None]
FORMATS = {"safe": SafeFormat(), "safe-uncompressed": SafeFormat("none"), "verl": VerlFormat()}


def roundtrip(fmt_name: str, value: Any) -> Any:
    fmt = FORMATS[fmt_name]
    return fmt.decode(fmt.encode(fmt.freeze(value, copy=True)))


def obj(items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


def batch(tensors: dict[str, torch.Tensor] | None = None, non_tensor: dict[str, Any] | None = None,
          meta: dict[str, Any] | None = None, rows: int = 2) -> Batch:
    td = None if tensors is None else TensorDict(tensors, batch_size=[rows])
    return Batch(batch=td, non_tensor_batch=non_tensor or {}, meta_info=meta or {})


# --------------------------------------------------------------------------- unsigned integers


def _unsigned(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    top = (1 << (8 * dtype.itemsize)) - 1
    full = torch.tensor([0, top >> 1], dtype=torch.int64)
    if dtype == torch.uint64:  # values above int64's range, set through their bits
        extremes = torch.tensor([-1, 0, 1 << 62], dtype=torch.int64).view(torch.uint64)
    else:
        extremes = torch.tensor([top, 0, 1], dtype=torch.int64).to(dtype)
    padded = torch.zeros(3, 40, dtype=torch.int64)
    padded[:, :3] = 7
    return {
        "small": torch.arange(6, dtype=torch.int64).to(dtype).reshape(2, 3),  # narrows to uint8
        "extremes": extremes,  # full range: stored as is
        "trimmed": padded.to(dtype),  # 2-D and mostly padding: trimmed, then narrowed
        "mid": full.to(dtype),
        "empty": torch.zeros(0, 4, dtype=dtype),
    }


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_tensors_are_stored_exactly(fmt: str, dtype: torch.dtype, exact: Exact) -> None:
    tensors = _unsigned(dtype)
    if fmt == "verl":
        value = batch({"x": tensors["trimmed"]}, rows=3)
        exact(roundtrip(fmt, value).batch["x"], tensors["trimmed"])
        return
    exact(roundtrip(fmt, tensors), tensors)


def test_uint16_tensors_in_a_batch_are_compacted(exact: Exact) -> None:
    padded = torch.zeros(4, 512, dtype=torch.uint16)
    padded[:, :5] = 60000
    value = batch({"ids": padded}, rows=4)
    files = SafeFormat().encode(SafeFormat().freeze(value, copy=True))
    assert len(files["data.safetensors"]) < padded.numel()  # trimmed, not stored as 4 KB of uint16
    exact(SafeFormat().decode(files).batch["ids"], padded)


# --------------------------------------------------------------------------- strings


SURROGATES = ["\ud800", "a\udfffb", "\udc80\udcff", "ok \U0001f600 \ud83d"]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_lone_surrogates_round_trip(fmt: str, exact: Exact) -> None:
    value = batch(non_tensor={"text": obj(SURROGATES), "plain": obj(["x", "y", "z", "w"])},
                  meta={"note": "\udcff", "keys": {"\ud800k": 1}, "nested": [("\udfff",)]}, rows=4)
    exact(roundtrip(fmt, value), value)


def test_surrogates_in_plain_values_and_tensordict_keys(exact: Exact) -> None:
    td = TensorDict({"x": torch.arange(2)}, batch_size=[2])
    td.set_non_tensor("label", "\ud800")
    value = {"td": td, "s": "\udcff", "keys": {"\ud801": "\udfff"}}
    exact(roundtrip("safe", value), value)


def test_utf8_text_stays_utf8_when_there_are_no_surrogates() -> None:
    fmt = SafeFormat()
    files = fmt.encode(fmt.freeze({"t": "中文 é"}, copy=False))
    assert "中文 é".encode() in files["data.json"]


# --------------------------------------------------------------------------- floats, bit for bit


def special_floats() -> dict[str, np.ndarray]:
    neg_nan = np.array([np.nan], dtype=np.float64)
    neg_nan.view(np.uint64)[0] |= np.uint64(1 << 63)
    payload = np.array([0x7FF0000000000123], dtype=np.uint64).view(np.float64)  # signalling NaN with a payload
    f32 = np.array([0x7FC01234, 0xFF800000, 0x80000000], dtype=np.uint32).view(np.float32)  # NaN, -inf, -0.0
    f16 = np.array([0x7E01, 0xFC00, 0x8000], dtype=np.uint16).view(np.float16)
    return {
        "neg-nan": neg_nan,
        "payload-nan": payload,
        "mixed": np.array([1.5, np.inf, -np.inf, -0.0, 0.0, np.nan]),
        "f32": f32,
        "f16": f16,
        "c16": np.array([complex(np.nan, -0.0), complex(np.inf, 1)]),
        "big-endian": np.array([np.nan, -0.0], dtype=">f8"),
        "2d": np.array([[np.nan, 1.0], [-0.0, np.inf]], dtype=np.float32),
    }


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", sorted(special_floats()))
def test_special_floats_in_object_columns_round_trip_bit_exactly(fmt: str, name: str, exact: Exact) -> None:
    array = special_floats()[name]
    value = batch(non_tensor={"col": obj([array, "x"])}, meta={"arr": array, "scalar": array.reshape(-1)[0]})
    out = roundtrip(fmt, value)
    if fmt == "verl":  # numpy's own protocol-4 unpickling turns '>f8' into native floats: what verl reads too
        value = pickle.loads(pickle.dumps(value, protocol=4))
    exact(out, value)  # compares arrays and scalars by their bytes
    assert out.non_tensor_batch["col"][0].tobytes() == value.non_tensor_batch["col"][0].tobytes()


def test_finite_float_arrays_stay_readable_json() -> None:
    fmt = SafeFormat()
    files = fmt.encode(fmt.freeze({"m": [np.array([1.5, -0.0])]}, copy=False))
    assert b"b64" not in files["data.json"] and b"1.5" in files["data.json"]


# --------------------------------------------------------------------------- refused by name


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_meta_info_that_contains_itself_is_refused_by_name(fmt: str) -> None:
    meta: dict[str, Any] = {"a": 1}
    meta["self"] = {"inner": [meta]}
    with pytest.raises(UnstorableValueError, match=r"result\.meta_info\['self'\]\['inner'\]\[0\].*contains itself"):
        FORMATS[fmt].freeze(batch(meta=meta), copy=True)


def test_a_list_that_contains_itself_is_refused_by_name() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    with pytest.raises(UnstorableValueError, match=r"result\['x'\]\[1\].*contains itself"):
        SafeFormat().freeze({"x": loop}, copy=False)


def test_very_deep_values_are_refused_not_a_recursion_error() -> None:
    deep: Any = 0
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(UnstorableValueError, match="nested too deeply"):
        SafeFormat().freeze({"x": deep}, copy=False)


def _meta_tensor() -> torch.Tensor:
    return torch.empty(2, 3, device="meta")


def _sparse_tensor() -> torch.Tensor:
    return torch.eye(2).to_sparse()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("make", [_meta_tensor, _sparse_tensor], ids=["meta", "sparse"])
def test_meta_and_sparse_tensors_are_refused_by_name(fmt: str, make: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(UnstorableValueError, match=r"result\.batch\['x'\]"):
        FORMATS[fmt].freeze(batch({"x": make()}), copy=True)
    nested = TensorDict({"inner": TensorDict({"x": make()}, batch_size=[2])}, batch_size=[2])
    with pytest.raises(UnstorableValueError, match="inner"):
        FORMATS[fmt].freeze(Batch(batch=nested, non_tensor_batch={}, meta_info={}), copy=True)


@pytest.mark.parametrize("make", [_meta_tensor, _sparse_tensor], ids=["meta", "sparse"])
def test_meta_and_sparse_tensors_outside_a_batch_are_refused_by_name(make: Callable[[], torch.Tensor]) -> None:
    with pytest.raises(UnstorableValueError, match=r"result\['t'\]"):
        SafeFormat().freeze({"t": make()}, copy=False)
    with pytest.raises(UnstorableValueError, match=r"result\.meta_info"):
        SafeFormat().freeze(batch(meta={"t": make()}), copy=False)


def test_a_ragged_list_column_is_refused_by_name() -> None:
    with pytest.raises(UnstorableValueError, match=r"result\.non_tensor_batch\['ragged'\].*object array"):
        SafeFormat().freeze(batch(non_tensor={"ragged": [[1, 2], [3]]}), copy=False)


def test_a_regular_list_column_is_stored_as_its_array(exact: Exact) -> None:
    out = roundtrip("safe", batch(non_tensor={"ids": [[1, 2], [3, 4]]}))
    exact(out.non_tensor_batch["ids"], np.array([[1, 2], [3, 4]]))


# --------------------------------------------------------------------------- the codec pool


class _Counter:
    def __init__(self, fail_on: int | None = None, error: type[Exception] = RuntimeError) -> None:
        self.calls: list[int] = []
        self.fail_on = fail_on
        self.error = error

    def __call__(self, item: int) -> int:
        self.calls.append(item)
        if item == self.fail_on:
            raise self.error(f"item {item} failed")
        return item * 10


def test_parallel_map_runs_each_item_once_and_keeps_order() -> None:
    count = _Counter()
    assert safe_module._parallel_map(count, list(range(8))) == [i * 10 for i in range(8)]
    assert sorted(count.calls) == list(range(8))


@pytest.mark.parametrize("error", [RuntimeError, KeyError])
def test_an_error_of_the_step_is_raised_and_nothing_runs_twice(error: type[Exception]) -> None:
    count = _Counter(fail_on=3, error=error)
    with pytest.raises(error, match="item 3"):
        safe_module._parallel_map(count, list(range(6)))
    assert sorted(count.calls) == sorted(set(count.calls))  # at most once each


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_pools_of_its_own() -> None:
    """A child forked after the pool's threads started (a DataLoader worker, a fork start method)
    encodes and decodes a large value through pools of its own: the parent's threads do not exist
    there, and work handed to the parent's executor would wait forever."""
    fmt = SafeFormat()
    value = {"ids": torch.arange(1 << 20).reshape(256, -1), "logp": torch.randn(256, 4096)}
    assert fmt.decode(fmt.encode(fmt.freeze(value, copy=True)))["ids"].equal(value["ids"])  # the pools started
    assert safe_module._POOLS
    child = os.fork()
    if child == 0:  # pragma: no cover - the child; a hang is turned into a failing exit status by the alarm
        code = 1
        try:
            signal.alarm(60)
            torch.set_num_threads(1)  # as a DataLoader worker does: torch's own thread pool does not survive a fork
            back = fmt.decode(fmt.encode(fmt.freeze(value, copy=True)))
            mapped = safe_module._parallel_map(lambda x: x * 10, list(range(4)),
                                               nbytes=safe_module.PARALLEL_MIN_BYTES)
            code = 0 if back["logp"].equal(value["logp"]) and mapped == [0, 10, 20, 30] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # -14 (SIGALRM): the child hung on the parent's pool


def test_a_pool_that_refuses_work_at_shutdown_leaves_the_rest_to_run_here(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = ThreadPoolExecutor(max_workers=2)
    pool.shutdown()
    monkeypatch.setitem(safe_module._POOLS, "codec", pool)
    count = _Counter()
    assert safe_module._parallel_map(count, list(range(5))) == [i * 10 for i in range(5)]
    assert count.calls == list(range(5))


def test_encoding_with_a_failing_pool_midway_runs_each_tensor_once(monkeypatch: pytest.MonkeyPatch,
                                                                   exact: Exact) -> None:
    """The pool takes two items and then refuses (interpreter shutdown): the encode still finishes, exactly."""

    class HalfPool(ThreadPoolExecutor):
        taken = 0

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            if HalfPool.taken >= 2:
                raise RuntimeError("cannot schedule new futures after interpreter shutdown")
            HalfPool.taken += 1
            return super().submit(fn, *args, **kwargs)

    monkeypatch.setitem(safe_module._POOLS, "codec", HalfPool(max_workers=2))
    padded = torch.zeros(4, 64, dtype=torch.int64)
    padded[:, :3] = 5
    value = batch({f"t{i}": padded + i for i in range(5)}, rows=4)
    exact(roundtrip("safe", value), value)
