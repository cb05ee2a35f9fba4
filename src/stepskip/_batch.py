"""``Batch``: a DataProto-compatible container for rollout data."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from tensordict import cat as cat_tensordicts

__all__ = ["Batch"]


def _object_array(values: Any) -> np.ndarray:
    """A 1-D numpy array; lists of lists/dicts become object arrays of those items, not 2-D arrays."""
    if isinstance(values, np.ndarray):
        return values
    items = list(values)
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


@dataclass
class Batch:
    """Rollout data in verl's ``DataProto`` shape.

    Args:
        batch: the tensors, a :class:`tensordict.TensorDict` whose first batch dimension is the
            row count, or None.
        non_tensor_batch: per-row numpy arrays (object arrays for strings, dicts, lists).
        meta_info: free-form metadata (timings, flags such as ``validate``).

    Example:
        >>> b = Batch.from_dict(tensors={"ids": torch.zeros(2, 3)}, non_tensors={"uid": ["a", "b"]})
        >>> len(b), b["uid"].tolist()
        (2, ['a', 'b'])
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """With tensors, every non-tensor column holds one item per row, as verl's ``DataProto`` checks.

        Raises:
            ValueError: a column that is not a sequence, or whose length is not the row count.
        """
        if self.batch is None or self.batch.batch_dims == 0:
            return
        rows = len(self.batch)
        for key, column in self.non_tensor_batch.items():
            try:
                count = len(column)
            except TypeError:
                raise ValueError(f"non-tensor column {key!r} is a {type(column).__qualname__}, "
                                 "not one item per row") from None
            if count != rows:
                raise ValueError(f"non-tensor column {key!r} holds {count} rows, the batch {rows}")

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build a batch from plain dicts; the row count is the first dimension of the tensors."""
        td = None
        if tensors:
            first = next(iter(tensors.values()))
            rows = first.size(0)
            td = TensorDict(dict(tensors), batch_size=[rows])
        non_tensor = {k: _object_array(v) for k, v in (non_tensors or {}).items()}
        return cls(batch=td, non_tensor_batch=non_tensor, meta_info=dict(meta_info or {}))

    @property
    def tensors(self) -> TensorDict:
        """``batch``, for code that needs the tensors: a batch without them is an error, not ``None``.

        Raises:
            ValueError: the batch holds no tensors (``batch`` is None).

        Example:
            >>> Batch.from_dict(tensors={"ids": torch.zeros(2, 3)}).tensors["ids"].shape
            torch.Size([2, 3])
        """
        if self.batch is None:
            raise ValueError(
                f"this Batch holds no tensors (batch is None; non-tensor columns: {sorted(self.non_tensor_batch)}); "
                "build it with Batch.from_dict(tensors=...)"
            )
        return self.batch

    def __len__(self) -> int:
        if self.batch is not None and self.batch.batch_dims > 0:
            return int(self.batch.batch_size[0])
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __getitem__(self, item: Any) -> Any:
        """``batch["uid"]`` reads a column; an int, slice or index array selects rows."""
        if isinstance(item, str):
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            if self.batch is not None and item in self.batch.keys():
                return self.batch[item]
            raise KeyError(item)
        if isinstance(item, int):
            item = slice(item, item + 1) if item != -1 else slice(item, None)
        index = item if isinstance(item, slice) else np.asarray(item)
        td = None
        if self.batch is not None:
            td = self.batch[index if isinstance(index, slice) else torch.as_tensor(index)]
        non_tensor = {k: v[index] for k, v in self.non_tensor_batch.items()}
        return Batch(batch=td, non_tensor_batch=non_tensor, meta_info=dict(self.meta_info))

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenate batches row-wise; ``meta_info`` is taken from the first."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        tds = [b.batch for b in batches if b.batch is not None]
        td = cat_tensordicts(tds, dim=0) if len(tds) == len(batches) else None
        keys = batches[0].non_tensor_batch.keys()
        non_tensor = {k: np.concatenate([b.non_tensor_batch[k] for b in batches], axis=0) for k in keys}
        return Batch(batch=td, non_tensor_batch=non_tensor, meta_info=dict(batches[0].meta_info))

    def chunk(self, chunks: int) -> list[Batch]:
        """Split into ``chunks`` nearly equal parts (the last ones may be one row shorter)."""
        rows = len(self)
        bounds = np.linspace(0, rows, chunks + 1).round().astype(int)
        return [self[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:])]
