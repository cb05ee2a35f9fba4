"""The listings a role takes of its directories, and the rules under which one is reused.

``repeat``, ``random`` and ``match`` list a run directory on every call. On local disk a parsed
listing is reused while all of these hold: the directory's version (device, inode, mtime and
ctime) is what it was, that mtime was already :data:`~stepskip._storage.SETTLED_NS` old when it was
listed, the role has written no entry since, and the listing is less than :data:`LISTING_MAX_AGE`
seconds old. A call then costs a ``stat``, not a listing, whatever the number of entries. The last
two rules bound what directory times cannot tell: a FUSE mount with fixed directory times, an NFS
client whose clock runs ahead of the server's, entries added by other writers whose times were set
back. Only names are reused: every candidate is still validated when it is chosen.
"""

from __future__ import annotations

import bisect
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stepskip._storage import settled
from stepskip._layout import RUN_DIR, Layout

__all__ = ["LISTING_MAX_AGE", "StepListing", "step_names"]

#: A reused directory listing is taken afresh at least this often (seconds), whatever the
#: directory's version says.
LISTING_MAX_AGE = 30.0
#: The clock of :data:`LISTING_MAX_AGE` (a module attribute so tests can move it).
_monotonic = time.monotonic
#: At most this many resolved steps wait for their reads (calls in flight at once).
_RESOLVED_MAX = 256
#: A listing differing from the last one parsed in at most this many step names updates its steps.
_UPDATED_MAX = 64
_STEP_NAME = re.compile(r"0|[1-9][0-9]{0,18}", re.ASCII)
_ODD_DIGITS = re.compile(r"\n0[0-9]|[0-9]{20}")  # a leading zero, or more digits than a step has


@dataclass(frozen=True, slots=True)
class _Steps:
    """A run directory's steps as listed: the directory and its version then, when (monotonic)."""

    path: str
    version: Any
    steps: tuple[int, ...]
    at: float


@dataclass(frozen=True, slots=True)
class _StartUp:
    """The listing the start-up clean-up took: its step names, when, and the writes seen by then."""

    path: str
    version: Any
    names: frozenset[str]
    at: float
    writes: int


@dataclass(frozen=True, slots=True)
class _Runs:
    """The step names of every run directory ``match`` spans, with the versions that keep it valid."""

    writes: int
    versions: tuple[tuple[str, Any], ...]
    listing: dict[str, frozenset[str]]
    at: float


class StepListing:
    """The reused listings of one role (see the module docstring).

    Args:
        store: returns the role's store (bound on first use).
    """

    def __init__(self, store: Callable[[], Any]) -> None:
        self._store = store
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """A new run: nothing listed yet."""
        self.writes_seen = 0
        #: call step -> the step a call's decision resolved to load (see :meth:`keep_resolved`)
        self._resolved: dict[int, int] = {}
        #: the directory, step names and steps of the last listing parsed, and its names as listed (a
        #: directory unchanged lists them in the same order; see :meth:`_parse`)
        self._parsed: tuple[str, frozenset[str], tuple[int, ...], list[str]] | None = None
        self._steps: _Steps | None = None
        self._start_up: _StartUp | None = None
        self._runs: _Runs | None = None

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def wrote(self) -> None:
        """The role wrote (or tried to write) an entry: the next listing is taken afresh."""
        with self.lock:
            self.writes_seen += 1
            self._steps = None

    def keep_resolved(self, step: int, load_step: int) -> None:
        """Keep the step a call at ``step`` resolved to load when its hit was decided, for the read
        that follows (:meth:`take_resolved`): resolving again would list the directory again."""
        if len(self._resolved) >= _RESOLVED_MAX:  # decisions whose read never came
            self._resolved.clear()
        self._resolved[step] = load_step

    def take_resolved(self, step: int) -> int | None:
        """The step kept for a call at ``step``, once (None when there is none)."""
        return self._resolved.pop(step, None)

    def clean_up(self, path: str) -> None:
        """Remove the leftovers under the local directory ``path``; the listing the store takes for it
        is kept for the first call, which lists it otherwise (10,000 names: a few milliseconds), under
        the rules of a reused listing."""
        store = self._store()
        version, listed_at, listed_mono = store.dir_version(path), time.time_ns(), _monotonic()
        names: list[str] = []
        store.remove_leftovers(path, listed=names)
        if settled(version, listed_at) and store.dir_version(path) == version:
            self._start_up = _StartUp(path, version, step_names(names), listed_mono, self.writes_seen)

    def steps(self, path: str) -> list[int]:
        """The steps that have a directory in ``path``, sorted: reused, or listed now."""
        store = self._store()
        version = store.dir_version(path)
        cached = self._steps
        writes = self.writes_seen
        start = self._start_up
        if cached is None and start is not None and version is not None and (start.path, start.version) == (
                path, version) and start.writes == writes and 0 <= _monotonic() - start.at < LISTING_MAX_AGE:
            # unchanged since the start-up clean-up listed it (settled then): as if listed at that time
            self._start_up = None
            cached = self._steps = _Steps(path, version, tuple(sorted(map(int, start.names))), start.at)
        if (version is not None and cached is not None and (cached.path, cached.version) == (path, version)
                and 0 <= _monotonic() - cached.at < LISTING_MAX_AGE):
            return list(cached.steps)
        listed_at, listed_mono = time.time_ns(), _monotonic()
        listed = self._parse(path, store.list_dir(path))
        if settled(version, listed_at) and store.dir_version(path) == version:
            with self.lock:  # as wrote() changes them: no write of ours finished while we listed
                if writes == self.writes_seen:
                    self._steps = _Steps(path, version, tuple(listed), listed_mono)
        return listed

    def _parse(self, path: str, names: list[str]) -> list[int]:
        """The steps named in ``names`` (a listing of ``path``), sorted. The names of the last listing
        parsed and their steps are kept: a listing with the same step names (a directory touched,
        a file beside the steps written) reuses its steps, one differing in a few names updates them;
        2,000 names parsed and sorted cost ~0.3 ms, compared ~0.05 ms."""
        last = self._parsed
        if last is not None and last[0] == path and names == last[3]:  # in the same order: ~0.02 ms
            return list(last[2])
        listed = list(names)  # a copy: the caller's list is the caller's
        digits = _step_names(names)
        if last is not None and last[0] == path:
            if last[1] == digits:
                self._parsed = (path, digits, last[2], listed)
                return list(last[2])
            added, removed = digits - last[1], last[1] - digits
            if len(added) + len(removed) <= _UPDATED_MAX:
                steps = list(last[2])
                for step in map(int, removed):
                    del steps[bisect.bisect_left(steps, step)]
                for step in map(int, added):
                    bisect.insort(steps, step)
                self._parsed = (path, digits, tuple(steps), listed)
                return steps
        steps = sorted(map(int, digits))
        self._parsed = (path, digits, tuple(steps), listed)
        return steps

    def runs(self, layout: Layout) -> dict[str, frozenset[str]]:
        """Run directory (with the role's subdirectory) -> the names of its step entries, for every run
        directory of ``layout``'s experiment whose prompt and response lengths are its run's.

        Reused, as :meth:`steps` reuses its listing, while every directory listed keeps its version
        (it was settled when listed), the role wrote nothing since and the listing is less than
        :data:`LISTING_MAX_AGE` seconds old: a later call then costs a ``stat`` per run directory,
        not a listing of every entry. Object stores have no versions: listed every call.
        """
        store = self._store()
        cached = self._runs
        if (cached is not None and cached.writes == self.writes_seen and 0 <= _monotonic() - cached.at < LISTING_MAX_AGE
                and all(store.dir_version(path) == version for path, version in cached.versions)):
            return cached.listing
        writes, listed_at, listed_mono = self.writes_seen, time.time_ns(), _monotonic()
        start, self._start_up = self._start_up, None  # used once at most: later listings are reused as above
        root = layout.experiment_dir
        versions = [(root, store.dir_version(root))]
        listing: dict[str, frozenset[str]] = {}
        for run_name in store.list_dir(root):
            shape = RUN_DIR.match(run_name)
            if shape is None or (int(shape[3]), int(shape[4])) != (layout.prompt_len, layout.response_len):
                continue
            project = layout.project_dir_of(run_name)
            version = store.dir_version(project)
            # a role directory not made yet: its run directory's version changes once it is
            run_dir = layout.run_dir_of(run_name)
            versions.append((project, version) if version is not None or not layout.subdir
                            else (run_dir, store.dir_version(run_dir)))
            if (start is not None and start.path == project and start.version == version and start.writes == writes
                    and 0 <= listed_mono - start.at < LISTING_MAX_AGE):
                listing[project] = start.names  # unchanged since the start-up clean-up listed it
            else:
                listing[project] = step_names(store.list_dir(project))
        if (all(settled(version, listed_at) and store.dir_version(path) == version for path, version in versions)
                and writes == self.writes_seen):  # nothing changed while we listed, no write of ours finished
            self._runs = _Runs(writes, tuple(versions), listing, listed_mono)
        return listing


def _step_names(names: list[str]) -> frozenset[str]:
    """The names :meth:`Layout.parse_step` reads a step in (ASCII digits), by C-level passes."""
    digits = frozenset(filter(str.isdigit, names))
    if not "".join(digits).isascii():  # other scripts' digits name no step
        digits = frozenset(name for name in digits if name.isascii())
    return digits


def step_names(names: list[str]) -> frozenset[str]:
    """The names among ``names`` that are step directories' (``0``, ``12``: ASCII digits, no leading zero).

    Checked by C-level passes (``str.isdigit``, then one scan of the digit names joined for a
    non-ASCII digit, a leading zero or a 20th digit), one by one only when some name has one: 10,000
    names cost well under a millisecond.

    Example:
        >>> sorted(step_names(["3", "03", "x", "12", ".tmp-1"]))
        ['12', '3']
    """
    digits = frozenset(filter(str.isdigit, names))
    joined = "\n" + "\n".join(digits)
    if not joined.isascii() or _ODD_DIGITS.search(joined):
        return frozenset(name for name in digits if _STEP_NAME.fullmatch(name))
    return digits
