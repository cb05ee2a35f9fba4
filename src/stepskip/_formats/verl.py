"""``format: verl``: the pickle files verl 0.9 writes and reads, without verl and without trust.

verl saves a rollout as ``pickle.dump(DataProto)``, whose state is ``(torch.save bytes of the
TensorDict, non_tensor_batch, meta_info)`` (under ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``
the TensorDict is pickled as numpy arrays of its tensors' bytes instead; both are read).
Writing: a pure-Python pickler emits the global ``verl.protocol.DataProto`` by name, so verl
need not be installed, and the TensorDict is saved unconsolidated (a consolidated TensorDict
with jagged tensors does not load under verl's tensordict 0.10). Reading: an allow-list
unpickler accepts only the globals such a file contains, and rebuilds numpy values itself from
exactly the shapes numpy writes (see the reader's section below); the TensorDict bytes go
through ``torch.load(weights_only=True)`` after :func:`~stepskip._formats.bounds.check_torch_zip`.
Anything else (a pickle reaching for ``os.system``, a forged dtype, a size the bytes do not back)
is refused before it runs.
"""

from __future__ import annotations

import contextlib
import copy as copylib
import copyreg
import io
import math
import pickle
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, SupportsIndex

import numpy as np
import torch
from tensordict import TensorDictBase

from stepskip._batch import Batch
from stepskip._calls import is_dataproto_like
from stepskip._entries import GEN_BATCH_FILE, TQ_BATCH_FILE
from stepskip.errors import CorruptEntryError, TruncatedEntryError, UnstorableValueError
from stepskip._formats.bounds import DecodeBudget, check_loaded, check_torch_zip
from stepskip._formats.values import unstorable_recursion, unstorable_tensor

__all__ = ["VerlFormat", "dumps_dataproto", "loads_dataproto", "restricted_loads"]

PICKLE_PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL of the Pythons verl 0.9 runs on


# The pure-Python pickler and copyreg's reconstructor are stdlib but absent from typeshed.
_PurePickler: Any = getattr(pickle, "_Pickler")
_NEWOBJ: Any = getattr(copyreg, "__newobj__")


class _DataProtoStandIn:
    """Takes the place of ``verl.protocol.DataProto`` on both sides of the pickle."""

    def __init__(self, state: tuple[bytes, dict[str, np.ndarray], dict[str, Any]] | None = None) -> None:
        self.state = state

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return _NEWOBJ, (type(self),), self.state

    def __setstate__(self, state: tuple[bytes, dict[str, np.ndarray], dict[str, Any]]) -> None:
        self.state = state


class _VerlPickler(_PurePickler):
    """The pure-Python pickler: unlike the C one, it lets a class be written under another name."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not _DataProtoStandIn:
            return super().save_global(obj, name)
        self.save("verl.protocol")
        self.save("DataProto")
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)
        return None


# --------------------------------------------------------------------------- the allow-list reader
#
# Numpy's own pickle reconstruction is not safe on foreign bytes: ``dtype.__setstate__`` takes
# flags and fields from the pickle (a forged dtype can say "object field, holds no references"
# and make numpy read raw bytes as object pointers), and ``ndarray(shape, 'O')`` allocates any
# size. So the reader never hands pickle data to those functions. It admits exactly the shapes
# numpy writes, ``_reconstruct(ndarray, (0,), b'b')`` + BUILD ``(1, shape, dtype, fortran, data)``,
# ``dtype(spec, False, True)`` + BUILD ``(3, byteorder, None, None, None, elsize, alignment, flags)``,
# ``scalar(dtype, bytes)`` and protocol 5's ``_frombuffer(buffer, dtype, shape, order)``, and
# rebuilds each dtype from its description (kind, size, byte order: nothing else) and each array
# only when its data is exactly what its shape calls for: the items of an object array as a list
# of them, any other array as its bytes. The pure-Python unpickler is used because the C one
# grows its memo to any index a pickle names (``LONG_BINPUT 2**28`` costs 4 GiB).


class _ArrayClass:
    """Stands for ``numpy.ndarray``: only an argument of ``_reconstruct``; calling it is refused."""

    def __reduce__(self) -> Any:  # pragma: no cover - never pickled
        raise pickle.PicklingError("not picklable")


_NDARRAY = _ArrayClass()
_DTYPE_SPEC = re.compile(r"[biufcOSU]\d{0,10}")
_ARRAY_KINDS = "biufcOSU"


class _PendingArray:
    """What ``_reconstruct`` returns: replaced by the real array when its state arrives (BUILD)."""

    __hash__ = None  # type: ignore[assignment]  # an array is no dict key, so this cannot be one either


class _PendingDtype:
    """What ``dtype(spec, ...)`` returns: replaced by a dtype rebuilt from its description at BUILD."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, spec: str) -> None:
        self.spec = spec


def _reconstruct(cls: Any, shape: Any, typecode: Any) -> _PendingArray:
    if cls is not _NDARRAY or shape != (0,) or typecode != b"b":
        raise pickle.UnpicklingError("numpy _reconstruct called with arguments numpy never writes")
    return _PendingArray()


def _dtype(spec: Any, align: Any = False, copy: Any = True) -> _PendingDtype:
    if type(spec) is not str or not _DTYPE_SPEC.fullmatch(spec) or align is not False or copy is not True:
        raise pickle.UnpicklingError(f"numpy dtype {str(spec)[:40]!r}: only plain numeric, string and object "
                                     "dtypes are read (no structured, void or datetime dtypes)")
    return _PendingDtype(spec)


def _real_dtype(value: Any, what: str) -> np.dtype:
    # every np.dtype a pickle can reach was rebuilt by _build_dtype: a forged one cannot exist
    if not isinstance(value, np.dtype):
        raise pickle.UnpicklingError(f"{what}: a numpy dtype is expected, not {type(value).__name__}")
    return value


def _build_dtype(pending: _PendingDtype, state: Any) -> np.dtype:
    if not isinstance(state, tuple) or len(state) not in (8, 9) or state[0] not in (3, 4) or \
            state[2:5] != (None, None, None) or (len(state) == 9 and state[8] is not None):
        raise pickle.UnpicklingError(f"numpy dtype {pending.spec!r}: a state numpy never writes for a plain dtype")
    byteorder, elsize = state[1], state[5]
    if byteorder not in ("<", ">", "|", "=") or type(elsize) is not int:
        raise pickle.UnpicklingError(f"numpy dtype {pending.spec!r}: bad byte order or size")
    kind = pending.spec[0]
    try:
        return _describe(kind, pending.spec, byteorder, elsize)
    except (TypeError, ValueError) as err:
        raise pickle.UnpicklingError(f"numpy dtype {pending.spec!r}: {err}") from err


def _describe(kind: str, spec: str, byteorder: str, elsize: int) -> np.dtype:
    """A dtype from its description only: kind, size and byte order (numpy derives the flags itself)."""
    if kind in "SU":
        unit = 4 if kind == "U" else 1
        if not 0 <= elsize < 1 << 31 or elsize % unit:
            raise ValueError(f"element size {elsize}")
        return np.dtype(f"{byteorder if kind == 'U' else '|'}{kind}{elsize // unit}")
    dtype = np.dtype(spec)
    if dtype.kind != kind or dtype.fields is not None or dtype.hasobject != (kind == "O"):
        raise ValueError("not a plain dtype")
    if byteorder in "<>" and dtype.itemsize > 1 and kind != "O":
        dtype = np.dtype(byteorder + spec)
    return dtype


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64 or not all(type(d) is int and d >= 0 for d in value):
        raise pickle.UnpicklingError(f"{what}: shape {str(value)[:60]} is not a tuple of non-negative ints")
    return value


def _build_array(state: Any) -> np.ndarray:
    if not isinstance(state, tuple) or len(state) != 5 or state[0] != 1 or type(state[3]) is not bool:
        raise pickle.UnpicklingError("numpy array state is not (1, shape, dtype, fortran, data)")
    shape = _shape(state[1], "numpy array")
    dtype = _real_dtype(state[2], "numpy array")
    data = state[4]
    count = math.prod(shape)
    if dtype.hasobject:
        if type(data) is not list or len(data) != count:
            raise pickle.UnpicklingError(f"numpy object array of shape {shape}: its items must be a list of {count}")
    elif type(data) is not bytes or len(data) != count * dtype.itemsize:
        raise pickle.UnpicklingError(f"numpy array of shape {shape} and dtype {dtype}: the data must be "
                                     f"{count * dtype.itemsize} bytes")
    array = np.ndarray.__new__(np.ndarray, (0,), np.uint8)
    array.__setstate__((1, shape, dtype, state[3], data))  # numpy's own code, on arguments just checked
    return array


def _scalar(dtype: Any, data: Any = None) -> Any:
    dtype = _real_dtype(dtype, "numpy scalar")
    if dtype.hasobject:
        raise pickle.UnpicklingError("numpy object scalars from raw bytes are refused: numpy never writes them")
    if type(data) is not bytes or len(data) != dtype.itemsize:
        raise pickle.UnpicklingError(f"numpy scalar of dtype {dtype}: the data must be {dtype.itemsize} bytes")
    if not dtype.itemsize:  # np.str_('') and np.bytes_(b'')
        return dtype.type()
    return np.frombuffer(data, dtype=dtype)[0]


def _frombuffer(buffer: Any, dtype: Any, shape: Any, order: Any) -> np.ndarray:
    dtype = _real_dtype(dtype, "numpy array")
    shape = _shape(shape, "numpy array")
    if dtype.hasobject or order not in ("C", "F") or type(buffer) not in (bytes, bytearray) or \
            len(buffer) != math.prod(shape) * dtype.itemsize:
        raise pickle.UnpicklingError(f"numpy array of shape {shape} and dtype {dtype}: the buffer does not fit")
    return np.frombuffer(buffer, dtype=dtype).reshape(shape, order=order)


def _refuse_ndarray(*args: Any) -> Any:
    raise pickle.UnpicklingError("calling numpy.ndarray directly is refused: numpy never writes it")


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size(dims)`` as a pickle names it (verl's numpy serialization): a plain tuple, checked."""
    return _shape(dims, "torch.Size")


_ALLOWED: dict[tuple[str, str], Any] = {
    ("verl.protocol", "DataProto"): _DataProtoStandIn,
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): _dtype,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.multiarray", "scalar"): _scalar,
    ("numpy._core.multiarray", "scalar"): _scalar,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("torch", "Size"): _torch_size,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "complex"): complex,
}
_BUILDABLE = (_PendingArray, _PendingDtype, _DataProtoStandIn)


_PENDING = (_PendingArray, _PendingDtype)


class _Source(io.BytesIO):
    """The pickle's bytes: a read that ends early is truncation (the pure-Python unpickler would go on)."""

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        if size is not None and size > 0 and len(data) < size:
            raise EOFError("pickle data was truncated")
        return data


_PyUnpickler: Any = pickle._Unpickler  # type: ignore[attr-defined]  # the pure-Python one, private but stable


class _RestrictedUnpickler(_PyUnpickler):
    """The pure-Python unpickler with the allow-list, and BUILD admitted only on the stand-ins above."""

    dispatch = dict(_PyUnpickler.dispatch)

    def __init__(self, data: bytes) -> None:
        super().__init__(_Source(data))
        self.size = len(data)
        self.pending = 0  # stand-ins made and not yet built
        self.pending_keys: dict[int, list[int]] = {}  # id(stand-in) -> memo keys holding it

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: not one of the data types a verl cache holds"
            )
        return found

    def _made(self) -> None:
        if type(self.stack[-1]) in _PENDING:
            self.pending += 1

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if func is _NDARRAY:
            _refuse_ndarray()
        stack[-1] = func(*args)
        self._made()

    dispatch[pickle.REDUCE[0]] = load_reduce

    def _instantiate(self, klass: Any, args: Any) -> None:  # INST and OBJ, protocols 0 and 1
        if klass is _NDARRAY:
            _refuse_ndarray()
        super()._instantiate(klass, args)
        self._made()

    def _put(self, key: int) -> None:
        if key < 0:
            raise pickle.UnpicklingError("negative memo index")
        top = self.stack[-1]
        self.memo[key] = top
        if type(top) in _PENDING:
            self.pending_keys.setdefault(id(top), []).append(key)

    def load_memoize(self) -> None:
        self._put(len(self.memo))

    def load_put(self) -> None:
        self._put(int(self.readline()[:-1]))

    def load_binput(self) -> None:
        self._put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._put(int.from_bytes(self.read(4), "little"))

    dispatch[pickle.MEMOIZE[0]] = load_memoize
    dispatch[pickle.PUT[0]] = load_put
    dispatch[pickle.BINPUT[0]] = load_binput
    dispatch[pickle.LONG_BINPUT[0]] = load_long_binput

    def load_build(self) -> None:
        stack = self.stack
        state = stack.pop()
        inst = stack[-1]
        kind = type(inst)
        if kind not in _BUILDABLE:
            raise pickle.UnpicklingError(f"refusing to set the state of a {kind.__name__}: numpy and verl "
                                         "never write that")
        if kind is _DataProtoStandIn:
            inst.__setstate__(state)
            return
        keys = [k for k in self.pending_keys.pop(id(inst), ()) if self.memo.get(k) is inst]
        # the stand-in must be nowhere but on the stack and in the memo: a container holding it
        # would keep the placeholder instead of the value (refs: stack slot, `inst`, the argument, memo)
        if sys.getrefcount(inst) > 3 + len(keys):
            raise pickle.UnpicklingError("a numpy value is used before its state is set: numpy never writes that")
        built = _build_array(state) if kind is _PendingArray else _build_dtype(inst, state)
        stack[-1] = built
        for key in keys:
            self.memo[key] = built
        self.pending -= 1

    dispatch[pickle.BUILD[0]] = load_build

    def load_bytearray8(self) -> None:
        # the pure-Python unpickler allocates the declared size before reading: check it against the bytes
        size = int.from_bytes(self.read(8), "little")
        if size > self.size:
            raise EOFError(f"pickle data was truncated: BYTEARRAY8 of {size} bytes in a {self.size}-byte pickle")
        self.append(bytearray(self.read(size)))

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8

    def load(self) -> Any:
        value = super().load()
        if self.pending:
            raise pickle.UnpicklingError(f"{self.pending} numpy value(s) without their state: numpy never writes that")
        return value


def restricted_loads(data: bytes) -> Any:
    """Unpickle ``data`` allowing only the globals a verl ``gen_batch.dp`` contains, rebuilt safely.

    Raises:
        pickle.UnpicklingError: the pickle names any other global, or uses an allowed one in a way
            numpy and verl never write; nothing of it was executed.
    """
    return _RestrictedUnpickler(data).load()


# --------------------------------------------------------------------------- tensordict across versions

_scope_lock = threading.Lock()
_scope_users = 0
_scope: Any = None  # the torch.serialization.safe_globals in force while any load runs


def _tensordict_globals() -> list[Any]:
    """What the pickle of a TensorDict names: tensordict's two rebuild functions and the classes they get.

    ``_rebuild_tensordict_files_consolidated(metadata, storage)`` rebuilds a consolidated TensorDict;
    ``_make_td(cls, state)`` the others, ``cls`` being one of the classes below (non-tensor leaves
    are ``NonTensorData``/``NonTensorStack``). tensordict 0.15 allow-lists these itself; 0.10 (verl
    0.9.1's pin) does not, and ``torch.load(weights_only=True)`` then refuses every TensorDict.
    """
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, _reductions

    return [_reductions._rebuild_tensordict_files_consolidated, _reductions._make_td, TensorDict,
            LazyStackedTensorDict, NonTensorData, NonTensorStack]


@contextlib.contextmanager
def _tensordict_load_scope() -> Iterator[None]:
    """Allow :func:`_tensordict_globals` that tensordict has not registered, for the loads inside only.

    torch keeps allowed globals in one process-wide set, so concurrent loads share one scope: it
    opens with the first load and closes with the last (a scope per load would withdraw the
    globals from a load still running in another thread).
    """
    global _scope, _scope_users
    with _scope_lock:
        if _scope_users == 0:
            registered = {id(g) for g in torch.serialization.get_safe_globals()}
            missing = [g for g in _tensordict_globals() if id(g) not in registered]
            _scope = torch.serialization.safe_globals(missing) if missing else None
            if _scope is not None:
                _scope.__enter__()
        _scope_users += 1
    try:
        yield
    finally:
        with _scope_lock:
            _scope_users -= 1
            if _scope_users == 0 and _scope is not None:
                _scope.__exit__(None, None, None)
                _scope = None


def _weights_only_load(data: bytes) -> Any:
    with _tensordict_load_scope():
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _savable(td: TensorDictBase, copy: bool | None = None) -> TensorDictBase:
    """``td`` as a plain TensorDict of contiguous tensors, its non-tensor leaves kept as they are.

    Not ``td.contiguous()``: under tensordict 0.10 that turns ``NonTensorStack`` columns (``uid``,
    ``raw_prompt``, ...) into empty TensorDicts, and the entry loses them. The tensors of a
    consolidated TensorDict (as a verl-written entry loads) are views of one byte buffer in several
    dtypes, which ``torch.save`` refuses unless they are copied out, as they are here.
    """
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    if copy is None:
        copy = bool(getattr(td, "is_consolidated", lambda: False)())
    out = TensorDict({}, batch_size=td.batch_size, device=td.device)
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, (NonTensorData, NonTensorStack)):
            out.set(key, value)  # type: ignore[arg-type]  # tensordict stores them; its stubs say otherwise
        elif isinstance(value, TensorDictBase):
            out.set(key, _savable(value, copy))
        else:
            out.set(key, value.clone() if copy else value.contiguous())
    return out


def dumps_dataproto(batch: TensorDictBase | None, non_tensor_batch: Mapping[str, np.ndarray],
                    meta_info: Mapping[str, Any]) -> bytes:
    """The bytes ``DataProto.save_to_disk`` would write for these three parts (verl not needed)."""
    buffer = io.BytesIO()
    torch.save(_savable(batch) if batch is not None else None, buffer)
    state = (buffer.getvalue(), dict(non_tensor_batch), dict(meta_info))
    out = io.BytesIO()
    _VerlPickler(out, protocol=PICKLE_PROTOCOL).dump(_DataProtoStandIn(state))
    return out.getvalue()


def loads_dataproto(data: bytes, budget: DecodeBudget | None = None,
                    ) -> tuple[TensorDictBase | None, dict[str, np.ndarray], dict[str, Any]]:
    """Read a verl ``gen_batch.dp`` through the allow-list; returns ``(batch, non_tensor_batch, meta_info)``.

    Args:
        data: the file's bytes.
        budget: charged for every tensor of verl's numpy serialization before it is made (the
            pickle memo lets one tensor's bytes be named by any number of fields); by default the
            bound of a file of this size.

    Raises:
        pickle.UnpicklingError: the file holds something other than a verl DataProto.
        DecodeLimitError: its tensors would need more memory than ``budget`` allows.
    """
    obj = restricted_loads(data)
    if not isinstance(obj, _DataProtoStandIn) or not isinstance(obj.state, tuple) or len(obj.state) != 3:
        raise pickle.UnpicklingError("the pickle does not hold a verl DataProto")
    tensor_state, non_tensor_batch, meta_info = obj.state
    if not isinstance(non_tensor_batch, dict) or not isinstance(meta_info, dict):
        raise pickle.UnpicklingError("the DataProto state is not (batch, dict, dict)")
    if isinstance(tensor_state, bytes):
        check_torch_zip(tensor_state, GEN_BATCH_FILE)  # before torch.load: no storage larger than the bytes
        batch = _weights_only_load(tensor_state)
    elif tensor_state is None or isinstance(tensor_state, tuple):
        batch = _numpy_tensordict(tensor_state, budget or DecodeBudget.for_files({GEN_BATCH_FILE: data}))
    else:
        raise pickle.UnpicklingError("the DataProto batch is neither torch.save bytes nor verl's numpy serialization")
    if batch is not None and not isinstance(batch, TensorDictBase):
        raise pickle.UnpicklingError(f"the DataProto batch is a {type(batch).__qualname__}, not a TensorDict")
    return batch, non_tensor_batch, meta_info


# --------------------------------------------------------------------------- VERL_DATAPROTO_SERIALIZATION_METHOD=numpy
#
# With that variable set verl pickles the TensorDict as ``(batch_size, device, {field: encoding})``,
# a dense tensor encoded ``(dtype name, torch.Size, uint8 array of its bytes)`` and a nested one
# ``(layout name, [encoding of each component])``. Every part came through the allow-list above
# (the arrays rebuilt from exactly their bytes); here each tensor is made only when its bytes are
# exactly what its dtype and shape call for, on the CPU whatever device the writer named.

_INTEGER_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                   torch.uint32, torch.uint64)
# only dtypes whose values are plain bytes: a quantized, bits or sub-byte tensor viewed from raw
# bytes has no quantizer or packing, and every copy or print of it fails
_TORCH_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value for value in vars(torch).values()
    if isinstance(value, torch.dtype) and (value.is_floating_point or value.is_complex or value in _INTEGER_DTYPES)
}
_NESTED_LAYOUTS = {"jagged": torch.jagged, "strided": torch.strided}


def _numpy_tensor(encoded: Any, what: str, budget: DecodeBudget) -> torch.Tensor:
    if not isinstance(encoded, tuple) or len(encoded) != 3:
        raise pickle.UnpicklingError(f"{what}: a tensor is encoded (dtype, shape, bytes)")
    name, shape, data = encoded
    dtype = _TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise pickle.UnpicklingError(f"{what}: {str(name)[:40]!r} is not a torch dtype")
    shape = _shape(shape, what)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
        raise pickle.UnpicklingError(f"{what}: the bytes of a tensor are a 1-D uint8 numpy array")
    size = torch.empty((), dtype=dtype).element_size()
    if data.size != math.prod(shape) * size:
        raise pickle.UnpicklingError(f"{what}: {data.size} bytes for a {name} tensor of shape {shape} "
                                     f"({math.prod(shape) * size} expected)")
    budget.charge(data.size, GEN_BATCH_FILE, what)  # the copy below: one array may back many fields
    return torch.from_numpy(data.copy()).view(dtype).view(shape)


def _numpy_tensordict(state: Any, budget: DecodeBudget) -> TensorDictBase | None:
    """The TensorDict of a ``gen_batch.dp`` verl wrote under ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``."""
    if state is None:
        return None
    from tensordict import TensorDict

    if len(state) != 3:
        raise pickle.UnpicklingError("verl's numpy serialization of a TensorDict is (batch_size, device, fields)")
    batch_size, device, fields = state
    batch_size = _shape(batch_size, "batch_size")
    if device is not None and not isinstance(device, str):
        raise pickle.UnpicklingError("the TensorDict's device is not a name")
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise pickle.UnpicklingError("the TensorDict's fields are not a mapping of names")
    tensors: dict[str, torch.Tensor] = {}
    for key, encoded in fields.items():
        if isinstance(encoded, tuple) and len(encoded) == 2:
            layout, parts = encoded
            if layout not in _NESTED_LAYOUTS or not isinstance(parts, list) or not parts:
                raise pickle.UnpicklingError(f"field {key!r}: a nested tensor is (jagged or strided, [components])")
            components = [_numpy_tensor(part, f"field {key!r}[{i}]", budget) for i, part in enumerate(parts)]
            budget.charge(sum(c.nbytes for c in components), GEN_BATCH_FILE, f"field {key!r}")  # joined: a copy
            tensors[key] = torch.nested.as_nested_tensor(components, layout=_NESTED_LAYOUTS[layout])
        else:
            tensors[key] = _numpy_tensor(encoded, f"field {key!r}", budget)
    return TensorDict(tensors, batch_size=list(batch_size))


_TRUNCATION_SIGNS = ("truncated", "ran out of input", "failed finding central directory", "unexpected eof",
                     "exhausted before end of frame")


def decode_failure(file_name: str, err: BaseException) -> CorruptEntryError:
    """The error for bytes of ``file_name`` that did not decode: truncation is told apart from the rest."""
    text = f"{type(err).__name__}: {err}"
    truncated = isinstance(err, EOFError) or any(sign in text.lower() for sign in _TRUNCATION_SIGNS)
    cls = TruncatedEntryError if truncated else CorruptEntryError
    return cls(f"cannot read {file_name}: {text}")


_READABLE_SCALARS = (str, int, float, bool, bytes, complex, type(None))


def _check_readable(value: Any, path: str) -> None:
    """Refuse what the allow-list reader would refuse, before writing it (the reader is the contract)."""
    if isinstance(value, _READABLE_SCALARS):
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            _check_readable(item, f"{path}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_readable(key, f"{path}.<key>")
            _check_readable(item, f"{path}[{key!r}]")
        return
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            for i, item in enumerate(value.reshape(-1)):
                _check_readable(item, f"{path}[{i}]")
        elif value.dtype.kind in "biufcUS":
            return
        else:
            raise _unreadable(value, path)
        return
    if isinstance(value, np.generic) and value.dtype.kind in "biufcUS":
        return
    raise _unreadable(value, path)


def _unreadable(value: Any, path: str) -> UnstorableValueError:
    return UnstorableValueError(
        f"{path}: a value of type {type(value).__module__}.{type(value).__qualname__} cannot be stored by "
        "format 'verl': its pickle would name a global the allow-list reader refuses; convert it to str, "
        "numbers, None, lists, dicts or numpy arrays"
    )


@dataclass
class _FrozenDataProto:
    batch: TensorDictBase | None
    non_tensor_batch: dict[str, np.ndarray]
    meta_info: dict[str, Any]


class VerlFormat:
    """Encode and decode verl 0.9's ``gen_batch.dp`` files (pickle; read only with ``allow_pickle``)."""

    name = "verl"
    uses_pickle = True
    files = (GEN_BATCH_FILE,)

    def freeze(self, value: Any, copy: bool) -> _FrozenDataProto:
        """Snapshot a DataProto-like value (``batch``, ``non_tensor_batch``, ``meta_info``)."""
        if not is_dataproto_like(value):
            raise UnstorableValueError(
                f"result: format 'verl' stores DataProto-like batches only, got {type(value).__qualname__}; "
                "use format: safe for other values"
            )
        batch = value.batch
        non_tensor = dict(value.non_tensor_batch)
        meta = dict(value.meta_info)
        if batch is not None and not isinstance(batch, TensorDictBase):
            raise UnstorableValueError(
                f"result.batch: format 'verl' stores a TensorDict, got {type(batch).__qualname__}"
            )
        if batch is not None:
            for key, tensor in batch.items(include_nested=True, leaves_only=True):
                if isinstance(tensor, torch.Tensor) and (refused := unstorable_tensor(tensor, f"result.batch[{key!r}]",
                                                                                      "verl")) is not None:
                    raise refused
        try:
            for key, column in non_tensor.items():
                _check_readable(column, f"result.non_tensor_batch[{key!r}]")
            _check_readable(meta, "result.meta_info")
        except RecursionError as err:
            raise unstorable_recursion(value, "result", self.name) from err
        if copy:
            batch = None if batch is None else batch.clone()
            non_tensor = copylib.deepcopy(non_tensor)
            meta = copylib.deepcopy(meta)
        return _FrozenDataProto(batch, non_tensor, meta)

    def encode(self, frozen: _FrozenDataProto) -> dict[str, bytes]:
        return {GEN_BATCH_FILE: dumps_dataproto(frozen.batch, frozen.non_tensor_batch, frozen.meta_info)}

    def decode(self, files: Mapping[str, bytes], consume: bool = False, max_bytes: int | None = None) -> Any:
        """Rebuild the batch: verl's ``DataProto`` when verl is importable, else :class:`~stepskip.Batch`.

        Every array is rebuilt from exactly the bytes the file holds, so a decode allocates a small
        multiple of the file's size; ``max_bytes`` (``max_decode_bytes``) caps it further.

        Raises:
            CorruptEntryError: unreadable bytes, a pickle that names a global outside the allow-list
                or uses an allowed one as numpy never does, or a jagged tensor with invalid offsets.
        """
        try:
            data = files[GEN_BATCH_FILE]
            budget = DecodeBudget.for_files(files, max_bytes)
            budget.charge(len(data), GEN_BATCH_FILE, "file")
            batch, non_tensor, meta = loads_dataproto(data, budget)
            check_loaded(batch, GEN_BATCH_FILE, "batch")
        except (CorruptEntryError, MemoryError):  # the bound keeps hostile entries from causing a MemoryError
            raise
        except Exception as err:  # the decode boundary: no failure to parse these bytes escapes as anything else
            raise decode_failure(GEN_BATCH_FILE, err) from err
        try:
            from verl.protocol import DataProto  # type: ignore[import-not-found]

            return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
        except ImportError:
            return Batch(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


class VerlTqFormat:
    """verl 0.9's V1 ``tq_batch.pt``: ``torch.save({"tensordict", "tags", "keys", "global_steps"})``.

    Read with ``torch.load(weights_only=True)``, tensordict's rebuild functions allowed (see
    :func:`_tensordict_globals`), so only tensors, TensorDicts and plain containers can come out of it.
    """

    name = "verl-tq"
    uses_pickle = True
    files = (TQ_BATCH_FILE,)

    def freeze(self, value: Any, copy: bool) -> dict[str, Any]:
        if not isinstance(value, dict) or "tensordict" not in value:
            raise UnstorableValueError(
                "result: format 'verl' stores V1 payloads {tensordict, tags, keys, global_steps}"
            )
        td = value["tensordict"]
        if copy and isinstance(td, TensorDictBase):
            td = td.clone()
        return {"tensordict": td, "tags": copylib.deepcopy(list(value["tags"])), "keys": list(value["keys"]),
                "global_steps": int(value["global_steps"])}

    def encode(self, frozen: dict[str, Any]) -> dict[str, bytes]:
        td = frozen["tensordict"]
        payload = dict(frozen, tensordict=_savable(td) if isinstance(td, TensorDictBase) else td)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return {TQ_BATCH_FILE: buffer.getvalue()}

    def decode(self, files: Mapping[str, bytes], consume: bool = False, max_bytes: int | None = None) -> Any:
        """The V1 payload dict; jagged tensors in it are checked before it is returned.

        Raises:
            CorruptEntryError: unreadable bytes, not a V1 payload, or a jagged tensor with invalid offsets.
        """
        try:
            data = files[TQ_BATCH_FILE]
            DecodeBudget.for_files(files, max_bytes).charge(len(data), TQ_BATCH_FILE, "file")
            check_torch_zip(data, TQ_BATCH_FILE)
            payload = _weights_only_load(data)
        except (CorruptEntryError, MemoryError):  # the bound keeps hostile entries from causing a MemoryError
            raise
        except Exception as err:  # the decode boundary: no failure to parse these bytes escapes as anything else
            raise decode_failure(TQ_BATCH_FILE, err) from err
        if not isinstance(payload, dict) or not {"tensordict", "tags", "keys"} <= set(payload):
            raise CorruptEntryError(f"{TQ_BATCH_FILE} does not hold a V1 payload")
        check_loaded(payload.get("tensordict"), TQ_BATCH_FILE, "tensordict")
        return payload
