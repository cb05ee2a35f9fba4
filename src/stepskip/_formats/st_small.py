"""The safetensors file of a dict of tensors, written by stepskip itself in safetensors' own layout.

``safetensors.torch.save`` spends tens of microseconds per tensor in Python (shared-storage
checks, a numpy view, a ctypes copy) before its serializer runs: for the thirty-odd parts of a
one-sample entry that is most of its encoding time. And for a big entry it returns a fresh
``bytes`` of the whole file: on a virtual machine each fresh page costs a fault in the guest and
one in the host, so building a 40 MB file in new memory takes longer than copying the bytes.

:func:`save_small` writes the same bytes for a few small tensors; :func:`save_pooled` writes them
for big ones into memory recycled by :data:`~stepskip._formats.pages.POOL` (the pages go back to
the pool when the returned view is dropped, after the store wrote them). Both lay the header out
as safetensors does (tensors by descending dtype, then by name; compact JSON padded with spaces
to 8 bytes), so files are identical whichever wrote them and any safetensors reader loads them.
They return None for anything outside the plain case; the caller then uses safetensors itself.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from collections.abc import Mapping

import numpy as np
import torch

from stepskip._formats.pages import POOL

__all__ = ["save_small", "save_pooled", "SMALL_BYTES", "SAFETENSORS_CODES"]

#: Dicts of tensors holding more than this are left to :func:`save_pooled` (or safetensors).
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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _plain(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor is one these writers store (CPU, strided, a listed dtype, a plain name)."""
    return sys.byteorder == "little" and all(  # safetensors stores little-endian: let it swap the bytes
        isinstance(tensor, torch.Tensor) and tensor.dtype in SAFETENSORS_CODES and tensor.device.type == "cpu"
        and tensor.layout is torch.strided and not tensor.is_nested and _PLAIN_NAME.fullmatch(name)
        for name, tensor in tensors.items())


def _layout(tensors: Mapping[str, torch.Tensor]) -> tuple[list[str], dict[str, tuple[int, int]], bytes]:
    """The names in file order, each one's byte range after the header, and the header (length prefix included)."""
    order = sorted(tensors, key=lambda n: (_RANK[tensors[n].dtype], n))
    header: dict[str, dict[str, object]] = {}
    spans: dict[str, tuple[int, int]] = {}
    offset = 0
    for name in order:
        tensor = tensors[name]
        spans[name] = (offset, offset + _nbytes(tensor))
        header[name] = {"dtype": SAFETENSORS_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": list(spans[name])}
        offset = spans[name][1]
    text = json.dumps(header, separators=(",", ":")).encode("ascii")
    text += b" " * (-len(text) % 8)
    return order, spans, struct.pack("<Q", len(text)) + text


def save_small(tensors: Mapping[str, torch.Tensor]) -> bytes | None:
    """The bytes ``safetensors.torch.save(tensors)`` writes, or None when ``tensors`` is not small
    (at most :data:`SMALL_BYTES`) and plain (CPU, strided, a dtype listed above, names of letters,
    digits and ``_.-``).

    Example:
        >>> import torch
        >>> from safetensors.torch import save
        >>> t = {"a": torch.arange(3), "b": torch.ones(2, dtype=torch.bool)}
        >>> save_small(t) == save(t)
        True
    """
    if sum(_nbytes(t) for t in tensors.values() if isinstance(t, torch.Tensor)) > SMALL_BYTES or not _plain(tensors):
        return None
    order, _, header = _layout(tensors)
    chunks: list[bytes] = [header]
    for name in order:
        tensor = tensors[name]
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.dtype in _NUMPY_DTYPES:  # numpy writes any layout in C order
            chunks.append(tensor.numpy().tobytes())
        else:  # bfloat16 and the wide unsigned types: their bytes through a uint8 view
            flat = tensor.reshape(-1)
            if flat.stride(0) != 1:  # e.g. a one-element view with stride 0: a dense copy
                flat = flat.new_empty(flat.shape).copy_(flat)
            chunks.append(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return b"".join(chunks)


def save_pooled(tensors: Mapping[str, torch.Tensor]) -> memoryview | None:
    """The bytes ``safetensors.torch.save(tensors)`` writes, in recycled memory, or None when
    ``tensors`` is not plain (see :func:`save_small`).

    The returned view keeps its pages until it is dropped (the store has written it by then); they
    then serve the next file or a hit's tensors. Callers only read it.

    Example:
        >>> import torch
        >>> from safetensors.torch import load
        >>> load(bytes(save_pooled({"ids": torch.arange(4)})))["ids"].tolist()
        [0, 1, 2, 3]
    """
    if not _plain(tensors):
        return None
    order, spans, header = _layout(tensors)
    start = len(header)
    out = POOL.array((start + sum(_nbytes(t) for t in tensors.values()),), np.uint8)
    out[:start] = np.frombuffer(header, dtype=np.uint8)
    body = torch.from_numpy(out[start:])
    for name in order:
        tensor, (begin, end) = tensors[name].detach(), spans[name]
        if end > begin:  # torch copies any layout in C order, releasing the GIL for big ones
            body[begin:end].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return out.data  # a memoryview of the pooled array, which it keeps alive
