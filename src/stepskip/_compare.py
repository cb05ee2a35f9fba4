"""Is the live result still the recorded one? The comparison behind ``action: compare`` and ``stepskip rerun``.

Pure functions: two values in (a recorded result and a live one, of any kind a role stores:
:class:`~stepskip.Batch`, verl's ``DataProto``, a ``TensorDict``, a dict of tensors, a tensor, rows
of numbers), one :class:`Drift` out. Nothing is read, written or logged here.

Both values are taken apart into named columns (``responses``, ``old_log_probs``, ``uid`` ...,
nested names joined with ``.``), paired by name, and each pair is measured by its kind:

* **tokens** (integer or boolean tensors on both sides): per row, the share of the valid positions
  holding the same value, where a position is valid on a side when its mask says so
  (``response_mask``, else ``attention_mask``, of the column's own shape) or, for rows of different
  lengths, when the row reaches it; the figure is the mean over rows;
* **float** (a floating tensor on either side): the share of the elements valid on either side that
  lie within ``|live - recorded| <= atol + rtol * |recorded|`` (NaN equals NaN), and the largest
  and mean ``|live - recorded|``;
* **values** (anything else: numpy object columns, strings, lists): the share of rows that are equal.

A field passes when its figure reaches ``min_match``; the result passes when every field does and
the prompts were not found to differ (a prompt mismatch is reported as such: the two results
answer different questions, so no field is called drifted for it).

Example:
    >>> import torch
    >>> recorded = {"responses": torch.tensor([[5, 6, 7, 0], [5, 5, 0, 0]]),
    ...             "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    >>> live = {"responses": torch.tensor([[5, 6, 8, 0], [5, 5, 0, 0]]),
    ...         "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])}
    >>> drift = compare_values(recorded, live)
    >>> round(drift.token_match, 4), drift.worst.name, drift.passed
    (0.8333, 'responses', False)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stepskip._calls import is_dataproto_like

__all__ = ["Tolerance", "FieldDrift", "Drift", "compare_values", "columns_of"]

#: The columns that say which positions of a column of the same shape hold data, in order of preference.
MASK_NAMES = ("response_mask", "attention_mask")
#: Per-row figures kept in a drift record (the rest of a larger batch is summarised by the batch figure).
MAX_ROWS_KEPT = 4096
#: Divergent rows kept as examples of the worst field, and the values kept of each side of one.
MAX_EXAMPLES = 3
MAX_EXAMPLE_VALUES = 256

_TOKENS, _FLOAT, _VALUES = "tokens", "float", "values"


@dataclass(frozen=True)
class Tolerance:
    """How close a live result must be to its recording.

    Args:
        rtol: relative tolerance of float elements.
        atol: absolute tolerance of float elements.
        min_match: the least figure (token match, share within tolerance, share of equal rows) a field
            needs to pass.
    """

    rtol: float = 1e-5
    atol: float = 1e-8
    min_match: float = 0.9


@dataclass
class FieldDrift:
    """How one column of the live result compares with the recorded one.

    Args:
        name: the column (nested names joined with ``.``).
        kind: ``tokens``, ``float`` or ``values`` (see the module docstring).
        match: the field's figure in ``[0, 1]``.
        passed: ``match`` reaches the tolerance's ``min_match``.
        rows: compared rows (the larger side's count).
        row_match: the figure of each row (at most :data:`MAX_ROWS_KEPT`; empty for ``values``).
        max_delta, mean_delta: the largest and mean ``|live - recorded|`` over the positions valid on both
            sides (None for ``values``, or when no position is).
        first_row: the first row that differs (None when none does).
        note: what made the columns incomparable in part (other row counts, other shapes).
        examples: up to :data:`MAX_EXAMPLES` divergent rows: ``{"row", "recorded", "live"}``, each side's
            valid values, at most :data:`MAX_EXAMPLE_VALUES` of them.
    """

    name: str
    kind: str
    match: float
    passed: bool
    rows: int
    row_match: list[float] = field(default_factory=list)
    max_delta: float | None = None
    mean_delta: float | None = None
    first_row: int | None = None
    note: str | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (no NaN, no infinity: those become None)."""
        return {"name": self.name, "kind": self.kind, "match": _finite(self.match), "passed": self.passed,
                "rows": self.rows, "row_match": [_finite(v) for v in self.row_match],
                "max_delta": _finite(self.max_delta), "mean_delta": _finite(self.mean_delta),
                "first_row": self.first_row, "note": self.note, "examples": self.examples}


@dataclass
class Drift:
    """The comparison of a live result with its recording.

    Args:
        fields: every column present on both sides, by name.
        tolerance: what the comparison required.
        prompts_equal: whether the call's prompts were the recorded ones (None: not known).
        only_recorded, only_live: columns present on one side only (reported, not judged).
    """

    fields: dict[str, FieldDrift]
    tolerance: Tolerance
    prompts_equal: bool | None = None
    only_recorded: list[str] = field(default_factory=list)
    only_live: list[str] = field(default_factory=list)

    @property
    def token_fields(self) -> list[FieldDrift]:
        return [f for f in self.fields.values() if f.kind == _TOKENS]

    @property
    def token_match(self) -> float | None:
        """The batch-mean token match of the lowest token field (None without token fields)."""
        tokens = self.token_fields
        return min(f.match for f in tokens) if tokens else None

    @property
    def row_token_match(self) -> list[float]:
        """The per-row token match of the field :attr:`token_match` comes from."""
        tokens = self.token_fields
        return min(tokens, key=lambda f: f.match).row_match if tokens else []

    @property
    def worst(self) -> FieldDrift | None:
        """The field with the lowest figure (of equal figures, the one with the larger ``|Δ|``)."""
        if not self.fields:
            return None
        return min(self.fields.values(), key=lambda f: (f.match, -(f.max_delta or 0.0)))

    @property
    def drifted(self) -> list[FieldDrift]:
        """The fields below ``min_match``."""
        return [f for f in self.fields.values() if not f.passed]

    @property
    def passed(self) -> bool:
        """Every field passed and the prompts were not found to differ."""
        return self.prompts_equal is not False and not self.drifted

    def describe(self) -> str:
        """The figure of the worst field in words, e.g. ``field 'responses': token match 0.412``."""
        worst = self.worst
        if worst is None:
            return "no field present on both sides"
        return describe_field(worst, self.tolerance)

    def as_record(self) -> dict[str, Any]:
        """The JSON-ready drift record (the caller adds where and when: step, role, entry ...)."""
        worst = self.worst
        return {
            "prompts_equal": self.prompts_equal,
            "token_match": _finite(self.token_match),
            "row_token_match": [_finite(v) for v in self.row_token_match],
            "worst_field": worst.name if worst else None,
            "worst_kind": worst.kind if worst else None,
            "worst_match": _finite(worst.match) if worst else None,
            "worst_delta": _finite(worst.max_delta) if worst else None,
            "first_row": worst.first_row if worst and not worst.passed else _first_row(self),
            "passed": self.passed,
            "drifted_fields": [f.name for f in self.drifted],
            "min_match": self.tolerance.min_match, "rtol": self.tolerance.rtol, "atol": self.tolerance.atol,
            "fields": {name: f.as_dict() for name, f in self.fields.items()},
            "only_recorded": list(self.only_recorded), "only_live": list(self.only_live),
        }


def describe_field(f: FieldDrift, tolerance: Tolerance) -> str:
    """One field's figure in words."""
    if f.kind == _TOKENS:
        text = f"field {f.name!r}: token match {f.match:.4g}"
    elif f.kind == _FLOAT:
        delta = "n/a" if f.max_delta is None else f"{f.max_delta:.4g}"
        text = (f"field {f.name!r}: {f.match:.2%} of elements within rtol {tolerance.rtol:g} / atol "
                f"{tolerance.atol:g}, max |delta| {delta}")
    else:
        text = f"field {f.name!r}: {f.match:.2%} of rows equal"
    if f.first_row is not None:
        text += f", first differing row {f.first_row}"
    if f.note:
        text += f" ({f.note})"
    return text


def _first_row(drift: Drift) -> int | None:
    rows = [f.first_row for f in drift.fields.values() if f.first_row is not None]
    return min(rows) if rows else None


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


# --------------------------------------------------------------------------- taking values apart


def columns_of(value: Any, prefix: str = "") -> dict[str, Any]:
    """The named columns of a result: tensors, numpy arrays, and lists of rows or values.

    Containers are opened (a batch's ``batch`` and ``non_tensor_batch``, a ``TensorDict``, a mapping,
    a tuple), their leaves named by their path; ``meta_info`` is left out (timings, not results).

    Example:
        >>> sorted(columns_of({"a": torch.zeros(2), "b": {"c": [1, 2]}}))
        ['a', 'b.c']
    """
    out: dict[str, Any] = {}
    _collect(value, prefix, out)
    return out


def _name(prefix: str, key: Any) -> str:
    key = ".".join(map(str, key)) if isinstance(key, tuple) else str(key)
    return f"{prefix}.{key}" if prefix else key


def _collect(value: Any, prefix: str, out: dict[str, Any]) -> None:
    from tensordict import TensorDictBase, is_non_tensor

    if is_dataproto_like(value):
        if value.batch is not None:
            _collect(value.batch, prefix, out)
        for key, column in (value.non_tensor_batch or {}).items():
            out[_name(prefix, key)] = column
        return
    if is_non_tensor(value):
        out[prefix or "value"] = value.tolist()
        return
    if isinstance(value, TensorDictBase):
        for key in value.keys():
            _collect(value.get(key), _name(prefix, key), out)
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            _collect(item, _name(prefix, key), out)
        return
    if isinstance(value, tuple) and not _numeric_rows_like(value):
        for i, item in enumerate(value):
            _collect(item, _name(prefix, i), out)
        return
    out[prefix or "value"] = value


def _is_number(x: Any) -> bool:
    return x is None or (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, np.bool_))


def _numeric_rows_like(value: Any) -> bool:
    """A list (or tuple) of numbers, or of lists of numbers (TRL's completion ids and log-probs)."""
    if not isinstance(value, (list, tuple)) or not value:
        return False
    if all(_is_number(x) and x is not None for x in value):
        return True
    return all(isinstance(row, (list, tuple)) and all(_is_number(x) for x in row) for row in value)


# --------------------------------------------------------------------------- numeric columns as padded rows


@dataclass
class _Rows:
    """A numeric column as ``[rows, width]`` values and the positions that hold data."""

    data: torch.Tensor
    valid: torch.Tensor
    floating: bool
    shape: tuple[int, ...]


def _as_rows(column: Any, mask: torch.Tensor | None) -> _Rows | None:
    """The numeric column as padded rows, or None when it is not numeric."""
    if isinstance(column, np.ndarray) and column.dtype != object:
        column = torch.from_numpy(np.ascontiguousarray(column))
    if isinstance(column, torch.Tensor):
        if column.is_nested:
            rows = [r.reshape(-1) for r in column.unbind()]
            return _pad([r.detach().cpu() for r in rows], column.dtype.is_floating_point, (len(rows), -1))
        tensor = column.detach().cpu()
        if tensor.dtype.is_complex:
            return None
        shape = tuple(tensor.shape)
        tensor = tensor.reshape(1, 1) if tensor.dim() == 0 else tensor.reshape(tensor.shape[0], -1)
        valid = torch.ones(tensor.shape, dtype=torch.bool)
        if mask is not None and tuple(mask.shape) == shape and len(shape) == 2:
            valid = mask.detach().cpu().reshape(tensor.shape) != 0
        return _Rows(tensor, valid, tensor.dtype.is_floating_point, shape)
    if isinstance(column, (list, tuple)) and _numeric_rows_like(column):
        rows_in = [row if isinstance(row, (list, tuple)) else [row] for row in column]
        floating = any(isinstance(x, (float, np.floating)) or x is None for row in rows_in for x in row)
        dtype = torch.float64 if floating else torch.int64
        rows = []
        for row in rows_in:
            rows.append(torch.tensor([math.nan if x is None else x for x in row], dtype=dtype))
        return _pad(rows, floating, (len(rows), -1))
    return None


def _pad(rows: list[torch.Tensor], floating: bool, shape: tuple[int, ...]) -> _Rows:
    width = max((len(r) for r in rows), default=0)
    dtype = rows[0].dtype if rows else (torch.float64 if floating else torch.int64)
    data = torch.zeros((len(rows), width), dtype=dtype)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        data[i, :len(row)] = row
        valid[i, :len(row)] = True
    return _Rows(data, valid, floating, shape)


def _widen(rows: _Rows, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    data, valid = rows.data, rows.valid
    if data.dtype == torch.bool:
        data = data.to(torch.int8)
    pad_rows, pad_cols = height - data.shape[0], width - data.shape[1]
    if pad_rows or pad_cols:
        wide = data.to(torch.float64 if rows.floating else torch.int64)
        data = torch.nn.functional.pad(wide, (0, pad_cols, 0, pad_rows))
        valid = torch.nn.functional.pad(valid, (0, pad_cols, 0, pad_rows), value=False)
    return data, valid


def _compare_numeric(name: str, recorded: _Rows, live: _Rows, tolerance: Tolerance) -> FieldDrift:
    height = max(recorded.data.shape[0], live.data.shape[0])
    width = max(recorded.data.shape[1], live.data.shape[1])
    a, va = _widen(recorded, height, width)
    b, vb = _widen(live, height, width)
    considered = va | vb
    both = va & vb
    floating = recorded.floating or live.floating
    if floating:
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
        close = torch.isclose(b64, a64, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=True)
        delta = (b64 - a64).abs()
        same_nan = a64.isnan() & b64.isnan()
        delta = torch.where(same_nan, torch.zeros_like(delta), torch.nan_to_num(delta, nan=math.inf))
    else:
        close = a == b
        delta = (b.to(torch.float64) - a.to(torch.float64)).abs()
    ok = close & both
    per_row_ok = ok.sum(dim=1).to(torch.float64)
    per_row_all = considered.sum(dim=1).to(torch.float64)
    row_match = torch.where(per_row_all > 0, per_row_ok / per_row_all.clamp_min(1), torch.ones_like(per_row_all))
    if floating:  # the share of elements
        total = float(per_row_all.sum())
        match = float(per_row_ok.sum()) / total if total else 1.0
    else:  # the mean over rows of each row's token match
        match = float(row_match.mean()) if height else 1.0
    differing = (per_row_ok < per_row_all).nonzero().flatten()
    first_row = int(differing[0]) if len(differing) else None
    deltas = delta[both]
    notes = []
    if recorded.data.shape[0] != live.data.shape[0]:
        notes.append(f"{recorded.data.shape[0]} recorded rows, {live.data.shape[0]} live")
    elif recorded.shape != live.shape and len(recorded.shape) > 1 and recorded.shape[1:] != (-1,):
        notes.append(f"shape {list(recorded.shape)} recorded, {list(live.shape)} live")
    examples = []
    for row in differing[:MAX_EXAMPLES].tolist():
        examples.append({"row": row, "recorded": _row_values(a[row], va[row]), "live": _row_values(b[row], vb[row])})
    return FieldDrift(
        name=name, kind=_FLOAT if floating else _TOKENS, match=match, passed=match >= tolerance.min_match,
        rows=height, row_match=row_match[:MAX_ROWS_KEPT].tolist(),
        max_delta=float(deltas.max()) if deltas.numel() else None,
        mean_delta=float(deltas.mean()) if deltas.numel() else None,
        first_row=first_row, note="; ".join(notes) or None, examples=examples)


def _row_values(data: torch.Tensor, valid: torch.Tensor) -> list[Any]:
    values = data[valid][:MAX_EXAMPLE_VALUES].tolist()
    return [_finite(v) if isinstance(v, float) else v for v in values]


# --------------------------------------------------------------------------- other columns


def _as_list(column: Any) -> list[Any]:
    if isinstance(column, np.ndarray):
        return list(column.reshape(-1)) if column.ndim else [column.item()]
    if isinstance(column, (list, tuple)):
        return list(column)
    return [column]


def _equal(a: Any, b: Any, depth: int = 0) -> bool:
    """Deep equality of stored values (NaN equals NaN; arrays and tensors by value)."""
    if depth > 64:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return bool(torch.equal(a, b)) or (a.is_floating_point() and bool(torch.isclose(a, b, equal_nan=True).all()))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_equal(x, y, depth + 1) for x, y in zip(a.reshape(-1), b.reshape(-1)))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f"))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # an object whose comparison fails is not equal
        return False


def _compare_values(name: str, recorded: Any, live: Any, tolerance: Tolerance) -> FieldDrift:
    a, b = _as_list(recorded), _as_list(live)
    height = max(len(a), len(b))
    equal = [i < len(a) and i < len(b) and _equal(a[i], b[i]) for i in range(height)]
    match = sum(equal) / height if height else 1.0
    first_row = next((i for i, same in enumerate(equal) if not same), None)
    note = f"{len(a)} recorded rows, {len(b)} live" if len(a) != len(b) else None
    examples = [{"row": i, "recorded": _short(a[i]) if i < len(a) else None,
                 "live": _short(b[i]) if i < len(b) else None}
                for i, same in enumerate(equal) if not same][:MAX_EXAMPLES]
    return FieldDrift(name=name, kind=_VALUES, match=match, passed=match >= tolerance.min_match, rows=height,
                      first_row=first_row, note=note, examples=examples)


def _short(value: Any) -> Any:
    """A stored value as a short JSON-ready text or number (for the examples of a drift record)."""
    if isinstance(value, (bool, int, str)) or value is None:
        return value if not isinstance(value, str) or len(value) <= 500 else value[:500] + "…"
    if isinstance(value, float):
        return _finite(value)
    text = repr(value)
    return text if len(text) <= 500 else text[:500] + "…"


# --------------------------------------------------------------------------- the comparison


def _mask_for(columns: Mapping[str, Any], name: str, column: Any) -> torch.Tensor | None:
    """The mask of a 2-D column: the first of :data:`MASK_NAMES` of the same shape (not for a mask itself)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in MASK_NAMES or not isinstance(column, torch.Tensor) or column.is_nested or column.dim() != 2:
        return None
    parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
    for mask_name in MASK_NAMES:
        mask = columns.get(parent + mask_name)
        if isinstance(mask, torch.Tensor) and not mask.is_nested and tuple(mask.shape) == tuple(column.shape):
            return mask
    return None


def compare_values(recorded: Any, live: Any, tolerance: Tolerance | None = None, exclude: Iterable[str] = (),
                   prompts_equal: bool | None = None) -> Drift:
    """Compare a live result with its recording, column by column.

    Args:
        recorded: the recorded result (as decoded from the entry).
        live: the live result of the same call.
        tolerance: ``rtol``, ``atol`` and ``min_match`` (default :class:`Tolerance`).
        exclude: column names left out (identity columns such as ``uid``, which differ by design).
        prompts_equal: whether the call's prompts were the recorded ones, as the caller found.

    Returns:
        The :class:`Drift`: a figure per column present on both sides, the worst field, passed.

    Example:
        >>> compare_values(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])).describe()
        "field 'value': 50.00% of elements within rtol 1e-05 / atol 1e-08, max |delta| 0.5, first differing row 1"
    """
    tolerance = tolerance or Tolerance()
    skipped = set(exclude)
    rec_cols = {k: v for k, v in columns_of(recorded).items() if k.rsplit(".", 1)[-1] not in skipped}
    live_cols = {k: v for k, v in columns_of(live).items() if k.rsplit(".", 1)[-1] not in skipped}
    fields: dict[str, FieldDrift] = {}
    for name in [n for n in rec_cols if n in live_cols]:
        a, b = rec_cols[name], live_cols[name]
        rows_a = _as_rows(a, _mask_for(rec_cols, name, a))
        rows_b = _as_rows(b, _mask_for(live_cols, name, b))
        if rows_a is not None and rows_b is not None:
            fields[name] = _compare_numeric(name, rows_a, rows_b, tolerance)
        else:
            fields[name] = _compare_values(name, a, b, tolerance)
    return Drift(fields=fields, tolerance=tolerance, prompts_equal=prompts_equal,
                 only_recorded=[n for n in rec_cols if n not in live_cols],
                 only_live=[n for n in live_cols if n not in rec_cols])
