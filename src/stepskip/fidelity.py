"""Replay fidelity: run fingerprints and prompt digests.

A cache replayed into a run with another model, sampling setup or data order gives wrong results
silently. At dump time an entry records (a) the values of the config keys that determine rollouts
— the run fingerprint — and (b) a digest of the prompts the stage received. At load time both
are compared with the live run and call; what happens on a difference is the role's
``on_mismatch`` / ``check_prompts`` policy.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import xxhash
from tensordict import TensorDictBase, is_non_tensor

from stepskip.formats.values import encode_object_array, encode_value
from stepskip.identity import VERL_FINGERPRINT_KEYS, fingerprint_diff, fingerprint_of

__all__ = ["FINGERPRINT_KEYS", "run_fingerprint", "fingerprint_diff", "prompt_digest"]

#: verl's config keys that determine what a rollout produces (SPEC §1).
FINGERPRINT_KEYS = VERL_FINGERPRINT_KEYS


def run_fingerprint(config: Any, extra_keys: Iterable[str] = ()) -> dict[str, Any]:
    """The values of verl's fingerprint keys (and ``extra_keys``) that are set in ``config``.

    Example:
        >>> run_fingerprint({"data": {"seed": 1}, "trainer": {"run_id": "x"}})
        {'data.seed': 1}
    """
    return fingerprint_of(config, (*VERL_FINGERPRINT_KEYS, *extra_keys))


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
