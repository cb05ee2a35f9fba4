"""``format: safe``: safetensors for tensors, JSON for structure and non-tensor data. No pickle.

An entry is two files: ``data.safetensors`` (every tensor, jagged tensors as values + offsets)
and ``data.json`` (a tree describing the container and holding the non-tensor values). The
supported containers are :class:`~stepskip.Batch`, verl's ``DataProto`` (duck-typed: ``batch``,
``non_tensor_batch``, ``meta_info``), :class:`tensordict.TensorDict` with regular, nested and
non-tensor entries, dicts, tensors, numpy arrays and JSON-like values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

from stepskip.batch import Batch
from stepskip.errors import CorruptEntryError, UnstorableValueError
from stepskip.formats.values import decode_object_array, decode_value, encode_object_array, encode_value

__all__ = ["SafeFormat"]

TENSORS_FILE = "data.safetensors"
TREE_FILE = "data.json"
VERSION = 1

_STORABLE_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
}


@dataclass
class Frozen:
    """A snapshot of a value, independent of the caller's objects, ready to be written."""

    tensors: dict[str, torch.Tensor]
    tree: dict[str, Any]


class _Encoder:
    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()

    def add(self, tensor: torch.Tensor, path: str) -> str:
        if tensor.is_nested:
            raise UnstorableValueError(f"{path}: nested tensors are stored through their components")
        if tensor.dtype not in _STORABLE_DTYPES:
            raise UnstorableValueError(
                f"{path}: tensors of dtype {tensor.dtype} cannot be stored by format 'safe'; "
                f"supported: {', '.join(sorted(str(d) for d in _STORABLE_DTYPES))}"
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        elif self.copy or not t.is_contiguous() or t.untyped_storage().data_ptr() in self._storages:
            # safetensors refuses tensors that share memory, and a snapshot must not see later writes.
            t = t.clone(memory_format=torch.contiguous_format)
        if t.numel():
            self._storages.add(t.untyped_storage().data_ptr())
        ref = f"t{len(self.tensors)}"
        self.tensors[ref] = t
        return ref

    def value(self, value: Any, path: str) -> Any:
        return encode_value(value, path, lambda t: self.add(t, path))

    def node(self, value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return self.tensor_node(value, path)
        if isinstance(value, TensorDictBase):
            return self.tensordict_node(value, path)
        if _is_dataproto_like(value):
            return self.batch_node(value, path)
        if isinstance(value, np.ndarray):
            return self.array_node(value, path)
        if type(value) is dict and all(type(k) is str for k in value):
            return {"kind": "dict", "entries": {k: self.node(v, f"{path}[{k!r}]") for k, v in value.items()}}
        return {"kind": "value", "v": self.value(value, path)}

    def tensor_node(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        if not tensor.is_nested:
            return {"kind": "tensor", "ref": self.add(tensor, path)}
        if tensor.layout == torch.jagged:
            lengths = tensor.lengths()
            return {
                "kind": "jagged",
                "values": self.add(tensor.values(), f"{path}.values"),
                "offsets": self.add(tensor.offsets(), f"{path}.offsets"),
                "lengths": None if lengths is None else self.add(lengths, f"{path}.lengths"),
                "ragged_idx": tensor._ragged_idx,
            }
        parts = tensor.unbind()
        return {"kind": "nested", "parts": [self.add(p, f"{path}[{i}]") for i, p in enumerate(parts)]}

    def tensordict_node(self, td: TensorDictBase, path: str) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        for key in td.keys():
            item = td.get(key)
            where = f"{path}[{key!r}]"
            if is_non_tensor(item):
                if isinstance(item, NonTensorStack):
                    rows = item.tolist()
                    entries[key] = {"kind": "non_tensor_stack", "batch_size": list(item.batch_size),
                                    "v": self.value(rows, where)}
                else:
                    entries[key] = {"kind": "non_tensor_data", "batch_size": list(item.batch_size),
                                    "v": self.value(item.data, where)}
            elif isinstance(item, TensorDictBase):
                entries[key] = self.tensordict_node(item, where)
            else:
                entries[key] = self.tensor_node(item, where)
        return {"kind": "tensordict", "batch_size": list(td.batch_size), "entries": entries}

    def array_node(self, array: np.ndarray, path: str) -> dict[str, Any]:
        if array.dtype.hasobject:
            return {"kind": "object_array", "shape": list(array.shape),
                    "v": encode_object_array(array.reshape(-1), path, lambda t: self.add(t, path))}
        if array.dtype.kind in "biuf" and array.dtype.isnative:
            try:
                tensor = torch.from_numpy(np.ascontiguousarray(array))
            except TypeError:
                tensor = None
            if tensor is not None and tensor.dtype in _STORABLE_DTYPES:
                return {"kind": "array", "dtype": array.dtype.str, "shape": list(array.shape),
                        "ref": self.add(tensor, path)}
        return {"kind": "value", "v": self.value(array, path)}

    def batch_node(self, value: Any, path: str) -> dict[str, Any]:
        cls = type(value)
        td = value.batch
        return {
            "kind": "batch",
            "cls": f"{cls.__module__}.{cls.__qualname__}",
            "batch": None if td is None else self.tensordict_node(td, f"{path}.batch"),
            "non_tensor_batch": {k: self.array_node(np.asarray(v) if not isinstance(v, np.ndarray) else v,
                                                    f"{path}.non_tensor_batch[{k!r}]")
                                 for k, v in value.non_tensor_batch.items()},
            "meta_info": self.value(dict(value.meta_info), f"{path}.meta_info"),
        }


def _is_dataproto_like(value: Any) -> bool:
    return hasattr(value, "non_tensor_batch") and hasattr(value, "meta_info") and hasattr(value, "batch")


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def tensor(self, ref: str) -> torch.Tensor:
        return self.tensors[ref]

    def node(self, node: dict[str, Any]) -> Any:
        kind = node["kind"]
        if kind == "tensor":
            return self.tensors[node["ref"]]
        if kind == "jagged":
            lengths = node.get("lengths")
            return torch.nested.nested_tensor_from_jagged(
                self.tensors[node["values"]], self.tensors[node["offsets"]],
                lengths=None if lengths is None else self.tensors[lengths], jagged_dim=node["ragged_idx"],
            )
        if kind == "nested":
            return torch.nested.nested_tensor([self.tensors[r] for r in node["parts"]])
        if kind == "tensordict":
            return self.tensordict(node)
        if kind == "batch":
            return self.batch(node)
        if kind == "array":
            return self.tensors[node["ref"]].numpy().view(np.dtype(node["dtype"])).reshape(node["shape"])
        if kind == "object_array":
            return decode_object_array(node["v"], self.tensor).reshape(node["shape"])
        if kind == "dict":
            return {k: self.node(v) for k, v in node["entries"].items()}
        if kind == "value":
            return decode_value(node["v"], self.tensor)
        raise ValueError(f"unknown node kind {kind!r}")

    def tensordict(self, node: dict[str, Any]) -> TensorDict:
        td = TensorDict({}, batch_size=node["batch_size"])
        for key, child in node["entries"].items():
            kind = child["kind"]
            if kind == "non_tensor_data":
                td.set(key, NonTensorData(data=decode_value(child["v"], self.tensor), batch_size=child["batch_size"]))
            elif kind == "non_tensor_stack":
                rows = decode_value(child["v"], self.tensor)
                stack = NonTensorStack(*(NonTensorData(data=r, batch_size=child["batch_size"][1:]) for r in rows))
                td.set(key, stack)
            else:
                td.set(key, self.node(child))
        return td

    def batch(self, node: dict[str, Any]) -> Any:
        td = None if node["batch"] is None else self.tensordict(node["batch"])
        non_tensor = {k: self.node(v) for k, v in node["non_tensor_batch"].items()}
        meta_info = decode_value(node["meta_info"], self.tensor)
        if node["cls"] == "verl.protocol.DataProto":
            try:
                from verl.protocol import DataProto  # type: ignore[import-not-found]

                return DataProto(batch=td, non_tensor_batch=non_tensor, meta_info=meta_info)
            except ImportError:
                pass
        return Batch(batch=td, non_tensor_batch=non_tensor, meta_info=meta_info)


class SafeFormat:
    """Encode and decode entries of ``format: safe``.

    Example:
        >>> fmt = SafeFormat()
        >>> files = fmt.encode(fmt.freeze({"x": torch.arange(3)}, copy=False))
        >>> fmt.decode(files)["x"].tolist()
        [0, 1, 2]
    """

    name = "safe"
    uses_pickle = False
    files = (TENSORS_FILE, TREE_FILE)

    def freeze(self, value: Any, copy: bool) -> Frozen:
        """Take a snapshot of ``value``; with ``copy`` it shares no memory with the caller's objects.

        Raises:
            UnstorableValueError: a part of ``value`` cannot be stored; the message names it.
        """
        encoder = _Encoder(copy)
        root = encoder.node(value, "result")
        return Frozen(tensors=encoder.tensors, tree={"format": self.name, "version": VERSION, "root": root})

    def encode(self, frozen: Frozen) -> dict[str, bytes]:
        """Serialise a snapshot into the entry's files."""
        tree = json.dumps(frozen.tree, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        return {TENSORS_FILE: st_save(frozen.tensors), TREE_FILE: tree}

    def decode(self, files: Mapping[str, bytes]) -> Any:
        """Rebuild the value from the entry's files.

        Raises:
            CorruptEntryError: the files cannot be parsed.
        """
        try:
            tree = json.loads(files[TREE_FILE])
            tensors = st_load(files[TENSORS_FILE])
            return _Decoder(tensors).node(tree["root"])
        except Exception as err:  # the decode boundary: any failure to parse these bytes is a damaged entry
            raise CorruptEntryError(f"cannot decode a 'safe' entry: {type(err).__name__}: {err}") from err
