"""Private snapshots of non-tensor values, cheap enough to take on the caller's thread.

A miss hands the background writer a snapshot: what is replayed must equal what was returned,
even if the caller changes the returned objects afterwards. Encoding the non-tensor
columns to JSON-ready data would give such a snapshot, but costs tens of milliseconds of Python
per batch; the snapshot below costs a fraction of it and the encoding runs in the background:

- immutable leaves (str, int, float, bool, None, bytes, numpy scalars) are shared, not copied;
- containers (list, dict, tuple, set) are rebuilt, numpy arrays copied, tensors cloned;
- each distinct object is copied once (memo by identity), so rows that shared an object (verl's
  ``DataProto.repeat`` ``np.repeat``-s its object arrays) share its copy, at the cost of one;
- the same walk checks every type against what :func:`~stepskip._formats.values.encode_value` can
  store, so an unstorable value is still refused at freeze time, with the encoder's own message
  naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stepskip.errors import UnstorableValueError
from stepskip._formats.values import encode_object_array, encode_value

__all__ = ["snapshot_value", "snapshot_object_array", "IMMUTABLE"]

#: Types whose values cannot change in place: shared between the caller and the snapshot.
IMMUTABLE = frozenset({str, int, float, bool, type(None), bytes})

TensorCheck = Callable[[torch.Tensor, str], Any]  # raises UnstorableValueError for a tensor it refuses


class _Refused(Exception):
    """A value the encoder cannot store; the caller re-runs the encoder for its message."""


def _plain_array(dtype: np.dtype) -> bool:
    # mirrors values._plain_items: the numpy dtypes encode_value writes exactly
    kind = dtype.kind
    return (kind in "biuf" and dtype.itemsize <= 8) or kind in "US" or (kind == "c" and dtype.itemsize <= 16)


class _Copier:
    def __init__(self, copy: bool, check_tensor: TensorCheck, path: str) -> None:
        self.copy = copy
        self.check_tensor = check_tensor
        self.path = path
        self.memo: dict[int, Any] = {}
        self.keep: list[Any] = []  # the originals, alive while the memo holds their ids

    def __call__(self, value: Any) -> Any:
        kind = type(value)
        if kind in IMMUTABLE:
            return value
        key = id(value)
        done = self.memo.get(key, self)
        if done is not self:
            return done
        out = self._copy(value, kind)
        self.memo[key] = out
        self.keep.append(value)
        return out

    def _copy(self, value: Any, kind: type) -> Any:
        copy = self.copy
        if kind is list:
            if set(map(type, value)) <= IMMUTABLE:
                return value.copy() if copy else value
            items = [self(v) for v in value]
            return items if copy else value
        if kind is dict:
            if set(map(type, value)) <= IMMUTABLE and set(map(type, value.values())) <= IMMUTABLE:
                return value.copy() if copy else value
            pairs = {self(k): self(v) for k, v in value.items()}
            return pairs if copy else value
        if kind is tuple:
            parts = tuple(self(v) for v in value)
            return parts if copy else value
        if kind is set or kind is frozenset:
            members = kind(self(v) for v in value)
            return members if copy else value
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                out = np.empty(value.size, dtype=object)
                for i, v in enumerate(value.reshape(-1).tolist()):
                    out[i] = self(v)
                return out.reshape(value.shape) if copy else value
            if not _plain_array(value.dtype):
                raise _Refused
            return value.copy() if copy else value
        if isinstance(value, np.generic):  # before the str/int/float subclasses: np.str_, np.float64
            if value.dtype.hasobject or not _plain_array(value.dtype):
                raise _Refused
            return value  # numpy scalars are immutable
        if isinstance(value, torch.Tensor):
            try:
                self.check_tensor(value, self.path)
            except UnstorableValueError:
                raise _Refused from None
            if not copy:
                return value
            t = value.detach()
            return t.cpu() if t.device.type != "cpu" else t.clone()
        if isinstance(value, (str, int, float)):  # enum members and other subclasses: refused by the encoder
            raise _Refused
        if isinstance(value, dict):  # a subclass: encoded as a plain dict of its items
            pairs = {self(k): self(v) for k, v in value.items()}
            return pairs if copy else value
        if isinstance(value, list):
            items = [self(v) for v in value]
            return items if copy else value
        raise _Refused


def _checker(check_tensor: TensorCheck, path: str) -> Callable[[torch.Tensor], str]:
    def check(tensor: torch.Tensor) -> str:
        check_tensor(tensor, path)
        return ""

    return check


def snapshot_value(value: Any, path: str, check_tensor: TensorCheck, copy: bool = True) -> Any:
    """A private copy of ``value`` (with ``copy``; else ``value`` itself, its types checked).

    Args:
        value: a non-tensor value (meta_info, a NonTensorData's data, a dict entry).
        path: where it lives, for error messages.
        check_tensor: raises :class:`UnstorableValueError` for a tensor the format cannot store.
        copy: copy what is mutable; False only checks (the caller promises not to change it).

    Returns:
        The snapshot, equal to ``value``.

    Raises:
        UnstorableValueError: a part of ``value`` cannot be stored; the message names it.

    Example:
        >>> rows = [{"role": "user"}]
        >>> snap = snapshot_value(rows, "x", lambda t, p: None)
        >>> rows[0]["role"] = "changed"
        >>> snap
        [{'role': 'user'}]
    """
    try:
        return _Copier(copy, check_tensor, path)(value)
    except _Refused:
        pass
    encode_value(value, path, _checker(check_tensor, path))  # raises, naming the field
    raise UnstorableValueError(f"{path}: a value of this field cannot be stored by format 'safe'")


def snapshot_object_array(array: np.ndarray, path: str, check_tensor: TensorCheck, copy: bool = True) -> np.ndarray:
    """A private copy of an object array whose items may be mutable (see :func:`snapshot_value`).

    An array of immutable items only (uids, data sources) is copied as pointers; otherwise each
    distinct item is copied once and rows that shared an item share its copy.

    Raises:
        UnstorableValueError: an item cannot be stored; the message names it.
    """
    flat = array.reshape(-1)
    items = flat.tolist()
    if set(map(type, items)) <= IMMUTABLE:
        return array.copy() if copy else array
    copier = _Copier(copy, check_tensor, path)
    try:
        copies = [copier(v) for v in items]
    except _Refused:
        encode_object_array(flat, path, _checker(check_tensor, path))  # raises, naming the field
        raise UnstorableValueError(f"{path}: an item of this column cannot be stored by format 'safe'") from None
    if not copy:
        return array
    out = np.empty(len(copies), dtype=object)
    for i, v in enumerate(copies):
        out[i] = v
    return out.reshape(array.shape)
