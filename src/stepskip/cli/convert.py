"""``stepskip convert``: re-encode a cache in another format, keeping its layout and ``meta.json``.

``--to safe`` imports caches verl wrote (``gen_batch.dp``, V1 ``tq_batch.pt``) through the
allow-list readers of :mod:`stepskip.formats.verl`; ``--to verl`` exports to the files verl 0.9
reads (``gen_batch.dp`` for flat entries, ``tq_batch.pt`` for V1 inner entries). Every entry is
written through :meth:`LocalStore.write_entry` (atomic, checksummed) and read back and compared
with its source before the next one starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepskip._version import __version__
from stepskip.cli.content import read_entry, value_digest
from stepskip.cli.errors import CliError
from stepskip.cli.removal import retire
from stepskip.cli.scan import EntryRecord, Issue, local_store, scan_cache, scan_entry
from stepskip.entries import storage_format
from stepskip.errors import CorruptEntryError, UnstorableValueError
from stepskip.formats import Format, get_format
from stepskip.store import EntryState

__all__ = ["ConvertReport", "ConvertedEntry", "TARGETS", "convert_cache", "plan_convert"]

TARGETS = ("safe", "verl")


@dataclass
class ConvertedEntry:
    """One entry converted (or not).

    Args:
        source: the entry read.
        dest: the entry written.
        source_format: its format before.
        dest_format: its format after.
        bytes: bytes written.
        error: why it could not be converted (None on success).
    """

    source: str
    dest: str
    source_format: str
    dest_format: str
    bytes: int = 0
    error: str | None = None


@dataclass
class ConvertReport:
    """What ``convert`` did: converted entries, failures, and invalid source steps left out."""

    converted: list[ConvertedEntry] = field(default_factory=list)
    failed: list[ConvertedEntry] = field(default_factory=list)
    skipped: list[Issue] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and not self.skipped


@dataclass
class _Job:
    entry: EntryRecord
    dest: str
    target: Format


def _target_format(to: str, entry: EntryRecord) -> Format:
    return get_format(storage_format(to, v1=entry.inner is not None).name)


def plan_convert(src: str, dst: str, to: str, allow_pickle: bool, overwrite: bool = False,
                 role: str | None = None) -> tuple[list[_Job], list[Issue]]:
    """Check the arguments and list what would be converted, before anything is written.

    Raises:
        CliError: bad ``to``, ``src`` not a cache, ``dst`` inside ``src``, pickle entries without
            ``allow_pickle``, or destination entries that exist (without ``overwrite``).
    """
    if to not in TARGETS:
        raise CliError(f"--to {to!r} is not valid; allowed values: {', '.join(TARGETS)}")
    runs = scan_cache(src)
    src_root = os.path.abspath(os.path.expanduser(src))
    dst_root = os.path.abspath(os.path.expanduser(dst))
    if dst_root == src_root or dst_root.startswith(src_root + os.sep):
        raise CliError(f"DST {dst} is inside SRC {src}; write the converted cache somewhere else")
    if os.path.exists(dst_root) and not os.path.isdir(dst_root):
        raise CliError(f"DST {dst} exists and is not a directory")
    jobs: list[_Job] = []
    skipped: list[Issue] = []
    for run in runs:
        # DST is a dump dir: every run keeps its {experiment}_{project}/GBS..._N..._in..._out... below it.
        dump_root = os.path.dirname(os.path.dirname(run.path))
        for step in run.steps:
            if role is not None and step.role != role:
                continue
            if not step.valid:
                skipped += step.issues()
                continue
            for entry in step.entries:
                dest = os.path.join(dst_root, os.path.relpath(entry.path, dump_root))
                if dest == entry.path:
                    raise CliError(f"DST {dst} would put the converted entries over their sources; "
                                   "write the converted cache to another dump dir")
                jobs.append(_Job(entry, dest, _target_format(to, entry)))
    if role is not None and not jobs and not skipped:
        raise CliError(f"{src} has no steps of role {role!r}")
    pickled = []
    for job in jobs:
        try:
            if get_format(job.entry.format or "").uses_pickle:
                pickled.append(job.entry)
        except ValueError as err:  # meta.json names a format this stepskip does not know
            raise CliError(f"{job.entry.path}: {err}") from None
    if pickled and not allow_pickle:
        formats = ", ".join(sorted({e.format or "?" for e in pickled}))
        raise CliError(
            f"{src} holds {len(pickled)} pickle-based entr{'y' if len(pickled) == 1 else 'ies'} (format {formats}, "
            f"as verl writes them; e.g. {pickled[0].path}). Reading them unpickles data: pass --allow-pickle to "
            "convert them through stepskip's allow-list unpickler, which refuses any global outside the data "
            "types such a file holds"
        )
    existing = [j.dest for j in jobs if os.path.exists(j.dest)]
    if existing and not overwrite:
        raise CliError(f"{len(existing)} destination entr{'y' if len(existing) == 1 else 'ies'} exist already "
                       f"(e.g. {existing[0]}); pass --overwrite to replace them")
    return jobs, skipped


def _new_meta(entry: EntryRecord, target: Format) -> dict[str, Any]:
    meta = {k: v for k, v in (entry.meta or {}).items() if k != "files"}
    meta["format"] = target.name
    meta["stepskip_version"] = __version__
    meta["converted_from"] = entry.format
    meta.setdefault("role", entry.role)
    meta.setdefault("created_unix", entry.time)
    if entry.inner is not None:
        meta.setdefault("inner_idx", entry.inner)
    return meta


def _convert_one(job: _Job, allow_pickle: bool) -> ConvertedEntry:
    entry, target = job.entry, job.target
    result = ConvertedEntry(entry.path, job.dest, entry.format or "?", target.name)
    store = local_store(os.path.dirname(job.dest))
    wrote = False
    try:
        value = read_entry(local_store(entry.path), entry, allow_pickle=allow_pickle)
        files = target.encode(target.freeze(value, copy=False))
        result.bytes = store.write_entry(job.dest, files, _new_meta(entry, target))
        wrote = True
        written = scan_entry(store, job.dest, entry.step, entry.inner, entry.role)
        if written.state is not EntryState.PRESENT:
            raise CorruptEntryError(f"the written entry is {written.state.value}: {written.reason}")
        # Our own output, read back through the same allow-list readers.
        if value_digest(read_entry(store, written, allow_pickle=True)) != value_digest(value):
            raise CorruptEntryError("the written entry decodes to other values than its source")
    except (CorruptEntryError, UnstorableValueError, OSError) as err:
        result.error = f"{type(err).__name__}: {err}"
        if wrote:  # an entry that failed its check is not left behind
            retire(store, job.dest)
    return result


def convert_cache(src: str, dst: str, to: str, allow_pickle: bool = False, overwrite: bool = False,
                  role: str | None = None,
                  on_entry: Callable[[ConvertedEntry], None] | None = None) -> ConvertReport:
    """Convert every valid entry under ``src`` into ``to``, written to the dump dir ``dst`` in the same layout.

    Args:
        src: a dump dir, experiment directory or run directory.
        dst: the dump dir to write: each run keeps its ``{experiment}_{project}/GBS..._N..._in..._out...``
            path below it, so ``dst`` can be a ``skip.<role>.dump_dir`` as it is.
        to: ``safe`` or ``verl``.
        allow_pickle: read pickle-based source entries (verl's files).
        overwrite: replace destination entries that exist.
        role: convert only this role's steps.
        on_entry: called after each entry (progress).

    Returns:
        The report: converted entries, failures (named with their reason), invalid source steps left out.

    Raises:
        CliError: see :func:`plan_convert`; nothing is written then.

    Example:
        >>> convert_cache("~/.verl/rollout_dump", "/data/safe_dump", to="safe", allow_pickle=True)  # doctest: +SKIP
    """
    jobs, skipped = plan_convert(src, dst, to, allow_pickle, overwrite, role)
    report = ConvertReport(skipped=skipped)
    for job in jobs:
        done = _convert_one(job, allow_pickle)
        (report.failed if done.error else report.converted).append(done)
        if on_entry is not None:
            on_entry(done)
    return report
