"""Loading a safetensors file that lies in a buffer of recycled pages.

``safetensors.torch.load`` takes ``bytes`` and copies every tensor into a fresh ``bytes`` object:
for the big tensor file of a hit, both buffers are new pages, each faulted in on first write.
:func:`load_view` reads the same layout from a memoryview (the store reads big files into
recycled pages, :mod:`stepskip._formats.pages`) and copies each tensor into recycled pages too, or,
for a reader that widens or decompresses the tensors on anyway, hands them out as views of the
buffer (``views``), saving a copy of the file.

The header is data someone else may have written: every field is checked before it is used,
and the tensors' byte ranges must lie inside the data and must not overlap, so the tensors
together never take more memory than the file holds.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
import torch

from stepskip.errors import CorruptEntryError
from stepskip._formats.pages import POOL
from stepskip._formats.st_small import SAFETENSORS_CODES

__all__ = ["load_view"]

_DTYPES = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}  # safetensors' dtype codes, read back
_MAX_HEADER = 100 << 20  # safetensors' own limit
#: A view's numpy type by element width: the integer type of that width (numpy has no bfloat16)
_BY_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def load_view(data: memoryview, file: str = "data.safetensors",
              views: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, each in memory of its own unless ``views`` is given.

    Given a set as ``views``, each tensor whose bytes lie in a writable ``data`` at an address
    aligned for its dtype views ``data`` instead, and its name is added to ``views``: for a reader
    that copies such tensors on anyway (widening, decompressing) and gives its caller only copies.
    A view holds ``data`` (numpy keeps a reference to it): ``data`` must not be released while a
    view lives.

    Raises:
        CorruptEntryError: the header is not a safetensors header, or a tensor's dtype, shape or
            byte range does not fit the data (the message names the file and the tensor).

    Example:
        >>> from safetensors.torch import save
        >>> load_view(memoryview(save({"x": torch.arange(3)})))["x"].tolist()
        [0, 1, 2]
    """
    if len(data) < 8:
        raise CorruptEntryError(f"{file}: {len(data)} bytes, too short for a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(_MAX_HEADER, len(data) - 8):
        raise CorruptEntryError(f"{file}: a header of {size} bytes in a file of {len(data)}")
    try:
        header = json.loads(bytes(data[8:8 + size]))
    except (UnicodeDecodeError, ValueError) as err:
        raise CorruptEntryError(f"{file}: the header is not JSON: {err}") from None
    except RecursionError:
        raise CorruptEntryError(f"{file}: the header nests too deep to be a safetensors header") from None
    if not isinstance(header, dict):
        raise CorruptEntryError(f"{file}: the header is not a JSON object")
    start, length = 8 + size, len(data) - 8 - size
    layout = sorted((_check(name, info, length, file) + (name,) for name, info in header.items()
                     if name != "__metadata__"), key=lambda item: (item[2], item[3]))
    for (_, _, _, end, name), (_, _, begin, _, other) in zip(layout, layout[1:]):
        if begin < end:
            raise CorruptEntryError(f"{file}: the bytes of {other[:40]!r} overlap those of {name[:40]!r}")
    source = np.frombuffer(data, dtype=np.uint8)
    base = source.ctypes.data + start  # the address of the data's first byte
    out: dict[str, torch.Tensor] = {}
    for dtype, shape, begin, end, name in layout:
        if views is not None and end > begin and (base + begin) % dtype.itemsize == 0 and not data.readonly:
            out[name] = _view(source[start + begin:start + end], dtype, shape)
            views.add(name)
            continue
        tensor = POOL.empty(shape, dtype)
        if end > begin:  # numpy copies the bytes (torch has no numpy view of bfloat16)
            flat = tensor.reshape(-1)
            (flat if dtype == torch.bool else flat.view(torch.uint8)).numpy()[:] = source[start + begin:start + end]
        out[name] = tensor
    return out


def _view(raw: np.ndarray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The bytes ``raw`` as a tensor of ``dtype`` and ``shape``, sharing their memory."""
    if dtype == torch.bool:
        return torch.from_numpy(raw.view(np.bool_)).reshape(shape)
    return torch.from_numpy(raw.view(_BY_WIDTH[dtype.itemsize])).view(dtype).reshape(shape)


def _check(name: str, info: Any, length: int, file: str) -> tuple[torch.dtype, list[int], int, int]:
    where = f"{file}: tensor {name[:40]!r}"
    if not isinstance(info, dict):
        raise CorruptEntryError(f"{where}: its header entry is not an object")
    code = info.get("dtype")
    dtype = _DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CorruptEntryError(f"{where}: dtype {str(code)[:20]!r} is not a safetensors dtype")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    # each size below 2**62: a shape holding a 0 may list any others, and torch overflows past 2**63
    if (not isinstance(shape, list) or len(shape) > 64
            or not all(type(d) is int and 0 <= d < 1 << 62 for d in shape)
            or math.prod(d for d in shape if d) >= 1 << 62):
        raise CorruptEntryError(f"{where}: shape {str(shape)[:60]} is not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= length):
        raise CorruptEntryError(f"{where}: data_offsets {str(offsets)[:60]} are not a range inside its "
                                f"{length} bytes of data")
    if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
        raise CorruptEntryError(f"{where}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
    return dtype, shape, offsets[0], offsets[1]
