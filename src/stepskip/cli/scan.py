"""The command line's view of a cache: the library's index (:mod:`stepskip.index`) opened on a path or URL.

Everything here is the index's; this module only opens it with the options a command was given
and keeps the names the commands (and their users' scripts) import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stepskip.index import (
    CacheIndex,
    EntryRecord,
    EntryStatus,
    Issue,
    IssueKind,
    NotACacheError,
    RoleSummary,
    RunDir,
    StepDir,
    StepKind,
    compress_steps,
    is_leftover,
)

__all__ = [
    "CacheIndex", "EntryRecord", "EntryStatus", "Issue", "IssueKind", "NotACacheError", "RoleSummary", "RunDir",
    "StepDir", "StepKind", "compress_steps", "is_leftover", "open_index", "scan_cache",
]


def open_index(path: str, storage_options: Mapping[str, Any] | None = None) -> CacheIndex:
    """The index of the cache (or part of one) at ``path``: a local path, ``memory://...``, ``s3://...``.

    Args:
        path: a dump dir, an experiment, run or role directory, or an entry.
        storage_options: fsspec options for a URL (ignored for local paths).

    Raises:
        SkipConfigError: the URL's filesystem is not installed.
    """
    return CacheIndex(path, storage_options)


def scan_cache(path: str, storage_options: Mapping[str, Any] | None = None) -> list[RunDir]:
    """Scan every run directory at ``path`` (itself, its children or grandchildren).

    Raises:
        NotACacheError: ``path`` is missing or is not a cache.

    Example:
        >>> [r.name for r in scan_cache("~/.verl/rollout_dump")]  # doctest: +SKIP
        ['exp_proj/GBS64_N8_in512_out1024']
    """
    return open_index(path, storage_options).runs()
