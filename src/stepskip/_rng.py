"""The global random state around a cached call (``restore_rng``): saved in an entry's meta, restored on a hit.

A trainer that draws from torch's global generator after the cached call (TRL shuffles the
generated batch) sees another random stream when the call is replayed instead of run: the
sampling inside the call advanced the generator when recording and does not when replaying.
Saving the state right after the recorded call and restoring it on a hit closes that gap.

The state is kept as base64 text in ``meta.json`` (torch's CPU state is ~5 KB): no pickle, and
a reader checks its size before handing it to torch.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from stepskip.errors import CorruptEntryError

__all__ = ["RngState", "capture_rng_state", "parse_rng_state", "restore_rng_state"]


def _b64(data: Any) -> str:
    return base64.b64encode(bytes(data.numpy().tobytes())).decode("ascii")


def capture_rng_state() -> dict[str, Any]:
    """torch's CPU generator state and, when CUDA is already initialised, every device's state.

    CUDA is never initialised here (a CPU-only run stays CPU-only).

    Example:
        >>> state = capture_rng_state()
        >>> sorted(state)[:1]
        ['cpu']
    """
    import torch

    state: dict[str, Any] = {"cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _bytes_tensor(text: Any, size: int, where: str) -> Any:
    import torch

    if not isinstance(text, str):
        raise CorruptEntryError(f"{where}: the recorded random state is {type(text).__name__}, expected base64 text")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as err:
        raise CorruptEntryError(f"{where}: the recorded random state is not valid base64: {err}") from err
    if len(raw) != size:
        raise CorruptEntryError(f"{where}: the recorded random state has {len(raw)} bytes; this torch's has {size}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


class RngState:
    """A checked random state, ready to be set (:func:`parse_rng_state`)."""

    __slots__ = ("cpu", "cuda", "skipped")

    def __init__(self, cpu: Any, cuda: list[Any], skipped: list[str]) -> None:
        self.cpu, self.cuda, self.skipped = cpu, cuda, skipped

    def apply(self) -> list[str]:
        """Set torch's generators; returns what was not restored and why."""
        import torch

        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(self.cuda)
        return list(self.skipped)


def parse_rng_state(recorded: Any, where: str) -> RngState:
    """Check ``recorded`` (what :func:`capture_rng_state` returned) against this torch, setting nothing.

    Raises:
        CorruptEntryError: it is not a state this torch accepts (wrong type or size).
    """
    import torch

    if not isinstance(recorded, dict):
        raise CorruptEntryError(f"{where}: the recorded random state is {type(recorded).__name__}, expected a mapping")
    cpu = _bytes_tensor(recorded.get("cpu"), torch.get_rng_state().numel(), where)
    skipped: list[str] = []
    cuda_states: list[Any] = []
    cuda = recorded.get("cuda")
    if cuda is not None:
        if not isinstance(cuda, list):
            raise CorruptEntryError(f"{where}: the recorded CUDA random states are {type(cuda).__name__}, "
                                    "expected a list")
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            sizes = [s.numel() for s in torch.cuda.get_rng_state_all()]
            cuda_states = [_bytes_tensor(text, size, where) for text, size in zip(cuda, sizes)]
        else:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            skipped.append(f"CUDA random states recorded for {len(cuda)} device(s), this process has {count}")
    return RngState(cpu, cuda_states, skipped)


def restore_rng_state(recorded: Any, where: str) -> list[str]:
    """Set torch's generators to ``recorded`` (what :func:`capture_rng_state` returned).

    Everything is checked before anything is set: a damaged state changes nothing.

    Args:
        recorded: the ``rng_state`` value of an entry's meta.
        where: the entry, for messages.

    Returns:
        What was not restored and why (e.g. CUDA states recorded on a run with other devices).

    Raises:
        CorruptEntryError: ``recorded`` is not a state this torch accepts (wrong type or size).

    Example:
        >>> import torch
        >>> state = capture_rng_state(); first = torch.rand(1)
        >>> restore_rng_state(state, "example"); bool(torch.rand(1) == first)
        []
        True
    """
    return parse_rng_state(recorded, where).apply()
