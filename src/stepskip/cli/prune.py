"""``stepskip prune``: remove the step directories of a run chosen by count, age or step list."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from stepskip.cli.errors import CliError
from stepskip.cli.removal import retire
from stepskip.cli.scan import RunDir, StepDir, local_store, scan_run
from stepskip.config import StepSet
from stepskip.errors import SkipConfigError
from stepskip.layout import RUN_DIR

__all__ = ["PrunePlan", "apply_prune", "parse_duration", "parse_steps", "plan_prune"]

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
    """

    run: RunDir
    remove: list[StepDir] = field(default_factory=list)
    keep: list[StepDir] = field(default_factory=list)


def plan_prune(path: str, keep_last: int | None = None, older_than: float | None = None,
               steps: StepSet | None = None, role: str | None = None, now: float | None = None) -> PrunePlan:
    """Choose the step directories to remove; exactly one criterion is given.

    Args:
        path: a run directory, or a stage role's subdirectory of one (prunes that role only).
        keep_last: keep the N highest steps of each role, remove the others.
        older_than: remove steps recorded more than this many seconds ago.
        steps: remove these steps.
        role: only this role's steps.
        now: the current time (tests).

    Returns:
        The plan; nothing is removed yet.

    Raises:
        CliError: ``path`` is not a run directory, or not exactly one criterion is given.

    Example:
        >>> plan = plan_prune("/tmp/dump/exp_proj/GBS4_N2_in8_out6", keep_last=2)  # doctest: +SKIP
    """
    chosen = [c for c in (keep_last, older_than, steps) if c is not None]
    if len(chosen) != 1:
        raise CliError("give exactly one of --keep-last N, --older-than AGE, --steps SPEC")
    if keep_last is not None and keep_last < 0:
        raise CliError(f"--keep-last {keep_last} is not valid; expected a count >= 0")
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(full):
        raise CliError(f"{path}: no such directory")
    name, parent = os.path.basename(full), os.path.dirname(full)
    if RUN_DIR.match(name):
        run = scan_run(full)
    elif RUN_DIR.match(os.path.basename(parent)):
        run = scan_run(parent)
        if role is not None and role != name:
            raise CliError(f"{path} holds the steps of role {name!r}, not {role!r}")
        role = name
        run.steps = [s for s in run.steps if os.path.dirname(s.path) == full]
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
    removed = {s.path for s in plan.remove}
    plan.remove.sort(key=lambda s: (s.role or "", s.step))
    plan.keep = [s for s in run.steps if s.path not in removed]
    return plan


def apply_prune(plan: PrunePlan) -> list[str]:
    """Remove the planned step directories (each vanishes at once: see :func:`retire`); returns their paths."""
    store = local_store(plan.run.path)
    for step in plan.remove:
        retire(store, step.path)
    return [s.path for s in plan.remove]
