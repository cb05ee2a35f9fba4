"""Exact JSON encoding of the non-tensor values found in rollout batches.

Plain JSON types pass through unchanged; everything JSON cannot say exactly (tuples, non-string
dict keys, numpy scalars and arrays, bytes, sets, tensors) becomes a tagged object
``{"__t": tag, ...}``. A user dict that happens to hold the key ``"__t"`` is itself tagged, so
decoding is unambiguous. Tensors are handed to a callback that stores them beside the JSON and
returns a reference. Anything else is an :class:`UnstorableValueError` naming the field.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stepskip.errors import UnstorableValueError

__all__ = ["encode_value", "decode_value", "encode_object_array", "decode_object_array"]

TAG = "__t"
_PLAIN = (str, int, float, bool, type(None))

TensorSink = Callable[[torch.Tensor], str]
TensorSource = Callable[[str], torch.Tensor]


def _no_tensors(_: torch.Tensor) -> str:
    raise UnstorableValueError("tensors are not allowed here")


def encode_value(value: Any, path: str, add_tensor: TensorSink = _no_tensors) -> Any:
    """Encode ``value`` as JSON-compatible data that :func:`decode_value` restores exactly.

    Args:
        value: the value to encode.
        path: where the value lives (``non_tensor_batch['messages'][3]``), for error messages.
        add_tensor: stores a tensor and returns its reference.

    Returns:
        JSON-compatible data.

    Raises:
        UnstorableValueError: a value of a type the encoding does not know.
    """
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is list:
        return [encode_value(v, f"{path}[{i}]", add_tensor) for i, v in enumerate(value)]
    if kind is dict:
        if TAG not in value and all(type(k) is str for k in value):
            return {k: encode_value(v, f"{path}[{k!r}]", add_tensor) for k, v in value.items()}
        return {TAG: "dict", "v": [[encode_value(k, f"{path}.<key>", add_tensor),
                                    encode_value(v, f"{path}[{k!r}]", add_tensor)] for k, v in value.items()]}
    if kind is tuple:
        return {TAG: "tuple", "v": [encode_value(v, f"{path}[{i}]", add_tensor) for i, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        return {TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                "v": encode_object_array(value.reshape(-1), path, add_tensor)
                if value.dtype.hasobject else _plain_items(value, path)}
    if isinstance(value, np.generic):
        if value.dtype.hasobject or value.dtype.kind in "MmV":
            raise _unstorable(value, path)
        return {TAG: "np", "dtype": value.dtype.str, "v": _plain_items(np.asarray(value).reshape(1), path)[0]}
    if isinstance(value, torch.Tensor):
        return {TAG: "tensor", "ref": add_tensor(value)}
    if kind is bytes:
        return {TAG: "bytes", "v": base64.b64encode(value).decode("ascii")}
    if kind is set or kind is frozenset:
        return {TAG: kind.__name__, "v": [encode_value(v, f"{path}{{}}", add_tensor) for v in value]}
    if isinstance(value, (str, int, float)):  # subclasses (enum members, np.str_ handled above)
        raise _unstorable(value, path)
    if isinstance(value, dict):
        return {TAG: "dict", "v": [[encode_value(k, f"{path}.<key>", add_tensor),
                                    encode_value(v, f"{path}[{k!r}]", add_tensor)] for k, v in value.items()]}
    if isinstance(value, list):
        return encode_value(list(value), path, add_tensor)
    raise _unstorable(value, path)


def _plain_items(array: np.ndarray, path: str) -> list[Any]:
    if array.dtype.kind in "biuf" and array.dtype.itemsize <= 8:
        return array.reshape(-1).tolist()
    if array.dtype.kind == "U":
        return [str(v) for v in array.reshape(-1)]
    if array.dtype.kind == "S":
        return [base64.b64encode(bytes(v)).decode("ascii") for v in array.reshape(-1)]
    if array.dtype.kind == "c" and array.dtype.itemsize <= 16:
        return [[v.real, v.imag] for v in array.reshape(-1).tolist()]
    raise _unstorable(array, path)


def _unstorable(value: Any, path: str) -> UnstorableValueError:
    return UnstorableValueError(
        f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored "
        "by format 'safe' (supported: str, int, float, bool, None, list, tuple, dict, set, bytes, numpy "
        "arrays and scalars, tensors); convert it to one of these before returning it, or use "
        "format: verl with allow_pickle: true"
    )


def encode_object_array(flat: np.ndarray, path: str, add_tensor: TensorSink = _no_tensors) -> list[Any]:
    """Encode the items of a 1-D object array (fast path when every item is a plain str)."""
    items = flat.tolist()
    if all(type(v) is str for v in items):
        return items
    return [encode_value(v, f"{path}[{i}]", add_tensor) for i, v in enumerate(items)]


def is_plain(data: Any) -> bool:
    """True when encoded data holds no tagged value, so decoding it is the identity."""
    kind = type(data)
    if kind is list:
        return all(is_plain(v) for v in data)
    if kind is dict:
        return TAG not in data and all(is_plain(v) for v in data.values())
    return True


def _no_source(ref: str) -> torch.Tensor:
    raise KeyError(ref)


def decode_value(data: Any, get_tensor: TensorSource = _no_source) -> Any:
    """Invert :func:`encode_value`."""
    kind = type(data)
    if kind is list:
        return [decode_value(v, get_tensor) for v in data]
    if kind is not dict:
        return data
    tag = data.get(TAG)
    if tag is None:
        return {k: decode_value(v, get_tensor) for k, v in data.items()}
    if tag == "dict":
        return {decode_value(k, get_tensor): decode_value(v, get_tensor) for k, v in data["v"]}
    if tag == "tuple":
        return tuple(decode_value(v, get_tensor) for v in data["v"])
    if tag == "ndarray":
        dtype = np.dtype(data["dtype"])
        if dtype.hasobject:
            return decode_object_array(data["v"], get_tensor).reshape(data["shape"])
        return _array_from_items(data["v"], dtype).reshape(data["shape"])
    if tag == "np":
        dtype = np.dtype(data["dtype"])
        return _array_from_items([data["v"]], dtype)[0]
    if tag == "tensor":
        return get_tensor(data["ref"])
    if tag == "bytes":
        return base64.b64decode(data["v"])
    if tag == "set":
        return {decode_value(v, get_tensor) for v in data["v"]}
    if tag == "frozenset":
        return frozenset(decode_value(v, get_tensor) for v in data["v"])
    raise ValueError(f"unknown value tag {tag!r}")


def _array_from_items(items: list[Any], dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "S":
        return np.array([base64.b64decode(v) for v in items], dtype=dtype)
    if dtype.kind == "c":
        return np.array([complex(r, i) for r, i in items], dtype=dtype)
    return np.array(items, dtype=dtype)


def decode_object_array(items: list[Any], get_tensor: TensorSource = _no_source, plain: bool = False) -> np.ndarray:
    """A 1-D object array holding the decoded items (never a 2-D array of nested lists).

    ``plain`` (from :func:`is_plain` at encode time) skips decoding: the items are final.
    """
    out = np.empty(len(items), dtype=object)
    if plain:
        for i, v in enumerate(items):
            out[i] = v
        return out
    for i, v in enumerate(items):
        out[i] = decode_value(v, get_tensor)
    return out
