"""Exact JSON encoding of the non-tensor values found in rollout batches.

Plain JSON types pass through unchanged; everything JSON cannot say exactly (tuples, non-string
dict keys, numpy scalars and arrays, bytes, sets, tensors) becomes a tagged object
``{"__t": tag, ...}``. A user dict that happens to hold the key ``"__t"`` is itself tagged, so
decoding is unambiguous. Tensors are handed to a callback that stores them beside the JSON and
returns a reference. Anything else is an :class:`UnstorableValueError` naming the field.

Ragged rows of numbers — a list of lists of ints, or of floats, with ``None`` holes allowed (TRL's
token ids and log-probs) — are stored as packed tensors when a tensor sink is given and they hold
at least :data:`PACK_MIN_ITEMS` items: ``{"__t": "rows", "kind": "int"|"float", "values": ref,
"offsets": ref, "holes": ref|null}``. Every row of such a list holds ints only (``bool`` is not
an int here) or floats only, each possibly with ``None`` items; a list that mixes ints and floats,
or holds ints outside int64, stays JSON (packing would change a type). Decoding gives back the
same lists: int stays int, float keeps its bits (``-0.0``, NaN payloads), ``None`` stays ``None``,
empty rows stay empty. A TRL result of 512 x 2048 token ids and their log-probs encodes in under
0.1 s and decodes in about 0.05 s this way, against about 0.5 s and 0.3 s item by item
(``benchmarks/bench_trl.py --codec-only``).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from stepskip._calls import is_dataproto_like
from stepskip.errors import CorruptEntryError, UnstorableValueError
from stepskip._formats.bounds import DecodeBudget, check_jagged, shape_of
from stepskip._formats.compact import narrow

__all__ = ["encode_value", "decode_value", "encode_object_array", "decode_object_array", "unstorable_recursion",
           "unstorable_tensor", "PACK_MIN_ITEMS"]

#: Ragged number rows with at least this many items in all are stored as packed tensors; fewer stay
#: JSON (a tensor costs a few hundred bytes of header and bookkeeping: small lists are cheaper inline).
PACK_MIN_ITEMS = 64

TAG = "__t"
_PLAIN = (str, int, float, bool, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)  # the values encode_value returns as they are
_STR = frozenset({str})

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
        if value and type(value[0]) is list and add_tensor is not _no_tensors:
            rows = _encode_rows(value, add_tensor)
            if rows is not None:
                return rows
        if value and type(value[0]) is dict and _plain_dicts(value):
            return value  # already JSON as it is (a V1 step's tag dicts)
        # plain items pass as they are, without a call or a path each
        return [v if type(v) in _PLAIN_TYPES else encode_value(v, f"{path}[{i}]", add_tensor)
                for i, v in enumerate(value)]
    if kind is dict:
        if _plain_dicts((value,)):
            return value  # already JSON as it is: string keys, plain values
        if TAG not in value and all(type(k) is str for k in value):
            return {k: v if type(v) in _PLAIN_TYPES else encode_value(v, f"{path}[{k!r}]", add_tensor)
                    for k, v in value.items()}
        return {TAG: "dict", "v": [[encode_value(k, f"{path}.<key>", add_tensor),
                                    encode_value(v, f"{path}[{k!r}]", add_tensor)] for k, v in value.items()]}
    if kind is tuple:
        return {TAG: "tuple", "v": [encode_value(v, f"{path}[{i}]", add_tensor) for i, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        if value.dtype.fields is not None or value.dtype.subdtype is not None:
            raise _unstorable(value, path)
        return _encode_array(value, path, add_tensor)
    if isinstance(value, np.generic):
        if value.dtype.hasobject or value.dtype.kind in "MmV":
            raise _unstorable(value, path)
        item = np.asarray(value).reshape(1)
        if _exact_floats_needed(item):
            return {TAG: "np", "dtype": value.dtype.str, "b64": base64.b64encode(item.tobytes()).decode("ascii")}
        return {TAG: "np", "dtype": value.dtype.str, "v": _plain_items(item, path)[0]}
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


_NONE = type(None)
_DICT = frozenset({dict})
_INT_ROWS = frozenset({int, _NONE})
_FLOAT_ROWS = frozenset({float, _NONE})
_NUMBERS = _INT_ROWS | _FLOAT_ROWS


def _plain_dicts(items: Sequence[Any]) -> bool:
    """Whether ``items`` are dicts that encode as themselves: string keys (the tag not among them), plain
    values. Checked in C loops: a V1 step's 1,024 tag dicts in a fraction of a millisecond."""
    return set(map(type, items)) <= _DICT and not any(map(operator.contains, items, itertools.repeat(TAG))) \
        and set(map(type, itertools.chain.from_iterable(items))) <= _STR \
        and set(map(type, itertools.chain.from_iterable(map(dict.values, items)))) <= _PLAIN_TYPES


def _encode_rows(rows: list[Any], add_tensor: TensorSink) -> dict[str, Any] | None:
    """Ragged number rows as packed tensors (see the module's docstring), or None when they are not such rows."""
    if not all(type(row) is list for row in rows):
        return None
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if int(lengths.sum()) < PACK_MIN_ITEMS:
        return None
    types: set[type] = set()
    for row in rows:
        types.update(map(type, row))
        if not types <= _NUMBERS:
            return None  # strings, dicts, deeper lists ...: decided at the first row that has one
    dtype: type[np.generic]
    if int in types and types <= _INT_ROWS:
        kind, dtype = "int", np.int64
    elif float in types and types <= _FLOAT_ROWS:
        kind, dtype = "float", np.float64
    else:
        return None  # mixed ints and floats, bools, all holes, other items: JSON keeps their types
    holes = _NONE in types
    parts, masks = [], []
    try:
        for row in rows:
            mask = None
            if not holes:
                part = np.array(row, dtype=dtype)
            elif kind == "float":
                part = np.array(row, dtype=dtype)  # None becomes NaN: the holes are among the NaNs
                mask = np.zeros(len(row), dtype=np.bool_)
                nan = np.flatnonzero(np.isnan(part)).tolist()
                if nan:
                    mask[[i for i in nan if row[i] is None]] = True
            else:
                mask = np.fromiter(map(operator.is_, row, itertools.repeat(None)), dtype=np.bool_, count=len(row))
                part = np.array([0 if item is None else item for item in row] if mask.any() else row, dtype=dtype)
            parts.append(part)
            if mask is not None:
                masks.append(mask)
    except OverflowError:
        return None  # an int outside int64
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = torch.from_numpy(np.concatenate(parts))
    if kind == "int":
        values = narrow(values)  # token ids fit 32 bits (or fewer): the decoder reads any integer width
    return {TAG: "rows", "kind": kind, "values": add_tensor(values), "offsets": add_tensor(torch.from_numpy(offsets)),
            "holes": add_tensor(torch.from_numpy(np.concatenate(masks))) if holes else None}


def _encode_array(value: np.ndarray, path: str, add_tensor: TensorSink) -> dict[str, Any]:
    node: dict[str, Any] = {TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape)}
    if value.dtype.hasobject:
        node["v"] = encode_object_array(value.reshape(-1), path, add_tensor)
    elif _exact_floats_needed(value):
        # NaN payloads and signs do not survive JSON: such arrays keep their exact bytes
        node["b64"] = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode("ascii")
    else:
        node["v"] = _plain_items(value, path)
    return node


def _exact_floats_needed(array: np.ndarray) -> bool:
    """True for float/complex arrays JSON would not keep bit for bit (NaN payloads and signs)."""
    kind, size = array.dtype.kind, array.dtype.itemsize
    return ((kind == "f" and size <= 8) or (kind == "c" and size <= 16)) and not bool(np.isfinite(array).all())


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


_TREE = "data.json"
_ARRAY_KINDS = "biufcUSO"


def _np_dtype(text: Any, field: str, kinds: str = _ARRAY_KINDS) -> np.dtype:
    """The numpy dtype recorded as ``text``: a plain dtype of ``kinds``, never a structured or forged one."""
    try:
        dtype = np.dtype(text) if isinstance(text, str) and len(text) <= 16 else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in kinds or dtype.fields is not None or dtype.subdtype is not None:
        raise CorruptEntryError(f"{_TREE}: {field}: {str(text)[:40]!r} is not a numpy dtype an entry can hold")
    return dtype


def _from_bytes(data: dict[str, Any], dtype: np.dtype, count: int, field: str) -> np.ndarray:
    raw = data["b64"]
    if not isinstance(raw, str) or len(raw) > 4 * (count * dtype.itemsize + 2) // 3 + 4:
        raise CorruptEntryError(f"{_TREE}: {field}: the bytes of {count} {dtype} values do not fit their record")
    try:
        buffer = base64.b64decode(raw, validate=True)
    except binascii.Error as err:
        raise CorruptEntryError(f"{_TREE}: {field}: the recorded bytes are not base64: {err}") from err
    if len(buffer) != count * dtype.itemsize:
        raise CorruptEntryError(f"{_TREE}: {field}: {len(buffer)} bytes for {count} {dtype} values")
    if dtype.kind == "U" and buffer and int(np.frombuffer(buffer, dtype=np.uint32).max()) > _MAX_CODE_POINT:
        # numpy would hold them, and fail (SystemError) when anything reads one back
        raise CorruptEntryError(f"{_TREE}: {field}: text values with characters past U+10FFFF")
    if dtype.kind == "b" and buffer and max(buffer) > 1:
        raise CorruptEntryError(f"{_TREE}: {field}: bool values recorded as bytes other than 0 and 1")
    return np.frombuffer(buffer, dtype=dtype).copy()


_MAX_CODE_POINT = 0x10FFFF
#: A set's or dict's recorded keys may share a hash at most this often: ints that are multiples of
#: 2**61 - 1 all hash to 0, and a hostile entry listing many would make building the set quadratic.
_MAX_SHARED_HASH = 16


def _hash_spread(keys: list[Any], field: str) -> list[Any]:
    """``keys``, checked to spread over hashes before a set or dict is built of them."""
    if len(keys) > _MAX_SHARED_HASH:
        counts: dict[int, int] = {}
        for key in keys:
            code = hash(key)
            counts[code] = counts.get(code, 0) + 1
            if counts[code] > _MAX_SHARED_HASH:
                raise CorruptEntryError(f"{_TREE}: {field}: more than {_MAX_SHARED_HASH} recorded keys of one "
                                        "set or dict share a hash (an entry built to make decoding slow)")
    return keys


def decode_value(data: Any, get_tensor: TensorSource = _no_source, budget: DecodeBudget | None = None,
                 field: str = "value") -> Any:
    """Invert :func:`encode_value`.

    A list of plain items, or of dicts holding plain values and not the tag key, is returned as it
    is: parsed JSON that stands for itself (a V1 step's keys and tags), checked in C loops.

    Args:
        data: what :func:`encode_value` returned, parsed back from JSON.
        get_tensor: the tensor stored under a reference.
        budget: charged for every array before it is allocated (see :mod:`stepskip._formats.bounds`).
        field: where ``data`` lives, for error messages.

    Raises:
        CorruptEntryError: a dtype, shape or size that does not fit the data, naming ``field``.
        DecodeLimitError: an array larger than the budget allows.
    """
    kind = type(data)
    if kind is list:
        if set(map(type, data)) <= _PLAIN_TYPES or _plain_dicts(data):  # parsed JSON that stands for itself
            return data
        return [decode_value(v, get_tensor, budget, field) for v in data]
    if kind is not dict:
        return data
    tag = data.get(TAG)
    if tag is None:
        return {k: decode_value(v, get_tensor, budget, field) for k, v in data.items()}
    if tag == "dict":
        pairs = [(decode_value(k, get_tensor, budget, field), decode_value(v, get_tensor, budget, field))
                 for k, v in data["v"]]
        _hash_spread([k for k, _ in pairs], field)
        return dict(pairs)
    if tag == "tuple":
        return tuple(decode_value(v, get_tensor, budget, field) for v in data["v"])
    if tag == "ndarray":
        return _decode_array(data, get_tensor, budget, field)
    if tag == "np":
        dtype = _np_dtype(data["dtype"], field, "biufcUS")
        if budget is not None:
            budget.charge(dtype.itemsize, _TREE, field)
        if "b64" in data:
            return _from_bytes(data, dtype, 1, field)[0]
        return _array_from_items([data["v"]], dtype, field)[0]
    if tag == "tensor":
        return get_tensor(data["ref"])
    if tag == "rows":
        return _decode_rows(data, get_tensor, budget, field)
    if tag == "bytes":
        return base64.b64decode(data["v"])
    if tag == "set":
        return set(_hash_spread([decode_value(v, get_tensor, budget, field) for v in data["v"]], field))
    if tag == "frozenset":
        return frozenset(_hash_spread([decode_value(v, get_tensor, budget, field) for v in data["v"]], field))
    # intact bytes of a newer stepskip, or damage: the reader tells them apart by the entry's checksums
    raise CorruptEntryError(f"{_TREE}: {field}: unknown value tag {str(tag)[:40]!r} (written by a newer stepskip?)")


def _decode_array(data: dict[str, Any], get_tensor: TensorSource, budget: DecodeBudget | None,
                  field: str) -> np.ndarray:
    dtype = _np_dtype(data["dtype"], field)
    shape = shape_of(data["shape"], _TREE, f"{field}.shape")
    count = math.prod(shape)
    if budget is not None:
        budget.charge(count * dtype.itemsize, _TREE, field)
    if dtype.hasobject:
        return decode_object_array(data["v"], get_tensor, budget=budget, field=field, count=count).reshape(shape)
    if "b64" in data:
        return _from_bytes(data, dtype, count, field).reshape(shape)
    items = data["v"]
    if not isinstance(items, list) or len(items) != count:
        raise CorruptEntryError(f"{_TREE}: {field}: {len(items) if isinstance(items, list) else 'no'} items "
                                f"for shape {list(shape)}")
    return _array_from_items(items, dtype, field).reshape(shape)


_ROW_INTS = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                       torch.uint64})
#: What a decoded item costs in Python objects: the list's pointer and the int or float it points to.
_ROW_ITEM_BYTES = 40
_ROW_BYTES = 64


def _decode_rows(data: dict[str, Any], get_tensor: TensorSource, budget: DecodeBudget | None,
                 field: str) -> list[list[Any]]:
    """Invert :func:`_encode_rows`; every part is checked before a row is built (the entry may be hostile)."""
    kind = data.get("kind")
    if kind not in ("int", "float") or "values" not in data or "offsets" not in data:
        raise CorruptEntryError(f"{_TREE}: {field}: packed rows of kind {str(kind)[:40]!r} with parts "
                                f"{sorted(map(str, data))[:6]} (known: kind int or float, values, offsets, holes)")
    values, offsets = get_tensor(data["values"]), get_tensor(data["offsets"])
    holes = None if data.get("holes") is None else get_tensor(data["holes"])
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor) or \
            not (holes is None or isinstance(holes, torch.Tensor)):
        raise CorruptEntryError(f"{_TREE}: {field}: packed rows whose parts are not tensors")
    allowed = _ROW_INTS if kind == "int" else {torch.float64}
    if values.dim() != 1 or values.is_nested or values.dtype not in allowed:
        raise CorruptEntryError(f"{_TREE}: {field}: packed {kind} rows stored as {values.dtype} of shape "
                                f"{list(values.shape)}, not a 1-D {'integer' if kind == 'int' else 'float64'} tensor")
    check_jagged(values, offsets, None, 1, _TREE, field)
    if holes is not None and (holes.dtype != torch.bool or holes.shape != values.shape):
        raise CorruptEntryError(f"{_TREE}: {field}: the holes of packed rows are {holes.dtype} of shape "
                                f"{list(holes.shape)}, not a bool mask of the {values.numel()} values")
    rows = offsets.numel() - 1
    if budget is not None:
        budget.charge(values.numel() * _ROW_ITEM_BYTES + rows * _ROW_BYTES, _TREE, field)
    flat = values.tolist()
    if holes is not None:
        if budget is not None:  # the positions of the holes are listed too: charged before they are
            budget.charge(int(holes.sum()) * _ROW_ITEM_BYTES, _TREE, field)
        for i in np.flatnonzero(holes.numpy()).tolist():  # numpy's is ~100x torch's nonzero on a CPU mask
            flat[i] = None
    bounds = offsets.tolist()
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def _array_from_items(items: list[Any], dtype: np.dtype, field: str) -> np.ndarray:
    """The array of ``dtype`` holding ``items`` (as many as the budget was charged for, each one value).

    Checked first, as numpy would otherwise size the array by the items: a list among them adds a
    dimension, and text under an unsized text dtype (``<U0``, what an empty ``np.str_`` records)
    widens every item to the longest one.
    """
    kind = dtype.kind
    if kind in "US":
        if any(type(v) is not str for v in items):
            raise CorruptEntryError(f"{_TREE}: {field}: {dtype} values recorded as something other than text")
        if dtype.itemsize == 0 and any(items):
            raise CorruptEntryError(f"{_TREE}: {field}: a text dtype without a length ({dtype}) holds only empty text")
    elif kind != "c" and any(type(v) not in (int, float, bool) for v in items):
        raise CorruptEntryError(f"{_TREE}: {field}: {dtype} values recorded as something other than numbers")
    if kind == "S":
        return np.array([base64.b64decode(v) for v in items], dtype=dtype)
    if kind == "c":
        return np.array([complex(r, i) for r, i in items], dtype=dtype)
    return np.array(items, dtype=dtype)


def decode_object_array(items: list[Any], get_tensor: TensorSource = _no_source, plain: bool = False,
                        budget: DecodeBudget | None = None, field: str = "value",
                        count: int | None = None) -> np.ndarray:
    """A 1-D object array holding the decoded items (never a 2-D array of nested lists).

    ``plain`` (from :func:`is_plain` at encode time) skips decoding: the items are final.
    ``count``, when given, is how many items the recorded shape calls for.

    Raises:
        CorruptEntryError: ``items`` is not a list (of ``count`` items).
    """
    if not isinstance(items, list) or (count is not None and len(items) != count):
        raise CorruptEntryError(f"{_TREE}: {field}: {len(items) if isinstance(items, list) else 'no'} items "
                                f"where {count if count is not None else 'a list'} are recorded")
    if budget is not None and count is None:
        budget.charge(8 * len(items), _TREE, field)
    out = np.empty(len(items), dtype=object)
    if plain:
        for i, v in enumerate(items):
            out[i] = v
        return out
    for i, v in enumerate(items):
        out[i] = decode_value(v, get_tensor, budget, field)
    return out


def _cycle(value: Any, path: str) -> str | None:
    """The path of a container that holds one of its own ancestors, if ``value`` has one (iterative)."""
    stack: list[tuple[Any, str, frozenset[int]]] = [(value, path, frozenset())]
    visits = 0
    while stack and visits < 1_000_000:  # shared references can make the walk long: it is only a diagnosis
        visits += 1
        item, where, ancestors = stack.pop()
        if isinstance(item, dict):
            children = [(v, f"{where}[{k!r}]") for k, v in item.items()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = [(v, f"{where}[{i}]") for i, v in enumerate(item)]
        elif isinstance(item, np.ndarray) and item.dtype.hasobject:
            children = [(v, f"{where}[{i}]") for i, v in enumerate(item.reshape(-1))]
        elif is_dataproto_like(item):
            children = [(item.non_tensor_batch, f"{where}.non_tensor_batch"), (item.meta_info, f"{where}.meta_info")]
        else:
            continue
        if id(item) in ancestors:
            return where
        inner = ancestors | {id(item)}
        stack.extend((child, child_path, inner) for child, child_path in children)
    return None


def unstorable_recursion(value: Any, path: str, fmt: str) -> UnstorableValueError:
    """The error for a value whose encoding hit Python's recursion limit: it contains itself, or is too deep."""
    where = _cycle(value, path)
    if where is not None:
        return UnstorableValueError(f"{where}: the value contains itself (a reference cycle); format {fmt!r} "
                                    "stores trees only: break the cycle before returning it")
    return UnstorableValueError(f"{path}: the value is nested too deeply to store with format {fmt!r}; "
                                "flatten it")


def unstorable_tensor(tensor: torch.Tensor, path: str, fmt: str) -> UnstorableValueError | None:
    """The error for a tensor that holds no values a reader could get back (meta device, sparse), else None."""
    if tensor.device.type == "meta":
        return UnstorableValueError(f"{path}: a tensor on the meta device has no values to store with format "
                                    f"{fmt!r}; materialise it first (tensor.to('cpu') after filling it)")
    if tensor.layout not in (torch.strided, torch.jagged):
        return UnstorableValueError(f"{path}: a {tensor.layout} tensor cannot be stored by format {fmt!r}; "
                                    "store it dense (tensor.to_dense())")
    return None
