"""What every decoder checks before it allocates: a cache is data someone else may have written.

The rule, in one place (docs/sharing.md quotes it): **a decode never allocates more than
``DECODE_RATIO`` (256) times the entry's size on disk plus ``DECODE_FLOOR`` (256 MiB), or
``max_decode_bytes`` when that is set.** Every tensor, array and decompression buffer a decoder
builds is charged to a :class:`DecodeBudget` *before* it is allocated, from shapes and widths
checked against what the entry's files hold; parsing ``data.json`` itself costs a small multiple
of its size and is not charged. Real rollouts decode to about 10-20 times their size on disk
(padding is stored as run lengths); the floor covers small, mostly-padding entries.

The structural checks shared by the decoders live here too: jagged offsets (:func:`jagged_problem`),
TensorDicts loaded by ``torch.load`` (:func:`check_loaded`) and the torch zip container
(:func:`check_torch_zip`).
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import threading
import zipfile
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from stepskip.errors import CorruptEntryError, DecodeLimitError

__all__ = [
    "DECODE_RATIO", "DECODE_FLOOR", "DecodeBudget", "jagged_problem", "check_jagged", "check_loaded",
    "check_torch_zip", "shape_of",
]

DECODE_RATIO = 256
DECODE_FLOOR = 256 << 20
_MAX_DIMS = 64  # torch's own limit on tensor dimensions


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"  # pragma: no cover - the loop always returns


class DecodeBudget:
    """The bytes one decode may still allocate; every decoder charges it before allocating.

    Args:
        limit: bytes the whole decode may allocate.
        origin: how the limit was set, for the error message.

    Example:
        >>> budget = DecodeBudget.for_files({"data.json": b"{}"})
        >>> budget.charge(1024, "data.json", "root")
        >>> budget.used
        1024
    """

    def __init__(self, limit: int, origin: str) -> None:
        self.limit = limit
        self.origin = origin
        self.used = 0
        self._lock = threading.Lock()  # sibling tensors decode on a thread pool

    @classmethod
    def for_files(cls, files: Mapping[str, Any], max_bytes: int | None = None) -> DecodeBudget:
        """The budget of an entry made of ``files`` (name -> bytes): the rule above, or ``max_bytes``."""
        if max_bytes is not None:
            return cls(int(max_bytes), f"max_decode_bytes={max_bytes}")
        on_disk = sum(len(data) for data in files.values())
        return cls(DECODE_RATIO * on_disk + DECODE_FLOOR,
                   f"{DECODE_RATIO} x {_size(on_disk)} on disk + {_size(DECODE_FLOOR)}")

    def charge(self, nbytes: int, file: str, field: str) -> None:
        """Count ``nbytes`` about to be allocated for ``field`` of ``file``.

        Raises:
            DecodeLimitError: the decode would go over its limit (a hostile or damaged entry).
        """
        with self._lock:
            self.used += nbytes
            over = self.used > self.limit
        if over:
            raise DecodeLimitError(
                f"{file}: {field}: decoding needs {_size(self.used)}, over the decode bound of {_size(self.limit)} "
                f"({self.origin}); the entry is damaged or hostile (raise max_decode_bytes if it is genuine)"
            )

    def tensor(self, shape: Any, itemsize: int, file: str, field: str) -> tuple[int, ...]:
        """Check ``shape`` (a list of non-negative ints) and charge a tensor of it; returns it as a tuple."""
        dims = shape_of(shape, file, field)
        self.charge(math.prod(dims) * itemsize, file, field)
        return dims


def shape_of(shape: Any, file: str, field: str) -> tuple[int, ...]:
    """``shape`` as a tuple of non-negative ints, or :class:`CorruptEntryError` naming ``field``."""
    if not isinstance(shape, (list, tuple)) or len(shape) > _MAX_DIMS or \
            not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptEntryError(f"{file}: {field}: {str(shape)[:80]!r} is not a shape (a list of non-negative ints)")
    return tuple(shape)


def jagged_problem(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None,
                   ragged_idx: Any) -> str | None:
    """What is wrong with these jagged components, or None when they describe a valid jagged tensor.

    Valid means: ``ragged_idx`` names a dimension of the rows (1 ..= ``values.dim()``), ``offsets``
    is a 1-D integer tensor that starts at 0 and never decreases, and either ends at the length of
    ``values`` along the ragged dimension or, with ``lengths`` (one per row, non-negative), every
    row ``offsets[i] : offsets[i] + lengths[i]`` lies inside it. Costs O(rows), never O(values).
    """
    if type(ragged_idx) is not int or not 1 <= ragged_idx <= values.dim():
        return f"ragged_idx {ragged_idx!r} is not a dimension of the rows (1 to {values.dim()})"
    total = values.size(ragged_idx - 1)
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype not in (torch.int32, torch.int64):
        return f"offsets must be a non-empty 1-D int32/int64 tensor, not {offsets.dtype} of shape {list(offsets.shape)}"
    if offsets.is_nested or values.is_nested:
        return "components of a jagged tensor cannot themselves be nested"
    if int(offsets[0]) != 0:
        return f"offsets start at {int(offsets[0])}, not 0"
    if offsets.numel() > 1 and bool((offsets.diff() < 0).any()):
        return "offsets decrease"
    if lengths is None:
        if int(offsets[-1]) != total:
            return f"offsets end at {int(offsets[-1])}, not at the {total} values"
        return None
    if lengths.dim() != 1 or lengths.numel() != offsets.numel() - 1 or lengths.dtype not in (torch.int32, torch.int64):
        return f"lengths must be {offsets.numel() - 1} int32/int64 values, not {lengths.dtype} {list(lengths.shape)}"
    # each bounded before any sum: stored values near 2**63 would wrap the int64 sum and pass the check
    if int(offsets[-1]) > total:
        return f"offsets end at {int(offsets[-1])}, past the {total} values"
    if lengths.numel() and (bool((lengths < 0).any()) or int(lengths.max()) > total
                            or int((offsets[:-1] + lengths).max()) > total):
        return f"lengths reach past the {total} values"
    return None


def check_jagged(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor | None, ragged_idx: Any,
                 file: str, field: str) -> None:
    """:func:`jagged_problem` as a :class:`CorruptEntryError` naming ``file`` and ``field``."""
    problem = jagged_problem(values, offsets, lengths, ragged_idx)
    if problem is not None:
        raise CorruptEntryError(f"{file}: {field}: invalid jagged tensor: {problem}")


def _check_nested(tensor: Any, file: str, field: str) -> None:  # Any: torch's stubs omit the jagged API
    if tensor.layout != torch.jagged:
        return  # strided nested tensors are rebuilt from their components, sizes checked by torch
    check_jagged(tensor.values(), tensor.offsets(), tensor.lengths(), tensor._ragged_idx, file, field)
    cache = getattr(tensor, "_metadata_cache", None) or {}
    if cache:
        # max_seqlen/min_seqlen are trusted by kernels and padding: they must be the rows' real extremes
        offsets, lengths = tensor.offsets(), tensor.lengths()
        rows = lengths if lengths is not None else offsets.diff()
        for key, real in (("max_seqlen", rows.max() if rows.numel() else None),
                          ("min_seqlen", rows.min() if rows.numel() else None)):
            cached = cache.get(key)
            if cached is None or real is None:
                continue
            value = cached.size(0) if isinstance(cached, torch.Tensor) and cached.dim() == 2 else cached
            if int(value) != int(real):
                raise CorruptEntryError(f"{file}: {field}: invalid jagged tensor: {key} {int(value)} is not "
                                        f"the rows' real {key.split('_')[0]} {int(real)}")


def check_loaded(value: Any, file: str, field: str = "value", _depth: int = 0) -> None:
    """Walk a value ``torch.load`` produced (TensorDicts, dicts, lists) and check every jagged tensor.

    Raises:
        CorruptEntryError: a nested tensor with invalid offsets, naming the key.
    """
    from tensordict import TensorDictBase, is_non_tensor

    if _depth > 100:
        raise CorruptEntryError(f"{file}: {field}: nested more than 100 levels deep")
    if isinstance(value, torch.Tensor):
        if value.layout not in (torch.strided, torch.jagged) or value.device.type != "cpu":
            # sparse tensors densify to any size, meta tensors hold nothing: neither is ever written
            raise CorruptEntryError(f"{file}: {field}: a {value.layout} tensor on {value.device} is not "
                                    "something stepskip or verl writes")
        if value.is_nested:
            _check_nested(value, file, field)
    elif isinstance(value, TensorDictBase):
        if is_non_tensor(value):
            return
        for key in value.keys():
            check_loaded(value.get(key), file, f"{field}[{key!r}]", _depth + 1)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            check_loaded(item, file, f"{field}[{key!r}]", _depth + 1)
    elif isinstance(value, (list, tuple)):
        _check_items(value, file, field, _depth)


def _check_items(items: Iterable[Any], file: str, field: str, depth: int) -> None:
    for i, item in enumerate(items):
        if isinstance(item, (torch.Tensor, Mapping, list, tuple)) or hasattr(item, "batch_size"):
            check_loaded(item, file, f"{field}[{i}]", depth + 1)


_ZIP_LOCAL = b"PK\x03\x04"


def check_torch_zip(data: bytes, file: str) -> None:
    """Refuse ``torch.save`` bytes that could make ``torch.load`` allocate more than they hold.

    ``torch.save`` writes an uncompressed zip; the legacy (pre-zip) format and compressed members
    are refused: both let a few bytes declare storages of any size. Reads only the zip directory.

    Raises:
        CorruptEntryError: not such a zip, a compressed member, or members larger than the bytes.
    """
    if not data.startswith(_ZIP_LOCAL):
        raise CorruptEntryError(f"{file}: the torch payload is not a torch.save zip archive")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, struct.error, ValueError, EOFError, OSError) as err:
        raise CorruptEntryError(f"{file}: the torch payload is a damaged zip archive: {err}") from err
    total = 0
    for member in members:
        if member.compress_type != zipfile.ZIP_STORED:
            raise CorruptEntryError(f"{file}: torch payload member {member.filename!r} is compressed; "
                                    "torch.save never compresses")
        total += member.file_size
    if total > len(data):
        raise CorruptEntryError(f"{file}: torch payload members declare {total} bytes, more than its {len(data)}")
    pickles = [m for m in members if m.filename.endswith("/data.pkl") or m.filename == "data.pkl"]
    if len(pickles) != 1:
        raise CorruptEntryError(f"{file}: the torch payload has {len(pickles)} data.pkl members, not 1")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        _scan_torch_pickle(archive.read(pickles[0]), file)


# Callables torch's weights-only unpickler admits that allocate whatever size their arguments say
# (``bytearray(2**31)``, ``torch.Tensor(10**10)``): never called with a size in a payload we read.
_SIZED_CALLABLES = frozenset({"builtins.bytearray", "__builtin__.bytearray", "torch.Tensor"})


class _Symbol:
    """A global, or the result of calling something, in a shadow reading of a torch pickle: inert."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) on an OrderedDict() result
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def add(self, value: Any) -> None:
        pass


def _refuse_sized(func: Any, args: Any, file: str) -> None:
    if not isinstance(func, _Symbol) or func.name not in _SIZED_CALLABLES:
        return
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    if func.name == "torch.Tensor":
        harmless = not args  # torch.save never calls the legacy constructor: only Tensor() itself is harmless
    else:  # bytearray(bytes), as pickle writes one; protocol 2 spells the bytes _codecs.encode(str, 'latin1')
        harmless = len(args) == 1 and (isinstance(args[0], bytes) or
                                       (isinstance(args[0], _Symbol) and args[0].name == "_codecs.encode()"))
    if not harmless:
        raise CorruptEntryError(f"{file}: the torch payload calls {func.name} with a size or another value: "
                                "it could allocate whatever the file says; torch.save never writes that")


_ShadowBase: Any = pickle._Unpickler  # type: ignore[attr-defined]  # the pure-Python unpickler: its memo is a dict


class _ShadowUnpickler(_ShadowBase):
    """Reads a torch ``data.pkl`` without building anything: globals and calls become :class:`_Symbol`.

    It only looks for calls that allocate by argument, before the real (weights-only) load runs.
    """

    dispatch = dict(_ShadowBase.dispatch)

    def __init__(self, data: bytes, file: str) -> None:
        super().__init__(io.BytesIO(data))
        self.file = file

    def find_class(self, module: str, name: str) -> _Symbol:
        return _Symbol(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Symbol:
        return _Symbol("storage")

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        _refuse_sized(func, args, self.file)
        self.stack[-1] = _Symbol(f"{func.name}()" if isinstance(func, _Symbol) else "result")

    def load_newobj(self) -> None:
        args = self.stack.pop()
        _refuse_sized(self.stack.pop(), args, self.file)
        self.append(_Symbol("result"))

    def load_newobj_ex(self) -> None:
        self.stack.pop()
        args = self.stack.pop()
        _refuse_sized(self.stack.pop(), args, self.file)
        self.append(_Symbol("result"))

    def load_build(self) -> None:
        self.stack.pop()

    def load_bytearray8(self) -> None:
        size = int.from_bytes(self.read(8), "little")
        self.append(bytearray(self.read(min(size, 1 << 30))))  # read() returns at most what is there

    def _instantiate(self, klass: Any, args: Any) -> None:
        _refuse_sized(klass, args, self.file)
        self.append(_Symbol("result"))

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8


def _scan_torch_pickle(data: bytes, file: str) -> None:
    try:
        _ShadowUnpickler(data, file).load()
    except CorruptEntryError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever stops the shadow reading stops the real one too
        raise CorruptEntryError(f"{file}: the torch payload's data.pkl does not parse: {type(err).__name__}: "
                                f"{err}") from err
