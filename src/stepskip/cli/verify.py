"""``stepskip verify``: checksums and completeness of every entry, leftovers, half-written directories.

A problem names the path ``--repair`` would remove: the damaged entry, the whole V1 step (its
inner entries can never be completed by another run; a step whose manifest is damaged), one
generation call's entry of a TRL step (every other call's entry is valid on its own), the
half-written directory or the leftover (recordings a V1 step's manifest does not name, too).
Valid entries are never targets. Things a writer may still be working on (leftovers, half-written
directories, incomplete V1 steps) are left alone while they are younger than the grace period (a
recording a manifest retired: younger than the grace period since it was retired). Entries of a
format this stepskip does not know and entries whose intact bytes do not decode here are reported
and never removed; neither is anything reached through a symbolic link.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stepskip._entries import format_spec
from stepskip._index import CacheIndex, EntryRecord, Issue, IssueKind, NotACacheError, RunDir, StepKind

__all__ = ["Problem", "RepairResult", "VerifyReport", "count_entries", "repair", "verify_runs"]

logger = logging.getLogger(__name__)

#: Kinds of damage a live writer may be in the middle of producing (protected by the grace period).
IN_PROGRESS_KINDS = frozenset({IssueKind.LEFTOVER, IssueKind.HALF_WRITTEN, IssueKind.INCOMPLETE,
                               IssueKind.MIXED_RUNS})
#: Reported, never removed: entries whose bytes are intact but that this stepskip cannot decode, and
#: in-place inner directories written after the manifest beside them (someone's data, not read), and
#: entries the store did not answer for (nothing is known of them).
KEPT_KINDS = frozenset({IssueKind.UNSUPPORTED, IssueKind.UNDECODABLE, IssueKind.SHADOWED, IssueKind.UNAVAILABLE})


@dataclass(frozen=True)
class Problem:
    """One thing wrong, and what ``--repair`` would do about it.

    Args:
        kind: what is wrong.
        path: where.
        detail: why, in words.
        remove: the path ``--repair`` removes (an entry, a whole V1 step, a leftover).
        recent: modified within the grace period, so possibly a write in progress: ``--repair`` keeps it.
    """

    kind: IssueKind
    path: str
    detail: str
    remove: str
    recent: bool = False


@dataclass
class VerifyReport:
    """What ``verify`` found.

    Args:
        runs: run directories checked.
        entries: entry directories checked.
        checksummed: entries whose files were checked against their checksums.
        decoded: entries decoded (``--deep``).
        unverified: entries without checksums (written by verl) that were not decoded.
        problems: everything wrong.
        others: paths that are no part of a cache's layout (left alone).
        links: symbolic links in the layout (never followed, never removed).
    """

    runs: int = 0
    entries: int = 0
    checksummed: int = 0
    decoded: int = 0
    unverified: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems


@dataclass
class RepairResult:
    """What ``--repair`` did: removed paths, and problems left because they may be in progress."""

    removed: list[str] = field(default_factory=list)
    kept: list[Problem] = field(default_factory=list)


def count_entries(runs: list[RunDir]) -> int:
    """How many entry directories ``verify_runs`` will check (for a progress bar)."""
    return sum(len(s.entries) for r in runs for s in r.steps)


def _check_entry(index: CacheIndex, entry: EntryRecord, deep: bool, allow_pickle: bool,
                 report: VerifyReport) -> Issue | None:
    """Checksums (and, when ``deep``, decoding) of one present entry; the problem found, if any."""
    issue = index.check_entry(entry, decode=deep, allow_pickle=allow_pickle)
    if issue is not None:
        return issue
    if entry.has_checksums:
        report.checksummed += 1
    spec = format_spec(entry.format)
    if deep and (allow_pickle or not (spec is not None and spec.uses_pickle)):
        report.decoded += 1
    elif not entry.has_checksums:
        report.unverified.append(entry.path)
    return None


def verify_runs(index: CacheIndex, runs: list[RunDir], deep: bool = False, allow_pickle: bool = False,
                grace: float = 3600.0, now: float | None = None,
                on_entry: Callable[[EntryRecord], None] | None = None) -> VerifyReport:
    """Check every entry of ``runs``.

    Args:
        index: the index the runs come from (it reads the entries).
        runs: from :meth:`CacheIndex.runs`.
        deep: also decode every entry (pickle-based ones only with ``allow_pickle``).
        allow_pickle: decode pickle-based entries when ``deep``.
        grace: seconds during which a leftover, half-written directory or incomplete V1 step counts
            as possibly in progress (reported, not repaired).
        now: the current time (tests).
        on_entry: called after each entry is checked (progress).

    Returns:
        The report.

    Example:
        >>> index = CacheIndex("~/.verl/rollout_dump")  # doctest: +SKIP
        >>> verify_runs(index, index.runs()).clean  # doctest: +SKIP
        True
    """
    now = time.time() if now is None else now
    report = VerifyReport(runs=len(runs))
    for run in runs:
        report.others += run.others
        report.links += run.links
        for step in run.steps:
            issues = step.issues()
            for entry in step.entries:
                report.entries += 1
                if entry.valid:
                    found = _check_entry(index, entry, deep, allow_pickle, report)
                    if found is not None:
                        issues.append(found)
                if on_entry is not None:
                    on_entry(entry)
            # A flat entry is its step directory; a V1 step is replayed whole or not at all, so it goes whole;
            # the calls of a TRL step are replayed one by one, so only the call's own entry goes.
            recent = now - step.mtime < grace
            for issue in issues:
                if issue.kind in KEPT_KINDS:
                    report.problems.append(Problem(issue.kind, issue.path, issue.detail, "", recent=False))
                    continue
                target, young = step.path, recent
                if step.kind is StepKind.CALLS:  # the call's own entry, written (or abandoned) on its own
                    target, young = issue.path, now - index.tree_stats(issue.path)[1] < grace
                in_progress = issue.kind in IN_PROGRESS_KINDS or step.kind is StepKind.V1
                report.problems.append(Problem(issue.kind, issue.path, issue.detail, target,
                                               recent=young and in_progress))
            for issue in step.shadowed_issues():
                report.problems.append(Problem(issue.kind, issue.path, issue.detail, "", recent=False))
            for leftover in step.leftovers:
                # a recording its manifest retired may still be read by whoever resolved the old manifest
                when = max(index.tree_stats(leftover)[1], step.retired_at(leftover) or 0.0)
                report.problems.append(Problem(IssueKind.LEFTOVER, leftover, "leftover of an interrupted write",
                                               leftover, recent=now - when < grace))
        for leftover in run.leftovers:
            report.problems.append(Problem(IssueKind.LEFTOVER, leftover,
                                           "leftover of an interrupted write or replacement", leftover,
                                           recent=now - index.tree_stats(leftover)[1] < grace))
    report.problems.sort(key=lambda p: (p.path, p.kind.value))
    return report


def repair(index: CacheIndex, report: VerifyReport) -> RepairResult:
    """Remove what can never become a valid entry; keep what may still be in progress.

    Returns:
        The removed paths and the problems kept (``recent``).
    """
    result = RepairResult()
    keep = {p.remove for p in report.problems if p.recent}
    keep |= {p.path for p in report.problems if p.kind in KEPT_KINDS}
    targets = {p.remove for p in report.problems if p.kind not in KEPT_KINDS}
    for target in sorted(targets - keep, key=len):  # parents before children
        if any(target.startswith(r + "/") for r in result.removed):
            continue  # gone with its parent
        if any(k.startswith(target + "/") for k in keep):
            keep.add(target)  # something inside may be in progress
            continue
        try:
            index.retire(target)
        except NotACacheError as err:  # became a link, or left the cache, since the scan: not followed
            logger.warning("not removed: %s", err)
            keep.add(target)
            continue
        result.removed.append(target)
    result.kept = [p for p in report.problems if p.remove in keep or p.kind in KEPT_KINDS]
    return result
