"""The safetensors file of a few small tensors, written without safetensors' per-tensor overhead.

``safetensors.torch.save`` spends tens of microseconds per tensor in Python (shared-storage
checks, a numpy view, a ctypes copy) before its serializer runs: for the thirty-odd parts of a
one-sample entry that is most of its encoding time. :func:`save_small` writes the same bytes
(the header laid out as safetensors lays it out: tensors by descending dtype, then by name;
compact JSON padded with spaces to 8 bytes), so files are identical whichever wrote them and any
safetensors reader loads them. It returns None for anything outside the plain case; the caller
then uses safetensors itself.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Mapping

import torch

__all__ = ["save_small", "SMALL_BYTES", "SAFETENSORS_CODES"]

#: Dicts of tensors holding more than this are left to safetensors (its overhead no longer matters).
SMALL_BYTES = 1 << 20

# safetensors' dtype codes, in the order its serializer lays tensors out (descending dtype)
SAFETENSORS_CODES = {
    torch.uint64: "U64", torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.uint32: "U32",
    torch.int32: "I32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint16: "U16", torch.int16: "I16",
    torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_RANK = {dtype: rank for rank, dtype in enumerate(SAFETENSORS_CODES)}
_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64}
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,200}")  # JSON-encoded the same by every encoder


def save_small(tensors: Mapping[str, torch.Tensor]) -> bytes | None:
    """The bytes ``safetensors.torch.save(tensors)`` writes, or None when ``tensors`` is not small
    and plain (CPU, strided, a dtype listed above, names of letters, digits and ``_.-``).

    Example:
        >>> import torch
        >>> from safetensors.torch import save
        >>> t = {"a": torch.arange(3), "b": torch.ones(2, dtype=torch.bool)}
        >>> save_small(t) == save(t)
        True
    """
    if sys.byteorder != "little":  # safetensors stores little-endian: let it swap the bytes
        return None
    total = 0
    for name, tensor in tensors.items():
        if (not isinstance(tensor, torch.Tensor) or tensor.dtype not in SAFETENSORS_CODES or tensor.device.type != "cpu"
                or tensor.layout is not torch.strided or tensor.is_nested or not _PLAIN_NAME.fullmatch(name)):
            return None
        total += tensor.numel() * tensor.element_size()
        if total > SMALL_BYTES:
            return None
    header: dict[str, dict[str, object]] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(tensors, key=lambda n: (_RANK[tensors[n].dtype], n)):
        tensor = tensors[name]
        if tensor.dtype in _NUMPY_DTYPES:  # numpy writes any layout in C order
            data = tensor.detach().numpy().tobytes()
        else:  # bfloat16 and the wide unsigned types: their bytes through a uint8 view
            flat = tensor.detach().reshape(-1)
            if flat.stride(0) != 1:  # e.g. a one-element view with stride 0: a dense copy
                flat = flat.new_empty(flat.shape).copy_(flat)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        header[name] = {"dtype": SAFETENSORS_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        chunks.append(data)
    text = json.dumps(header, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)
