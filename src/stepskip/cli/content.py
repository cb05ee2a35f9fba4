"""What a decoded entry holds: its fields, response-length and reward statistics, sample rows.

Values are read by the cache index (:meth:`stepskip._index.CacheIndex.read_step`); this module
only looks at them, and is the one part of the command line that imports torch.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDictBase, is_non_tensor

from stepskip._calls import is_dataproto_like
from stepskip.cli.errors import CliError

__all__ = [
    "FieldInfo", "SampleRow", "Stat", "describe_fields", "response_lengths",
    "load_tokenizer", "recorded_tokenizer", "rewards", "row_count", "sample_rows", "scores_rows", "value_digest",
]

#: Per-row reward columns, most specific first; 2-D ones (token level) are summed over the last dimension.
REWARD_KEYS = ("token_level_scores", "token_level_rewards", "rm_scores", "reward_score", "reward", "rewards",
               "score", "scores", "acc")
#: Columns that hold the prompt as text when no token ids are stored.
PROMPT_TEXT_KEYS = ("raw_prompt", "messages", "prompt")


# --------------------------------------------------------------------------- fields


@dataclass(frozen=True)
class FieldInfo:
    """One column of a value.

    Args:
        name: the column name (dotted for nested TensorDicts).
        kind: ``tensor``, ``jagged`` (rows of different lengths), ``non-tensor`` or ``value``.
        dtype: the element type (``object`` for non-tensor columns).
        shape: the dimensions; a ragged dimension is written ``"min..max"``.
        bytes: bytes of the tensor data (None for non-tensor columns).
    """

    name: str
    kind: str
    dtype: str
    shape: list[int | str]
    bytes: int | None


def _parts(value: Any) -> tuple[TensorDictBase | Mapping[str, Any] | None, Mapping[str, Any]]:
    """The tensor part and the per-row non-tensor columns of a value."""
    if is_dataproto_like(value):
        return value.batch, value.non_tensor_batch
    if isinstance(value, Mapping) and "tensordict" in value and "keys" in value:
        return value["tensordict"], {}
    if isinstance(value, (TensorDictBase, Mapping)):
        return value, {}
    if isinstance(value, torch.Tensor):
        return {"value": value}, {}
    return None, {}



def _tensor_info(name: str, t: Any) -> FieldInfo:  # Any: torch's stubs lack the nested-tensor methods
    dtype = str(t.dtype).replace("torch.", "")
    if t.is_nested:
        lengths = _jagged_lengths(t)
        ragged = f"{min(lengths)}..{max(lengths)}" if lengths else "0"
        values = t.values() if t.layout == torch.jagged else None
        nbytes = (values.numel() * values.element_size() + t.offsets().numel() * t.offsets().element_size()
                  if values is not None else sum(p.numel() * p.element_size() for p in t.unbind()))
        tail = list(t.values().shape[1:]) if values is not None else []
        return FieldInfo(name, "jagged", dtype, [len(lengths), ragged, *tail], nbytes)
    return FieldInfo(name, "tensor", dtype, list(t.shape), t.numel() * t.element_size())


def _jagged_lengths(t: Any) -> list[int]:
    if t.layout == torch.jagged and t.lengths() is None:
        return t.offsets().diff().tolist()
    return [p.shape[0] if p.dim() else 1 for p in t.unbind()]


def describe_fields(value: Any) -> list[FieldInfo]:
    """The columns of a decoded value, tensors first.

    Example:
        >>> from stepskip import Batch
        >>> [f.name for f in describe_fields(Batch.from_dict({"ids": torch.zeros(2, 3)}, {"uid": ["a", "b"]}))]
        ['ids', 'uid']
    """
    tensors, non_tensors = _parts(value)
    out: list[FieldInfo] = []
    if tensors is None:
        return [FieldInfo("value", "value", type(value).__name__, [], None)]
    _collect(tensors, "", out)
    for key, column in non_tensors.items():
        array = np.asarray(column) if not isinstance(column, np.ndarray) else column
        out.append(FieldInfo(str(key), "non-tensor", str(array.dtype), list(array.shape), None))
    return out


def _collect(node: Any, prefix: str, out: list[FieldInfo]) -> None:
    keys = list(node.keys())
    for key in keys:
        item = node.get(key) if isinstance(node, TensorDictBase) else node[key]
        name = f"{prefix}{key}"
        if isinstance(item, (NonTensorStack, NonTensorData)) or is_non_tensor(item):
            out.append(FieldInfo(name, "non-tensor", "object", list(item.batch_size), None))
        elif isinstance(item, (TensorDictBase, Mapping)):
            _collect(item, f"{name}.", out)
        elif isinstance(item, torch.Tensor):
            out.append(_tensor_info(name, item))
        elif isinstance(item, np.ndarray):
            out.append(FieldInfo(name, "non-tensor" if item.dtype.hasobject else "tensor", str(item.dtype),
                                 list(item.shape), None if item.dtype.hasobject else item.nbytes))
        else:
            out.append(FieldInfo(name, "value", type(item).__name__, [], None))


def row_count(value: Any) -> int | None:
    """Rows (trajectories) of a value, when it has rows."""
    if is_dataproto_like(value):
        try:
            return len(value)
        except TypeError:
            return None
    tensors, _ = _parts(value)
    if isinstance(tensors, TensorDictBase):
        return int(tensors.batch_size[0]) if tensors.batch_dims else None
    if isinstance(tensors, Mapping):
        for item in tensors.values():
            if isinstance(item, torch.Tensor) and item.dim():
                return int(item.size(0))
    return None


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stat:
    """Summary of one per-row quantity.

    Args:
        name: what was measured (``response_length``, ``reward``).
        source: the column it was computed from.
        count, min, mean, max: over the rows.
    """

    name: str
    source: str
    count: int
    min: float
    mean: float
    max: float

    @classmethod
    def of(cls, name: str, source: str, values: Sequence[float]) -> Stat | None:
        finite = [float(v) for v in values if math.isfinite(float(v))]
        if not finite:
            return None
        return cls(name, source, len(finite), min(finite), sum(finite) / len(finite), max(finite))


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    try:
        if key in node.keys():
            return node.get(key) if isinstance(node, TensorDictBase) else node[key]
    except (AttributeError, TypeError):
        return None
    return None


def _rows(column: Any) -> list[torch.Tensor] | None:
    """A 2-D column's rows as 1-D tensors (a jagged one's rows have their own lengths), else None."""
    if not isinstance(column, torch.Tensor):
        return None
    if column.is_nested:
        rows = list(column.unbind())
        return rows if all(r.dim() == 1 for r in rows) else None
    return list(column.unbind(0)) if column.dim() == 2 else None


def _nonzero_tails(mask: Any, widths: list[int] | None) -> list[int] | None:
    """Non-zero positions per row of a mask, over each row's last ``widths[row]`` positions (all without
    ``widths``); None when the mask is no 2-D or jagged column, or a row is shorter than its width."""
    if isinstance(mask, torch.Tensor) and not mask.is_nested and mask.dim() == 2 and (
            widths is None or (len(set(widths)) == 1 and len(widths) == mask.shape[0])):
        width = mask.shape[1] if not widths else widths[0]
        return (mask[:, mask.shape[1] - width:] != 0).sum(-1).tolist() if width <= mask.shape[1] else None
    rows = _rows(mask)
    if rows is None or (widths is not None and len(widths) != len(rows)):
        return None
    tails = [r.shape[0] for r in rows] if widths is None else widths
    if any(w > r.shape[0] for w, r in zip(tails, rows)):
        return None
    return [int((r[r.shape[0] - w:] != 0).sum()) for w, r in zip(tails, rows)]


def response_lengths(value: Any) -> tuple[str, list[int]] | None:
    """Per-row response lengths and the column they come from, when the value has responses.

    Padding is not a response token: ``response_mask`` (its non-zero positions), else the
    response part of ``attention_mask`` (its last ``len(response)`` positions), else the row
    lengths of jagged ``responses``. Dense and jagged columns alike: a V1 entry stores every
    per-row tensor jagged, padded responses and their mask included.

    Example:
        >>> from stepskip import Batch
        >>> b = Batch.from_dict({"responses": torch.tensor([[7, 8, 0], [9, 0, 0]]),
        ...                      "response_mask": torch.tensor([[1, 1, 0], [1, 0, 0]])})
        >>> response_lengths(b)
        ('response_mask', [2, 1])
    """
    tensors, _ = _parts(value)
    if (lengths := _nonzero_tails(_get(tensors, "response_mask"), None)) is not None:
        return "response_mask", lengths
    responses = _get(tensors, "responses")
    if not isinstance(responses, torch.Tensor):
        return None
    if responses.is_nested:
        widths = _jagged_lengths(responses)
    elif responses.dim() == 2:
        widths = [responses.shape[1]] * responses.shape[0]
    else:
        return None
    if (lengths := _nonzero_tails(_get(tensors, "attention_mask"), widths)) is not None:
        return "attention_mask", lengths
    return ("responses", widths) if responses.is_nested else None


def rewards(value: Any) -> tuple[str, list[float]] | None:
    """Per-row rewards and the column they come from (see :data:`REWARD_KEYS`)."""
    tensors, non_tensors = _parts(value)
    for key in REWARD_KEYS:
        item = _get(tensors, key)
        if isinstance(item, torch.Tensor) and not item.is_nested and item.numel():
            rows = item.float()
            if rows.dim() >= 2:
                rows = rows.reshape(rows.size(0), -1).sum(-1)
            if rows.dim() == 1:
                return key, rows.tolist()
        column = non_tensors.get(key)
        if column is not None:
            try:
                return key, [float(v) for v in column]
            except (TypeError, ValueError):
                continue
    return None


def scores_rows(value: Any, rows: int) -> tuple[str, list[float]] | None:
    """The rewards of a stage role's value that scores ``rows`` trajectories: one per row, and no prompts or
    responses of its own (a value holding trajectories is not a score of another's). Else None.

    Example:
        >>> scores_rows({"scores": torch.tensor([1.0, 0.5])}, 2)
        ('scores', [1.0, 0.5])
    """
    tensors, _ = _parts(value)
    if any(_get(tensors, key) is not None for key in ("prompts", "responses", "input_ids")):
        return None
    found = rewards(value)
    return found if found is not None and len(found[1]) == rows else None


def statistics(value: Any) -> list[Stat]:
    """Response-length and reward statistics, when the value holds them."""
    out: list[Stat] = []
    lengths = response_lengths(value)
    if lengths is not None and (stat := Stat.of("response_length", *lengths)) is not None:
        out.append(stat)
    reward = rewards(value)
    if reward is not None and (stat := Stat.of("reward", *reward)) is not None:
        out.append(stat)
    return out


# --------------------------------------------------------------------------- sample rows


@dataclass
class SampleRow:
    """One trajectory for ``stepskip show``.

    Args:
        index: the row.
        id: ``uid`` (rollout) or the queue key (V1), when present.
        prompt: prompt token ids (padding removed), or None.
        response: response token ids (padding removed), or None.
        prompt_text: the prompt as stored text (``raw_prompt``/``messages``) when there are no ids.
        reward: the row's reward, when present.
        extra: other short per-row values (``data_source`` ...).
    """

    index: int
    id: str | None = None
    prompt: list[int] | None = None
    response: list[int] | None = None
    prompt_text: str | None = None
    reward: float | None = None
    extra: dict[str, str] = field(default_factory=dict)


def _row_tokens(rows: list[torch.Tensor] | None, column: Any, row: int, masks: list[torch.Tensor] | None,
                left: bool) -> list[int] | None:
    """One row's token ids without padding: the mask's first (``left``) or last positions select them."""
    if not isinstance(column, torch.Tensor):
        return None
    if rows is None:  # neither a 2-D nor a jagged column of ids: shown whole
        part = column.unbind()[row] if column.is_nested else column[row]
        return part.reshape(-1).tolist()
    if row >= len(rows):
        return None
    ids = rows[row]
    mask = masks[row] if masks is not None and row < len(masks) else None
    if mask is not None and mask.shape[0] >= ids.shape[0]:
        part = mask[:ids.shape[0]] if left else mask[mask.shape[0] - ids.shape[0]:]
        return ids[part != 0].tolist()
    return ids.tolist()


def _non_tensor_row(column: Any, row: int) -> Any:
    if isinstance(column, (NonTensorStack, NonTensorData)):
        return column.tolist()[row] if isinstance(column, NonTensorStack) else column.data
    return column[row]


def sample_rows(value: Any, rows: int) -> list[SampleRow]:
    """The first ``rows`` trajectories of a value: prompt, response, reward.

    Example:
        >>> from stepskip import Batch
        >>> b = Batch.from_dict({"prompts": torch.tensor([[0, 5, 6]]), "responses": torch.tensor([[7, 0]]),
        ...                      "attention_mask": torch.tensor([[0, 1, 1, 1, 0]])}, {"uid": ["u0"]})
        >>> r = sample_rows(b, 1)[0]
        >>> r.id, r.prompt, r.response
        ('u0', [5, 6], [7])
    """
    tensors, non_tensors = _parts(value)
    total = row_count(value) or 0
    keys = value.get("keys") if isinstance(value, Mapping) and "tensordict" in value else None
    prompts, responses = _get(tensors, "prompts"), _get(tensors, "responses")
    prompt_rows, response_rows = _rows(prompts), _rows(responses)
    attention, response_mask = _rows(_get(tensors, "attention_mask")), _rows(_get(tensors, "response_mask"))
    reward = rewards(value)
    out = []
    for row in range(min(rows, total)):
        sample = SampleRow(index=row)
        if keys is not None and row < len(keys):
            sample.id = str(keys[row])
        elif "uid" in non_tensors:
            sample.id = str(non_tensors["uid"][row])
        elif _get(tensors, "uid") is not None:
            sample.id = str(_non_tensor_row(_get(tensors, "uid"), row))
        sample.prompt = _row_tokens(prompt_rows, prompts, row, attention, left=True)
        sample.response = _row_tokens(response_rows, responses, row,
                                      response_mask if response_mask is not None else attention, left=False)
        if sample.prompt is None:
            for key in PROMPT_TEXT_KEYS:
                column = non_tensors.get(key) if key in non_tensors else _get(tensors, key)
                if column is not None:
                    sample.prompt_text = _short(_non_tensor_row(column, row), 2000)
                    break
        if reward is not None and row < len(reward[1]):
            sample.reward = reward[1][row]
        for key in ("data_source",):
            if key in non_tensors:
                sample.extra[key] = _short(non_tensors[key][row], 200)
        out.append(sample)
    return out


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory (a tokenizer or a whole model), loaded offline.

    Raises:
        CliError: transformers is not installed, or ``path`` holds no loadable tokenizer.

    Example:
        >>> load_tokenizer("/models/Qwen2.5-7B-Instruct").decode([9707])  # doctest: +SKIP
        'Hello'
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise CliError("--tokenizer needs the transformers package (pip install transformers)") from err
    local = os.path.expanduser(path)
    try:
        return AutoTokenizer.from_pretrained(local, local_files_only=True)
    except Exception as err:  # a third-party loader's boundary: any failure means "no usable tokenizer here"
        why = "no such directory" if not os.path.exists(local) else f"{type(err).__name__}: {err}"
        raise CliError(f"--tokenizer {path}: cannot load a Hugging Face tokenizer ({why}); "
                       "pass a local tokenizer or model directory") from None


def recorded_tokenizer(fingerprint: Mapping[str, Any] | None) -> Any:
    """The tokenizer stepskip itself knows for entries with this recorded fingerprint, else None.

    Only the reference pipelines' character tokenizer (``stepskip demo``'s caches): built in code,
    nothing read from the cache nor from a path it names.

    Example:
        >>> recorded_tokenizer({"actor_rollout_ref.model.path": "stepskip/tiny-llama-random"}).decode([1, 3, 4])
        '<s>01'
    """
    from stepskip.pipelines.tokenizer import tokenizer_for

    return tokenizer_for(fingerprint)


def _short(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


# --------------------------------------------------------------------------- exact comparison


def value_digest(value: Any) -> str:
    """A digest of a value's exact content, independent of how any format laid it out on disk.

    Types, dtypes, shapes, key order and every bit (``-0.0``, NaN payloads) count; a Batch and
    verl's DataProto with the same parts digest alike.

    Example:
        >>> value_digest({"x": torch.tensor([0.0])}) == value_digest({"x": torch.tensor([-0.0])})
        False
    """
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    def tag(*parts: Any) -> None:
        h.update(("\x00".join(map(str, parts)) + "\x01").encode("utf-8", "surrogatepass"))

    if isinstance(value, torch.Tensor):
        if value.is_nested:
            parts = value.unbind()
            tag("nested", value.dtype, len(parts))
            for part in parts:
                _feed(h, part)
            return
        flat = value.detach().cpu().contiguous().reshape(-1)
        tag("tensor", value.dtype, tuple(value.shape))
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().tobytes())
        return
    if isinstance(value, NonTensorStack):
        tag("non_tensor_stack", tuple(value.batch_size))
        _feed(h, value.tolist())
        return
    if isinstance(value, NonTensorData):
        tag("non_tensor_data", tuple(value.batch_size))
        _feed(h, value.data)
        return
    if isinstance(value, TensorDictBase):
        tag("tensordict", tuple(value.batch_size), len(list(value.keys())))
        for key in value.keys():
            tag("key", key)
            _feed(h, value.get(key))
        return
    if is_dataproto_like(value):
        tag("batch")
        _feed(h, value.batch)
        _feed(h, dict(value.non_tensor_batch))
        _feed(h, dict(value.meta_info))
        return
    if isinstance(value, np.ndarray):
        tag("ndarray", value.dtype.str, value.shape)
        if value.dtype.hasobject:
            for item in value.reshape(-1):
                _feed(h, item)
        else:
            h.update(np.ascontiguousarray(value).tobytes())
        return
    if isinstance(value, np.generic):
        tag("np", value.dtype.str)
        h.update(np.asarray(value).tobytes())
        return
    if isinstance(value, Mapping):
        tag(type(value).__name__, len(value))
        for key, item in value.items():
            _feed(h, key)
            _feed(h, item)
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        tag(type(value).__name__, len(value))
        for item in items:
            _feed(h, item)
        return
    if isinstance(value, float):
        tag("float", value.hex() if math.isfinite(value) else repr(value))
        return
    tag(type(value).__name__, repr(value))
