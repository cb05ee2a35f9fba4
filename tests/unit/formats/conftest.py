"""Shared helpers for the format tests: an exact, type-strict deep comparison."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase, is_non_tensor


def _tensor_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return b""
    return flat.view(torch.uint8).numpy().tobytes()


def assert_exact(actual: Any, expected: Any, path: str = "value") -> None:
    """Assert ``actual`` equals ``expected`` exactly: same types, dtypes, shapes and bits.

    NaNs compare equal to NaNs (bitwise for arrays and tensors); dict key order must match.
    """
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual)} is not a tensor"
        assert actual.is_nested == expected.is_nested, f"{path}: is_nested differs"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, f"{path}: device {actual.device} != {expected.device}"
        if expected.is_nested:
            assert actual.layout == expected.layout, f"{path}: layout {actual.layout} != {expected.layout}"
            a_parts, e_parts = actual.unbind(), expected.unbind()
            assert len(a_parts) == len(e_parts), f"{path}: {len(a_parts)} components != {len(e_parts)}"
            for i, (a, e) in enumerate(zip(a_parts, e_parts)):
                assert_exact(a, e, f"{path}[{i}]")
            return
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert _tensor_bytes(actual) == _tensor_bytes(expected), f"{path}: tensor values differ"
        return
    if isinstance(expected, TensorDictBase) and not is_non_tensor(expected):
        assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
        assert actual.batch_size == expected.batch_size, \
            f"{path}: batch_size {actual.batch_size} != {expected.batch_size}"
        assert list(actual.keys()) == list(expected.keys()), \
            f"{path}: keys {list(actual.keys())} != {list(expected.keys())}"
        for key in expected.keys():
            assert_exact(actual.get(key), expected.get(key), f"{path}[{key!r}]")
        return
    if isinstance(expected, NonTensorStack):
        assert isinstance(actual, NonTensorStack), f"{path}: {type(actual)} is not a NonTensorStack"
        assert actual.batch_size == expected.batch_size, f"{path}: batch_size differs"
        assert_exact(actual.tolist(), expected.tolist(), f"{path}.tolist()")
        return
    if isinstance(expected, NonTensorData):
        assert isinstance(actual, NonTensorData), f"{path}: {type(actual)} is not NonTensorData"
        assert actual.batch_size == expected.batch_size, f"{path}: batch_size differs"
        assert_exact(actual.data, expected.data, f"{path}.data")
        return
    assert type(actual) is type(expected), f"{path}: type {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        if expected.dtype.hasobject:
            for idx in np.ndindex(expected.shape):
                assert_exact(actual[idx], expected[idx], f"{path}[{idx}]")
        else:
            assert np.ascontiguousarray(actual).tobytes() == np.ascontiguousarray(expected).tobytes(), \
                f"{path}: array values differ: {actual!r} != {expected!r}"
        return
    if isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes(), f"{path}: {actual!r} != {expected!r}"
        return
    if isinstance(expected, float):
        if math.isnan(expected):
            assert math.isnan(actual), f"{path}: {actual!r} is not NaN"
        else:
            assert actual == expected and math.copysign(1, actual) == math.copysign(1, expected), \
                f"{path}: {actual!r} != {expected!r}"
        return
    if isinstance(expected, dict):
        a_keys, e_keys = list(actual.keys()), list(expected.keys())
        assert len(a_keys) == len(e_keys), f"{path}: keys {a_keys!r} != {e_keys!r}"
        for ak, ek in zip(a_keys, e_keys):
            assert_exact(ak, ek, f"{path}.<key {ek!r}>")
        for k in expected:
            assert_exact(actual[k], expected[k], f"{path}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_exact(a, e, f"{path}[{i}]")
        return
    if isinstance(expected, (set, frozenset)):
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"
        assert sorted(type(x).__name__ for x in actual) == sorted(type(x).__name__ for x in expected), \
            f"{path}: element types differ"
        return
    if hasattr(expected, "non_tensor_batch") and hasattr(expected, "meta_info") and hasattr(expected, "batch"):
        if expected.batch is None:
            assert actual.batch is None, f"{path}.batch is not None"
        else:
            assert_exact(actual.batch, expected.batch, f"{path}.batch")
        assert_exact(actual.non_tensor_batch, expected.non_tensor_batch, f"{path}.non_tensor_batch")
        assert_exact(actual.meta_info, expected.meta_info, f"{path}.meta_info")
        return
    assert actual == expected, f"{path}: {actual!r} != {expected!r}"


@pytest.fixture
def exact() -> Callable[[Any, Any], None]:
    """``exact(actual, expected)``: the strict comparison above."""
    return assert_exact


@pytest.fixture
def trim_every_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trim tensors of every size, as the encoder did before small tensors of many rows were left
    narrowed (``compact.TRIM_MIN_ELEMENTS``): for tests of the trimmed layouts themselves, which
    entries of any size written before, and big tensors today, are read through."""
    from stepskip._formats import compact

    monkeypatch.setattr(compact, "TRIM_MIN_ELEMENTS", 0)
