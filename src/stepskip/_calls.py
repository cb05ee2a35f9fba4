"""What a decorated call carries: where its prompts are, whether it is validation, what it returned.

Written once for the decorators, the roles and the formats. Free of heavy imports.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CallInfo", "CURRENT_CALL", "PromptsFinder", "BypassTest", "find_prompts", "is_validation", "is_dataproto_like",
    "call_prompts", "prompt_columns", "added_columns",
]

#: ``prompts(*args, **kwargs)`` -> the call's prompts (or None).
PromptsFinder = Callable[..., Any]
#: ``bypass(*args, **kwargs)`` -> True when the call must run untouched (validation).
BypassTest = Callable[..., bool]


def is_dataproto_like(value: Any) -> bool:
    """True for verl's ``DataProto``, :class:`~stepskip.Batch` and look-alikes (batch, non_tensor_batch, meta_info)."""
    return hasattr(value, "non_tensor_batch") and hasattr(value, "batch") and hasattr(value, "meta_info")


def find_prompts(*args: Any, **kwargs: Any) -> Any:
    """verl's convention: keyword ``prompts``, else the second positional argument (after ``self``),
    else a lone first argument that has ``meta_info``; None when the call has none of these."""
    prompts = kwargs.get("prompts")
    if prompts is not None:
        return prompts
    if len(args) > 1:
        return args[1]
    if len(args) == 1 and hasattr(args[0], "meta_info"):
        return args[0]
    return None


def is_validation(*args: Any, **kwargs: Any) -> bool:
    """verl's validation bypass: the prompts carry ``meta_info["validate"]`` or a TensorDict's
    ``non_tensor_data["validate"]``, truthy."""
    prompts = find_prompts(*args, **kwargs)
    if prompts is None:
        return False
    meta_info = getattr(prompts, "meta_info", None)
    if isinstance(meta_info, dict) and meta_info.get("validate"):
        return True
    non_tensor_data = getattr(prompts, "non_tensor_data", None)
    if non_tensor_data is not None:
        try:
            return bool(non_tensor_data.get("validate", False))
        except (AttributeError, TypeError, KeyError):
            return False
    return False


@dataclass(frozen=True)
class CallInfo:
    """What the decorator knows about the call a role is serving.

    Args:
        prompts: the call's prompts, as the decorator's ``prompts=`` finder located them.
        generation_seconds: how long the decorated function ran (set for ``prepare_data`` on a miss).
        function: the decorated function (set for ``prepare_data`` on a miss: which argument is ``self``).
        columns: the prompts' column names before the function ran (set after a call that ran): a
            column the function added to its own input (verl's agent loop adds ``priority``) is not
            part of what it was asked, and the prompt digests leave it out.
    """

    prompts: Any = None
    generation_seconds: float | None = None
    function: Callable[..., Any] | None = None
    columns: frozenset[str] | None = None


#: Set by the decorators around the role hooks, so that the hooks keep verl's signatures.
CURRENT_CALL: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("stepskip_call", default=None)


def call_prompts(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The prompts of the call being served: the decorator's finding, else verl's convention."""
    info = CURRENT_CALL.get()
    if info is not None:
        return info.prompts
    return find_prompts(*args, **kwargs)


def prompt_columns(prompts: Any) -> frozenset[str] | None:
    """The column names of a batch of prompts (tensor and non-tensor), None for values without columns."""
    if is_dataproto_like(prompts):
        batch = prompts.batch
        names = set(batch.keys()) if batch is not None else set()
        return frozenset(names | set(prompts.non_tensor_batch))
    keys = getattr(prompts, "keys", None)
    if callable(keys) and hasattr(prompts, "batch_size"):  # a TensorDict
        return frozenset(str(key) for key in keys())
    return None


def added_columns(prompts: Any) -> list[str]:
    """The columns of ``prompts`` that the call being recorded added to them while it ran."""
    info = CURRENT_CALL.get()
    before = info.columns if info is not None else None
    if before is None:
        return []
    now = prompt_columns(prompts)
    return sorted(now - before) if now is not None else []
