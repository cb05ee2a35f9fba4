"""The cache as scripts see it: the index the command line reads, and the operations it runs.

Every ``stepskip`` command is a thin shell over these names, so a script can do what the command
line does — on a local path, ``memory://`` or an object store (``s3://…`` with its
``storage_options``) — and get the findings as objects instead of text:

- :class:`CacheIndex` lists runs, roles and steps, classifies every entry and reads them back;
- :func:`verify` checks checksums, completeness and leftovers, and :func:`repair` removes what can
  never become a valid entry (never a valid entry of any layout stepskip writes);
- :func:`plan_prune` / :func:`apply_prune` remove whole steps by age, count or list;
- :func:`convert` rewrites a cache in another format (verl's pickles into the safe format).

Example:
    >>> from stepskip.cache import CacheIndex, compress_steps, verify
    >>> index = CacheIndex("~/.verl/rollout_dump")  # doctest: +SKIP
    >>> for run in index.runs():  # doctest: +SKIP
    ...     for role in run.roles():
    ...         print(run.name, role.role, compress_steps(role.steps))
    >>> verify(index).clean  # doctest: +SKIP
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from stepskip.cli.errors import CliError
from stepskip.cli.prune import PrunePlan, apply_prune, plan_prune
from stepskip.cli.verify import Problem, RepairResult, VerifyReport, repair, verify_runs
from stepskip._index import (
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
)

__all__ = [
    "CacheIndex", "EntryRecord", "EntryStatus", "Issue", "IssueKind", "RoleSummary", "RunDir", "StepDir", "StepKind",
    "NotACacheError", "CliError", "compress_steps", "open_cache",
    "verify", "verify_runs", "repair", "VerifyReport", "Problem", "RepairResult",
    "plan_prune", "apply_prune", "PrunePlan",
    "convert", "convert_cache", "plan_convert", "ConvertReport", "ConvertedEntry",
]


#: Names whose module loads the codecs (and torch): imported on first use, so a script that only lists or
#: verifies a cache starts as fast as ``stepskip ls`` does.
_LAZY = {"ConvertedEntry": "stepskip.cli.convert", "ConvertReport": "stepskip.cli.convert",
         "convert_cache": "stepskip.cli.convert", "plan_convert": "stepskip.cli.convert"}

if TYPE_CHECKING:
    from stepskip.cli.convert import ConvertedEntry, ConvertReport, convert_cache, plan_convert


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stepskip.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def open_cache(path: str | CacheIndex, storage_options: Mapping[str, Any] | None = None) -> CacheIndex:
    """The index of the cache (or part of one) at ``path``.

    Args:
        path: a dump dir, an experiment, run or role directory, or an entry: a local path or a URL;
            an index is returned as it is.
        storage_options: fsspec options for a URL (a role's ``storage_options``).

    Returns:
        The index; nothing is read until it is asked.

    Raises:
        SkipConfigError: the URL's filesystem is not installed.

    Example:
        >>> open_cache("/tmp/no-cache-here").path  # doctest: +SKIP
        '/tmp/no-cache-here'
    """
    return path if isinstance(path, CacheIndex) else CacheIndex(path, storage_options)


def verify(path: str | CacheIndex, *, deep: bool = False, allow_pickle: bool = False, grace: float = 3600.0,
           storage_options: Mapping[str, Any] | None = None,
           on_entry: Callable[[EntryRecord], None] | None = None) -> VerifyReport:
    """Check every entry under ``path``, as ``stepskip verify`` does; nothing is changed.

    Args:
        path: a dump dir, experiment or run directory (or an open :class:`CacheIndex`).
        deep: also decode every entry (pickle-based ones only with ``allow_pickle``).
        allow_pickle: decode pickle-based entries (verl's files) through the allow-list unpickler.
        grace: seconds during which a leftover or a half-written step counts as possibly in progress.
        storage_options: fsspec options for a URL.
        on_entry: called after each entry (progress).

    Returns:
        The report; ``report.clean`` is true when nothing is wrong. Hand it to :func:`repair` to
        remove what can never become valid.

    Raises:
        NotACacheError: ``path`` is missing or holds no cache.

    Example:
        >>> report = verify("~/.verl/rollout_dump", deep=True)  # doctest: +SKIP
        >>> [p.kind.value for p in report.problems]  # doctest: +SKIP
        []
    """
    index = open_cache(path, storage_options)
    return verify_runs(index, index.runs(), deep=deep, allow_pickle=allow_pickle, grace=grace, on_entry=on_entry)


def convert(src: str | CacheIndex, dst: str | CacheIndex, to: str = "safe", *, allow_pickle: bool = False,
            overwrite: bool = False, role: str | None = None,
            storage_options: Mapping[str, Any] | None = None) -> ConvertReport:
    """Rewrite every valid entry under ``src`` in format ``to`` into the dump dir ``dst``, as
    ``stepskip convert`` does; ``src`` is never modified.

    Args:
        src: the cache to read (a dump dir, experiment or run directory).
        dst: the dump dir to write (need not exist); runs keep their paths below it.
        to: ``safe`` or ``verl``.
        allow_pickle: read pickle-based source entries (verl's files).
        overwrite: replace destination entries that exist.
        role: convert only this role's steps.
        storage_options: fsspec options for URLs (both sides).

    Returns:
        The report: converted entries, failures with their reason, invalid source steps left out.

    Raises:
        CliError: the conversion cannot start (``dst`` inside ``src``, pickles without ``allow_pickle`` …).

    Example:
        >>> convert("~/.verl/rollout_dump", "/data/safe_dump", allow_pickle=True).ok  # doctest: +SKIP
        True
    """
    from stepskip.cli.convert import convert_cache

    return convert_cache(open_cache(src, storage_options), open_cache(dst, storage_options), to,
                         allow_pickle=allow_pickle, overwrite=overwrite, role=role)
