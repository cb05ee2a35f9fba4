"""The queue client stepskip talks to (:class:`TQClient`) and an in-process one with the semantics of
``transfer_queue``'s KV interface.

The in-process client is used by tests and by the reference pipelines' embedded default; pass it explicitly as
``SkipManager.init(cfg, tq_client=InProcessTQClient())``. Like the real queue it stores data per
row: per-key fields and tags inside partitions, column-wise puts that add fields to existing
keys, and reads that return per-row tensors as jagged nested tensors (per-row scalars come
back dense, non-tensor values as a ``NonTensorStack``).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

__all__ = ["InProcessTQClient", "KVBatchMeta", "TQClient"]

logger = logging.getLogger(__name__)


@runtime_checkable
class TQClient(Protocol):
    """The TransferQueue client the ``rollout_tq`` role reads trajectories from and injects them into.

    It is the part of ``transfer_queue``'s KV interface (0.1.11) that stepskip calls, with its
    signatures: the ``transfer_queue`` module itself satisfies it, as does
    :class:`InProcessTQClient`; anything else passed as ``SkipManager.init(cfg, tq_client=...)``
    needs these two methods. ``isinstance(client, TQClient)`` checks that both exist (not their
    signatures).

    Example:
        >>> isinstance(InProcessTQClient(), TQClient)
        True
    """

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: TensorDict | None = None,
                     tags: list[dict[str, Any]] | None = None) -> object:
        """Store rows and tags of ``keys`` in ``partition_id``.

        Args:
            keys: one key per row.
            partition_id: the partition (``"train"``, ``"val"``, ...).
            fields: one row per key; None for a put that only updates tags.
            tags: one dict per key, merged into the key's stored tags.

        Returns:
            A batch meta (``keys``, ``tags``, ``partition_id``, ``fields``); stepskip does not read it.
        """
        ...

    def kv_batch_get(self, keys: list[str] | str, partition_id: str,
                     select_fields: list[str] | str | None = None) -> TensorDict:
        """The rows of ``keys`` in ``partition_id``.

        Args:
            keys: a key or a list of keys.
            partition_id: the partition they were put in.
            select_fields: the fields to read; None reads every field all the keys hold.

        Returns:
            A TensorDict with one row per key found.
        """
        ...


@dataclasses.dataclass
class KVBatchMeta:
    """What ``kv_batch_put`` returns and ``ReplayBuffer.sample`` hands out: keys, tags, partition."""

    keys: list[str] = dataclasses.field(default_factory=list)
    tags: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise ValueError(f"keys and tags must have the same length, got {len(self.keys)} and {len(self.tags)}")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("Got duplicated keys.")

    @property
    def size(self) -> int:
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


def _keys(keys: Any) -> list[str]:
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise TypeError("Only string or list of strings are allowed as `keys`.")
    if not keys:
        raise ValueError("Received an empty list as keys.")
    return list(keys)


def _rows_of(name: str, value: Any, count: int) -> list[Any]:
    if is_non_tensor(value):
        if not isinstance(value, NonTensorStack):
            raise TypeError(f"field {name!r}: a batch-wide NonTensorData cannot be stored per key; "
                            "give one value per row (NonTensorStack)")
        return list(value.tolist())
    if isinstance(value, TensorDictBase):
        raise ValueError(f"field {name!r}: nested TensorDicts are not supported by the queue")
    rows = list(value.unbind(0))
    if len(rows) != count:
        raise ValueError(f"field {name!r} has {len(rows)} rows for {count} keys")
    return rows


def _column(rows: list[Any]) -> Any:
    if rows and all(isinstance(r, torch.Tensor) for r in rows):
        if all(r.dim() == 0 for r in rows):
            return torch.stack(rows)
        return torch.nested.as_nested_tensor([r.contiguous() for r in rows], layout=torch.jagged)
    return NonTensorStack(*(NonTensorData(data=r, batch_size=[]) for r in rows), batch_size=[len(rows)])


def _common_fields(records: list[dict[str, Any]]) -> list[str]:
    if not records:
        return []
    common = set(records[0])
    for record in records[1:]:
        common &= set(record)
    return sorted(common)


class InProcessTQClient:
    """``kv_batch_put`` / ``kv_batch_get`` / ``kv_list`` / ``kv_clear`` over in-memory partitions.

    Matches transfer_queue 0.1.11 where the two were compared (tests/integration/tq): fields must
    be a TensorDict of per-row values, keys a str or a list of str; a get without
    ``select_fields`` returns the fields every key holds; missing keys are skipped with a warning.
    Unlike the real queue, a put that fails leaves nothing behind.

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

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: TensorDictBase | None = None,
                     tags: Sequence[dict[str, Any]] | None = None) -> KVBatchMeta:
        keys = _keys(keys)
        if len(set(keys)) != len(keys):
            raise ValueError("Got duplicated keys.")
        if fields is None and not tags:
            raise ValueError("kv_batch_put needs fields or tags")
        if tags is not None and len(tags) != len(keys):
            raise ValueError(f"tags has {len(tags)} entries for {len(keys)} keys")
        columns: dict[str, list[Any]] = {}
        if fields is not None:
            if not isinstance(fields, TensorDictBase):
                raise TypeError(
                    f"fields must be a TensorDict with batch_size [{len(keys)}], got {type(fields).__name__}"
                )
            for name in fields.keys():
                columns[name] = _rows_of(name, fields.get(name), len(keys))
        with self._lock:
            partition = self._partitions.setdefault(partition_id, {})
            for i, key in enumerate(keys):
                record = partition.setdefault(key, {"fields": {}, "tags": {}})
                for name, rows in columns.items():
                    record["fields"][name] = rows[i]
                if tags is not None:
                    record["tags"].update(copy.deepcopy(tags[i]))
            out_tags = [copy.deepcopy(partition[k]["tags"]) for k in keys]
            field_names = _common_fields([partition[k]["fields"] for k in keys])
        return KVBatchMeta(keys=keys, tags=out_tags, partition_id=partition_id, fields=field_names)

    def kv_batch_get(self, keys: list[str] | str, partition_id: str,
                     select_fields: Sequence[str] | str | None = None) -> TensorDict:
        """Rows of ``keys``; keys the partition lacks are skipped with a warning, as the real queue does."""
        keys = _keys(keys)
        with self._lock:
            partition = self._partitions.get(partition_id, {})
            found = [k for k in keys if k in partition]
            records = [partition[k]["fields"] for k in found]
        if not found:
            raise ValueError(f"keys or partition were not found! (partition {partition_id!r})")
        if len(found) < len(keys):
            logger.warning("kv_batch_get: %d of %d keys not found in partition %r", len(keys) - len(found),
                           len(keys), partition_id)
        if select_fields is None:
            names = _common_fields(records)
            if not names:
                raise ValueError("Some fields are not ready in all the requested keys!")
        else:
            names = [select_fields] if isinstance(select_fields, str) else list(select_fields)
            if any(name not in r for r in records for name in names):
                logger.warning("kv_batch_get: a selected field is missing for some keys; returning nothing")
                return TensorDict({}, batch_size=[0])
        out = TensorDict({}, batch_size=[len(found)])
        for name in names:
            out.set(name, _column([r[name] for r in records]))
        return out

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
        with self._lock:
            chosen = [partition_id] if partition_id is not None else list(self._partitions)
            return {p: {k: copy.deepcopy(v["tags"]) for k, v in self._partitions[p].items()}
                    for p in chosen if p in self._partitions}

    def kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        keys = _keys(keys)
        with self._lock:
            partition = self._partitions.get(partition_id, {})
            for key in keys:
                partition.pop(key, None)
