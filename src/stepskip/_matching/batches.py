"""Row-level pieces of ``action: match``: prompt groups, the prompt index, row selection and merging.

A *prompt group* is the set of rows of a batch whose prompt content is the same (the
``rebind_keys`` columns excluded): a GRPO group of ``n`` samples is one group. Every entry a
row-wise role writes records one digest per row (``meta["row_prompts"]``, from
:func:`stepskip._fidelity.prompt_row_digests`); the index maps a digest to the entry and rows that
hold its responses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from stepskip._calls import is_dataproto_like

__all__ = ["group_rows", "PromptIndex", "MatchSplit", "select_batch_rows", "concat_batches", "batch_rows", "row_count",
           "rows_unlike_prompts", "join_problem", "Recorded", "RecordedRow", "LoadedRows"]


def batch_rows(value: Any) -> int:
    """The row count of a DataProto-like batch or a TensorDict; -1 when it has no rows to speak of."""
    if is_dataproto_like(value):
        if value.batch is not None:
            return int(value.batch.batch_size[0]) if len(value.batch.batch_size) else -1
        columns = list(value.non_tensor_batch.values())
        return len(columns[0]) if columns else -1
    batch_size = getattr(value, "batch_size", None)
    if batch_size is not None and len(batch_size):
        return int(batch_size[0])
    return -1


def row_count(value: Any) -> int:
    """The rows of a call's result, for the counters: 0 for a value without rows, or one that cannot say
    (reading it is the snapshot's job, which reports what is wrong with it)."""
    try:
        return max(batch_rows(value), 0)
    except Exception:
        return 0


def group_rows(digests: Sequence[str]) -> dict[str, list[int]]:
    """The rows of each prompt group, groups in order of first appearance.

    Example:
        >>> group_rows(["a", "b", "a"])
        {'a': [0, 2], 'b': [1]}
    """
    groups: dict[str, list[int]] = {}
    for row, digest in enumerate(digests):
        groups.setdefault(digest, []).append(row)
    return groups


class Recorded(NamedTuple):
    """Where a prompt group was recorded: the entry and the group's rows in it."""

    path: str
    rows: list[int]


class RecordedRow(NamedTuple):
    """Where one live row's response was recorded: the entry and the row in it."""

    path: str
    row: int


@dataclass
class LoadedRows:
    """The recorded rows of one entry a split replays, read and checked when the split was made.

    Args:
        rows: those rows, as a batch.
        indices: their indices in the entry.
        meta: the entry's ``meta.json``.
        nbytes: the bytes read.
    """

    rows: Any
    indices: list[int]
    meta: dict[str, Any]
    nbytes: int


@dataclass
class PromptIndex:
    """Prompt digest -> the entry and rows (:class:`Recorded`) of an entry that recorded its responses.

    Built from the ``row_prompts`` of the entries' ``meta.json`` — written atomically with each
    entry — so it never points at an entry that does not exist or holds other rows, and can
    always be rebuilt from the entries alone. Among entries recording the same prompt, the one of
    the latest step wins; among those of one step, the one of the greatest ``rank`` given to
    :meth:`add`, then the last added.
    """

    groups: dict[str, Recorded] = field(default_factory=dict)
    entries: dict[str, int] = field(default_factory=dict)  # entry path -> its step
    by_dir: dict[str, set[str]] = field(default_factory=dict)  # directory -> names of its entries indexed
    _rows: dict[str, dict[str, list[int]]] = field(default_factory=dict, repr=False)  # path -> digest -> rows
    _holders: dict[str, dict[str, int]] = field(default_factory=dict, repr=False)  # digest -> path -> order added
    _ranks: dict[str, tuple[tuple[Any, ...], int]] = field(default_factory=dict, repr=False)  # path -> (rank, order)
    _added: int = field(default=0, repr=False)

    def add(self, path: str, step: int, digests: Sequence[str], rank: tuple[Any, ...] = ()) -> None:
        """Index the entry at ``path`` of ``step`` holding rows of ``digests``; ``rank`` (comparable
        tuples, the same shape for every entry) breaks a tie with an entry of the same step before the
        order of addition does."""
        self.forget(path)
        self.entries[path] = step
        parent, _, name = path.rpartition("/")
        self.by_dir.setdefault(parent, set()).add(name)
        self._added += 1
        self._ranks[path] = order = (rank, self._added)
        self._rows[path] = grouped = group_rows(digests)
        for digest, rows in grouped.items():
            self._holders.setdefault(digest, {})[path] = self._added
            current = self.groups.get(digest)
            if current is None or current.path not in self.entries or self.key_of(current.path) <= (step, *order):
                self.groups[digest] = Recorded(path, rows)

    def key_of(self, path: str) -> tuple[int, tuple[Any, ...], int]:
        """What decides between ``path`` and another indexed entry recording the same prompt (the greater
        wins): its step, its rank, the order it was added in."""
        return (self.entries[path], *self._ranks[path])

    def forget(self, path: str) -> None:
        """Drop ``path``; each prompt it served falls back to the other entry recording it (latest step,
        then rank, then the last added), so forgetting one entry never hides another's prompts."""
        if self.entries.pop(path, None) is None:
            return
        self._ranks.pop(path, None)
        parent, _, name = path.rpartition("/")
        names = self.by_dir.get(parent)
        if names is not None:
            names.discard(name)
            if not names:
                del self.by_dir[parent]
        for digest in self._rows.pop(path, {}):
            holders = self._holders.get(digest, {})
            holders.pop(path, None)
            if not holders:
                self._holders.pop(digest, None)
                self.groups.pop(digest, None)
            elif digest in self.groups and self.groups[digest].path == path:
                best = max(holders, key=self.key_of)
                self.groups[digest] = Recorded(best, self._rows[best][digest])


@dataclass
class MatchSplit:
    """How a live batch divides into recorded and missing prompt groups.

    Args:
        digests: one per live row.
        found: live row -> where it was recorded, for every row that is replayed.
        missing_rows: live rows to generate, in live order.
        subset: the live prompts restricted to ``missing_rows`` (None when nothing is missing).
        sources: entry path -> how many prompt groups are taken from it.
        loaded: entry path -> its recorded rows that are replayed, read and checked when the split was made.
        damaged: entries found damaged while the split was made (counted once).
    """

    digests: list[str]
    found: dict[int, RecordedRow]
    missing_rows: list[int]
    subset: Any = None
    sources: dict[str, int] = field(default_factory=dict)
    loaded: dict[str, LoadedRows] = field(default_factory=dict)
    damaged: list[str] = field(default_factory=list)

    def keeping(self, loaded: dict[str, LoadedRows], prompts: Any,
                damaged: Sequence[str] = ()) -> MatchSplit:
        """This split replaying only the entries of ``loaded``: the rows of any other entry are generated
        too (``prompts``: the live call's, for the new ``subset``; ``damaged``: entries to add to it)."""
        found = {row: where for row, where in self.found.items() if where.path in loaded}
        missing = sorted(self.missing_rows + [row for row, where in self.found.items() if where.path not in loaded])
        subset = None if not missing else prompts if not found else select_batch_rows(prompts, missing)
        return MatchSplit(digests=self.digests, found=found, missing_rows=missing, subset=subset,
                          sources={path: n for path, n in self.sources.items() if path in loaded},
                          loaded=dict(loaded), damaged=[*self.damaged, *damaged])


def select_batch_rows(value: Any, rows: Sequence[int]) -> Any:
    """Rows ``rows`` (any order, repeats allowed) of a DataProto-like batch or a TensorDict, as the same type."""
    from stepskip.tq.rows import select_rows

    if is_dataproto_like(value):
        index = np.asarray(rows, dtype=np.int64)
        batch = None if value.batch is None else select_rows(value.batch, list(rows))
        non_tensor = {k: np.asarray(v)[index] for k, v in value.non_tensor_batch.items()}
        return _rebuild(value, batch, non_tensor, dict(value.meta_info))
    return select_rows(value, list(rows))


def concat_batches(parts: Sequence[Any]) -> Any:
    """Join batches of one type row-wise (meta_info from the first).

    Raises:
        ValueError: the parts hold other columns, or columns of other dtypes (a join would drop
            or silently convert them).
    """
    from stepskip.tq.rows import concat_rows

    problem = _column_mismatch(parts)
    if problem is not None:
        raise ValueError(f"cannot join these batches row-wise: {problem}")
    first = parts[0]
    if is_dataproto_like(first):
        batches = [p.batch for p in parts]
        batch = None if any(b is None for b in batches) else concat_rows(batches)
        keys = list(first.non_tensor_batch)
        non_tensor = {k: np.concatenate([np.asarray(p.non_tensor_batch[k]) for p in parts]) for k in keys}
        return _rebuild(first, batch, non_tensor, dict(first.meta_info))
    return concat_rows(list(parts))


def _column_mismatch(parts: Sequence[Any]) -> str | None:
    """How a part's columns (non-tensor names; tensor names and dtypes) differ from the first part's."""
    first = parts[0]
    names = set(first.non_tensor_batch) if is_dataproto_like(first) else None
    dtypes = _dtypes(first)
    for i, part in enumerate(parts[1:], start=1):
        if names is not None and set(part.non_tensor_batch) != names:
            return f"part {i} has the non-tensor columns {sorted(part.non_tensor_batch)}, part 0 {sorted(names)}"
        other = _dtypes(part)
        if other != dtypes:
            if other.keys() != dtypes.keys():
                return f"part {i} has the tensors {sorted(other)}, part 0 {sorted(dtypes)}"
            key = next(k for k in dtypes if other[k] != dtypes[k])
            return f"part {i}'s {key!r} is {other[key]}, part 0's {dtypes[key]}"
    return None


def rows_unlike_prompts(value: Any, recorded: Any) -> str | None:
    """Why an entry's data does not hold the rows its ``row_prompts`` (``recorded``) describe, or None."""
    rows = batch_rows(value)
    if not isinstance(recorded, list) or rows != len(recorded):
        count = len(recorded) if isinstance(recorded, list) else 0
        return f"its data holds {rows} rows but its meta.json records the prompts of {count}"
    return None


def join_problem(parts: Sequence[Any]) -> str | None:
    """Why ``parts`` cannot be joined row-wise (other columns, dtypes or trailing shapes), or None.

    Cheap: one row of each part is joined, which exercises every column without copying the batches.
    """
    if len(parts) < 2:
        return None
    try:
        concat_batches([select_batch_rows(p, [0]) if batch_rows(p) > 0 else p for p in parts])
    except Exception as err:  # any failure to join is the answer, never an escape into the trainer
        return f"its columns cannot be joined with the others' ({type(err).__name__}: {err})"
    return None


def _dtypes(value: Any) -> dict[str, str]:
    import torch

    batch = value.batch if is_dataproto_like(value) else value
    if batch is None or not hasattr(batch, "items"):
        return {}
    return {str(k): str(v.dtype) for k, v in batch.items(True, True) if isinstance(v, torch.Tensor)}


def _rebuild(like: Any, batch: Any, non_tensor: Mapping[str, np.ndarray], meta_info: dict[str, Any]) -> Any:
    try:
        return type(like)(batch=batch, non_tensor_batch=dict(non_tensor), meta_info=meta_info)
    except TypeError:
        from stepskip._batch import Batch

        return Batch(batch=batch, non_tensor_batch=dict(non_tensor), meta_info=meta_info)
