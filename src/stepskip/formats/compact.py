"""Lossless compact encodings of rollout tensors, chosen per tensor.

Rollout batches are mostly padding: prompts padded on the left, responses on the right, masks
that are runs of 0 and 1, position ids that stop counting in the padding, int64 token ids that
fit in 32 bits, and ``input_ids`` that repeat ``prompts`` next to ``responses``. Three encodings
exploit that, each exact to the bit (floats are compared through their integer bit patterns, so
``-0.0`` and NaN payloads survive):

- ``trim``: per row, the run of the row's first value at its start and the run of its last value
  at its end are stored as counts and values; only the middle is kept.
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
from stepskip.formats.bounds import DecodeBudget, shape_of
from stepskip.formats.pages import POOL

__all__ = ["encode_tensor", "decode_tensor", "find_concat", "narrow", "pack", "unpack", "compress_bytes"]

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16, torch.bool: torch.uint8}
_NARROW = (torch.uint8, torch.int8, torch.int16, torch.int32)
_INTS = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64}
MIN_TRIM_GAIN = 0.9  # trim only when it keeps at most this share of the elements
ZSTD_LEVEL = 1  # decompression speed barely depends on the level; compression does
_SAMPLE_BYTES = 1 << 18
#: Trimmed rows at least this wide are rebuilt row by row (each output byte written once, a few
#: slice copies per row); narrower ones with vectorised masks, so that the Python work per output
#: element stays bounded whatever shape an entry declares.
ROW_COPY_MIN_WIDTH = 256

TREE = "data.json"  # the file whose fields the decoders check (error messages name it)
Sink = Callable[[torch.Tensor], str]
Source = Callable[[str], torch.Tensor]


#: Tensors of at most this many elements are narrowed through numpy: for a small tensor, each
#: torch call costs more than the work it does (one-sample entries of the async role).
SMALL_ELEMENTS = 1 << 16
_NARROW_RANGES = [(dtype, torch.iinfo(dtype).min, torch.iinfo(dtype).max) for dtype in _NARROW]
_NUMPY = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}


def _small_array(tensor: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a small plain CPU integer tensor (None for any other: torch handles those)."""
    if (tensor.dtype not in _NUMPY or tensor.numel() > SMALL_ELEMENTS or tensor.device.type != "cpu"
            or tensor.requires_grad or tensor.is_nested or tensor.layout is not torch.strided):
        return None
    return tensor.numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPES = {_name: getattr(torch, _name) for _name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
    "float32", "float64")}


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
        low, high = int(array.min()), int(array.max())
    else:  # torch has no min/max for uint16 on CPU: its values fit int32 exactly
        low, high = (int(v) for v in torch.aminmax(tensor.to(torch.int32) if tensor.dtype == torch.uint16 else tensor))
    for dtype, smallest, largest in _NARROW_RANGES:
        if smallest <= low and high <= largest:
            if dtype.itemsize >= tensor.dtype.itemsize:
                return tensor
            return torch.from_numpy(array.astype(_NUMPY[dtype])) if array is not None else tensor.to(dtype)
    return tensor


def _trim(bits: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Split a [B, L] integer tensor into (middle values, left counts, right counts, left values, right values)."""
    rows, width = bits.shape
    if rows == 0 or width < 2:
        return None
    a = np.ascontiguousarray(bits.numpy())
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
    return (torch.from_numpy(middle), torch.from_numpy(left.astype(np.int32)), torch.from_numpy(right.astype(np.int32)),
            torch.from_numpy(lval), torch.from_numpy(rval))


def encode_tensor(tensor: torch.Tensor, add: Sink) -> dict[str, Any]:
    """The node of one dense tensor in its most compact exact encoding; ``add`` stores a part."""
    if tensor.dim() == 2 and tensor.dtype in _INTS | set(_BITS):
        parts = _trim(_bits(tensor))
        if parts is not None:
            values, left, right, lval, rval = parts
            return {
                "kind": "tensor", "enc": "trim", "dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape),
                "bits": _dtype_name(values.dtype),
                "values": add(narrow(values)), "left": add(narrow(left)), "right": add(narrow(right)),
                "lval": add(narrow(lval)), "rval": add(narrow(rval)),
            }
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
        return _decode_trim(node, get, dtype, budget, field)
    raise CorruptEntryError(f"{TREE}: {field}: unknown tensor encoding {str(enc)[:40]!r}")


def _decode_trim(node: Mapping[str, Any], get: Source, dtype: torch.dtype, budget: DecodeBudget,
                 field: str) -> torch.Tensor:
    shape = shape_of(node["shape"], TREE, f"{field}.shape")
    if len(shape) != 2:
        raise CorruptEntryError(f"{TREE}: {field}.shape: a trimmed tensor is 2-D, not {list(shape)}")
    rows, width = shape
    bits_dtype = _dtype(node["bits"], f"{field}.bits")
    if bits_dtype != _BITS.get(dtype, dtype):
        raise CorruptEntryError(f"{TREE}: {field}.bits: {bits_dtype} is not the bit pattern of {dtype}")
    parts = {name: get(node[name]) for name in ("left", "right", "lval", "rval", "values")}
    for name, part in parts.items():
        if part.is_nested or part.dim() != 1 or part.dtype not in _INTS | {torch.uint8}:
            raise CorruptEntryError(f"{TREE}: {field}.{name}: a 1-D integer tensor is expected, "
                                    f"not {part.dtype} of shape {list(part.shape)}")
        if name != "values" and part.numel() != rows:
            raise CorruptEntryError(f"{TREE}: {field}.{name}: {part.numel()} values for {rows} rows")
    # the output, the two run masks and the column index, charged before any of them exists
    budget.charge(rows * width * (dtype.itemsize + 2) + width * 8, TREE, field)
    left = parts["left"].numpy().astype(np.int64)
    right = parts["right"].numpy().astype(np.int64)
    if rows and not _runs_fit(left, right, width):
        raise CorruptEntryError(f"{TREE}: {field}: run lengths outside the row width {width}")
    values = parts["values"].numpy()
    kept = rows * width - int((left + right).sum())
    if values.size != kept:
        raise CorruptEntryError(f"{TREE}: {field}.values: {values.size} values for {kept} kept positions")
    target = _NUMPY[bits_dtype]
    lval, rval = parts["lval"].numpy().astype(target), parts["rval"].numpy().astype(target)
    if rows == 1 or width >= ROW_COPY_MIN_WIDTH:  # each row by slices (one row: an entry per sample)
        out = POOL.array((rows, width), target)
        if rows:
            _fill_rows(out.reshape(-1), width, left.tolist(), right.tolist(), lval.tolist(), rval.tolist(), values)
    else:  # narrow rows: per-row Python work would dominate, so the vectorised rebuild
        columns = np.arange(width)
        in_left = columns < left[:, None]
        out = np.where(in_left, lval[:, None], rval[:, None])
        if values.size:  # masks are all runs: nothing in the middle
            keep = np.logical_not(in_left, out=in_left)  # reuse the buffer: peak memory matters on load
            keep &= columns < (width - right)[:, None]
            out[keep] = values
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
    values on the way); a vectorised where-then-mask rebuild writes the output twice and builds
    two row-by-width masks, several times slower for rollout-sized tensors. The caller checked that
    the runs fit the width and the values fill the kept positions exactly.
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


def find_concat(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Map each 2-D integer tensor equal to two siblings side by side to those siblings' keys.

    A sibling used as a part is never itself stored as a concatenation, so parts always decode
    on their own.
    """
    two_d = {k: t for k, t in tensors.items() if t.dim() == 2 and t.dtype in _INTS and not t.is_nested}
    found: dict[str, list[str]] = {}
    parts: set[str] = set()
    for key, whole in two_d.items():
        if key in parts:
            continue
        for a_key, a in two_d.items():
            if a_key == key or a_key in found or a.shape[0] != whole.shape[0] or a.dtype != whole.dtype:
                continue
            rest = whole.shape[1] - a.shape[1]
            if rest <= 0 or not torch.equal(whole[:, : a.shape[1]], a):
                continue
            b_key = next((k for k, b in two_d.items() if k not in (key, a_key) and k not in found
                          and b.shape == (whole.shape[0], rest) and b.dtype == whole.dtype
                          and torch.equal(whole[:, a.shape[1]:], b)), None)
            if b_key is not None:
                found[key] = [a_key, b_key]
                parts.update((a_key, b_key))
                break
    return found


ZSTD_MIN_BYTES = 1 << 16
ZSTD_MAX_RATIO = 0.5  # keep a tensor zstd-compressed only when that halves it: decompression costs load time


def pack(tensor: torch.Tensor, mode: str) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """Compress one stored tensor with zstd when ``mode`` asks for it and it pays.

    Returns the tensor to store and, when compressed, the info :func:`unpack` needs.
    """
    if mode == "none" or tensor.numel() * tensor.element_size() < ZSTD_MIN_BYTES:
        return tensor, None
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.dtype != torch.bool else \
        tensor.contiguous().numpy().tobytes()
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


def compress_bytes(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
