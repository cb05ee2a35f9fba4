"""What a cache directory holds: runs, roles, step directories and entries, found without reading data.

A dump dir holds ``{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}/`` run directories
(:data:`stepskip.layout.RUN_DIR`). Inside a run directory:

* ``{step}/`` with ``meta.json``: an entry of ``rollout`` or ``async_rollout`` (``data.*`` or
  verl's ``gen_batch.dp``);
* ``{step}/{inner}/``: the inner entries of one ``rollout_tq`` (V1) step;
* ``{name}/{step}/``: the entries of the generic stage role ``name``;
* ``.tmp-*`` / ``.trash-*``: leftovers of interrupted writes and replacements, never entries.

Entries are classified with :meth:`LocalStore.probe` (sizes, ``meta.json``), never decoded here.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stepskip.cli.errors import CliError
from stepskip.entries import legacy_format
from stepskip.layout import RUN_DIR, Layout, is_url
from stepskip.store import META_FILE, TMP_PREFIX, TRASH_PREFIX, EntryState, LocalStore, open_store

__all__ = [
    "EntryRecord", "Issue", "IssueKind", "RoleSummary", "RunDir", "StepDir", "StepKind", "compress_steps",
    "find_run_dirs", "is_leftover", "local_store", "resolve_target", "scan_cache", "scan_entry", "scan_run",
    "scan_step", "tree_stats",
]

V1_ROLE = "rollout_tq"
DEFAULT_ROLE = "rollout"


class IssueKind(str, enum.Enum):
    """The kinds of damage ``stepskip verify`` reports."""

    DAMAGED = "damaged"  # unreadable meta.json, missing or truncated data file
    CHECKSUM = "checksum"  # a data file does not match its checksum
    UNDECODABLE = "undecodable"  # intact files that do not decode here (--deep): unreadable, never removed
    UNSUPPORTED = "unsupported"  # a format this stepskip does not know (a newer stepskip?): never removed
    HALF_WRITTEN = "half-written"  # a step (or inner) directory without meta.json
    INCOMPLETE = "incomplete"  # a V1 step missing inner entries
    MIXED_RUNS = "mixed-runs"  # a V1 step whose inner entries come from different runs
    LEFTOVER = "leftover"  # .tmp-* / .trash-* of an interrupted write


@dataclass(frozen=True)
class Issue:
    """One thing wrong in a cache.

    Args:
        kind: what is wrong.
        path: where.
        detail: why, in words.
    """

    kind: IssueKind
    path: str
    detail: str


@dataclass(frozen=True)
class EntryRecord:
    """One entry directory (a flat step entry or one inner entry of a V1 step), from its ``meta.json``.

    Args:
        path: the entry directory.
        step: the step of the directory name.
        inner: the inner index of a V1 entry, else None.
        role: the role that wrote it (``meta.json`` ``role``, else inferred from where it lives).
        format: the storage format (``safe``, ``verl``, ``verl-tq``); None when ``meta.json`` is unreadable.
        state: what :meth:`LocalStore.probe` found.
        reason: why the entry is damaged ("" when it is not).
        meta: the parsed ``meta.json`` (None when unreadable).
        bytes: bytes on disk of every file in the directory.
        time: when it was recorded (``created_unix``, else the ``meta.json`` modification time).
    """

    path: str
    step: int
    inner: int | None
    role: str
    format: str | None
    state: EntryState
    reason: str
    meta: dict[str, Any] | None
    bytes: int
    time: float

    @property
    def valid(self) -> bool:
        return self.state is EntryState.PRESENT

    @property
    def has_checksums(self) -> bool:
        """False for entries verl itself wrote: their ``meta.json`` lists no files."""
        return isinstance((self.meta or {}).get("files"), dict)

    @property
    def written_by(self) -> str:
        if self.meta is None:
            return "unknown"
        if "files" not in self.meta:
            return "verl"
        return f"stepskip {self.meta.get('stepskip_version', '?')}"

    @property
    def run_id(self) -> str | None:
        value = (self.meta or {}).get("run_id")
        return None if value is None else str(value)


class StepKind(str, enum.Enum):
    """How a step directory is laid out."""

    ENTRY = "entry"  # {step}/meta.json: rollout, async_rollout, stage roles
    V1 = "v1"  # {step}/{inner}/meta.json: rollout_tq
    HALF_WRITTEN = "half-written"  # neither: an interrupted write


@dataclass
class StepDir:
    """One ``{step}/`` directory of a run (or of a stage role's subdirectory).

    Args:
        path: the directory.
        step: its step number.
        kind: flat entry, V1 step or half-written.
        role: the role owning it (None for a half-written directory outside a stage subdirectory).
        entries: the entry itself (flat), the inner entries (V1, sorted), or none.
        leftovers: ``.tmp-*`` / ``.trash-*`` inside it (V1 inner writes leave them here).
        bytes: bytes on disk below it.
        mtime: the newest modification time below it (how recently something wrote here).
    """

    path: str
    step: int
    kind: StepKind
    role: str | None
    entries: list[EntryRecord] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    bytes: int = 0
    mtime: float = 0.0

    @property
    def time(self) -> float:
        """When the step was recorded (its newest entry), else its modification time."""
        return max((e.time for e in self.entries), default=self.mtime)

    @property
    def formats(self) -> list[str]:
        return sorted({e.format for e in self.entries if e.format})

    @property
    def expected_inner(self) -> int:
        """How many inner entries a V1 step needs: the recorded ``parameter_sync_step``, at least the
        highest index + 1 (entries verl wrote record no ``parameter_sync_step``)."""
        recorded = [e.meta.get("parameter_sync_step") for e in self.entries if e.meta]
        counts = [v for v in recorded if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        highest = max((e.inner for e in self.entries if e.inner is not None), default=-1)
        return max([highest + 1, *counts])

    def issues(self) -> list[Issue]:
        """What is structurally wrong with the step (no data read: checksums are ``verify``'s job)."""
        if self.kind is StepKind.HALF_WRITTEN:
            return [Issue(IssueKind.HALF_WRITTEN, self.path, f"step directory without {META_FILE} or inner entries "
                                                             "(a write was interrupted)")]
        out: list[Issue] = []
        for entry in self.entries:
            if entry.state is EntryState.MISSING:
                out.append(Issue(IssueKind.HALF_WRITTEN, entry.path, f"inner entry directory without {META_FILE}"))
            elif entry.state is EntryState.DAMAGED:
                out.append(Issue(IssueKind.DAMAGED, entry.path, entry.reason))
        if self.kind is StepKind.V1:
            have = {e.inner for e in self.entries}
            missing = [i for i in range(self.expected_inner) if i not in have]
            if missing:
                out.append(Issue(IssueKind.INCOMPLETE, self.path,
                                 f"V1 step lacks inner entr{'y' if len(missing) == 1 else 'ies'} "
                                 f"{', '.join(map(str, missing))} of {self.expected_inner}"))
            runs = sorted({str(e.run_id) for e in self.entries if e.valid})
            if len(runs) > 1:
                out.append(Issue(IssueKind.MIXED_RUNS, self.path,
                                 f"V1 inner entries were written by different runs ({', '.join(runs)}); "
                                 "a step is replayed only when one run wrote all of it"))
        return out

    @property
    def valid(self) -> bool:
        return not self.issues()


@dataclass(frozen=True)
class RoleSummary:
    """One role of a run, as ``stepskip ls`` shows it.

    Args:
        role: the role name.
        formats: the storage formats of its entries.
        steps: its valid steps, sorted.
        invalid_steps: its steps with damaged, incomplete or mixed entries.
        entries: valid entry directories (a V1 step has one per inner entry).
        bytes: bytes on disk of all its step directories.
        newest: when its newest valid step was recorded (None when it has none).
    """

    role: str
    formats: list[str]
    steps: list[int]
    invalid_steps: list[int]
    entries: int
    bytes: int
    newest: float | None


@dataclass
class RunDir:
    """One run directory ``{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}``.

    Args:
        path: the directory.
        steps: every step directory, stage roles' included.
        leftovers: ``.tmp-*`` / ``.trash-*`` directly in it or in a stage subdirectory.
        others: paths that are no part of the layout (left alone by every command).
    """

    path: str
    steps: list[StepDir] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``{experiment}_{project}/GBS..._N..._in..._out...``."""
        parent = os.path.basename(os.path.dirname(self.path))
        return f"{parent}/{os.path.basename(self.path)}"

    @property
    def shape(self) -> dict[str, int]:
        match = RUN_DIR.match(os.path.basename(self.path))
        if match is None:
            return {}
        return dict(zip(("gbs", "n", "prompt_len", "response_len"), map(int, match.groups())))

    @property
    def entries(self) -> list[EntryRecord]:
        return [e for s in self.steps for e in s.entries]

    def issues(self) -> list[Issue]:
        """Structural issues of every step plus the leftovers."""
        out = [i for s in self.steps for i in s.issues()]
        leftovers = self.leftovers + [p for s in self.steps for p in s.leftovers]
        out += [Issue(IssueKind.LEFTOVER, p, "leftover of an interrupted write or replacement") for p in leftovers]
        return out

    def roles(self) -> list[RoleSummary]:
        """One summary per role, in the order rollout, async_rollout, rollout_tq, then stage roles by name."""
        by_role: dict[str, list[StepDir]] = {}
        for step in self.steps:
            if step.role is not None:
                by_role.setdefault(step.role, []).append(step)
        order = {"rollout": 0, "async_rollout": 1, V1_ROLE: 2}
        out = []
        for role in sorted(by_role, key=lambda r: (order.get(r, 3), r)):
            steps = by_role[role]
            valid = [s for s in steps if s.valid]
            out.append(RoleSummary(
                role=role,
                formats=sorted({f for s in steps for f in s.formats}),
                steps=sorted(s.step for s in valid),
                invalid_steps=sorted(s.step for s in steps if not s.valid),
                entries=sum(len(s.entries) for s in valid),
                bytes=sum(s.bytes for s in steps),
                newest=max((s.time for s in valid), default=None),
            ))
        return out


# --------------------------------------------------------------------------- finding runs


def is_leftover(name: str) -> bool:
    """True for the temporaries and trash the store leaves when a write or replacement is interrupted."""
    return name.startswith((TMP_PREFIX, TRASH_PREFIX))


def _check_local_dir(path: str) -> str:
    if is_url(path) and not path.startswith("file://"):
        raise CliError(f"{path}: object-store URLs are not supported by the command line yet; "
                       "run it on a local or mounted path")
    if path.startswith("file://"):
        path = path[len("file://"):]
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.exists(full):
        raise CliError(f"{path}: no such file or directory")
    if not os.path.isdir(full):
        raise CliError(f"{path}: not a directory")
    return full


def local_store(path: str) -> LocalStore:
    """The store of a local cache path (the command line works on local and mounted paths only)."""
    store = open_store(path)
    if not isinstance(store, LocalStore):  # pragma: no cover - URLs are refused before this
        raise CliError(f"{path}: only local paths are supported by the command line")
    return store


def _subdirs(store: LocalStore, path: str) -> list[str]:
    return sorted(n for n in store.list_dir(path) if os.path.isdir(f"{path}/{n}"))


def find_run_dirs(path: str) -> list[str]:
    """The run directories at ``path``: itself, its children or its grandchildren (a dump dir).

    Args:
        path: a dump dir, an ``{experiment}_{project}`` directory or a run directory.

    Returns:
        The run directories, sorted; empty for an empty directory.

    Raises:
        CliError: ``path`` does not exist, is not a directory, or holds no run directory.

    Example:
        >>> find_run_dirs("~/.verl/rollout_dump")  # doctest: +SKIP
        ['/home/me/.verl/rollout_dump/exp_proj/GBS64_N8_in512_out1024']
    """
    root = _check_local_dir(path)
    if RUN_DIR.match(os.path.basename(root)):
        return [root]
    store = local_store(root)
    children = _subdirs(store, root)
    found = [f"{root}/{c}" for c in children if RUN_DIR.match(c)]
    for child in children:
        found += [f"{root}/{child}/{g}" for g in _subdirs(store, f"{root}/{child}") if RUN_DIR.match(g)]
    if found or not store.list_dir(root):
        return sorted(found)
    parent = os.path.dirname(root)
    hint = ""
    if Layout.parse_step(os.path.basename(root)) is not None or RUN_DIR.match(os.path.basename(parent)):
        hint = " (this looks like a step or stage directory: pass the dump dir or a run directory)"
    raise CliError(
        f"{path} is not a rollout cache: no run directory (GBS<gbs>_N<n>_in<prompt_len>_out<response_len>) in it "
        f"or two levels below{hint}; pass the dump_dir of skip.<role> (default ~/.verl/rollout_dump)"
    )


# --------------------------------------------------------------------------- scanning


def tree_stats(path: str) -> tuple[int, float]:
    """Bytes of every file below ``path`` and the newest modification time (files and directories)."""
    total, newest = 0, 0.0
    try:
        newest = os.stat(path).st_mtime
    except OSError:
        return 0, 0.0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            try:
                st = os.stat(f"{dirpath}/{name}", follow_symlinks=False)
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if name in filenames:
                total += st.st_size
    return total, newest


def scan_entry(store: LocalStore, path: str, step: int, inner: int | None, role: str) -> EntryRecord:
    """Describe one entry directory from its ``meta.json`` (no data read).

    Args:
        store: the store holding it.
        path: the entry directory.
        step: the step it belongs to.
        inner: its V1 inner index, or None for a flat entry.
        role: the role to assume when ``meta.json`` does not name one.

    Returns:
        The record; ``state`` says whether the entry is present, damaged or missing.
    """
    legacy = legacy_format(inner is not None)
    probe = store.probe(path, legacy.files)
    meta = probe.meta
    size, mtime = tree_stats(path)
    fmt: str | None = None
    when = mtime
    if meta is not None:
        fmt = str(meta.get("format", legacy.name))
        role = str(meta.get("role") or role)
        created = meta.get("created_unix")
        if isinstance(created, (int, float)) and not isinstance(created, bool):
            when = float(created)
        else:
            try:
                when = os.path.getmtime(f"{path}/{META_FILE}")
            except OSError:
                pass
    return EntryRecord(path=path, step=step, inner=inner, role=role, format=fmt, state=probe.state,
                       reason=probe.reason, meta=meta, bytes=size, time=when)


def scan_step(store: LocalStore, path: str, step: int, stage: str | None = None) -> StepDir:
    """Describe one step directory: a flat entry, a V1 step with inner entries, or a half-written one.

    Args:
        store: the store holding it.
        path: the ``{step}`` directory.
        step: its step number.
        stage: the stage role's name when it lives in a stage subdirectory.
    """
    names = store.list_dir(path)
    size, mtime = tree_stats(path)
    if META_FILE in names:
        entry = scan_entry(store, path, step, None, stage or DEFAULT_ROLE)
        return StepDir(path, step, StepKind.ENTRY, entry.role, [entry], [], size, mtime)
    inner = sorted((idx, n) for n in names
                   if (idx := Layout.parse_step(n)) is not None and os.path.isdir(f"{path}/{n}"))
    leftovers = sorted(f"{path}/{n}" for n in names if is_leftover(n))
    if not inner:
        return StepDir(path, step, StepKind.HALF_WRITTEN, stage, [], leftovers, size, mtime)
    entries = [scan_entry(store, f"{path}/{n}", step, idx, V1_ROLE) for idx, n in inner]
    role = next((e.role for e in entries if e.meta), stage or V1_ROLE)
    return StepDir(path, step, StepKind.V1, role, entries, leftovers, size, mtime)


def scan_run(path: str) -> RunDir:
    """Describe every step directory, leftover and stage role of one run directory."""
    store = local_store(path)
    run = RunDir(path)
    for name in sorted(store.list_dir(path)):
        full = f"{path}/{name}"
        step = Layout.parse_step(name)
        if is_leftover(name):
            run.leftovers.append(full)
        elif step is not None and os.path.isdir(full):
            run.steps.append(scan_step(store, full, step))
        elif os.path.isdir(full) and not name.startswith("."):
            _scan_stage(store, run, full, name)
        else:
            run.others.append(full)
    run.steps.sort(key=lambda s: (s.role or "", s.step))
    return run


def _scan_stage(store: LocalStore, run: RunDir, path: str, name: str) -> None:
    children = store.list_dir(path)
    steps = [(s, c) for c in children if (s := Layout.parse_step(c)) is not None and os.path.isdir(f"{path}/{c}")]
    leftovers = [f"{path}/{c}" for c in children if is_leftover(c)]
    if not steps and not leftovers:
        run.others.append(path)  # not a stage role's directory: no steps in it
        return
    run.steps += [scan_step(store, f"{path}/{c}", s, stage=name) for s, c in sorted(steps)]
    run.leftovers += sorted(leftovers)
    run.others += sorted(f"{path}/{c}" for c in children
                         if Layout.parse_step(c) is None and not is_leftover(c))


def scan_cache(path: str) -> list[RunDir]:
    """Scan every run directory at ``path`` (see :func:`find_run_dirs`).

    Raises:
        CliError: ``path`` is missing or is not a cache.

    Example:
        >>> [r.name for r in scan_cache("~/.verl/rollout_dump")]  # doctest: +SKIP
        ['exp_proj/GBS64_N8_in512_out1024']
    """
    return [scan_run(p) for p in find_run_dirs(path)]


# --------------------------------------------------------------------------- one entry or step


def resolve_target(path: str, step: int | None = None) -> tuple[StepDir, EntryRecord | None]:
    """The step directory ``path`` names (or ``path/step``), and the inner entry when it names one.

    Args:
        path: a step directory, a V1 inner entry, or a run directory (with ``step``).
        step: the step to take inside ``path``.

    Returns:
        ``(step_dir, inner)``: ``inner`` is the V1 inner entry ``path`` points at, else None.

    Raises:
        CliError: the path does not exist or is not an entry.
    """
    full = _check_local_dir(path)
    if step is not None:
        full = f"{full}/{int(step)}"
        if not os.path.isdir(full):
            steps = _steps_hint(os.path.dirname(full))
            raise CliError(f"{path} has no step {step}{steps}")
    name, parent = os.path.basename(full), os.path.dirname(full)
    number = Layout.parse_step(name)
    store = local_store(full)
    if number is None:
        if RUN_DIR.match(name):
            raise CliError(f"{path} is a run directory; pass one of its step directories, "
                           f"or add --step N{_steps_hint(full)}")
        raise CliError(f"{path} is not a cache entry: its name is not a step number "
                       "(expected .../GBS<gbs>_N<n>_in<p>_out<r>/<step>)")
    parent_step = Layout.parse_step(os.path.basename(parent))
    if parent_step is not None:  # {step}/{inner}: run and stage directories never have numeric names
        step_dir = scan_step(store, parent, parent_step)
        inner = next((e for e in step_dir.entries if e.inner == number), None)
        if inner is None:
            raise CliError(f"{path} is not a cache entry: no {META_FILE} in it")
        return step_dir, inner
    in_run = bool(RUN_DIR.match(os.path.basename(parent)))
    step_dir = scan_step(store, full, number, stage=None if in_run else os.path.basename(parent))
    in_stage = bool(RUN_DIR.match(os.path.basename(os.path.dirname(parent))))
    if step_dir.kind is StepKind.HALF_WRITTEN and not (in_run or in_stage):
        raise CliError(f"{path} is not a cache entry: no {META_FILE} and no inner entries in it")
    return step_dir, None


def _steps_hint(run_dir: str) -> str:
    store = local_store(run_dir)
    steps = sorted(s for n in store.list_dir(run_dir) if (s := Layout.parse_step(n)) is not None)
    return f" (steps there: {compress_steps(steps)})" if steps else ""


# --------------------------------------------------------------------------- step lists


def compress_steps(steps: Iterable[int]) -> str:
    """Write steps as ranges in the syntax of ``skip.<role>.steps`` (and ``prune --steps``).

    Runs of consecutive steps become ``a-b``, runs of three or more with one stride ``a-b:k``.

    Example:
        >>> compress_steps([1, 2, 3, 4, 5, 8, 10, 11, 12])
        '1-5,8,10-12'
        >>> compress_steps([2, 4, 6, 10])
        '2-6:2,10'
    """
    values = sorted(set(int(s) for s in steps))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        if i + 1 < len(values):
            stride = values[i + 1] - values[i]
            while j + 1 < len(values) and values[j + 1] - values[j] == stride:
                j += 1
            length = j - i + 1
            if stride == 1 and length >= 2:
                parts.append(f"{values[i]}-{values[j]}")
                i = j + 1
                continue
            if stride > 1 and length >= 3:
                parts.append(f"{values[i]}-{values[j]}:{stride}")
                i = j + 1
                continue
        parts.append(str(values[i]))
        i += 1
    return ",".join(parts)
