"""A stage call's recorded arguments (``record_inputs: true``): what ``stepskip rerun`` calls a function on.

The arguments after a method's ``self``, positional and keyword, are stored in the entry itself,
beside its result, as two more files (``inputs.safetensors`` and ``inputs.json``) written by the
safe format whatever the role's ``format``: no pickle, checksummed with the entry, committed with
it, removed with it. Replaying the entry never reads them.

Example:
    >>> def compute(self, batch, scale=1.0): ...
    >>> call_arguments(compute, ("trainer", "batch"), {"scale": 2.0})
    (['batch'], {'scale': 2.0}, 'str')
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stepskip._entries import FileBytes
from stepskip.errors import CorruptEntryError

__all__ = ["INPUTS_TENSORS", "INPUTS_TREE", "INPUT_FILES", "WithInputs", "call_arguments", "freeze_inputs",
           "encode_entry", "decode_inputs", "inputs_meta", "has_inputs"]

INPUTS_TENSORS = "inputs.safetensors"
INPUTS_TREE = "inputs.json"
#: The files holding a call's recorded arguments, in the order the safe format writes its own two.
INPUT_FILES = (INPUTS_TENSORS, INPUTS_TREE)
_SAFE_FILES = ("data.safetensors", "data.json")


@dataclass
class WithInputs:
    """A result's snapshot and its call's arguments' snapshot, written as one entry."""

    output: Any
    inputs: Any


def call_arguments(func: Callable[..., Any] | None, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                   ) -> tuple[list[Any], dict[str, Any], str | None]:
    """The call's arguments after a method's ``self``: ``(positional, keyword, type name of self or None)``.

    The first positional argument is a method's ``self`` (or ``cls``) when the function's first
    parameter has that name.
    """
    positional = list(args)
    owner = None
    if positional and func is not None:
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # no signature to read: every argument is the call's
            params = []
        if params and params[0].name in ("self", "cls") and params[0].kind in (
                inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            owner = type(positional.pop(0)).__qualname__
    return positional, dict(kwargs), owner


def _tree(positional: list[Any], keyword: Mapping[str, Any]) -> dict[str, Any]:
    # dicts with string keys are containers the safe format opens: each argument keeps its own kind
    return {"args": {str(i): value for i, value in enumerate(positional)}, "kwargs": dict(keyword)}


def freeze_inputs(positional: list[Any], keyword: Mapping[str, Any], copy: bool) -> Any:
    """A snapshot of the arguments by the safe format (private copies when ``copy``).

    Raises:
        UnstorableValueError: an argument cannot be stored safely; the message names it.
    """
    from stepskip._formats.safe import SafeFormat

    return SafeFormat().freeze(_tree(positional, keyword), copy=copy)


def inputs_meta(positional: list[Any], keyword: Mapping[str, Any], owner: str | None) -> dict[str, Any]:
    """What an entry's ``meta.json`` says of its recorded arguments (``meta["inputs"]``)."""
    return {"args": len(positional), "kwargs": sorted(keyword), "self": owner, "files": list(INPUT_FILES)}


def has_inputs(meta: Mapping[str, Any] | None) -> bool:
    """Whether an entry's ``meta.json`` says it holds its call's arguments (and lists their files)."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("inputs"), Mapping):
        return False
    files = meta.get("files")
    return isinstance(files, Mapping) and all(name in files for name in INPUT_FILES)


def encode_entry(codec: Any, frozen: Any) -> dict[str, FileBytes]:
    """An entry's files: the codec's for the result, and the arguments' files when ``frozen`` holds them."""
    if not isinstance(frozen, WithInputs):
        return dict(codec.encode(frozen))
    from stepskip._formats.safe import SafeFormat

    files = dict(codec.encode(frozen.output))
    encoded = SafeFormat().encode(frozen.inputs)
    for name, stored in zip(INPUT_FILES, _SAFE_FILES):
        files[name] = encoded[stored]
    return files


def decode_inputs(files: Mapping[str, bytes | memoryview], max_bytes: int | None = None
                  ) -> tuple[list[Any], dict[str, Any]]:
    """The recorded ``(positional, keyword)`` arguments from an entry's argument files.

    Raises:
        CorruptEntryError: the files do not decode, or do not hold arguments.
    """
    from stepskip._formats.safe import SafeFormat

    renamed = {stored: bytes(files[name]) for name, stored in zip(INPUT_FILES, _SAFE_FILES)}
    tree = SafeFormat().decode(renamed, max_bytes=max_bytes)
    if not isinstance(tree, dict) or not isinstance(tree.get("args"), dict) or not isinstance(tree.get("kwargs"), dict):
        raise CorruptEntryError(f"{INPUTS_TREE} does not hold a call's arguments")
    numbered = tree["args"]
    if set(numbered) != {str(i) for i in range(len(numbered))}:
        raise CorruptEntryError(f"{INPUTS_TREE}: positional arguments {json.dumps(sorted(numbered))[:200]} "
                                "are not numbered 0, 1, ...")
    return [numbered[str(i)] for i in range(len(numbered))], dict(tree["kwargs"])
