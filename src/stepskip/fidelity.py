"""Replay fidelity: run fingerprints and prompt digests.

A cache replayed into a run with another model, sampling setup or data order gives wrong results
silently. At dump time an entry records (a) the values of the config keys that determine rollouts
— the run fingerprint — and (b) a digest of the prompts the stage received. At load time both
are compared with the live run and call; what happens on a difference is the role's
``on_mismatch`` / ``check_prompts`` policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import xxhash
from tensordict import TensorDictBase, is_non_tensor

from stepskip.config import select, to_plain
from stepskip.formats.values import encode_object_array, encode_value

__all__ = ["FINGERPRINT_KEYS", "run_fingerprint", "fingerprint_diff", "prompt_digest"]

#: Config keys that determine what a rollout produces (SPEC §1); never a run id, time or host.
FINGERPRINT_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.prompt_length",
    "actor_rollout_ref.rollout.response_length",
    "data.train_files",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.seed",
)


def _jsonable(value: Any) -> Any:
    value = to_plain(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def run_fingerprint(config: Any, extra_keys: Iterable[str] = ()) -> dict[str, Any]:
    """The values of the fingerprint keys (and ``extra_keys``) that are set in ``config``.

    Example:
        >>> run_fingerprint({"data": {"seed": 1}, "trainer": {"run_id": "x"}})
        {'data.seed': 1}
    """
    out: dict[str, Any] = {}
    for key in (*FINGERPRINT_KEYS, *extra_keys):
        value = select(config, key)
        if value is not None:
            out[key] = _jsonable(value)
    return out


def fingerprint_diff(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: recorded X, now Y`` for every key whose value differs (a key absent on one side counts)."""
    lines = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        if old != new:
            lines.append(f"{key}: recorded {old!r}, now {new!r}")
    return lines


def _hash_tensor(h: xxhash.xxh3_64, name: str, tensor: torch.Tensor) -> None:
    if tensor.is_nested:
        if tensor.layout == torch.jagged:
            _hash_tensor(h, f"{name}.values", tensor.values())
            _hash_tensor(h, f"{name}.offsets", tensor.offsets())
        else:
            for i, part in enumerate(tensor.unbind()):
                _hash_tensor(h, f"{name}[{i}]", part)
        return
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.view(torch.uint8).reshape(-1).numpy() if t.dtype != torch.bool else t.numpy())


def _hash_value(h: xxhash.xxh3_64, name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        _hash_tensor(h, name, value)
    elif isinstance(value, np.ndarray) and not value.dtype.hasobject:
        h.update(f"{name}|{value.dtype.str}|{value.shape}|".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, np.ndarray):
        h.update(f"{name}|object|{value.shape}|".encode())
        h.update(json.dumps(encode_object_array(value.reshape(-1), name, lambda t: repr(t)),
                            sort_keys=True, default=repr).encode())
    else:
        h.update(f"{name}|".encode())
        h.update(json.dumps(encode_value(value, name, lambda t: repr(t)), sort_keys=True, default=repr).encode())


def prompt_digest(prompts: Any, exclude: Iterable[str] = ()) -> str | None:
    """A fast digest of what a stage received, without per-run identifier columns.

    Covers the tensors (token ids, masks) and non-tensor columns (raw prompts) of a
    Batch/DataProto or TensorDict, minus the ``exclude`` columns (``rebind_keys``: uids, sample
    ids). ``meta_info`` is left out (timings, flags). Returns None for values it cannot read.
    """
    skip = set(exclude)
    h = xxhash.xxh3_64()
    try:
        if hasattr(prompts, "non_tensor_batch") and hasattr(prompts, "batch"):
            td = prompts.batch
            if td is not None:
                _hash_tensordict(h, td, skip)
            for key in sorted(prompts.non_tensor_batch):
                if key not in skip:
                    _hash_value(h, key, prompts.non_tensor_batch[key])
        elif isinstance(prompts, TensorDictBase):
            _hash_tensordict(h, prompts, skip)
        elif isinstance(prompts, torch.Tensor):
            _hash_tensor(h, "prompts", prompts)
        else:
            return None
    except (TypeError, ValueError, RuntimeError):
        return None
    return "xxh3_64:" + h.hexdigest()


def _hash_tensordict(h: xxhash.xxh3_64, td: TensorDictBase, skip: set[str], prefix: str = "") -> None:
    for key in sorted(td.keys()):
        if key in skip:
            continue
        item = td.get(key)
        name = f"{prefix}{key}"
        if is_non_tensor(item):
            _hash_value(h, name, item.tolist() if hasattr(item, "tolist") else item.data)
        elif isinstance(item, TensorDictBase):
            _hash_tensordict(h, item, skip, prefix=f"{name}.")
        else:
            _hash_tensor(h, name, item)
