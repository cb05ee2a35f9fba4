"""Names every part of stepskip agrees on for cache entries: verl's data files and format names.

Free of heavy imports, so tools that only list, verify or prune caches start without torch.
"""

from __future__ import annotations

__all__ = ["GEN_BATCH_FILE", "TQ_BATCH_FILE", "FORMAT_USES_PICKLE", "verl_entry_kind"]

GEN_BATCH_FILE = "gen_batch.dp"  # rollout / async_rollout entries written by verl (a DataProto pickle)
TQ_BATCH_FILE = "tq_batch.pt"  # rollout_tq inner entries written by verl (torch.save of a V1 payload)

#: Every storage format by name, and whether its files are pickles (read only with allow_pickle).
FORMAT_USES_PICKLE = {"safe": False, "verl": True, "verl-tq": True}


def verl_entry_kind(v1: bool) -> tuple[tuple[str, ...], str]:
    """``(data files verl writes, format name)`` for a flat entry or a V1 inner entry."""
    return ((TQ_BATCH_FILE,), "verl-tq") if v1 else ((GEN_BATCH_FILE,), "verl")
