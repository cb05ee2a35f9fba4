"""Lossless compact encodings of rollout tensors, chosen per tensor.

Rollout batches are mostly padding: prompts padded on the left, responses on the right, masks
that are runs of 0 and 1, position ids that stop counting in the padding, int64 token ids that
fit in 32 bits, and ``input_ids`` that repeat ``prompts`` next to ``responses``. Three encodings
exploit that, each exact to the bit (floats are compared through their integer bit patterns, so
``-0.0`` and NaN payloads survive):

- ``trim``: per row, the run of the row's first value at its start and the run of its last value
  at its end are stored as counts and values; only the middle is kept. For a few rows (the
  one-sample entries of the async role) the counts and values are written inline in the node,
  as JSON integers, instead of as four stored parts of one element per row.
- ``narrow``: integers stored in the smallest dtype that holds their range.
- ``concat``: a 2-D tensor equal to two sibling tensors side by side is stored as a reference.

The whole tensor file may then be compressed with zstd. Decoding restores dtype and shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from stepskip.errors import CorruptEntryError, TruncatedEntryError
from stepskip._formats.bounds import DecodeBudget, shape_of
from stepskip._formats.pages import POOL

__all__ = ["encode_tensor", "decode_tensor", "find_concat", "narrow", "pack", "unpack", "compress_bytes", "host_view"]

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16, torch.bool: torch.uint8}
_NARROW = (torch.uint8, torch.int8, torch.int16, torch.int32)
_INTS = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
MIN_TRIM_GAIN = 0.9  # trim only when it keeps at most this share of the elements
ZSTD_LEVEL = 1  # decompression speed barely depends on the level; compression does
_SAMPLE_BYTES = 1 << 18
#: The encoder gathers the middles of trimmed rows at least this wide by one slice per row (one C
#: call joins them), narrower ones by a vectorised mask, so that the Python work per element stays
#: small. (The decoder rebuilds many rows by masked passes, :func:`_fill_masked`, whatever the width.)
ROW_COPY_MIN_WIDTH = 256
#: Trimmed tensors of at most this many rows keep their run counts and run values inline in the node
#: (a few JSON integers) when the encoder is asked to (``inline=True``): each stored part costs
#: more to write, index and read back than the handful of bytes it holds. Readers accept inline
#: runs for at most this many rows.
INLINE_MAX_ROWS = 16
#: Inline runs of more rows than this are rebuilt by whole-tensor numpy passes (:func:`_fill_small`),
#: fewer by a slice write per row (:func:`_fill_rows`), which costs less for a handful of rows.
INLINE_ROW_WRITES_MAX = 4
#: Tensors of more than :data:`INLINE_MAX_ROWS` rows are trimmed only from this many elements up; below
#: it they are only narrowed. Rebuilding a trimmed tensor of many rows costs ~40 us of fixed work plus
#: ~1 ns an element of masked passes, copying a narrowed one ~0.1 ns an element: for a debugging
#: batch (32 to 512 rows) trimming made decoding 6-10x slower to save bytes that cost far less to
#: read than to rebuild (a 256 x 1536 batch: 1.3 MB trimmed, 4 MB narrowed). From here up (1024 rows
#: of a few thousand tokens), what trimming saves on disk is the larger gain.
TRIM_MIN_ELEMENTS = 1 << 20

TREE = "data.json"  # the file whose fields the decoders check (error messages name it)
Sink = Callable[[torch.Tensor], str]
Source = Callable[[str], torch.Tensor]


#: Tensors of at most this many elements are narrowed through numpy: for a small tensor, each
#: torch call costs more than the work it does (one-sample entries of the async role).
SMALL_ELEMENTS = 1 << 16
_NARROW_RANGES = [(dtype, torch.iinfo(dtype).min, torch.iinfo(dtype).max) for dtype in _NARROW]
_NUMPY = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}


#: dtypes numpy holds with torch's bytes (not bfloat16 nor the float8s; not complex, whose conjugate and
#: negative views numpy would not see).
_HOST_DTYPES = frozenset({torch.bool, torch.float16, torch.float32, torch.float64, *_NUMPY})


def host_view(tensor: torch.Tensor) -> np.ndarray | None:
    """numpy's view of a plain CPU tensor (no autograd, strided, a dtype numpy holds), else None.

    A small tensor is cheaper to copy, compare or hash through numpy: each torch call costs more
    than the work, and releases the GIL, which the dump worker's thread then takes for a while (the
    async role's one-sample entries make many such calls on both threads at once).
    """
    if (type(tensor) is not torch.Tensor or tensor.dtype not in _HOST_DTYPES or tensor.device.type != "cpu"
            or tensor.requires_grad or tensor.is_nested or tensor.layout is not torch.strided):
        return None
    return tensor.numpy()


def _small_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a small plain CPU integer tensor (None for any other: torch handles those)."""
    if tensor.dtype not in _NUMPY or tensor.numel() > SMALL_ELEMENTS:
        return None
    return host_view(tensor)


_DTYPES = {_name: getattr(torch, _name) for _name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
    "float32", "float64")}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def _dtype(name: Any, field: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` in ``data.json``; only the dtypes format 'safe' stores."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise CorruptEntryError(f"{TREE}: {field}: {str(name)[:40]!r} is not a dtype format 'safe' stores")
    return dtype


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """An integer view with the same bits (floats and bools), or the tensor itself."""
    target = _BITS.get(tensor.dtype)
    return tensor.view(target) if target is not None else tensor


def narrow(tensor: torch.Tensor) -> torch.Tensor:
    """The smallest integer dtype that holds ``tensor``'s values exactly (itself if none is smaller)."""
    if tensor.dtype not in _INTS or tensor.numel() == 0 or tensor.dtype in (torch.uint64, torch.uint32):
        return tensor
    array = _small_array(tensor)
    if array is not None:  # the same choice in numpy, for a fraction of torch's per-call cost
        narrowed = _narrow_small(array)
        return tensor if narrowed is array else torch.from_numpy(narrowed)
    # torch has no min/max for uint16 on CPU: its values fit int32 exactly
    low, high = (int(v) for v in torch.aminmax(tensor.to(torch.int32) if tensor.dtype == torch.uint16 else tensor))
    for dtype, smallest, largest in _NARROW_RANGES:
        if smallest <= low and high <= largest:
            if dtype.itemsize >= tensor.dtype.itemsize:
                return tensor
            return POOL.empty(tensor.shape, dtype).copy_(tensor)  # recycled pages: a dump's tensors are big
    return tensor


_NARROW_ARRAYS = [(np.dtype(_NUMPY[dtype]), smallest, largest) for dtype, smallest, largest in _NARROW_RANGES]


def _narrow_small(array: np.ndarray) -> np.ndarray:
    """:func:`narrow` of a small numpy integer array, in numpy (the array itself when nothing is smaller)."""
    if array.size == 0 or array.dtype.kind not in "iu" or array.dtype.itemsize == 1 or \
            array.dtype in (np.uint64, np.uint32):
        return array
    low, high = int(array.min()), int(array.max())
    for dtype, smallest, largest in _NARROW_ARRAYS:
        if smallest <= low and high <= largest:
            return array if dtype.itemsize >= array.dtype.itemsize else array.astype(dtype)
    return array


def _trim(bits: torch.Tensor) -> tuple[np.ndarray, ...] | None:
    """Split a [B, L] integer tensor into numpy arrays of (middle values, left counts, right counts,
    left values, right values)."""
    rows, width = bits.shape
    if rows == 0 or width < 2:
        return None
    a = np.ascontiguousarray(bits.numpy())
    return _trim_row(a.reshape(-1)) if rows == 1 else _trim_rows(a)


def _trim_row(row: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """:func:`_trim_rows` of a single row (the one-sample entries of the async role): the same parts
    from a handful of numpy calls instead of the row-vectorised ones."""
    width = row.shape[0]
    lval, rval = row[:1].copy(), row[-1:].copy()
    differs = row != lval[0]
    left = int(differs.argmax())
    if differs[left]:
        # a value other than the first exists, so one other than the last does too
        right = min(int((row[::-1] != rval[0]).argmax()), width - left)
    else:
        left, right = width, 0  # the whole row is one run
    if width - left - right > MIN_TRIM_GAIN * width:
        return None
    return (row[left:width - right].copy(), np.array([left], dtype=np.intp), np.array([right], dtype=np.intp),
            lval, rval)


def _trim_rows(a: np.ndarray) -> tuple[np.ndarray, ...] | None:
    """:func:`_trim` of a contiguous [B, L] array."""
    rows, width = a.shape
    index = np.arange(rows)
    lval, rval = a[:, 0].copy(), a[:, -1].copy()
    # numpy's bool argmax stops at each row's first True: a run costs one comparison pass, not four
    differs = a != lval[:, None]
    left = differs.argmax(1)
    left[~differs[index, left]] = width  # the whole row is one run
    differs = (a != rval[:, None])[:, ::-1]
    right = differs.argmax(1)
    right[~differs[index, right]] = width
    del differs
    right = np.minimum(right, width - left)
    kept = int((width - left - right).sum())
    if kept > MIN_TRIM_GAIN * rows * width:
        return None
    if width >= ROW_COPY_MIN_WIDTH:  # one slice per row, gathered by one C call
        middle = np.concatenate([a[i, l_count:width - r_count]
                                 for i, (l_count, r_count) in enumerate(zip(left.tolist(), right.tolist()))])
    else:  # narrow rows: a masked gather, whose cost does not grow with the row count
        columns = np.arange(width)
        middle = a[(columns >= left[:, None]) & (columns < (width - right)[:, None])]
    return middle, left, right, lval, rval


_TRIMMABLE = _INTS | set(_BITS)


def encode_tensor(tensor: torch.Tensor, add: Sink, inline: bool = False) -> dict[str, Any]:
    """The node of one dense tensor in its most compact exact encoding; ``add`` stores a part.

    With ``inline``, a trimmed tensor of at most :data:`INLINE_MAX_ROWS` rows keeps its run counts
    and run values in the node itself (readers before tree version 3 cannot read those nodes).
    """
    if tensor.dim() == 2 and tensor.dtype in _TRIMMABLE and (
            tensor.shape[0] <= INLINE_MAX_ROWS or tensor.numel() >= TRIM_MIN_ELEMENTS):
        parts = _trim(_bits(tensor))
        if parts is not None:
            values, left, right, lval, rval = parts
            stored = torch.from_numpy(_narrow_small(values)) if values.size <= SMALL_ELEMENTS else \
                narrow(torch.from_numpy(values))
            node: dict[str, Any] = {
                "kind": "tensor", "enc": "trim", "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape),
                "bits": _dtype_name(_BITS.get(tensor.dtype, tensor.dtype)), "values": add(stored),
            }
            if inline and len(left) <= INLINE_MAX_ROWS:
                node.update(left=left.tolist(), right=right.tolist(), lval=lval.tolist(), rval=rval.tolist())
            else:
                node.update({name: add(narrow(torch.from_numpy(part))) for name, part in (
                    ("left", left.astype(np.int32)), ("right", right.astype(np.int32)), ("lval", lval),
                    ("rval", rval))})
            return node
    narrowed = narrow(tensor)
    if narrowed is not tensor:
        return {"kind": "tensor", "enc": "narrow", "dtype": _dtype_name(tensor.dtype), "ref": add(narrowed)}
    return {"kind": "tensor", "ref": add(tensor)}


def decode_tensor(node: Mapping[str, Any], get: Source, sibling: Callable[[str], torch.Tensor] | None = None,
                  budget: DecodeBudget | None = None, field: str = "tensor") -> torch.Tensor:
    """Invert :func:`encode_tensor` (and ``concat`` nodes, whose parts come from ``sibling``).

    Every shape, width and count is checked against the parts actually stored, and every output is
    charged to ``budget`` before it is allocated.

    Raises:
        CorruptEntryError: a field that does not fit the stored parts, naming ``field``.
        DecodeLimitError: the output would exceed the budget.
    """
    budget = budget if budget is not None else DecodeBudget(1 << 62, "unbounded")
    enc = node.get("enc")
    if enc is None:
        return get(node["ref"])
    dtype = _dtype(node["dtype"], field)
    if enc == "narrow":
        stored = get(node["ref"])
        if stored.dtype not in _INTS or dtype not in _INTS:
            raise CorruptEntryError(f"{TREE}: {field}: narrowed {stored.dtype} cannot stand for {dtype}")
        budget.charge(stored.numel() * dtype.itemsize, TREE, field)
        return POOL.empty(stored.shape, dtype).copy_(stored)
    if enc == "concat":
        if sibling is None or not isinstance(node.get("parts"), list) or len(node["parts"]) != 2:
            raise CorruptEntryError(f"{TREE}: {field}: a concat node needs two sibling tensors")
        parts = [sibling(key) for key in node["parts"]]
        if any(p.is_nested or p.dim() != 2 or p.dtype != dtype or p.size(0) != parts[0].size(0) for p in parts):
            raise CorruptEntryError(f"{TREE}: {field}: concat parts {node['parts']!r} are not 2-D {dtype} tensors "
                                    "with the same rows")
        budget.charge(sum(p.numel() for p in parts) * dtype.itemsize, TREE, field)
        return torch.cat(parts, dim=1, out=POOL.empty((parts[0].size(0), parts[0].size(1) + parts[1].size(1)), dtype))
    if enc == "trim":
        if isinstance(node.get("left"), list):
            return _decode_inline_trim(node, get, dtype, budget, field)
        return _decode_trim(node, get, dtype, budget, field)
    raise CorruptEntryError(f"{TREE}: {field}: unknown tensor encoding {str(enc)[:40]!r}")


def _trim_header(node: Mapping[str, Any], dtype: torch.dtype, field: str) -> tuple[int, int, torch.dtype]:
    """``(rows, width, bits dtype)`` of a trim node, checked."""
    shape = shape_of(node["shape"], TREE, f"{field}.shape")
    if len(shape) != 2:
        raise CorruptEntryError(f"{TREE}: {field}.shape: a trimmed tensor is 2-D, not {list(shape)}")
    bits_dtype = _dtype(node["bits"], f"{field}.bits")
    if bits_dtype != _BITS.get(dtype, dtype):
        raise CorruptEntryError(f"{TREE}: {field}.bits: {bits_dtype} is not the bit pattern of {dtype}")
    return shape[0], shape[1], bits_dtype


_RANGES: dict[torch.dtype, tuple[int, int]] = {
    dtype: (int(np.iinfo(array_dtype).min), int(np.iinfo(array_dtype).max))  # type: ignore[type-var]
    for dtype, array_dtype in _NUMPY.items()}


def _inline_ints(node: Mapping[str, Any], name: str, rows: int, low: int, high: int, field: str) -> list[int]:
    """The inline list ``node[name]``: exactly ``rows`` plain integers in ``[low, high]``."""
    value = node.get(name)
    # plain ints only (bools, floats and anything else are damage): checked by C loops, not one by one
    if type(value) is list and len(value) == rows and (not value or (
            set(map(type, value)) == _INT_ONLY and min(value) >= low and max(value) <= high)):
        return value
    raise CorruptEntryError(f"{TREE}: {field}.{name}: {rows} inline integers in [{low}, {high}] are expected, "
                            f"not {str(value)[:60]!r}")


_INT_ONLY = {int}


def _decode_inline_trim(node: Mapping[str, Any], get: Source, dtype: torch.dtype, budget: DecodeBudget,
                        field: str) -> torch.Tensor:
    """A trimmed tensor of a few rows whose runs are inline in the node (tree version 3).

    Every inline field is checked as strictly as a stored part: plain integers, one per row, run
    lengths within the width, run values within the bit pattern's range (0 or 1 for bools).
    """
    rows, width, bits_dtype = _trim_header(node, dtype, field)
    if not 1 <= rows <= INLINE_MAX_ROWS:
        raise CorruptEntryError(f"{TREE}: {field}: inline runs are written for 1 to {INLINE_MAX_ROWS} rows, "
                                f"not {rows}")
    budget.charge(rows * width * dtype.itemsize, TREE, field)  # before anything is checked or allocated
    left = _inline_ints(node, "left", rows, 0, width, field)
    right = _inline_ints(node, "right", rows, 0, width, field)
    if any(l_count + r_count > width for l_count, r_count in zip(left, right)):
        raise CorruptEntryError(f"{TREE}: {field}: run lengths outside the row width {width}")
    low, high = (0, 1) if dtype == torch.bool else _RANGES[bits_dtype]
    lval = _inline_ints(node, "lval", rows, low, high, field)
    rval = _inline_ints(node, "rval", rows, low, high, field)
    stored = get(node["values"])
    if stored.is_nested or stored.dim() != 1 or stored.dtype not in _INTS:
        raise CorruptEntryError(f"{TREE}: {field}.values: a 1-D integer tensor is expected, "
                                f"not {stored.dtype} of shape {list(stored.shape)}")
    kept = rows * width - sum(left) - sum(right)
    if stored.numel() != kept:
        raise CorruptEntryError(f"{TREE}: {field}.values: {stored.numel()} values for {kept} kept positions")
    values = stored.numpy()
    if dtype == torch.bool and kept and (int(values.min()) < 0 or int(values.max()) > 1):
        raise CorruptEntryError(f"{TREE}: {field}.values: a bool tensor's values are 0 or 1")
    target = _NUMPY[bits_dtype]
    if rows == 1:  # one sample: the row's three slices, without the per-row loop
        out = np.empty((rows, width), dtype=target)
        row, middle = out[0], width - right[0]
        row[:left[0]] = lval[0]
        row[left[0]:middle] = values
        row[middle:] = rval[0]
    elif rows <= INLINE_ROW_WRITES_MAX:
        out = np.empty((rows, width), dtype=target)
        _fill_rows(out.reshape(-1), width, left, right, lval, rval, values)
    else:  # the run lists were range-checked: numpy holds them in these types exactly
        out = POOL.array((rows, width), target)
        runs = (np.array(left, dtype=np.int64), np.array(right, dtype=np.int64), np.array(lval, dtype=target),
                np.array(rval, dtype=target))
        if rows * width <= SMALL_FILL_ELEMENTS:
            budget.charge(2 * rows * width, TREE, field)  # its two masks
            _fill_small(out, width, *runs, values)
        else:
            budget.charge(rows * width + rows * _RUN_ROW_BYTES, TREE, field)  # a block's mask, its run arrays
            _fill_masked(out.reshape(-1), width, *runs, values, lambda n: budget.charge(n, TREE, field))
    result = torch.from_numpy(out)
    return result.view(dtype) if dtype in _BITS else result


#: What one row of a stored-run trim costs while it decodes, beyond its output and its mask: its runs
#: as int64 arrays (left, right, their sum, lval, rval, three run counts, the run pattern), the rows
#: whose runs hold their own values, and for a single row its runs as Python ints.
_RUN_ROW_BYTES = 5 * 8 + 4 * 36


def _decode_trim(node: Mapping[str, Any], get: Source, dtype: torch.dtype, budget: DecodeBudget,
                 field: str) -> torch.Tensor:
    rows, width, bits_dtype = _trim_header(node, dtype, field)
    parts = {name: get(node[name]) for name in ("left", "right", "lval", "rval", "values")}
    for name, part in parts.items():
        if part.is_nested or part.dim() != 1 or part.dtype not in _INTS:
            raise CorruptEntryError(f"{TREE}: {field}.{name}: a 1-D integer tensor is expected, "
                                    f"not {part.dtype} of shape {list(part.shape)}")
        if name != "values" and part.numel() != rows:
            raise CorruptEntryError(f"{TREE}: {field}.{name}: {part.numel()} values for {rows} rows")
    # the output and its one-byte mask of middles, and per row its runs widened and counted (int64
    # arrays, their sums, Python ints for a single row): charged before any of them exists
    budget.charge(rows * width * (dtype.itemsize + 1) + rows * _RUN_ROW_BYTES, TREE, field)
    left = parts["left"].numpy().astype(np.int64)
    right = parts["right"].numpy().astype(np.int64)
    if rows and not _runs_fit(left, right, width):
        raise CorruptEntryError(f"{TREE}: {field}: run lengths outside the row width {width}")
    values = parts["values"].numpy()
    kept = rows * width - int((left + right).sum())
    if values.size != kept:
        raise CorruptEntryError(f"{TREE}: {field}.values: {values.size} values for {kept} kept positions")
    target = _NUMPY[bits_dtype]
    if dtype == torch.bool and any(p.size and (int(p.min()) < 0 or int(p.max()) > 1)
                                   for p in (values, parts["lval"].numpy(), parts["rval"].numpy())):
        raise CorruptEntryError(f"{TREE}: {field}: a bool tensor's values are 0 or 1")  # any other byte is no bool
    lval, rval = parts["lval"].numpy().astype(target), parts["rval"].numpy().astype(target)
    out = POOL.array((rows, width), target)
    if rows == 1:  # an entry per sample: the row's three slices
        _fill_rows(out.reshape(-1), width, left.tolist(), right.tolist(), lval.tolist(), rval.tolist(), values)
    elif rows * width <= SMALL_FILL_ELEMENTS:
        budget.charge(2 * rows * width, TREE, field)  # its two extra masks
        _fill_small(out, width, left, right, lval, rval, values)
    elif rows:
        _fill_masked(out.reshape(-1), width, left, right, lval, rval, values, lambda n: budget.charge(
            n, TREE, field))
    result = torch.from_numpy(out)
    return result.view(dtype) if dtype in _BITS else result


def _runs_fit(left: Any, right: Any, width: int) -> bool:
    """Whether every row's two runs fit its width (``left``/``right``: non-empty int64 tensors or arrays).

    Each run is bounded by the width before any sum: stored lengths near 2**63 would otherwise
    wrap the int64 sum to a small (or negative) number and pass the check.
    """
    if int(left.min()) < 0 or int(right.min()) < 0 or int(left.max()) > width or int(right.max()) > width:
        return False
    return int((left + right).max()) <= width


def _fill_rows(flat: Any, width: int, left: list[int], right: list[int], lval: list[Any], rval: list[Any],
               values: Any) -> None:
    """Write each row of a trimmed tensor once: its left run, its middle values, its right run.

    Every output byte is written exactly once, by contiguous slice copies (numpy casts the narrowed
    values on the way): for a single row and the few rows of inline runs, where the numpy calls of
    :func:`_fill_masked` would cost more than these. The caller checked that the runs fit the width
    and the values fill the kept positions exactly.
    """
    start, taken = 0, 0
    for l_count, r_count, l_value, r_value in zip(left, right, lval, rval):
        middle = start + width - r_count
        kept = middle - start - l_count
        flat[start:start + l_count] = l_value
        flat[start + l_count:middle] = values[taken:taken + kept]
        flat[middle:start + width] = r_value
        start += width
        taken += kept


#: Trimmed tensors of at most this many elements are rebuilt by :func:`_fill_small`: a handful of
#: whole-tensor numpy calls, where :func:`_fill_masked`'s blocks and run patterns cost ~0.1 ms of fixed
#: work each (a debugging batch's tensors, where that fixed work was most of a hit). Its two extra
#: masks, one byte per element each, are charged to the decode budget.
SMALL_FILL_ELEMENTS = 1 << 16


def _columns(width: int) -> np.ndarray:
    """``arange(width)`` as a row of the narrowest signed type that holds ``width``, kept per width
    (a batch's tensors share a few widths): comparing narrow integers costs a fraction of int64's."""
    columns = _COLUMNS.get(width)
    if columns is None:
        columns = np.arange(width, dtype=_index_type(width))[None, :]
        columns.flags.writeable = False
        if len(_COLUMNS) < 64:
            _COLUMNS[width] = columns
    return columns


def _index_type(width: int) -> type[np.signedinteger[Any]]:
    return np.int16 if width < 1 << 15 else np.int32 if width < 1 << 31 else np.int64


_COLUMNS: dict[int, np.ndarray] = {}


def _fill_small(out: np.ndarray, width: int, left: np.ndarray, right: np.ndarray, lval: np.ndarray,
                rval: np.ndarray, values: np.ndarray) -> None:
    """Write a small trimmed [rows, width] tensor: each row's left value everywhere, its right value
    from its right run on (a pass left out when every row's two run values agree, as a mask's zeros
    do), then the middles by one mask. The caller checked the runs and values (as for
    :func:`_fill_masked`): they fit the width, so they fit :func:`_columns`' type."""
    columns = _columns(width)
    index = columns.dtype
    right_start = (width - right).astype(index)[:, None]
    out[...] = lval[:, None]
    if not np.array_equal(lval, rval):
        np.copyto(out, rval[:, None], where=columns >= right_start)
    keep = columns >= left.astype(index)[:, None]
    keep &= columns < right_start
    out[keep] = values


#: Run patterns of a trimmed row, as :func:`_fill_masked` spells them: its left run, its middle, its right run.
_MIDDLE = np.array([False, True, False])
#: :func:`_fill_masked` masks at most this many output elements at a time (a block of whole rows), so
#: that its mask takes a few MiB beside the output, however large the tensor.
_MASK_ELEMENTS = 1 << 20
#: :func:`_fill_masked` writes rows whose runs hold their own values one by one while there are at
#: most one per this many output elements (a few slice writes cost about what a masked pass over
#: this many elements does); more, and it writes every run by a second masked pass.
_ODD_RUN_ELEMENTS = 512


def _fill_masked(flat: np.ndarray, width: int, left: np.ndarray, right: np.ndarray, lval: np.ndarray,
                 rval: np.ndarray, values: np.ndarray, charge: Callable[[int], None]) -> None:
    """Write a trimmed tensor of many rows, a block of rows at a time: one fill with the common run
    value, one masked copy of the middles, then the runs of the rows whose run values differ
    (position ids' right runs).

    Every call is one numpy operation over a block, which releases the GIL: the codec pool rebuilds a
    hit's tensors side by side, where per-row slice writes (:func:`_fill_rows`) hold the GIL for a few
    microseconds each and the pool's threads would take turns. The mask is one byte per element of a
    block of at most :data:`_MASK_ELEMENTS` (charged by the caller per element of the whole output).
    ``left``/``right`` are int64 arrays the caller checked (the runs fit the width, the values fill
    the middles); ``lval``/``rval`` are of ``flat``'s dtype. ``charge`` is given the bytes of the run
    values listed out when a block's second masked pass needs them.
    """
    rows = left.size
    kept = width - left - right
    block = max(1, _MASK_ELEMENTS // max(1, width))
    taken = 0
    for first in range(0, rows, block):
        last = min(rows, first + block)
        count = int(kept[first:last].sum())
        _fill_block(flat[first * width:last * width], width, left[first:last], right[first:last], kept[first:last],
                    lval[first:last], rval[first:last], values[taken:taken + count], charge)
        taken += count


def _fill_block(flat: np.ndarray, width: int, left: np.ndarray, right: np.ndarray, kept: np.ndarray,
                lval: np.ndarray, rval: np.ndarray, values: np.ndarray, charge: Callable[[int], None]) -> None:
    """:func:`_fill_masked` of one block of rows (``kept``: each row's middle length)."""
    rows = left.size
    counts = np.empty((rows, 3), dtype=np.int64)
    counts[:, 0], counts[:, 1], counts[:, 2] = left, kept, right
    keep = np.repeat(np.tile(_MIDDLE, rows), counts.reshape(-1))
    common = lval[0]
    odd = np.flatnonzero(((lval != common) & (left > 0)) | ((rval != common) & (right > 0)))
    if odd.size * _ODD_RUN_ELEMENTS > flat.size:  # many rows with runs of their own: the runs by a mask too
        charge((flat.size - values.size) * flat.itemsize)
        flat[keep] = values
        np.logical_not(keep, out=keep)
        flat[keep] = np.repeat(np.stack([lval, rval], axis=1).reshape(-1), counts[:, ::2].reshape(-1))
        return
    flat.fill(common)
    flat[keep] = values
    for i, l_count, r_count in zip(odd.tolist(), left[odd].tolist(), right[odd].tolist()):
        start = i * width
        flat[start:start + l_count] = lval[i]
        flat[start + width - r_count:start + width] = rval[i]


#: (key, rows, width, dtype) of every candidate tensor -> the checks :func:`find_concat` makes for it.
_CONCAT_PLANS: dict[tuple[tuple[str, int, int, torch.dtype], ...], tuple[tuple[str, str, tuple[str, ...]], ...]] = {}
_CONCAT_PLANS_MAX = 256
_Kind = tuple[int, int, torch.dtype]


def _concat_plan(kinds: dict[str, _Kind]) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """Every ``(whole, left, rights)`` a concatenation could be by shape and dtype alone, in search order:
    ``left`` as wide as ``whole``'s first columns, each of ``rights`` as wide as the rest."""
    plan = []
    for key, (rows, width, dtype) in kinds.items():
        for a_key, (a_rows, a_width, a_dtype) in kinds.items():
            rest = width - a_width
            if rest <= 0 or a_rows != rows or a_dtype != dtype or a_key == key:
                continue
            others = tuple(k for k, kind in kinds.items() if kind == (rows, rest, dtype) and k not in (key, a_key))
            if others:
                plan.append((key, a_key, others))
    return tuple(plan)


def find_concat(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Map each 2-D integer tensor equal to two siblings side by side to those siblings' keys.

    A sibling used as a part is never itself stored as a concatenation, so parts always decode
    on their own. Which pairs could match depends on shapes and dtypes alone: that plan is kept per
    set of shapes (the one-sample entries of the async role all have one), and only values are
    compared per call.
    """
    two_d = {k: t for k, t in tensors.items() if t.dim() == 2 and t.dtype in _INTS and not t.is_nested}
    signature = tuple((k, t.shape[0], t.shape[1], t.dtype) for k, t in two_d.items())
    plan = _CONCAT_PLANS.get(signature)
    if plan is None:
        plan = _concat_plan({k: (rows, width, dtype) for k, rows, width, dtype in signature})
        if len(_CONCAT_PLANS) < _CONCAT_PLANS_MAX:
            _CONCAT_PLANS[signature] = plan
    found: dict[str, list[str]] = {}
    if not plan:
        return found
    arrays: dict[str, np.ndarray | None] = {}

    def array(key: str) -> np.ndarray | None:
        if key not in arrays:
            arrays[key] = _small_array(two_d[key])
        return arrays[key]

    parts: set[str] = set()
    for key, a_key, candidates in plan:
        if key in parts or key in found or a_key in found:
            continue
        # the shapes first: comparing values costs more than looking for a sibling that could match
        others = [k for k in candidates if k not in found]
        whole, a_width = two_d[key], two_d[a_key].shape[1]
        if not others or not _equal(whole, array(key), two_d[a_key], array(a_key), 0, a_width):
            continue
        width = whole.shape[1]
        b_key = next((k for k in others if _equal(whole, array(key), two_d[k], array(k), a_width, width)), None)
        if b_key is not None:
            found[key] = [a_key, b_key]
            parts.update((a_key, b_key))
    return found


def _equal(whole: torch.Tensor, whole_array: np.ndarray | None, part: torch.Tensor, part_array: np.ndarray | None,
           start: int, stop: int) -> bool:
    """Whether columns ``start:stop`` of ``whole`` equal ``part`` (same shape): in numpy when both are small,
    where one torch call costs more than the comparison."""
    if whole_array is not None and part_array is not None:
        if whole_array.size and whole_array[0, start] != part_array[0, 0]:
            return False  # most candidates differ at once: a scalar look before a pass over every value
        return bool((whole_array[:, start:stop] == part_array).all())
    return torch.equal(whole[:, start:stop], part)


ZSTD_MIN_BYTES = 1 << 16
ZSTD_MAX_RATIO = 0.5  # keep a tensor zstd-compressed only when that halves it: decompression costs load time


def pack(tensor: torch.Tensor, mode: str) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """Compress one stored tensor with zstd when ``mode`` asks for it and it pays.

    Returns the tensor to store and, when compressed, the info :func:`unpack` needs.
    """
    if mode == "none" or tensor.numel() * tensor.element_size() < ZSTD_MIN_BYTES:
        return tensor, None
    contiguous = tensor.contiguous()
    # the tensor's own bytes, not a copy: zstd reads any buffer, and a sample may show it is not worth it
    raw = (contiguous.view(torch.uint8) if tensor.dtype != torch.bool else contiguous).numpy().data.cast("B")
    if mode == "auto" and len(raw) > 4 * _SAMPLE_BYTES:
        middle = len(raw) // 2
        sample = raw[middle - _SAMPLE_BYTES // 2: middle + _SAMPLE_BYTES // 2]
        if len(compress_bytes(sample)) > (ZSTD_MAX_RATIO + 0.1) * len(sample):
            return tensor, None  # a sample shows it will not halve: skip compressing the whole
    packed = compress_bytes(raw)
    if mode == "auto" and len(packed) > ZSTD_MAX_RATIO * len(raw):
        return tensor, None
    info = {"codec": "zstd", "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8), info


def unpack(stored: torch.Tensor, info: Mapping[str, Any], budget: DecodeBudget | None = None,
           field: str = "packed") -> torch.Tensor:
    """Invert :func:`pack`, decompressing straight into the output tensor (no intermediate copy).

    The zstd frame must declare exactly the output's size; decompression never writes past it.

    Raises:
        CorruptEntryError: the info or the frame do not match, naming ``field``.
        DecodeLimitError: the output would exceed the budget.
    """
    import zstandard

    if not isinstance(info, Mapping) or info.get("codec") != "zstd":
        raise CorruptEntryError(f"{TREE}: {field}: unknown packing {str(info)[:60]!r}")
    dtype = _dtype(info["dtype"], f"{field}.dtype")
    budget = budget if budget is not None else DecodeBudget(1 << 62, "unbounded")
    shape = budget.tensor(info["shape"], dtype.itemsize, TREE, field)
    expected = math.prod(shape) * dtype.itemsize
    if stored.dtype != torch.uint8 or stored.dim() != 1:
        raise CorruptEntryError(f"{TREE}: {field}: a zstd frame is stored as 1-D uint8, not {stored.dtype}")
    frame = stored.numpy().data
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as err:
        raise CorruptEntryError(f"{TREE}: {field}: not a zstd frame: {err}") from err
    if declared != expected:  # our writer always records the content size
        raise CorruptEntryError(f"{TREE}: {field}: the zstd frame holds {declared} bytes, not the {expected} of "
                                f"{list(shape)} {dtype}")
    out = POOL.empty(shape, dtype)
    target = (out.view(torch.uint8).numpy() if out.dtype != torch.bool else out.numpy()).data.cast("B")
    # the window is at most the content size: a frame cannot make zstd allocate more than its output
    decompressor = zstandard.ZstdDecompressor(max_window_size=max(1 << 10, min(1 << 27, _pow2_at_least(expected))))
    try:
        with decompressor.stream_reader(frame) as reader:
            filled = 0
            while filled < len(target):
                count = reader.readinto(target[filled:])
                if not count:
                    raise TruncatedEntryError(f"{TREE}: {field}: the zstd stream ended after {filled} of "
                                              f"{len(target)} bytes")
                filled += count
    except zstandard.ZstdError as err:
        raise CorruptEntryError(f"{TREE}: {field}: damaged zstd frame: {err}") from err
    return out


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def compress_bytes(data: bytes | memoryview) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
