"""The cache index: runs, roles, steps and entries of a dump dir, on any store, found without decoding data.

A dump dir holds ``{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}/`` run directories
(:data:`stepskip._layout.RUN_DIR`). Inside a run directory:

* ``{step}/`` with ``meta.json``: an entry of ``rollout`` or ``async_rollout`` (verl's layout);
* ``{step}/{inner}/``: the inner entries of one ``rollout_tq`` (V1) step; on object stores
  ``{step}/step.json`` (the step's manifest) naming ``{step}/rec-{token}/{inner}/``, the one
  recording readers use (:mod:`stepskip._manifest`); recordings it does not name are leftovers;
* ``{role}/{step}/``: the entries of every other role (stage and custom roles);
* ``trl_generate/{step}/c{call}-r{rank}/``: the TRL integration's entries, one per generation call
  of the step and rank (``c{call}t{turn}-r{rank}/`` for a tool loop's turns), each an entry of its
  own (:meth:`stepskip._layout.Layout.call_dir`);
* ``.tmp-*`` / ``.trash-*``: leftovers of interrupted writes and replacements, never entries;
* ``.stepskip-drift/``: the drift records of ``action: compare`` (:mod:`stepskip._drift`), beside the steps.

The prompt hints the roles keep beside the run directories (``{experiment}/.stepskip-index/``,
:mod:`stepskip._matching.hints`) are no run directory: the index neither lists nor removes them.

Everything is read through the store abstraction (:func:`stepskip._storage.open_store`), so local
paths, ``memory://`` and ``s3://`` caches are indexed alike. A cache is data someone else may
have written, so the index never follows a symbolic link (a linked run, stage, step or data file
is reported, not entered), accepts only file names in ``meta.json`` that are single path
components naming regular files of the entry itself, and deletes only below the directory it
was opened on. Format facts come from the registry (:data:`stepskip._entries.FORMATS`): a format
it does not know is *unsupported* (written by a newer stepskip?), never damage. The index imports
no torch; decoding an entry (:meth:`CacheIndex.read_entry`) loads the format's codec.

Example:
    >>> index = CacheIndex("~/.verl/rollout_dump")  # doctest: +SKIP
    >>> [(run.name, [r.role for r in run.roles()]) for run in index.runs()]  # doctest: +SKIP
    [('exp_proj/GBS64_N8_in512_out1024', ['rollout', 'reward'])]
"""

from __future__ import annotations

import enum
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from stepskip._reading.classify import EntryStatus, classify, kind_words, root_state
from stepskip._storage import META_FILE, TMP_PREFIX, TRASH_PREFIX, DirItem, EntryState, Probe, open_store
from stepskip._storage.outages import StoreOutage
from stepskip.config import ROLLOUT_ROLES
from stepskip._entries import FORMATS, legacy_format
from stepskip.errors import (
    CacheMissError,
    CorruptEntryError,
    SkipConfigError,
    StoreUnavailableError,
    TruncatedEntryError,
    UnreadableEntryError,
)
from stepskip._layout import DEFAULT_ROLE, DRIFT_DIR, RUN_DIR, V1_ROLE, Layout, is_url, normalize_location
from stepskip._manifest import MANIFEST_FILE, StepManifest, StepRoot, is_recording, resolve_step

__all__ = [
    "CacheIndex", "EntryRecord", "EntryStatus", "Issue", "IssueKind", "NotACacheError", "PickleNotAllowedError",
    "RoleSummary", "RunDir", "StepDir", "StepKind", "V1_ROLE", "compress_steps", "generation_rows",
    "is_leftover",
]

logger = logging.getLogger(__name__)

#: Missing V1 inner indices named in a message (a hostile ``parameter_sync_step`` may claim a billion).
_LISTED_MISSING = 8
#: Scans of a manifest step whose manifest keeps changing before it is left unjudged (being republished).
_MANIFEST_SCANS = 3


class NotACacheError(SkipConfigError):
    """A path given to the index does not exist, is not a directory, or holds no cache."""


class PickleNotAllowedError(UnreadableEntryError):
    """A pickle-based entry (verl's ``gen_batch.dp``, ``tq_batch.pt``) read without ``allow_pickle``."""

    def __init__(self, path: str, format_name: str) -> None:
        super().__init__(f"{path} is a pickle-based entry (format {format_name!r}, as verl writes it); "
                         "allow pickle (allow_pickle: true, or --allow-pickle) to read it through stepskip's "
                         "allow-list unpickler")
        self.path = path
        self.format_name = format_name


class IssueKind(str, enum.Enum):
    """What can be wrong in a cache."""

    DAMAGED = "damaged"  # unreadable meta.json, missing or truncated data file, a file outside the entry
    CHECKSUM = "checksum"  # a data file does not match its checksum
    UNDECODABLE = "undecodable"  # intact files that do not decode here: unreadable, never removed
    UNSUPPORTED = "unsupported"  # a format this stepskip does not know (a newer stepskip?): never removed
    HALF_WRITTEN = "half-written"  # a step (or inner) directory without meta.json
    INCOMPLETE = "incomplete"  # a V1 step missing inner entries
    MIXED_RUNS = "mixed-runs"  # a V1 step whose inner entries come from different runs
    LEFTOVER = "leftover"  # .tmp-* / .trash-* of an interrupted write
    SHADOWED = "shadowed"  # in-place inner directories beside a manifest written after it: not read, kept
    UNAVAILABLE = "unavailable"  # the store did not answer for it (timeout, connection error, 5xx): never removed


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
    """One entry directory (a flat step entry, one inner entry of a V1 step or one generation call's
    entry of a TRL step), from its ``meta.json``.

    Args:
        path: the entry directory.
        step: the step of the directory name.
        inner: the inner index of a V1 entry, else None.
        role: the role that wrote it.
        format: the storage format recorded (``safe``, ``verl``, ``verl-tq`` ...); None without a readable meta.
        state: what the index found.
        reason: why it is not present ("" when it is).
        meta: the parsed ``meta.json`` (None when unreadable).
        bytes: bytes of every file in the directory.
        time: when it was recorded (``created_unix``, else the ``meta.json`` modification time).
        call: the name of a generation call's entry (``c0-r1``), else None.
    """

    path: str
    step: int
    inner: int | None
    role: str
    format: str | None
    state: EntryStatus
    reason: str
    meta: dict[str, Any] | None
    bytes: int
    time: float
    call: str | None = None

    @property
    def valid(self) -> bool:
        return self.state is EntryStatus.PRESENT

    @property
    def kept(self) -> bool:
        """Intact but not readable here (unsupported or unreadable), or not seen at all (the store did not
        answer: unavailable): no command removes it."""
        return self.state in (EntryStatus.UNSUPPORTED, EntryStatus.UNREADABLE, EntryStatus.UNAVAILABLE)

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

    @property
    def rows(self) -> int | None:
        """Trajectories recorded in ``meta.json`` (``num_trajectories``), when it says."""
        return _int((self.meta or {}).get("num_trajectories"))

    @property
    def generation_seconds(self) -> float | None:
        value = _float((self.meta or {}).get("generation_seconds"))
        return None if value is None else float(value)

    @property
    def fingerprint(self) -> dict[str, Any] | None:
        value = (self.meta or {}).get("fingerprint")
        return value if isinstance(value, dict) else None


def _int(value: Any) -> int | None:
    """``value`` when metadata holds a whole number there (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    """``value`` when metadata holds a number there (not a bool), else None."""
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else value


class StepKind(str, enum.Enum):
    """How a step directory is laid out."""

    ENTRY = "entry"  # {step}/meta.json: rollout, async_rollout, other roles in their subdirectory
    V1 = "v1"  # {step}/{inner}/meta.json: rollout_tq
    CALLS = "calls"  # {step}/c{call}-r{rank}/meta.json: the TRL integration, one entry per call and rank
    HALF_WRITTEN = "half-written"  # neither: an interrupted write


@dataclass
class StepDir:
    """One ``{step}/`` directory of a run (or of a role's subdirectory).

    Args:
        path: the directory.
        step: its step number.
        kind: flat entry, V1 step, generation calls (TRL) or half-written.
        role: the role owning it (None for a half-written directory directly in the run directory).
        entries: the entry itself (flat), the inner entries (V1, sorted), the calls' entries (in call
            order, then rank), or none.
        leftovers: ``.tmp-*`` / ``.trash-*`` inside it (V1 inner writes leave them here), and on a
            step with a manifest the recordings it does not name and the in-place inner directories
            older than it (superseded by it).
        bytes: bytes below it.
        mtime: the newest modification time below it (how recently something wrote here).
        manifest: the step's manifest (V1 steps on object stores), when it has a usable one.
        problem: why the step's manifest cannot be used (damaged, or of a newer version), if so.
        shadowed: on a step with a manifest, in-place inner directories (``{step}/{inner}/``) written
            after it or of unknown age (verl's own dumper, an older stepskip): not read while the
            manifest stands, reported, never removed.
    """

    path: str
    step: int
    kind: StepKind
    role: str | None
    entries: list[EntryRecord] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    bytes: int = 0
    mtime: float = 0.0
    manifest: StepManifest | None = None
    problem: Issue | None = None
    shadowed: list[str] = field(default_factory=list)

    def retired_at(self, path: str) -> float | None:
        """When the manifest retired the recording at ``path`` (readers may still use it for a grace period)."""
        if self.manifest is None or not path.startswith(self.path.rstrip("/") + "/"):
            return None
        return self.manifest.retired.get(path[len(self.path.rstrip("/")) + 1:])

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
        if self.manifest is not None:
            counts.append(self.manifest.inner_entries)
        return max([highest + 1, *counts])

    @property
    def kept(self) -> bool:
        """Holds an entry no command may remove (unsupported format, unreadable, not answered for by the store),
        or its manifest is such."""
        if self.problem is not None and self.problem.kind in (IssueKind.UNSUPPORTED, IssueKind.UNAVAILABLE):
            return True
        return any(e.kept for e in self.entries)

    def issues(self) -> list[Issue]:
        """What is structurally wrong with the step (no data read: checksums are checked on read)."""
        if self.problem is not None:
            return [self.problem]
        if self.kind is StepKind.HALF_WRITTEN:
            return [Issue(IssueKind.HALF_WRITTEN, self.path, f"step directory without {META_FILE} or inner entries "
                                                             "(a write was interrupted)")]
        out: list[Issue] = []
        for entry in self.entries:
            if entry.state is EntryStatus.MISSING:
                out.append(Issue(IssueKind.HALF_WRITTEN, entry.path, f"inner entry directory without {META_FILE}"))
            elif entry.state is EntryStatus.DAMAGED:
                out.append(Issue(IssueKind.DAMAGED, entry.path, entry.reason))
            elif entry.state is EntryStatus.UNSUPPORTED:
                out.append(Issue(IssueKind.UNSUPPORTED, entry.path, entry.reason))
            elif entry.state is EntryStatus.UNREADABLE:
                out.append(Issue(IssueKind.UNDECODABLE, entry.path, entry.reason))
            elif entry.state is EntryStatus.UNAVAILABLE:
                out.append(Issue(IssueKind.UNAVAILABLE, entry.path, entry.reason))
        if self.kind is StepKind.V1:
            have = {e.inner for e in self.entries}
            expected = self.expected_inner
            missing_count = expected - len([i for i in have if i is not None and i < expected])
            if missing_count > 0:
                missing = []
                for i in range(expected):  # stops after a few: never a list as long as a hostile count
                    if i not in have:
                        missing.append(str(i))
                        if len(missing) == _LISTED_MISSING:
                            break
                more = f" and {missing_count - len(missing)} more" if missing_count > len(missing) else ""
                out.append(Issue(IssueKind.INCOMPLETE, self.path,
                                 f"V1 step lacks inner entr{'y' if missing_count == 1 else 'ies'} "
                                 f"{', '.join(missing)}{more} of {expected}"))
            runs = sorted({str(e.run_id) for e in self.entries if e.valid})
            if len(runs) > 1:
                out.append(Issue(IssueKind.MIXED_RUNS, self.path,
                                 f"V1 inner entries were written by different runs ({', '.join(runs)}); "
                                 "a step is replayed only when one run wrote all of it"))
        return out

    def shadowed_issues(self) -> list[Issue]:
        """The in-place inner directories the step's manifest shadows (see ``shadowed``): reported, never removed."""
        return [Issue(IssueKind.SHADOWED, p, f"an in-place inner directory written after {MANIFEST_FILE}, which "
                                             "names another recording: not read while the manifest stands; "
                                             "kept (remove it yourself if it is not wanted)")
                for p in self.shadowed]

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
        invalid_steps: its steps with damaged, incomplete, mixed, unsupported or unreadable entries.
        entries: valid entry directories (a V1 step has one per inner entry).
        bytes: bytes of all its step directories.
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
        steps: every step directory, other roles' subdirectories included.
        leftovers: ``.tmp-*`` / ``.trash-*`` directly in it or in a role subdirectory.
        others: paths that are no part of the layout (left alone by every command).
        links: symbolic links where the layout has directories or files (never followed, never removed).
    """

    path: str
    steps: list[StepDir] = field(default_factory=list)
    leftovers: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """``{experiment}_{project}/GBS..._N..._in..._out...``."""
        parent, base = _split(self.path)
        return f"{_split(parent)[1]}/{base}"

    @property
    def shape(self) -> dict[str, int]:
        match = RUN_DIR.match(_split(self.path)[1])
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
        out += [i for s in self.steps for i in s.shadowed_issues()]
        return out

    def roles(self) -> list[RoleSummary]:
        """One summary per role, in the order rollout, async_rollout, rollout_tq, then other roles by name."""
        by_role: dict[str, list[StepDir]] = {}
        for step in self.steps:
            if step.role is not None:
                by_role.setdefault(step.role, []).append(step)
        order = {role: i for i, role in enumerate(ROLLOUT_ROLES)}
        out = []
        for role in sorted(by_role, key=lambda r: (order.get(r, len(order)), r)):
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


# --------------------------------------------------------------------------- helpers


def is_leftover(name: str) -> bool:
    """True for the temporaries and trash the store leaves when a write or replacement is interrupted."""
    return name.startswith((TMP_PREFIX, TRASH_PREFIX))


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rstrip("/").rpartition("/")
    return parent, name


def compress_steps(steps: Iterable[int]) -> str:
    """Write steps as ranges in the syntax of ``skip.<role>.steps`` (and ``stepskip prune --steps``).

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


#: The tag of the TRL integration's own packing of ragged rows (entries written before ``format: safe``
#: packed rows itself hold it).
_PACKED_GENERATION = "stepskip.trl.generation/1"


def generation_rows(calls: Iterable[tuple[str, Any]]) -> Any:
    """The completions of generation calls' entries as rows, laid out as the commands read a batch.

    A call's entry (the TRL integration's) holds what ``_generate_single_turn`` returned:
    ``(completion_ids, logprobs)``, ragged rows of token ids and of log-probs (``None`` where none
    was recorded; or ``None`` for all). The rows of every call, in the order given, become
    ``responses`` (jagged token ids), ``logprobs`` (jagged, NaN where none was recorded; only when
    some call recorded them) and ``call`` (the entry each row came from).

    Args:
        calls: ``(entry name, decoded value)`` per call.

    Returns:
        The rows; a value that is no generation result is returned as it is (one call), or as a
        mapping of entry names to values.

    Example:
        >>> rows = generation_rows([("c0-r0", ([[5, 6], [7]], None)), ("c0-r1", ([[8]], [[-0.5]]))])
        >>> [r.tolist() for r in rows["responses"].unbind()], list(rows["call"])
        ([[5, 6], [7], [8]], ['c0-r0', 'c0-r0', 'c0-r1'])
        >>> rows["logprobs"].unbind()[2].tolist()
        [-0.5]
    """
    import numpy as np
    import torch

    values = list(calls)
    as_stored = values[0][1] if len(values) == 1 else dict(values)
    ids: list[list[int]] = []
    logprobs: list[list[float]] = []
    names: list[str] = []
    recorded = False  # some call recorded log-probs
    for name, value in values:
        result = _generation_result(value)
        if result is None:
            return as_stored
        rows, probs = result
        recorded = recorded or probs is not None
        ids += rows
        logprobs += probs if probs is not None else [[math.nan] * len(row) for row in rows]
        names += [name] * len(rows)
    if not values:
        return {}
    try:
        out: dict[str, Any] = {"responses": _jagged(ids, torch.int64)}
        if recorded:
            out["logprobs"] = _jagged(logprobs, torch.float64)
    except (OverflowError, RuntimeError, TypeError, ValueError):  # ids beyond int64: shown as stored
        return as_stored
    out["call"] = np.array(names, dtype=object)
    return out


def _jagged(rows: list[list[Any]], dtype: Any) -> Any:
    import torch

    offsets = [0]
    for row in rows:
        offsets.append(offsets[-1] + len(row))
    flat = torch.tensor([v for row in rows for v in row], dtype=dtype)
    return torch.nested.nested_tensor_from_jagged(flat, torch.tensor(offsets, dtype=torch.int64))


def _generation_result(value: Any) -> tuple[list[list[int]], list[list[float]] | None] | None:
    """``(completion_ids, logprobs)`` of a call's entry (NaN where no log-prob was recorded), or None
    when the value is no generation result."""
    if isinstance(value, Mapping) and value.get("kind") == _PACKED_GENERATION:
        ids = _packed_rows(value.get("completion_ids"))
        probs = None if value.get("logprobs") is None else _packed_rows(value.get("logprobs"))
        value = None if ids is None or (value.get("logprobs") is not None and probs is None) else (ids, probs)
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not isinstance(value[0], list):
        return None
    ids, probs = value
    if not all(isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row)
               for row in ids):
        return None
    if probs is None:
        return ids, None
    if not isinstance(probs, list) or len(probs) != len(ids):
        return None
    out: list[list[float]] = []
    for row, ids_row in zip(probs, ids):
        if not isinstance(row, list) or len(row) != len(ids_row):
            return None
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in row):
            return None
        out.append([math.nan if v is None else float(v) for v in row])
    return ids, out


def _packed_rows(packed: Any) -> list[list[Any]] | None:
    """Rows of the integration's own packing (``values``, ``offsets`` and, for log-probs, ``missing``)."""
    import torch

    if not isinstance(packed, Mapping):
        return None
    values, offsets, missing = packed.get("values"), packed.get("offsets"), packed.get("missing")
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor) or values.dim() != 1 \
            or offsets.dim() != 1 or offsets.dtype != torch.int64 or offsets.numel() < 1:
        return None
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != values.numel() or any(b < a for a, b in zip(bounds, bounds[1:])):
        return None
    flat = values.tolist()
    if missing is not None:
        if not isinstance(missing, torch.Tensor) or missing.dtype != torch.bool or missing.shape != values.shape:
            return None
        flat = [None if gone else v for v, gone in zip(flat, missing.tolist())]
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


# --------------------------------------------------------------------------- the index


class CacheIndex:
    """A cache (or part of one) opened for listing, reading and retiring entries.

    Args:
        root: a dump dir, an ``{experiment}_{project}`` directory, a run directory or an entry:
            a local path or an fsspec URL (``memory://``, ``s3://bucket/prefix`` ...).
        storage_options: fsspec options for a URL (``client_kwargs``, ``anon`` ...).

    Raises:
        SkipConfigError: the URL's filesystem is not installed.

    Example:
        >>> index = CacheIndex("s3://bucket/rollout_dump", {"anon": False})  # doctest: +SKIP
        >>> [r.name for r in index.runs()]  # doctest: +SKIP
        ['exp_proj/GBS64_N8_in512_out1024']
    """

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.given = root
        # the root the user named is resolved once; below it, nothing is ever followed through a link
        self.root = normalize_location(root, resolve_links=True)
        self.is_url = is_url(self.root)
        self.store = open_store(self.root, storage_options)

    # ----------------------------------------------------------------- paths

    def _item(self, path: str) -> DirItem | None:
        item = self.store.stat_item(path)
        if item is None and self.is_url and self.store.list_items(path):
            return DirItem(_split(path)[1], "dir")  # an object-store prefix with objects below it
        return item

    def _dirs(self, path: str) -> list[str]:
        return sorted(i.name for i in self.store.list_items(path) if i.kind == "dir")

    def inside(self, path: str) -> bool:
        """True when ``path`` lies strictly below the index root and reaches it through no link."""
        if not path.startswith(self.root.rstrip("/") + "/"):
            return False
        if any(part in ("", ".", "..") for part in path[len(self.root.rstrip("/")) + 1:].split("/")):
            return False
        if not self.is_url:
            parent = os.path.dirname(path)
            return os.path.realpath(parent) == parent
        return True

    def tree_stats(self, path: str) -> tuple[int, float]:
        """Bytes of every file below ``path`` and the newest modification time (links never followed)."""
        item = self._item(path)
        if item is None:
            return 0, 0.0
        total, newest = item.size, item.mtime or 0.0
        pending = [path] if item.kind == "dir" else []
        while pending:
            current = pending.pop()
            for child in self.store.list_items(current):
                newest = max(newest, child.mtime or 0.0)
                total += child.size
                if child.kind == "dir":
                    pending.append(f"{current}/{child.name}")
        return total, newest

    # ----------------------------------------------------------------- finding runs

    def find_run_dirs(self, path: str | None = None) -> list[str]:
        """The run directories at ``path`` (default: the root): itself, its children or grandchildren.

        Raises:
            NotACacheError: ``path`` does not exist, is not a directory, or holds no run directory.
        """
        root = self.root if path is None else path
        self._check_dir(root, self.given if path is None else path)
        if RUN_DIR.match(_split(root)[1]):
            return [root]
        children = self._dirs(root)
        found = [f"{root}/{c}" for c in children if RUN_DIR.match(c)]
        for child in children:
            found += [f"{root}/{child}/{g}" for g in self._dirs(f"{root}/{child}") if RUN_DIR.match(g)]
        if found or not self.store.list_items(root):
            return sorted(found)
        parent = _split(root)[0]
        hint = ""
        if Layout.parse_step(_split(root)[1]) is not None or RUN_DIR.match(_split(parent)[1]):
            hint = " (this looks like a step or role directory: pass the dump dir or a run directory)"
        raise NotACacheError(
            f"{self.given if path is None else path} is not a rollout cache: no run directory "
            f"(GBS<gbs>_N<n>_in<prompt_len>_out<response_len>) in it or two levels below{hint}; "
            "pass the dump_dir of skip.<role> (default ~/.verl/rollout_dump)"
        )

    def _check_dir(self, path: str, shown: str) -> None:
        item = self._item(path)
        if item is None:
            raise NotACacheError(f"{shown}: no such file or directory")
        if item.kind != "dir":
            raise NotACacheError(f"{shown}: not a directory")

    def runs(self) -> list[RunDir]:
        """Every run directory below the root, scanned.

        Raises:
            NotACacheError: see :meth:`find_run_dirs`.
        """
        return [self.scan_run(p) for p in self.find_run_dirs()]

    # ----------------------------------------------------------------- scanning

    def scan_run(self, path: str) -> RunDir:
        """Every step directory, leftover and role subdirectory of one run directory."""
        run = RunDir(path)
        for item in sorted(self.store.list_items(path), key=lambda i: i.name):
            full = f"{path}/{item.name}"
            step = Layout.parse_step(item.name)
            if item.name == DRIFT_DIR and item.kind == "dir":
                continue  # reports beside the steps, not entries
            if item.kind == "link":
                run.links.append(full)  # a linked step, role or leftover is never entered nor removed
            elif is_leftover(item.name) and item.kind in ("dir", "file"):
                run.leftovers.append(full)
            elif item.kind != "dir":
                run.others.append(full)
            elif step is not None:
                run.steps.append(self.scan_step(full, step))
            elif not item.name.startswith("."):
                self._scan_role_dir(run, full, item.name)
            else:
                run.others.append(full)
        run.steps.sort(key=lambda s: (s.role or "", s.step))
        return run

    def _scan_role_dir(self, run: RunDir, path: str, name: str) -> None:
        children = self.store.list_items(path)
        steps = sorted((s, c.name) for c in children
                       if (s := Layout.parse_step(c.name)) is not None and c.kind == "dir")
        leftovers = sorted(f"{path}/{c.name}" for c in children if is_leftover(c.name) and c.kind in ("dir", "file"))
        if not steps and not leftovers:
            run.others.append(path)  # not a role's directory: no steps in it
            return
        run.steps += [self.scan_step(f"{path}/{c}", s, role=name) for s, c in steps]
        run.leftovers += leftovers
        run.links += sorted(f"{path}/{c.name}" for c in children if c.kind == "link")
        run.others += sorted(f"{path}/{c.name}" for c in children if f"{path}/{c.name}" not in leftovers
                             and c.kind != "link" and (Layout.parse_step(c.name) is None or c.kind != "dir")
                             and not (c.name == DRIFT_DIR and c.kind == "dir"))

    def scan_step(self, path: str, step: int, role: str | None = None) -> StepDir:
        """One step directory: a flat entry, a V1 step with inner entries (those of the recording its
        manifest names, when it has one), a TRL step with one entry per generation call and rank, or
        a half-written one.

        Args:
            path: the ``{step}`` directory.
            step: its step number.
            role: the role of the subdirectory it lives in; None for one directly in the run directory.
        """
        try:
            return self._scan_step(path, step, role)
        except StoreOutage as err:  # a listing the store did not answer: nothing is known of the step, nothing judged
            issue = Issue(IssueKind.UNAVAILABLE, path, str(err.strerror))
            return StepDir(path, step, StepKind.HALF_WRITTEN, role, problem=issue)

    def _scan_step(self, path: str, step: int, role: str | None) -> StepDir:
        items = self.store.list_items(path)
        names = {i.name: i for i in items}
        size, mtime = self.tree_stats(path)
        if META_FILE in names:
            entry = self.scan_entry(path, step, None, role or DEFAULT_ROLE, items=items, fixed_role=role is not None)
            return StepDir(path, step, StepKind.ENTRY, entry.role, [entry], [], size, mtime)
        if MANIFEST_FILE in names:
            return self._scan_manifest_step(path, step, role, items, size, mtime)
        inner = sorted((idx, i.name) for i in items
                       if (idx := Layout.parse_step(i.name)) is not None and i.kind == "dir")
        # recordings without a manifest: a recorder killed (or still writing) before it committed its step
        leftovers = sorted(f"{path}/{i.name}" for i in items
                           if (is_leftover(i.name) and i.kind in ("dir", "file")) or (is_recording(i.name)
                                                                                      and i.kind == "dir"))
        if inner:
            entries = [self.scan_entry(f"{path}/{n}", step, idx, role or V1_ROLE, fixed_role=True)
                       for idx, n in inner]
            return StepDir(path, step, StepKind.V1, role or V1_ROLE, entries, leftovers, size, mtime)
        calls = sorted((call, i.name) for i in items if i.kind == "dir" and (call := Layout.parse_call(i.name)))
        if calls:  # each call's entry is written (and replayed) on its own: a step of entries, not one
            entries = [self.scan_entry(f"{path}/{n}", step, None, role or DEFAULT_ROLE, fixed_role=role is not None,
                                       call=n) for _, n in calls]
            return StepDir(path, step, StepKind.CALLS, role or entries[0].role, entries, leftovers, size, mtime)
        return StepDir(path, step, StepKind.HALF_WRITTEN, role, [], leftovers, size, mtime)

    def _scan_manifest_step(self, path: str, step: int, role: str | None, items: list[DirItem], size: int,
                            mtime: float) -> StepDir:
        """A V1 step committed by a manifest: the recording it names, the other recordings as leftovers.

        The manifest is read before the step is listed again (a recorder publishing after the first
        listing adds the recording it names), and a step whose manifest changed while it was scanned
        is scanned again: what a concurrent publish shows half-done is never reported as damage.
        """
        role = role or V1_ROLE
        item = {i.name: i for i in items}[MANIFEST_FILE]
        if item.kind != "file":
            issue = Issue(IssueKind.DAMAGED, f"{path}/{MANIFEST_FILE}", f"{MANIFEST_FILE} is a {kind_words(item)}, "
                                                                         "not a regular file (not followed)")
            return StepDir(path, step, StepKind.V1, role, [], [], size, mtime, problem=issue)
        for _ in range(_MANIFEST_SCANS):
            where = resolve_step(self.store, path)
            self.store.forget_listings(path)  # listed below after the manifest was read: never a cached listing
            scanned = self._scan_manifest_once(path, step, role, where, self.store.list_items(path), size, mtime)
            if scanned.problem is None or where.manifest is None:
                return scanned
            if resolve_step(self.store, path).manifest == where.manifest:
                return scanned  # the same manifest before and after: what it names is really lacking
            logger.debug("the manifest of %s changed while it was scanned: scanning it again", path)
        return replace(scanned, problem=None)  # still being republished: nothing to judge now

    def _scan_manifest_once(self, path: str, step: int, role: str, where: StepRoot, items: list[DirItem], size: int,
                            mtime: float) -> StepDir:
        names = {i.name: i for i in items}
        manifest_path = f"{path}/{MANIFEST_FILE}"
        if root_state(where) is EntryStatus.UNSUPPORTED:
            issue = Issue(IssueKind.UNSUPPORTED, manifest_path, _relative_reason(where.reason, path))
            return StepDir(path, step, StepKind.V1, role, [], [], size, mtime, problem=issue)
        if root_state(where) is EntryStatus.UNAVAILABLE:  # nothing is known of the step: never judged, never removed
            issue = Issue(IssueKind.UNAVAILABLE, manifest_path, _relative_reason(where.reason, path))
            return StepDir(path, step, StepKind.V1, role, [], [], size, mtime, problem=issue)
        if where.manifest is None:  # damaged (or removed since the listing: then nothing is there either)
            issue = Issue(IssueKind.DAMAGED, manifest_path, _relative_reason(where.reason, path) or "unreadable")
            return StepDir(path, step, StepKind.V1, role, [], [], size, mtime, problem=issue)
        manifest = where.manifest
        named = names.get(manifest.recording)
        leftovers = sorted(f"{path}/{i.name}" for i in items if i.name != manifest.recording and i.kind == "dir"
                           and (is_recording(i.name) or is_leftover(i.name)))
        leftovers += sorted(f"{path}/{i.name}" for i in items if is_leftover(i.name) and i.kind == "file")
        # in-place inner directories: superseded (a leftover) only when all of them predates the manifest;
        # written after it (verl's own dumper, an older stepskip) or of unknown age, they are someone's data
        shadowed = []
        for in_place in sorted(f"{path}/{i.name}" for i in items
                               if i.kind == "dir" and Layout.parse_step(i.name) is not None):
            newest = self.tree_stats(in_place)[1]
            if manifest.created_unix is not None and 0.0 < newest < manifest.created_unix:
                leftovers.append(in_place)
            else:
                shadowed.append(in_place)
        if named is not None and named.kind == "link":
            issue = Issue(IssueKind.DAMAGED, where.root, "the recording the manifest names is a symbolic link "
                                                         "(not followed)")
            return StepDir(path, step, StepKind.V1, role, [], leftovers, size, mtime, manifest, issue, shadowed)
        inner_items = self.store.list_items(where.root) if named is not None and named.kind == "dir" else []
        inner = sorted((idx, i.name) for i in inner_items
                       if (idx := Layout.parse_step(i.name)) is not None and i.kind == "dir")
        leftovers += sorted(f"{where.root}/{i.name}" for i in inner_items
                            if is_leftover(i.name) and i.kind in ("dir", "file"))
        entries = [self.scan_entry(f"{where.root}/{n}", step, idx, role, fixed_role=True) for idx, n in inner]
        lacking = manifest.lacking(idx for idx, _ in inner)
        problem = Issue(IssueKind.DAMAGED, manifest_path, manifest.lacking_reason(lacking)) if lacking else None
        return StepDir(path, step, StepKind.V1, role, entries, sorted(leftovers), size, mtime, manifest, problem,
                       shadowed)

    def scan_entry(self, path: str, step: int, inner: int | None, role: str, items: list[DirItem] | None = None,
                   fixed_role: bool = False, call: str | None = None) -> EntryRecord:
        """Describe one entry directory from its ``meta.json`` and its listing (no data read).

        Args:
            path: the entry directory.
            step: the step it belongs to.
            inner: its V1 inner index, or None for a flat entry.
            role: the role of the directory it lives in (or the default when ``meta.json`` names none).
            items: its listing, when the caller has it.
            fixed_role: the role is given by where the entry lives (a role subdirectory, a V1 step),
                not by ``meta.json``.
            call: the name of a generation call's entry (``c0-r1``), else None.
        """
        items = self.store.list_items(path) if items is None else items
        names = {i.name: i for i in items}
        size = sum(i.size for i in items)
        meta_item = names.get(META_FILE)
        when = max((i.mtime or 0.0 for i in items), default=0.0)
        legacy = legacy_format(inner is not None)
        if meta_item is not None and meta_item.kind == "file":
            try:
                probe = self.store.probe(path, legacy.files)
            except (RecursionError, UnicodeDecodeError, TypeError) as err:  # a hostile meta.json the store let through
                return EntryRecord(path, step, inner, role, None, EntryStatus.DAMAGED,
                                   f"unreadable {META_FILE}: {type(err).__name__}", None, size, when, call)
        else:
            probe = Probe(EntryState.MISSING)  # (classify says why from the listing)
        meta = probe.meta
        if meta is not None and not fixed_role and isinstance(meta.get("role"), str):
            role = meta["role"]
        look = classify(path, probe, legacy, role=role if fixed_role else None, v1=inner is not None, listing=names)
        if meta is not None and look.meta is not None:
            created = _float(meta.get("created_unix"))
            when = float(created) if created is not None else ((meta_item.mtime if meta_item else None) or when)
        return EntryRecord(path, step, inner, role, look.format, look.state, look.reason, look.meta, size, when, call)

    # ----------------------------------------------------------------- one entry or step

    def resolve(self, path: str | None = None, step: int | None = None) -> tuple[StepDir, EntryRecord | None]:
        """The step directory ``path`` (default: the root) names, or ``path/step``, and the entry inside
        it when it names one.

        Args:
            path: a step directory, a V1 inner entry, a generation call's entry, or a run (or role)
                directory with ``step``.
            step: the step to take inside ``path``.

        Returns:
            ``(step_dir, inner)``: ``inner`` is the V1 inner entry or the call's entry ``path`` points
            at, else None.

        Raises:
            NotACacheError: the path does not exist or is not an entry.
        """
        given = self.given if path is None else path
        full = self.root if path is None else path
        self._check_dir(full, given)
        if step is not None:
            full = f"{full}/{int(step)}"
            item = self.store.stat_item(full)
            if item is None or item.kind != "dir":
                raise NotACacheError(f"{given} has no step {step}{self._steps_hint(_split(full)[0])}")
        parent, name = _split(full)
        number = Layout.parse_step(name)
        parent_step = Layout.parse_step(_split(parent)[1])
        if number is None and parent_step is not None and Layout.parse_call(name) is not None:
            grand = _split(_split(parent)[0])[1]
            step_dir = self.scan_step(parent, parent_step, role=None if RUN_DIR.match(grand) else grand)
            call = next((e for e in step_dir.entries if e.call == name), None)
            if call is None:
                raise NotACacheError(f"{given} is not a cache entry: no {META_FILE} in it")
            return step_dir, call
        if number is None:
            if RUN_DIR.match(name):
                raise NotACacheError(f"{given} is a run directory; pass one of its step directories, "
                                     f"or add --step N{self._steps_hint(full)}")
            raise NotACacheError(f"{given} is not a cache entry: its name is not a step number "
                                 "(expected .../GBS<gbs>_N<n>_in<p>_out<r>/<step>)")
        if is_recording(_split(parent)[1]):  # {step}/rec-{token}/{inner}: an inner entry of a recording
            step_path, step_name = _split(_split(parent)[0])
            recorded_step = Layout.parse_step(step_name)
            if recorded_step is not None:
                grand = _split(step_path)[1]
                step_dir = self.scan_step(_split(parent)[0], recorded_step,
                                          role=None if RUN_DIR.match(grand) else grand)
                inner = next((e for e in step_dir.entries if e.path == full), None)
                if inner is None:
                    raise NotACacheError(f"{given} is not an inner entry of the recording its step's "
                                         f"{MANIFEST_FILE} names")
                return step_dir, inner
        if parent_step is not None:  # {step}/{inner}: run and role directories never have numeric names
            grand = _split(_split(parent)[0])[1]
            step_dir = self.scan_step(parent, parent_step, role=None if RUN_DIR.match(grand) else grand)
            inner = next((e for e in step_dir.entries if e.inner == number), None)
            if inner is None:
                raise NotACacheError(f"{given} is not a cache entry: no {META_FILE} in it")
            return step_dir, inner
        in_run = bool(RUN_DIR.match(_split(parent)[1]))
        step_dir = self.scan_step(full, number, role=None if in_run else _split(parent)[1])
        in_role_dir = bool(RUN_DIR.match(_split(_split(parent)[0])[1]))
        if step_dir.kind is StepKind.HALF_WRITTEN and not (in_run or in_role_dir):
            raise NotACacheError(f"{given} is not a cache entry: no {META_FILE} and no inner entries in it")
        return step_dir, None

    def _steps_hint(self, run_dir: str) -> str:
        steps = sorted(s for n in self._dirs(run_dir) if (s := Layout.parse_step(n)) is not None)
        return f" (steps there: {compress_steps(steps)})" if steps else ""

    def read_entry(self, entry: EntryRecord, allow_pickle: bool = False, verify: bool = True) -> Any:
        """Decode one entry with the codec of its format (:func:`stepskip._formats.get_format`).

        Args:
            entry: a present entry of this index.
            allow_pickle: read pickle-based formats (through the allow-list readers of ``stepskip._formats``).
            verify: check the files' checksums.

        Returns:
            The value as the role would replay it (a Batch, a V1 payload dict, a TensorDict ...).

        Raises:
            PickleNotAllowedError: a pickle-based entry and ``allow_pickle`` is false.
            UnreadableEntryError: an unsupported format, or intact bytes that do not decode here.
            CorruptEntryError: the entry is damaged (missing, truncated, checksum mismatch).
        """
        if entry.state is EntryStatus.UNSUPPORTED:
            raise UnreadableEntryError(entry.reason)
        if entry.state is EntryStatus.UNREADABLE:
            raise UnreadableEntryError(f"{entry.path}: {entry.reason}")
        if not entry.valid or entry.meta is None:
            raise CorruptEntryError(f"{entry.path}: {entry.reason or 'not a complete entry'}")
        spec = FORMATS[str(entry.format)]
        if spec.uses_pickle and not allow_pickle:
            raise PickleNotAllowedError(entry.path, spec.name)
        legacy = legacy_format(entry.inner is not None)
        try:  # one version of the entry, even while a writer replaces it
            _, files = self.store.read_entry(entry.path, legacy.files, spec.files, verify)
        except CorruptEntryError:
            raise
        except CacheMissError as err:
            raise NotACacheError(f"{entry.path}: no entry there any more (removed meanwhile)") from err
        from stepskip._formats import get_format  # the codecs import torch: only when something is decoded

        try:
            return get_format(spec.name).decode(files)
        except TruncatedEntryError:
            if entry.has_checksums:
                raise UnreadableEntryError(f"{entry.path}: its checksums match but it does not decode here "
                                           "(ends early); re-record the step with action: record") from None
            raise  # bytes that end early, with no checksum to say otherwise: damage
        except CorruptEntryError as err:
            raise UnreadableEntryError(f"{entry.path}: intact bytes that this stepskip cannot decode ({err}); "
                                       "read it with the stepskip (and tensordict) that wrote it, or re-record "
                                       "the step with action: record; the entry was left untouched") from err
        except Exception as err:  # a decoder meeting foreign bytes: any failure means "not readable here"
            raise UnreadableEntryError(f"{entry.path}: does not decode here ({type(err).__name__}: {err}); "
                                       "re-record the step with action: record; the entry was left untouched") \
                from err

    def read_step(self, step: StepDir, allow_pickle: bool = False, inner: EntryRecord | None = None) -> Any:
        """Decode a step: its one entry, one V1 inner entry, or all inner entries merged row-wise (as
        ``rollout_tq`` replays them); a TRL step (or one call's entry of it) as the rows of its
        calls' completions (:func:`generation_rows`).

        Raises:
            PickleNotAllowedError, UnreadableEntryError, CorruptEntryError: as :meth:`read_entry`.
        """
        if inner is not None and inner.call is not None:
            return generation_rows([(inner.call, self.read_entry(inner, allow_pickle))])
        if inner is not None:
            return self.read_entry(inner, allow_pickle)
        if step.kind is StepKind.CALLS:
            return generation_rows([(str(e.call), self.read_entry(e, allow_pickle)) for e in step.entries])
        if step.kind is StepKind.ENTRY:
            return self.read_entry(step.entries[0], allow_pickle)
        if step.kind is StepKind.HALF_WRITTEN or not step.entries:
            raise CorruptEntryError(f"{step.path}: no entry in this step directory")
        payloads = [self.read_entry(e, allow_pickle) for e in step.entries]
        if not all(isinstance(p, Mapping) and "tensordict" in p for p in payloads):
            return payloads[0]
        from stepskip.tq.rows import concat_rows, payload_problem

        for entry, payload in zip(step.entries, payloads):
            problem = payload_problem(payload)  # checksums prove the bytes, not that they are a V1 payload
            if problem is not None:
                raise CorruptEntryError(f"{entry.path}: {problem}")

        return {
            "tensordict": concat_rows([p["tensordict"] for p in payloads]),
            "tags": [t for p in payloads for t in p["tags"]],
            "keys": [k for p in payloads for k in p["keys"]],
            "global_steps": payloads[0].get("global_steps"),
        }

    def check_entry(self, entry: EntryRecord, decode: bool = False, allow_pickle: bool = False) -> Issue | None:
        """Check a present entry's checksums (one file in memory at a time) and, with ``decode``, decode it.

        Pickle-based entries are decoded only with ``allow_pickle``.

        Returns:
            None when nothing is wrong; else a checksum mismatch or damage (truncation, a missing file),
            or ``undecodable``: intact bytes that do not decode here (unreadable, never to be removed).
        """
        if not entry.valid:
            return None
        if entry.has_checksums:
            for name in (entry.meta or {})["files"]:
                try:
                    self.store.read_entry(entry.path, names=[name], verify=True)
                except CorruptEntryError as err:
                    # The size was right when the entry was scanned: a mismatch now is the checksum's.
                    kind = IssueKind.CHECKSUM if "checksum" in str(err) else IssueKind.DAMAGED
                    return Issue(kind, entry.path, _relative_reason(str(err), entry.path))
                except StoreUnavailableError as err:  # not checked, not damaged: never removed for it
                    return Issue(IssueKind.UNAVAILABLE, entry.path, _relative_reason(str(err), entry.path))
                except CacheMissError:
                    return None  # removed since the scan: nothing left to check
        if decode and (allow_pickle or not FORMATS[str(entry.format)].uses_pickle):
            try:
                self.read_entry(entry, allow_pickle=allow_pickle, verify=False)
            except UnreadableEntryError as err:
                return Issue(IssueKind.UNDECODABLE, entry.path, _relative_reason(str(err), entry.path))
            except CorruptEntryError as err:
                return Issue(IssueKind.DAMAGED, entry.path, _relative_reason(str(err), entry.path))
            except NotACacheError:
                return None  # removed since the scan
        return None

    # ----------------------------------------------------------------- retiring

    def retire(self, path: str) -> None:
        """Remove an entry, a step directory or a leftover below the root; readers see it vanish whole.

        Nothing is followed through a link: a linked directory is refused, a link inside goes itself.

        Raises:
            NotACacheError: ``path`` is not strictly below the root, is reached through a link, or is a link.
        """
        if not self.inside(path):
            raise NotACacheError(f"{path} is not inside {self.given} (or is reached through a link): not removed")
        item = self.store.stat_item(path)
        if item is None:
            return
        if item.kind == "link":
            raise NotACacheError(f"{path} is a symbolic link: not followed, not removed")
        logger.debug("removing %s", path)  # the caller logs the removal (prune, retention)
        try:
            self.store.retire_entry(path)
        except OSError as err:  # the store's own confinement: a link on the way, a path outside its root
            raise NotACacheError(f"{path}: not removed ({err})") from err


def _relative_reason(reason: str, path: str) -> str:
    """A store's message without the entry path it starts with (callers name the entry already)."""
    for prefix in (f"{path}: ", f"{path}/"):
        if reason.startswith(prefix):
            return reason[len(prefix):]
    return reason.replace(f"{path}/", "")
