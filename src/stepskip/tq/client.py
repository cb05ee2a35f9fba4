"""An in-process TransferQueue client with the semantics of ``transfer_queue``'s KV interface.

Used by tests and by the reference pipelines' embedded default; pass it explicitly as
``SkipManager.init(cfg, tq_client=InProcessTQClient())``. Like the real queue it stores data per
row: per-key fields and tags inside partitions, column-wise puts that add fields to existing
keys, and reads that return per-row tensors as jagged nested tensors (per-row scalars come
back dense, non-tensor values as a ``NonTensorStack``).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

__all__ = ["InProcessTQClient", "KVBatchMeta"]


@dataclasses.dataclass
class KVBatchMeta:
    """What ``kv_batch_put`` returns and ``ReplayBuffer.sample`` hands out: keys, tags, partition."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have the same length, got {len(self.keys)} and {len(self.tags)}")

    def __len__(self) -> int:
        return len(self.keys)


def _as_list(keys: Sequence[str] | str) -> list[str]:
    return [keys] if isinstance(keys, str) else list(keys)


def _rows_of(name: str, value: Any, count: int) -> list[Any]:
    if is_non_tensor(value):
        return list(value.tolist()) if isinstance(value, NonTensorStack) else [value.data] * count
    if isinstance(value, TensorDictBase):
        raise ValueError(f"field {name!r}: nested TensorDicts are not supported by the queue")
    if isinstance(value, torch.Tensor):
        rows = list(value.unbind(0))
    else:
        rows = list(value)
    if len(rows) != count:
        raise ValueError(f"field {name!r} has {len(rows)} rows for {count} keys")
    return rows


def _column(rows: list[Any]) -> Any:
    if rows and all(isinstance(r, torch.Tensor) for r in rows):
        if all(r.dim() == 0 for r in rows):
            return torch.stack(rows)
        return torch.nested.as_nested_tensor([r.contiguous() for r in rows], layout=torch.jagged)
    return NonTensorStack(*(NonTensorData(data=r, batch_size=[]) for r in rows), batch_size=[len(rows)])


class InProcessTQClient:
    """``kv_batch_put`` / ``kv_batch_get`` / ``kv_list`` / ``kv_clear`` over in-memory partitions.

    Example:
        >>> tq = InProcessTQClient()
        >>> _ = tq.kv_batch_put(keys=["a", "b"], partition_id="train",
        ...                     fields=TensorDict({"x": torch.arange(2)}, batch_size=[2]), tags=[{}, {}])
        >>> tq.kv_batch_get(keys=["b"], partition_id="train")["x"].tolist()
        [1]
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # partition -> key -> {"fields": {name: row}, "tags": {...}}
        self._partitions: dict[str, dict[str, dict[str, Any]]] = {}

    def kv_batch_put(self, keys: Sequence[str], partition_id: str, fields: Any = None,
                     tags: Sequence[dict[str, Any]] | None = None) -> KVBatchMeta:
        keys = _as_list(keys)
        if fields is None and not tags:
            raise ValueError("kv_batch_put needs fields or tags")
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"tags has {len(tags)} entries for {len(keys)} keys")
        columns: dict[str, list[Any]] = {}
        if fields is not None:
            items = fields.items() if not isinstance(fields, TensorDictBase) else ((k, fields.get(k)) for k in fields.keys())
            for name, value in items:
                columns[name] = _rows_of(name, value, len(keys))
        with self._lock:
            partition = self._partitions.setdefault(partition_id, {})
            for i, key in enumerate(keys):
                record = partition.setdefault(key, {"fields": {}, "tags": {}})
                for name, rows in columns.items():
                    record["fields"][name] = rows[i]
                if tags is not None:
                    record["tags"].update(copy.deepcopy(tags[i]))
            out_tags = [copy.deepcopy(partition[k]["tags"]) for k in keys]
            field_names = sorted({n for k in keys for n in partition[k]["fields"]})
        return KVBatchMeta(keys=keys, tags=out_tags, partition_id=partition_id, fields=field_names)

    def kv_batch_get(self, keys: Sequence[str] | str, partition_id: str,
                     select_fields: Sequence[str] | str | None = None) -> TensorDict:
        keys = _as_list(keys)
        with self._lock:
            partition = self._partitions.get(partition_id)
            if partition is None:
                raise ValueError(f"partition {partition_id!r} not found")
            missing = [k for k in keys if k not in partition]
            if missing:
                raise ValueError(f"keys not found in partition {partition_id!r}: {missing[:5]}")
            records = [partition[k]["fields"] for k in keys]
        names = _as_list(select_fields) if select_fields is not None else sorted({n for r in records for n in r})
        out = TensorDict({}, batch_size=[len(keys)])
        for name in names:
            if any(name not in r for r in records):
                raise ValueError(f"field {name!r} is empty for some of the requested keys")
            out.set(name, _column([r[name] for r in records]))
        return out

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        with self._lock:
            chosen = [partition_id] if partition_id is not None else list(self._partitions)
            return {p: {k: copy.deepcopy(v["tags"]) for k, v in self._partitions.get(p, {}).items()} for p in chosen}

    def kv_clear(self, keys: Sequence[str] | str, partition_id: str) -> None:
        with self._lock:
            partition = self._partitions.get(partition_id, {})
            for key in _as_list(keys):
                partition.pop(key, None)
