"""Replay fidelity: run fingerprints and prompt digests.

A cache replayed into a run with another model, sampling setup or data order gives wrong results
silently. At dump time an entry records (a) the values of the config keys that determine rollouts
— the run fingerprint — and (b) a digest of the prompts the stage received. At load time both
are compared with the live run and call; what happens on a difference is the role's
``on_mismatch`` / ``check_prompts`` policy.
"""

from __future__ import annotations

import ctypes
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import numpy as np
import numpy.ctypeslib  # noqa: F401  (numpy imports these two on first use: in a call, otherwise;
import numpy.ma  # noqa: F401  np.unique asks numpy.ma whether its input is masked)
import torch
import xxhash
from tensordict import TensorDictBase, is_non_tensor

from stepskip._calls import is_dataproto_like
from stepskip._formats.compact import host_view
from stepskip._identity import VERL_FINGERPRINT_KEYS, fingerprint_diff, fingerprint_of

__all__ = ["FINGERPRINT_KEYS", "DIGEST_PREFIX", "STEPLESS_PREFIX", "STEP_COLUMNS", "run_fingerprint",
           "fingerprint_diff", "prompt_digest", "prompt_row_digests", "digest_like", "shared_object_digests"]

#: The scheme of :func:`prompt_digest` values. Entries recorded by an older scheme (``xxh3_64:``)
#: hold digests that cannot be compared with this one: a reader should skip the check for them.
DIGEST_PREFIX = "xxh3v2:"

#: The scheme of *stepless* digests: those of :data:`DIGEST_PREFIX`, less the :data:`STEP_COLUMNS`.
#: The queue role writes these: its prompts carry the step they were submitted at, so a prompt
#: recorded at one step must digest the same when it is asked again at another (``action: match``,
#: prompts re-issued after a resume). A digest of either scheme is compared in its own scheme
#: (:func:`digest_like`), so entries written before this one existed keep their exact check.
STEPLESS_PREFIX = "xxh3v3:"

#: Columns a trainer sets on a whole batch for the step it submits it at: bookkeeping, not what
#: was asked (verl's V1 trainer stamps ``global_steps`` on every batch of prompts it submits or
#: re-issues).
STEP_COLUMNS = ("global_steps",)

#: verl's config keys that determine what a rollout produces.
FINGERPRINT_KEYS = VERL_FINGERPRINT_KEYS


def run_fingerprint(config: Any, extra_keys: Iterable[str] = ()) -> dict[str, Any]:
    """The values of verl's fingerprint keys (and ``extra_keys``) that are set in ``config``.

    Example:
        >>> run_fingerprint({"data": {"seed": 1}, "trainer": {"run_id": "x"}})
        {'data.seed': 1}
    """
    return fingerprint_of(config, (*VERL_FINGERPRINT_KEYS, *extra_keys))


def _buffer(array: np.ndarray) -> Any:
    """A contiguous array as the buffer xxhash reads without a copy (numpy's stubs do not say it is one)."""
    return array


def _hash_tensor(h: xxhash.xxh3_64, name: str, tensor: torch.Tensor) -> None:
    """Hash a tensor on its bytes (plus name, dtype and shape), jagged and nested ones part by part."""
    if tensor.is_nested:
        if tensor.layout == torch.jagged:
            jagged: Any = tensor  # torch's stubs do not declare the jagged layout's accessors
            _hash_tensor(h, f"{name}.values", jagged.values())
            _hash_tensor(h, f"{name}.offsets", jagged.offsets())
        else:
            for i, part in enumerate(tensor.unbind()):
                _hash_tensor(h, f"{name}[{i}]", part)
        return
    h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    if not tensor.numel():
        return
    # the same bytes without the torch calls below, each of which releases the GIL (a 0-d tensor goes
    # below: its byte view raises there, as it always did)
    host = host_view(tensor) if tensor.dim() else None
    if host is not None:
        h.update(_buffer(np.ascontiguousarray(host).reshape(-1).view(np.uint8)))
        return
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h.update(_buffer(t.view(torch.uint8).reshape(-1).numpy() if t.dtype != torch.bool else t.numpy()))


# ------------------------------------------------------------------ non-tensor values
#
# Each distinct object of a column is hashed once (rows share objects: verl's DataProto.repeat
# np.repeats its object arrays), and the digest depends on content only: a column of shared
# objects and one of equal copies hash alike. Dict key order does not count (equal dicts, equal
# digests, as before); list order, types (tuple vs list, 1 vs 1.0 vs True, int vs str keys) do.

_LEAVES = frozenset({str, int, float, bool, type(None)})
_TAG = "__t"


def _is_plain(value: Any) -> bool:
    """True when ``json.dumps`` says ``value`` exactly: str-keyed dicts, lists and JSON scalars only."""
    kind = type(value)
    if kind is dict:
        for key in value:
            if type(key) is not str:
                return False
        for item in value.values():
            if type(item) not in _LEAVES and not _is_plain(item):
                return False
        return True
    if kind is list:
        for item in value:
            if type(item) not in _LEAVES and not _is_plain(item):
                return False
        return True
    return kind in _LEAVES


def _make_json() -> Callable[[Any], str]:
    """The C JSON encoder built once (``json.dumps`` builds one per call, ~1 µs); sort_keys makes
    dict key order irrelevant, ASCII output makes the text unique. Pure Python where C is missing."""
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), allow_nan=True)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return encoder.encode
    # markers=None: no cycle check (a cyclic value hits the recursion limit: no digest); floats are
    # written with float.__repr__, exact and identical across processes
    iterencode = make(None, encoder.default, json.encoder.encode_basestring_ascii, None, ":", ",", True, False, True)

    def encode(value: Any) -> str:
        return "".join(iterencode(value, 0))

    return encode


_json = _make_json()
#: The digests of an empty dict and an empty list, as :func:`_value_digest` computes them.
_EMPTY = {kind: xxhash.xxh3_64_intdigest(b"J" + _json(kind()).encode("ascii")) for kind in (dict, list)}


def _tensor_hex(tensor: torch.Tensor) -> str:
    h = xxhash.xxh3_64()
    _hash_tensor(h, "", tensor)
    return h.hexdigest()


def _canonical(value: Any) -> Any:
    """A JSON-able form of ``value`` that tells apart what plain JSON conflates (tagged, order-free sets).

    Raises:
        TypeError: a value of a type with no deterministic content form (its repr may hold an address).
    """
    kind = type(value)
    if kind in _LEAVES:
        return value
    if kind is list:
        return [_canonical(v) for v in value]
    if kind is dict and _TAG not in value and set(map(type, value)) <= {str}:
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, dict):
        items = sorted((_json(_canonical(k)), _canonical(v)) for k, v in value.items())
        return {_TAG: "dict", "v": [[k, v] for k, v in items]}
    if kind is tuple:
        return {_TAG: "tuple", "v": [_canonical(v) for v in value]}
    if kind is set or kind is frozenset:
        return {_TAG: kind.__name__, "v": sorted(_json(_canonical(v)) for v in value)}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return {_TAG: "ndarray", "shape": list(value.shape), "v": [_canonical(v) for v in value.reshape(-1)]}
        return {_TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                "h": xxhash.xxh3_64_hexdigest(np.ascontiguousarray(value).tobytes())}
    if isinstance(value, np.generic) and not value.dtype.hasobject:
        return {_TAG: "np", "dtype": value.dtype.str, "h": value.tobytes().hex()}
    if isinstance(value, torch.Tensor):
        return {_TAG: "tensor", "h": _tensor_hex(value)}
    if kind is bytes or kind is bytearray:
        return {_TAG: "bytes", "h": xxhash.xxh3_64_hexdigest(bytes(value))}
    if isinstance(value, (str, int, float)):  # enum members and other subclasses: their type and value
        base = str if isinstance(value, str) else int if isinstance(value, int) else float
        return {_TAG: f"{kind.__module__}.{kind.__qualname__}", "v": base(value)}
    if isinstance(value, list):
        return {_TAG: f"{kind.__module__}.{kind.__qualname__}", "v": [_canonical(v) for v in value]}
    raise TypeError(f"no content digest for a value of type {kind.__module__}.{kind.__qualname__}")


def _value_digest(value: Any) -> int:
    """64-bit digest of one value's content; plain JSON data takes the C encoder's fast path."""
    kind = type(value)
    if (kind is dict or kind is list) and not value:
        return _EMPTY[kind]  # verl's tools_kwargs and interaction_kwargs: a {} per row
    if _is_plain(value):
        return xxhash.xxh3_64_intdigest(b"J" + _json(value).encode("ascii"))
    return xxhash.xxh3_64_intdigest(b"T" + _json(_canonical(value)).encode("ascii"))


def _hash_objects(h: xxhash.xxh3_64, items: list[Any], column: np.ndarray | None = None) -> None:
    """Hash a sequence of values, each distinct object once (by identity), the digest by content.

    ``column``: the object array ``items`` came from, by which :func:`shared_object_digests`
    finds the column's digests again without looking at its items."""
    known = _column_memo(column)
    # a column whose first item is a dict or a list is not one of scalars: no pass over its types
    leaves = known[1] if known is not None else \
        (not items or type(items[0]) in _LEAVES) and set(map(type, items)) <= _LEAVES
    if leaves:  # uids, data sources, indices: one C call for the whole column
        h.update(b"J" + _json(items).encode("ascii"))
        return
    h.update(b"O")
    h.update((known[2] if known is not None else _item_digests(items, column)).tobytes())


#: Inside :func:`shared_object_digests`: the bytes of a column's item ids, or the id of the column's
#: object array, -> (its items or that array, whether every item is a JSON scalar, their digests).
#: What a key names is kept with its digests, so that no id can be reused by another object while the
#: memo lives.
_SHARED: ContextVar[dict[bytes | int, tuple[Any, bool, np.ndarray]] | None] = ContextVar("stepskip_shared_digests",
                                                                                       default=None)


@contextmanager
def shared_object_digests() -> Iterator[None]:
    """Within this block, :func:`prompt_digest` and :func:`prompt_row_digests` hash each non-tensor
    column once between them (a miss records both digests of the same prompts).

    The values are those computed without it; only the work is shared. Objects, and the object
    arrays holding them, must not be changed inside the block (the digests of a column of the
    same objects are reused).

    Example:
        >>> from stepskip import Batch
        >>> b = Batch.from_dict(non_tensors={"messages": [{"role": "user", "content": "hi"}] * 2})
        >>> with shared_object_digests():
        ...     rows, whole = prompt_row_digests(b), prompt_digest(b)
        >>> (rows, whole) == (prompt_row_digests(b), prompt_digest(b))
        True
    """
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def _column_memo(column: np.ndarray | None) -> tuple[Any, bool, np.ndarray] | None:
    memo = _SHARED.get()
    if memo is None or column is None:
        return None
    return memo.get(id(column))  # the memo holds the array: no other object can have its id meanwhile


#: Whether an object array's buffer holds its items' ids: CPython's ``id`` is an object's address,
#: and an object array stores the addresses of its items.
_IDS_IN_ARRAYS = sys.implementation.name == "cpython" and np.dtype(object).itemsize == ctypes.sizeof(ctypes.c_void_p)


def _object_ids(items: list[Any], column: np.ndarray | None) -> np.ndarray:
    """``id`` of each item, as uint64.

    Read in one copy from ``column``, the object array ``items`` was listed from, where it holds
    them (1,024 rows: 2 µs, against 40 for an ``id`` call per item); checked on the first and last
    item, else (another interpreter, an array of other objects, a subclass) one ``id`` call each."""
    # a plain ndarray only: a subclass may list other values than it holds (a masked array lists None)
    if _IDS_IN_ARRAYS and items and type(column) is np.ndarray and column.dtype == object \
            and column.size == len(items):
        flat = np.ascontiguousarray(column).reshape(-1)  # the same objects, whatever the array's strides
        slots = (ctypes.c_size_t * flat.size).from_address(flat.__array_interface__["data"][0])
        ids = np.ctypeslib.as_array(slots).astype(np.uint64)  # a copy: nothing points into the array
        if int(ids[0]) == id(items[0]) and int(ids[-1]) == id(items[-1]):
            return ids
    return np.fromiter(map(id, items), dtype=np.uint64, count=len(items))


#: Columns of at most this many rows find their distinct objects by a dict of ids rather than by
#: ``np.unique`` over the ids (whose fixed cost is most of a small column's).
_SMALL_COLUMN = 64


def _item_digests(items: list[Any], column: np.ndarray | None = None) -> np.ndarray:
    """The content digest of each item, each distinct object (by identity) computed once; a column
    seen before in the shared memo (the same objects in the same rows, or the same ``column``
    array they came from) is not looked at again."""
    known = _column_memo(column)
    if known is not None:
        return known[2]
    memo = _SHARED.get()
    if memo is None and len(items) <= _SMALL_COLUMN:  # a hit's check: no memo to fill, few rows
        by_id: dict[int, int] = {}
        out = []
        for item in items:  # the list holds every item: no id is reused meanwhile
            digest = by_id.get(id(item))
            if digest is None:
                digest = by_id[id(item)] = _value_digest(item)
            out.append(digest)
        return np.array(out, dtype=np.uint64)
    ids = _object_ids(items, column)
    key = ids.tobytes() if memo is not None else b""
    if memo is not None and key in memo:
        return memo[key][2]
    distinct, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    values = [items[i] for i in first.tolist()]
    digests = np.fromiter(map(_value_digest, values), dtype=np.uint64, count=len(distinct))
    digests = digests[inverse.reshape(-1)]
    if memo is not None:
        leaves = set(map(type, values)) <= _LEAVES  # the distinct items have every type the column has
        memo[key] = (items, leaves, digests)
        if column is not None:
            memo[id(column)] = (column, leaves, digests)
    return digests


def _hash_value(h: xxhash.xxh3_64, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        _hash_tensor(h, name, value)
    elif isinstance(value, np.ndarray) and not value.dtype.hasobject:
        h.update(f"{name}|{value.dtype.str}|{value.shape}|".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"{name}|object|{value.shape}|".encode())
        _hash_objects(h, value.reshape(-1).tolist(), value)
    elif type(value) is list:  # a NonTensorStack's rows
        h.update(f"{name}|list|{len(value)}|".encode())
        _hash_objects(h, value)
    else:
        h.update(f"{name}|".encode())
        h.update(_value_digest(value).to_bytes(8, "little"))


def prompt_digest(prompts: Any, exclude: Iterable[str] = (), stepless: bool = False) -> str | None:
    """A fast digest of what a stage received, without per-run identifier columns.

    Covers the tensors (token ids, masks: hashed on their bytes) and non-tensor columns (raw
    prompts, reward-model dicts) of a Batch/DataProto or TensorDict, a tensor, or a plain list or
    tuple (token-id rows ``list[list[int]]`` hashed packed, as TRL passes them; other lists by
    content), minus the ``exclude`` columns
    (``rebind_keys``: uids, sample ids). ``meta_info`` is left out (timings, flags). Each distinct
    non-tensor object is hashed once, so the n rows verl repeats from one prompt cost one. The
    value depends on content only and is the same in every process: shared or copied objects,
    dict key order and ``PYTHONHASHSEED`` (sets are hashed sorted) do not change it; any change of
    a value, of list order or of a type (tuple vs list, 1 vs 1.0 vs True) does.

    Args:
        prompts: the stage's input.
        exclude: columns left out.
        stepless: leave the :data:`STEP_COLUMNS` out too, under the :data:`STEPLESS_PREFIX` scheme.

    Returns:
        ``"xxh3v2:<hex>"`` (see :data:`DIGEST_PREFIX`; ``"xxh3v3:<hex>"`` when ``stepless``), or None
        for values it cannot read (objects of types with no content form, e.g. arbitrary classes).

    Example:
        >>> from stepskip import Batch
        >>> a = Batch.from_dict(tensors={"ids": torch.ones(2, 3)}, non_tensors={"uid": ["x", "y"]})
        >>> b = Batch.from_dict(tensors={"ids": torch.ones(2, 3)}, non_tensors={"uid": ["p", "q"]})
        >>> prompt_digest(a, ["uid"]) == prompt_digest(b, ["uid"])
        True
    """
    skip = set(exclude).union(STEP_COLUMNS) if stepless else set(exclude)
    h = xxhash.xxh3_64()
    try:
        if is_dataproto_like(prompts):
            td = prompts.batch
            if td is not None:
                _hash_tensordict(h, td, skip)
            for key in sorted(prompts.non_tensor_batch):
                if key not in skip:
                    _hash_value(h, key, prompts.non_tensor_batch[key])
        elif isinstance(prompts, TensorDictBase):
            _hash_tensordict(h, prompts, skip)
        elif isinstance(prompts, torch.Tensor):
            _hash_tensor(h, "prompts", prompts)
        elif type(prompts) is list or type(prompts) is tuple:
            _hash_sequence(h, prompts)
        else:
            return None
    except (TypeError, ValueError, RuntimeError):
        return None
    return (STEPLESS_PREFIX if stepless else DIGEST_PREFIX) + h.hexdigest()


def digest_like(recorded: Any, prompts: Any, exclude: Iterable[str] = ()) -> str | None:
    """The digest of ``prompts`` in the scheme of the ``recorded`` one, to compare them.

    Args:
        recorded: a digest an entry recorded (``meta["prompt_digest"]``).
        prompts: the live call's prompts.
        exclude: columns left out (the identity columns).

    Returns:
        The live digest, or None when the recorded one is of a scheme this stepskip does not know
        (an earlier one: not comparable, so never a mismatch) or the prompts cannot be read.

    Example:
        >>> from stepskip import Batch
        >>> b = Batch.from_dict(tensors={"ids": torch.ones(2, 3)})
        >>> digest_like(prompt_digest(b, stepless=True), b) == prompt_digest(b, stepless=True)
        True
        >>> digest_like("xxh3_64:0123456789abcdef", b) is None
        True
    """
    text = str(recorded)
    if text.startswith(STEPLESS_PREFIX):
        return prompt_digest(prompts, exclude, stepless=True)
    if text.startswith(DIGEST_PREFIX):
        return prompt_digest(prompts, exclude)
    return None


def _packed_int_rows(rows: list[Any]) -> np.ndarray | None:
    """``[row count, row lengths..., items...]`` as int64 for a list of lists of ints (bool is not an int
    here), or None for anything else (other items, ints outside int64)."""
    if not all(type(row) is list for row in rows):
        return None
    types: set[type] = set()
    for row in rows:
        types.update(map(type, row))
    if not types <= {int}:
        return None
    head = np.empty(len(rows) + 1, dtype=np.int64)
    head[0] = len(rows)
    head[1:] = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    try:
        return np.concatenate([head, *(np.array(row, dtype=np.int64) for row in rows)])
    except OverflowError:
        return None


def _hash_sequence(h: xxhash.xxh3_64, prompts: list[Any] | tuple[Any, ...]) -> None:
    """Hash prompts that are a plain list or tuple (TRL's ``prompt_ids``, a user's list of messages).

    Token-id rows (a list of lists of ints) are hashed as one packed int64 array, row lengths
    included, on its bytes: 512 x 2048 ids cost milliseconds, not a JSON text per item. The bytes
    and header are those of :func:`_hash_tensor` on that array as a tensor named ``prompts``, the
    form TRL entries recorded before this function existed: their digests still compare equal.
    Anything else is hashed by content (:func:`_hash_value`).
    """
    packed = _packed_int_rows(prompts) if type(prompts) is list else None
    if packed is None:
        _hash_value(h, "prompts", prompts)
        return
    h.update(f"prompts|{torch.int64}|{tuple(packed.shape)}|".encode())
    h.update(_buffer(packed))


def _hash_tensordict(h: xxhash.xxh3_64, td: TensorDictBase, skip: set[str], prefix: str = "") -> None:
    for key in sorted(td.keys()):
        if key in skip:
            continue
        item = td.get(key)
        name = f"{prefix}{key}"
        if is_non_tensor(item):
            _hash_value(h, name, item.tolist() if hasattr(item, "tolist") else item.data)
        elif isinstance(item, TensorDictBase):
            _hash_tensordict(h, item, skip, prefix=f"{name}.")
        else:
            _hash_tensor(h, name, item)


# ------------------------------------------------------------------ per-row digests (action match)


def _tensor_row_digests(name: str, tensor: torch.Tensor, rows: int) -> np.ndarray:
    """64-bit digest of each row's bytes (the dtype and row shape go in the seed)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_nested:
        parts = t.unbind()
        if len(parts) != rows:
            raise ValueError(f"column {name!r} has {len(parts)} rows, the batch {rows}")
        return np.fromiter((_row_hash(name, p) for p in parts), dtype=np.uint64, count=rows)
    if t.dim() == 0 or int(t.shape[0]) != rows:
        raise ValueError(f"column {name!r} has {int(t.shape[0]) if t.dim() else 0} rows, the batch {rows}")
    seed = xxhash.xxh3_64_intdigest(f"{name}|{t.dtype}|{tuple(t.shape[1:])}|".encode())
    t = t.contiguous()
    flat = (t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)).reshape(rows, -1).numpy()
    digest = xxhash.xxh3_64_intdigest
    return np.fromiter((digest(row, seed) for row in flat), dtype=np.uint64, count=rows)


def _row_hash(name: str, part: torch.Tensor) -> int:
    p = part.contiguous()
    seed = xxhash.xxh3_64_intdigest(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
    if not p.numel():
        return seed
    return xxhash.xxh3_64_intdigest(_buffer((p.view(torch.uint8) if p.dtype != torch.bool else p.to(torch.uint8))
                                            .reshape(-1).numpy()), seed)


def _object_row_digests(name: str, items: list[Any], rows: int, column: np.ndarray | None = None) -> np.ndarray:
    """64-bit content digest of each row's value, each distinct object computed once (``column``:
    the object array ``items`` came from, see :func:`_hash_objects`)."""
    if len(items) != rows:
        raise ValueError(f"non-tensor column {name!r} has {len(items)} rows, the batch {rows}")
    seed = np.uint64(xxhash.xxh3_64_intdigest(f"{name}|".encode()))
    return _item_digests(items, column) ^ seed


def prompt_row_digests(prompts: Any, exclude: Iterable[str] = (), stepless: bool = False) -> list[str]:
    """One digest per row of ``prompts``, over every column but ``exclude``: rows with equal
    digests asked for the same thing (the content rules of :func:`prompt_digest`; ``stepless``: the
    :data:`STEP_COLUMNS` left out too, under the :data:`STEPLESS_PREFIX` scheme).

    A fast form of :func:`stepskip._matching.batches.row_digests` (its values differ: one scheme must be
    used by the recording and the replaying run): tensor rows are hashed on their bytes without
    copies, and each distinct non-tensor object once.

    Raises:
        ValueError: ``prompts`` is not a batch of rows, or a column's length is not the row count.

    Example:
        >>> from stepskip import Batch
        >>> b = Batch.from_dict(tensors={"ids": torch.tensor([[1, 2], [1, 2], [3, 4]])}, non_tensors={"uid": "abc"})
        >>> d = prompt_row_digests(b, exclude=["uid"])
        >>> d[0] == d[1] != d[2]
        True
    """
    skip = set(exclude).union(STEP_COLUMNS) if stepless else set(exclude)
    prefix = STEPLESS_PREFIX if stepless else DIGEST_PREFIX
    dataproto = is_dataproto_like(prompts)
    td = prompts.batch if dataproto else prompts
    if td is not None and not isinstance(td, TensorDictBase):
        raise ValueError(f"row digests need a DataProto-like batch or a TensorDict, got {type(prompts).__qualname__}")
    if td is not None and len(td.batch_size):
        rows = int(td.batch_size[0])
    elif dataproto and prompts.non_tensor_batch:
        rows = len(next(iter(prompts.non_tensor_batch.values())))
    else:
        raise ValueError(f"row digests need a batch with rows, got {type(prompts).__qualname__}")
    columns: list[np.ndarray] = []
    if td is not None:
        for key in sorted(td.keys()):
            if key in skip:
                continue
            item = td.get(key)
            if is_non_tensor(item):
                values = item.tolist() if hasattr(item, "tolist") else [item.data] * rows
                columns.append(_object_row_digests(key, list(values), rows))
            elif isinstance(item, torch.Tensor):
                columns.append(_tensor_row_digests(key, item, rows))
    if dataproto:
        for key in sorted(prompts.non_tensor_batch):
            if key not in skip:
                source = prompts.non_tensor_batch[key]
                column = np.asarray(source, dtype=object).reshape(-1)
                columns.append(_object_row_digests(key, column.tolist(), rows,
                                                   source if isinstance(source, np.ndarray) else None))
    if not columns:
        return [prefix + xxhash.xxh3_64_hexdigest(b"")] * rows
    table = np.ascontiguousarray(np.stack(columns, axis=1))
    return [prefix + xxhash.xxh3_64_hexdigest(_buffer(row)) for row in table.view(np.uint8).reshape(rows, -1)]
