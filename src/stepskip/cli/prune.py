"""``stepskip prune``: remove the step directories of a run chosen by count, age or step list.

Steps holding an entry this stepskip cannot read — a format it does not know (a newer stepskip's),
or, with ``deep``, intact bytes that do not decode here — are never removed: they are listed as
protected; so are steps with an entry (or a manifest) the store did not answer for while scanning.
Nothing reached through a symbolic link is removed (or entered).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

from stepskip.cli.errors import CliError
from stepskip.config import StepSet
from stepskip.errors import SkipConfigError
from stepskip._index import CacheIndex, Issue, IssueKind, NotACacheError, RunDir, StepDir
from stepskip._layout import RUN_DIR, Layout

__all__ = ["PrunePlan", "apply_prune", "parse_duration", "parse_steps", "plan_prune", "protected_issues",
           "retire_steps"]

logger = logging.getLogger(__name__)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_duration(text: str, option: str = "--older-than") -> float:
    """Seconds in ``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"2w"`` (or ``"0"``).

    Raises:
        CliError: anything else; the message shows the accepted forms.

    Example:
        >>> parse_duration("7d")
        604800.0
    """
    if text.strip() == "0":
        return 0.0
    match = _DURATION.match(text)
    if match is None:
        raise CliError(f"{option} {text!r} is not a duration; use a number and a unit: 90s, 30m, 12h, 7d, 2w")
    return float(match[1]) * _UNITS[match[2]]


def parse_steps(spec: str, option: str = "--steps") -> StepSet:
    """A step list in the syntax of ``skip.<role>.steps``: ``"1,2,10-20,30-100:10"`` or ``"all"``.

    Raises:
        CliError: the spec does not parse (the message says what is allowed).

    Example:
        >>> 15 in parse_steps("1,2,10-20")
        True
    """
    try:
        return StepSet.parse([p.strip() for p in spec.split(",") if p.strip()], key=option)
    except SkipConfigError as err:
        raise CliError(str(err)) from None


@dataclass
class PrunePlan:
    """The step directories a prune removes and keeps.

    Args:
        run: the run directory.
        remove: step directories to remove.
        keep: step directories left in place.
        protected: why chosen steps are kept anyway (an unsupported or unreadable entry in them).
    """

    run: RunDir
    remove: list[StepDir] = field(default_factory=list)
    keep: list[StepDir] = field(default_factory=list)
    protected: list[Issue] = field(default_factory=list)


def plan_prune(index: CacheIndex, keep_last: int | None = None, older_than: float | None = None,
               steps: StepSet | None = None, role: str | None = None, now: float | None = None,
               deep: bool = False, allow_pickle: bool = False) -> PrunePlan:
    """Choose the step directories to remove; exactly one criterion is given.

    Args:
        index: opened on a run directory, or on a role's subdirectory of one (prunes that role only).
        keep_last: keep the N highest steps of each role, remove the others.
        older_than: remove steps recorded more than this many seconds ago.
        steps: remove these steps.
        role: only this role's steps.
        now: the current time (tests).
        deep: decode every chosen entry first and keep those that do not decode here (unreadable).
        allow_pickle: decode pickle-based entries when ``deep`` (otherwise they are not checked).

    Returns:
        The plan; nothing is removed yet.

    Raises:
        CliError: ``path`` is not a run directory, or not exactly one criterion is given.

    Example:
        >>> plan = plan_prune(CacheIndex("/tmp/dump/exp_proj/GBS4_N2_in8_out6"), keep_last=2)  # doctest: +SKIP
    """
    chosen = [c for c in (keep_last, older_than, steps) if c is not None]
    if len(chosen) != 1:
        raise CliError("give exactly one of --keep-last N, --older-than AGE, --steps SPEC")
    if keep_last is not None and keep_last < 0:
        raise CliError(f"--keep-last {keep_last} is not valid; expected a count >= 0")
    path, full = index.given, index.root
    item = index.store.stat_item(full)
    if item is None or item.kind != "dir":
        raise CliError(f"{path}: no such directory")
    parent, _, name = full.rpartition("/")
    if RUN_DIR.match(name):
        run = index.scan_run(full)
    elif RUN_DIR.match(parent.rpartition("/")[2]):
        run = index.scan_run(parent)
        if role is not None and role != name:
            raise CliError(f"{path} holds the steps of role {name!r}, not {role!r}")
        role = name
        run.steps = [s for s in run.steps if s.path.rpartition("/")[0] == full]
    else:
        raise CliError(f"{path} is not a run directory (GBS<gbs>_N<n>_in<prompt_len>_out<response_len>); "
                       "`stepskip ls DUMP_DIR` lists them")
    candidates = [s for s in run.steps if role is None or s.role == role]
    if role is not None and not candidates:
        known = sorted({s.role for s in run.steps if s.role})
        raise CliError(f"{path} has no steps of role {role!r}; roles there: {', '.join(known) or 'none'}")
    plan = PrunePlan(run)
    now = time.time() if now is None else now
    if keep_last is not None:
        by_role: dict[str, list[StepDir]] = {}
        for s in candidates:
            if s.role is not None:  # half-written directories of unknown role: `verify --repair` handles them
                by_role.setdefault(s.role, []).append(s)
        for group in by_role.values():
            group.sort(key=lambda s: s.step, reverse=True)
            plan.remove += group[keep_last:]
    elif older_than is not None:
        plan.remove = [s for s in candidates if now - s.time > older_than]
    else:
        assert steps is not None
        plan.remove = [s for s in candidates if s.step in steps]
    for s in list(plan.remove):  # what this stepskip cannot read is someone else's data: chosen, but kept
        found = protected_issues(index, s, deep=deep, allow_pickle=allow_pickle)
        if found:
            plan.protected += found
            plan.remove.remove(s)
    removed = {s.path for s in plan.remove}
    plan.remove.sort(key=lambda s: (s.role or "", s.step))
    plan.keep = [s for s in run.steps if s.path not in removed]
    return plan


def protected_issues(index: CacheIndex, step: StepDir, deep: bool = False, allow_pickle: bool = False) -> list[Issue]:
    """Why ``step`` must not be removed: the entries in it this stepskip cannot read (a format it does not
    know; with ``deep``, intact bytes that do not decode here), someone else's data, or could not see (the
    store did not answer for it or its manifest). Empty: it may go.

    Example:
        >>> protected_issues(index, index.scan_step(path, 3))  # doctest: +SKIP
        []
    """
    # an entry (or a step's manifest) the store did not answer for may be any of these: nothing is known of it
    found = [i for i in step.issues()
             if i.kind in (IssueKind.UNSUPPORTED, IssueKind.UNDECODABLE, IssueKind.UNAVAILABLE)]
    if deep and not found:
        found = [issue for e in step.entries if (issue := index.check_entry(e, decode=True, allow_pickle=allow_pickle))
                 is not None and issue.kind is IssueKind.UNDECODABLE]
    return found


def apply_prune(index: CacheIndex, plan: PrunePlan) -> list[str]:
    """Remove the planned step directories (each vanishes at once: see :meth:`CacheIndex.retire`).

    Returns:
        The removed paths.
    """
    return retire_steps(index, plan.remove)


def retire_steps(index: CacheIndex, steps: list[StepDir]) -> list[str]:
    """Remove step directories, each at once (:meth:`CacheIndex.retire`: renamed away, then deleted, on
    local stores; commit points first on object stores), as ``stepskip prune`` and in-run retention do.

    The drift records of a removed step (``action: compare``'s reports, beside the steps) go with it, so
    they do not accumulate over a long run's retention.

    Returns:
        The removed paths (a step that became a link since it was scanned is left, with a warning).
    """
    removed = []
    for step in steps:
        try:
            index.retire(step.path)
        except NotACacheError as err:  # became a link since the scan: not followed, not removed
            logger.warning("not removed: %s", err)
            continue
        removed.append(step.path)
    _retire_drift_records(index, removed)
    return removed


def _retire_drift_records(index: CacheIndex, step_paths: list[str]) -> None:
    """Remove the drift records of the removed steps: one listing per directory of records."""
    by_dir: dict[str, set[str]] = {}
    for path in step_paths:
        by_dir.setdefault(Layout.drift_dir_of(path), set()).add(path.rstrip("/").rpartition("/")[2])
    for where, steps in by_dir.items():
        for name in index.store.list_dir(where):
            step = name.removesuffix(".json").partition("-")[0]
            if name.endswith(".json") and step in steps:
                try:
                    index.retire(f"{where}/{name}")
                except NotACacheError as err:  # a link planted among the records: left, never followed
                    logger.warning("not removed: %s", err)
