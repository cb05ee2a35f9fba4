"""``format: verl``: the pickle files verl 0.9 writes and reads, without verl and without trust.

verl saves a rollout as ``pickle.dump(DataProto)``, whose state is ``(torch.save bytes of the
TensorDict, non_tensor_batch, meta_info)``. Writing: a pure-Python pickler emits the global
``verl.protocol.DataProto`` by name, so verl need not be installed, and the TensorDict is saved
unconsolidated (a consolidated TensorDict with jagged tensors does not load under verl's
tensordict 0.10). Reading: an allow-list unpickler accepts only the globals such a file
contains; the TensorDict bytes go through ``torch.load(weights_only=True)``. Anything else (a
pickle reaching for ``os.system``, say) is refused before it runs.
"""

from __future__ import annotations

import copy as copylib
import copyreg
import io
import pickle
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from stepskip.batch import Batch
from stepskip.entries import GEN_BATCH_FILE, TQ_BATCH_FILE
from stepskip.errors import CorruptEntryError, TruncatedEntryError, UnstorableValueError

__all__ = ["VerlFormat", "dumps_dataproto", "loads_dataproto", "restricted_loads"]

PICKLE_PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL of the Pythons verl 0.9 runs on


class _DataProtoStandIn:
    """Takes the place of ``verl.protocol.DataProto`` on both sides of the pickle."""

    def __init__(self, state: tuple[bytes, dict[str, np.ndarray], dict[str, Any]] | None = None) -> None:
        self.state = state

    def __reduce_ex__(self, protocol: int) -> tuple[Any, ...]:
        return copyreg.__newobj__, (type(self),), self.state

    def __setstate__(self, state: tuple[bytes, dict[str, np.ndarray], dict[str, Any]]) -> None:
        self.state = state


class _VerlPickler(pickle._Pickler):  # type: ignore[name-defined]
    """The pure-Python pickler: unlike the C one, it lets a class be written under another name."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is not _DataProtoStandIn:
            return super().save_global(obj, name)
        self.save("verl.protocol")
        self.save("DataProto")
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)
        return None


def _numpy_reconstruct() -> Any:
    return np._core.multiarray._reconstruct  # type: ignore[attr-defined]


def _numpy_scalar() -> Any:
    return np._core.multiarray.scalar  # type: ignore[attr-defined]


_ALLOWED: dict[tuple[str, str], Any] = {
    ("verl.protocol", "DataProto"): _DataProtoStandIn,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct(),
    ("numpy.core.multiarray", "scalar"): _numpy_scalar(),
    ("numpy._core.multiarray", "scalar"): _numpy_scalar(),
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "complex"): complex,
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "numpy.dtypes" and name.endswith("DType"):
            found = getattr(np.dtypes, name, None)
        if found is None:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: not one of the data types a verl cache holds"
            )
        return found


def restricted_loads(data: bytes) -> Any:
    """Unpickle ``data`` allowing only the globals a verl ``gen_batch.dp`` contains.

    Raises:
        pickle.UnpicklingError: the pickle names any other global; nothing of it was executed.
    """
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def dumps_dataproto(batch: TensorDictBase | None, non_tensor_batch: Mapping[str, np.ndarray],
                    meta_info: Mapping[str, Any]) -> bytes:
    """The bytes ``DataProto.save_to_disk`` would write for these three parts (verl not needed)."""
    buffer = io.BytesIO()
    torch.save(batch.contiguous() if batch is not None else None, buffer)
    state = (buffer.getvalue(), dict(non_tensor_batch), dict(meta_info))
    out = io.BytesIO()
    _VerlPickler(out, protocol=PICKLE_PROTOCOL).dump(_DataProtoStandIn(state))
    return out.getvalue()


def loads_dataproto(data: bytes) -> tuple[TensorDictBase | None, dict[str, np.ndarray], dict[str, Any]]:
    """Read a verl ``gen_batch.dp`` through the allow-list; returns ``(batch, non_tensor_batch, meta_info)``.

    Raises:
        pickle.UnpicklingError: the file holds something other than a verl DataProto.
    """
    obj = restricted_loads(data)
    if not isinstance(obj, _DataProtoStandIn) or not isinstance(obj.state, tuple) or len(obj.state) != 3:
        raise pickle.UnpicklingError("the pickle does not hold a verl DataProto")
    tensor_bytes, non_tensor_batch, meta_info = obj.state
    if not isinstance(tensor_bytes, bytes) or not isinstance(non_tensor_batch, dict) or not isinstance(meta_info, dict):
        raise pickle.UnpicklingError("the DataProto state is not (bytes, dict, dict)")
    batch = torch.load(io.BytesIO(tensor_bytes), weights_only=True, map_location="cpu")
    if batch is not None and not isinstance(batch, TensorDictBase):
        raise pickle.UnpicklingError(f"the DataProto batch is a {type(batch).__qualname__}, not a TensorDict")
    return batch, non_tensor_batch, meta_info


_TRUNCATION_SIGNS = ("truncated", "ran out of input", "failed finding central directory", "unexpected eof")


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
        if not all(hasattr(value, a) for a in ("batch", "non_tensor_batch", "meta_info")):
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
        for key, column in non_tensor.items():
            _check_readable(column, f"result.non_tensor_batch[{key!r}]")
        _check_readable(meta, "result.meta_info")
        if copy:
            batch = None if batch is None else batch.clone()
            non_tensor = copylib.deepcopy(non_tensor)
            meta = copylib.deepcopy(meta)
        return _FrozenDataProto(batch, non_tensor, meta)

    def encode(self, frozen: _FrozenDataProto) -> dict[str, bytes]:
        return {GEN_BATCH_FILE: dumps_dataproto(frozen.batch, frozen.non_tensor_batch, frozen.meta_info)}

    def decode(self, files: Mapping[str, bytes], consume: bool = False) -> Any:
        """Rebuild the batch: verl's ``DataProto`` when verl is importable, else :class:`~stepskip.Batch`.

        Raises:
            CorruptEntryError: unreadable bytes, or a pickle that names a global outside the allow-list.
        """
        try:
            batch, non_tensor, meta = loads_dataproto(files[GEN_BATCH_FILE])
        except Exception as err:  # the decode boundary: no failure to parse these bytes escapes as anything else
            raise decode_failure(GEN_BATCH_FILE, err) from err
        try:
            from verl.protocol import DataProto  # type: ignore[import-not-found]

            return DataProto(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)
        except ImportError:
            return Batch(batch=batch, non_tensor_batch=non_tensor, meta_info=meta)


class VerlTqFormat:
    """verl 0.9's V1 ``tq_batch.pt``: ``torch.save({"tensordict", "tags", "keys", "global_steps"})``.

    Read with ``torch.load(weights_only=True)`` (tensordict registers its own rebuild functions),
    so only tensors, TensorDicts and plain containers can come out of it.
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
        payload = dict(frozen, tensordict=td.contiguous() if isinstance(td, TensorDictBase) else td)
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return {TQ_BATCH_FILE: buffer.getvalue()}

    def decode(self, files: Mapping[str, bytes], consume: bool = False) -> Any:
        try:
            payload = torch.load(io.BytesIO(files[TQ_BATCH_FILE]), weights_only=True, map_location="cpu")
        except Exception as err:  # the decode boundary: no failure to parse these bytes escapes as anything else
            raise decode_failure(TQ_BATCH_FILE, err) from err
        if not isinstance(payload, dict) or not {"tensordict", "tags", "keys"} <= set(payload):
            raise CorruptEntryError(f"{TQ_BATCH_FILE} does not hold a V1 payload")
        return payload
