"""``stepskip info``: everything known about one entry or step, as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepskip.errors import CorruptEntryError, UnreadableEntryError
from stepskip._index import CacheIndex, EntryRecord, Issue, IssueKind, PickleNotAllowedError, StepDir

if TYPE_CHECKING:  # the content helpers import torch: only when an entry is decoded
    from stepskip.cli.content import FieldInfo, Stat

__all__ = ["EntryInfo", "describe_entry"]


@dataclass
class EntryInfo:
    """One entry (or a whole V1 step) described.

    Args:
        path: the step directory, or the V1 inner entry or generation call's entry asked for.
        step: the step.
        role: the role that wrote it.
        kind: ``entry``, ``v1``, ``calls`` (a TRL step), ``half-written``, ``v1-inner`` or ``call``.
        entries: the entry directories it is made of (one, a V1 step's inner entries or a TRL step's
            calls' entries).
        meta: ``meta.json`` of the (first) entry.
        issues: what is wrong with it (empty when it is valid).
        rows: trajectories (rows) in it, when decoded.
        fields: its columns, when decoded.
        stats: response-length and reward statistics, when decoded and present.
        meta_info: the batch's ``meta_info``, when it has one.
        note: why the content was not decoded (a pickle without ``--allow-pickle``, damage).
        drift: the drift records ``action: compare`` wrote beside the step (see :mod:`stepskip._drift`).
    """

    path: str
    step: int
    role: str | None
    kind: str
    entries: list[EntryRecord]
    meta: dict[str, Any] | None
    issues: list[Issue] = field(default_factory=list)
    rows: int | None = None
    fields: list[FieldInfo] | None = None
    stats: list[Stat] = field(default_factory=list)
    meta_info: dict[str, Any] | None = None
    note: str | None = None
    drift: list[dict[str, Any]] = field(default_factory=list)


def describe_entry(index: CacheIndex, step: int | None = None, allow_pickle: bool = False) -> EntryInfo:
    """Describe the entry the index was opened on (or its ``step``): meta, files, fields, statistics.

    Args:
        index: opened on a step directory, a V1 inner entry, or a run directory (with ``step``).
        step: the step inside ``path``.
        allow_pickle: decode pickle-based entries (otherwise their fields are not shown).

    Returns:
        The description; ``issues`` lists damage, ``note`` says why fields are missing.

    Raises:
        NotACacheError: the path is not an entry.

    Example:
        >>> info = describe_entry(CacheIndex("/tmp/dump/exp_proj/GBS4_N2_in8_out6"), step=3)  # doctest: +SKIP
        >>> [f.name for f in info.fields]  # doctest: +SKIP
        ['prompts', 'responses', 'uid']
    """
    step_dir, inner = index.resolve(step=step)
    entries = [inner] if inner is not None else step_dir.entries
    issues = [i for i in step_dir.issues() if inner is None or i.path == inner.path]
    meta = entries[0].meta if entries else None
    info = EntryInfo(path=inner.path if inner is not None else step_dir.path, step=step_dir.step,
                     role=step_dir.role, kind=_kind(step_dir, inner),
                     entries=list(entries), meta=meta, issues=issues)
    info.drift = drift_of(index, step_dir)
    if issues:
        info.note = "content not decoded: the entry is not valid (see issues)"
        return info
    _decode_into(index, info, step_dir, inner, allow_pickle)
    return info


def _kind(step_dir: StepDir, inner: EntryRecord | None) -> str:
    if inner is None:
        return step_dir.kind.value
    return "call" if inner.call is not None else "v1-inner"
def drift_of(index: CacheIndex, step_dir: StepDir) -> list[dict[str, Any]]:
    """The drift records written beside a step by ``action: compare`` (empty when it was never compared)."""
    from stepskip._drift import drift_records

    return drift_records(index.store, step_dir.path)


def _decode_into(index: CacheIndex, info: EntryInfo, step_dir: StepDir, inner: EntryRecord | None,
                 allow_pickle: bool) -> None:
    try:
        value = index.read_step(step_dir, allow_pickle, inner)
    except PickleNotAllowedError:
        info.note = ("fields not shown: a pickle-based entry (as verl writes it); pass --allow-pickle to read it "
                     "through the allow-list unpickler")
        return
    except UnreadableEntryError as err:
        info.issues.append(Issue(IssueKind.UNDECODABLE, info.path, str(err)))
        info.note = "content not decoded: the entry's bytes are intact but do not decode here (see issues)"
        return
    except CorruptEntryError as err:
        info.issues.append(Issue(IssueKind.DAMAGED, info.path, str(err)))
        info.note = "content not decoded: the entry is damaged (see issues)"
        return
    from stepskip.cli.content import describe_fields, row_count, statistics

    info.rows = row_count(value)
    info.fields = describe_fields(value)
    info.stats = statistics(value)
    meta_info = getattr(value, "meta_info", None)
    info.meta_info = dict(meta_info) if isinstance(meta_info, dict) else None
