"""Row operations on TensorDicts that keep jagged tensors jagged and non-tensor stacks as they are.

``select_rows`` picks rows in any order, repeats included, without unbinding or densifying a
nested tensor: for a jagged tensor it gathers the selected rows' values with one index
computation and rebuilds the offsets. ``concat_rows`` joins TensorDicts row-wise the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

from stepskip._formats.bounds import jagged_problem

__all__ = ["select_rows", "concat_rows", "num_rows", "payload_problem"]


def _index(indices: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(indices, dtype=torch.long).reshape(-1)


# Jagged tensors are typed Any below: torch's stubs do not declare offsets(), lengths() and _ragged_idx.
def _checked(tensor: Any) -> Any:
    """``tensor`` itself when it is a valid jagged tensor: the gathers below trust its offsets."""
    problem = jagged_problem(tensor.values(), tensor.offsets(), tensor.lengths(), tensor._ragged_idx)
    if problem is not None:
        raise ValueError(f"invalid jagged tensor: {problem}")
    return tensor


def _select_jagged(tensor: Any, index: torch.Tensor) -> torch.Tensor:
    _checked(tensor)
    rows = tensor.size(0)
    index = torch.where(index < 0, index + rows, index)  # negative rows count from the end, as for dense tensors
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows):
        raise IndexError(f"row index out of range for a jagged tensor of {rows} rows")
    if tensor._ragged_idx != 1 or tensor.lengths() is not None:
        parts = tensor.unbind()  # rare layouts: fall back to rebuilding from the rows
        return torch.nested.as_nested_tensor([parts[i] for i in index.tolist()], layout=torch.jagged)
    offsets = tensor.offsets()
    values = tensor.values()
    starts = offsets[index]
    new_offsets = torch.zeros(index.numel() + 1, dtype=offsets.dtype)
    torch.cumsum(offsets[index + 1] - starts, 0, out=new_offsets[1:])
    # consecutive rows are one contiguous run of values: copy runs (one for rows in their recorded
    # order), not a per-element gather whose index tensors outweigh the values themselves
    bounds = offsets.tolist()
    runs: list[list[int]] = []
    for row in index.tolist():
        if runs and runs[-1][1] == row:
            runs[-1][1] = row + 1
        else:
            runs.append([row, row + 1])
    picked = [values[bounds[first]:bounds[end]] for first, end in runs]
    out = picked[0].clone() if len(picked) == 1 else torch.cat(picked) if picked else values[:0].clone()
    return torch.nested.nested_tensor_from_jagged(out, new_offsets)


def _select_tensor(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if tensor.is_nested:
        if tensor.layout == torch.jagged:
            return _select_jagged(tensor, index)
        parts = tensor.unbind()
        return torch.nested.nested_tensor([parts[i] for i in index.tolist()])
    return tensor[index]


def select_rows(data: Any, indices: Sequence[int] | torch.Tensor) -> Any:
    """Rows ``indices`` (any order, repeats allowed) of a TensorDict, a mapping of columns, or a column.

    Regular tensors are indexed, jagged tensors gathered without densifying, ``NonTensorStack``
    rows picked, ``NonTensorData`` (one value for the whole batch) kept; lists and numpy arrays
    inside a mapping are picked row-wise.

    Example:
        >>> nt = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
        >>> [r.tolist() for r in select_rows(TensorDict({"x": nt}, batch_size=[2]), [1, 1, 0])["x"].unbind()]
        [[0, 1, 2], [0, 1, 2], [0, 1]]
    """
    index = _index(indices)
    if isinstance(data, TensorDictBase):
        out = TensorDict({}, batch_size=[index.numel()])
        for key in data.keys():
            item = data.get(key)
            if is_non_tensor(item):
                if isinstance(item, NonTensorStack):
                    rows = item.tolist()
                    out.set(key, NonTensorStack(*(NonTensorData(data=rows[i], batch_size=[]) for i in index.tolist()),
                                                batch_size=[index.numel()]) if index.numel() else
                            NonTensorStack.from_list([]))
                else:
                    out.set_non_tensor(key, item.data)
            else:
                out.set(key, select_rows(item, index))
        return out
    if isinstance(data, torch.Tensor):
        return _select_tensor(data, index)
    if isinstance(data, Mapping):
        return {k: select_rows(v, index) for k, v in data.items()}
    if isinstance(data, np.ndarray):
        return data[index.numpy()]
    if isinstance(data, (list, tuple)):
        return [data[i] for i in index.tolist()]
    raise TypeError(f"cannot select rows of {type(data).__qualname__}")


def _concat_tensors(parts: list[Any]) -> torch.Tensor:
    if not parts[0].is_nested:
        return torch.cat(parts, dim=0)
    if all(p.layout == torch.jagged and p._ragged_idx == 1 and p.lengths() is None for p in parts):
        for part in parts:
            _checked(part)
        values = torch.cat([p.values() for p in parts], dim=0)
        lengths = torch.cat([p.offsets().diff() for p in parts])
        offsets = torch.zeros(lengths.numel() + 1, dtype=parts[0].offsets().dtype)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    rows = [row for p in parts for row in p.unbind()]
    return torch.nested.as_nested_tensor(rows, layout=parts[0].layout)


def concat_rows(parts: Sequence[Any]) -> Any:
    """Join TensorDicts (or mappings of columns) row-wise; jagged tensors stay jagged."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if isinstance(first, TensorDictBase):
        out = TensorDict({}, batch_size=[sum(num_rows(p) for p in parts)])
        for key in first.keys():
            items = [p.get(key) for p in parts]
            if is_non_tensor(items[0]):
                if isinstance(items[0], NonTensorStack) or any(isinstance(i, NonTensorStack) for i in items):
                    rows = [r for p, i in zip(parts, items) for r in _non_tensor_rows(i, num_rows(p))]
                    out.set(key, NonTensorStack(*(NonTensorData(data=r, batch_size=[]) for r in rows),
                                                batch_size=[len(rows)]))
                else:
                    out.set_non_tensor(key, items[0].data)
            else:
                out.set(key, concat_rows(items) if isinstance(items[0], TensorDictBase) else _concat_tensors(items))
        return out
    if isinstance(first, torch.Tensor):
        return _concat_tensors(list(parts))
    if isinstance(first, Mapping):
        return {k: concat_rows([p[k] for p in parts]) for k in first}
    if isinstance(first, np.ndarray):
        return np.concatenate(parts, axis=0)
    if isinstance(first, (list, tuple)):
        return [x for p in parts for x in p]
    raise TypeError(f"cannot concatenate {type(first).__qualname__}")


def _non_tensor_rows(item: Any, rows: int) -> list[Any]:
    if isinstance(item, NonTensorStack):
        return item.tolist()
    return [item.data] * rows


def num_rows(data: Any) -> int:
    """The row count of a TensorDict, tensor, mapping of columns, array or list."""
    if isinstance(data, TensorDictBase):
        return int(data.batch_size[0]) if data.batch_dims else 0
    if isinstance(data, torch.Tensor):
        return int(data.size(0))
    if isinstance(data, Mapping):
        for value in data.values():
            return num_rows(value)
        return 0
    return len(data)


def payload_problem(payload: Any, recorded: list[Any] | None = None) -> str | None:
    """Why a decoded V1 inner entry (``{"tensordict", "keys", "tags", ...}``) is no payload whose keys, tags,
    rows (and recorded prompts, when given) describe the same trajectories; None when it is one.

    A cache is data someone else may have written: checksums prove the bytes, not their shape, so
    every decoded payload is checked before its keys or tags are used.

    Example:
        >>> payload_problem({"tensordict": torch.zeros(2), "keys": ["a", "b"], "tags": [{}, 5]})
        'one of its tags is not a mapping'
    """
    if not isinstance(payload, dict) or "tensordict" not in payload:
        return "it does not hold a V1 payload"
    keys, tags = payload.get("keys"), payload.get("tags")
    if not isinstance(keys, list) or not isinstance(tags, list):
        return "its keys or tags are not lists"
    if not all(isinstance(t, dict) for t in tags):
        return "one of its tags is not a mapping"
    try:
        rows = num_rows(payload["tensordict"])
    except Exception:  # a decoded value that is no batch of rows
        rows = -1
    if recorded is None:
        if not len(keys) == len(tags) == rows:
            return f"its data holds {rows} rows, {len(keys)} keys and {len(tags)} tags"
    elif not len(keys) == len(tags) == rows == len(recorded):
        return (f"its data holds {rows} rows, {len(keys)} keys and {len(tags)} tags, and its meta.json records "
                f"the prompts of {len(recorded)} trajectories")
    return None
