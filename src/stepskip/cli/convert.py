"""``stepskip convert``: re-encode a cache in another format, keeping its layout and ``meta.json``.

``--to safe`` imports caches verl wrote (``gen_batch.dp``, V1 ``tq_batch.pt``) through the
allow-list readers of :mod:`stepskip._formats.verl`; ``--to verl`` exports to the files verl 0.9
reads (``gen_batch.dp`` for flat entries, ``tq_batch.pt`` for V1 inner entries); the targets and
their V1 variants come from the format registry (:data:`stepskip._entries.FORMATS`). SRC and DST
are any stores (local paths, ``memory://``, ``s3://``). Every entry is written through the
store's ``write_entry`` (atomic, checksummed) and read back and compared with its source before
the next one starts. DST must not lie inside SRC, compared by real path (a link to SRC is SRC).
V1 steps are written in place (``{step}/{inner}/``) whatever their source layout: a step an
object store committed by a manifest (``{step}/step.json``) is converted from the recording it
names, and a destination step's manifest is removed before (``--overwrite``), so that it cannot
hide the converted entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepskip._version import __version__
from stepskip.cli.content import value_digest
from stepskip.cli.errors import CliError
from stepskip._entries import CONFIG_FORMATS, FORMATS, storage_format
from stepskip.errors import CorruptEntryError, UnreadableEntryError, UnstorableValueError
from stepskip._formats import Format, get_format
from stepskip._index import CacheIndex, EntryRecord, EntryStatus, Issue
from stepskip._manifest import MANIFEST_FILE

__all__ = ["ConvertReport", "ConvertedEntry", "TARGETS", "convert_cache", "plan_convert"]

#: What ``--to`` accepts: the values of the role option ``format``.
TARGETS = CONFIG_FORMATS


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
    manifest: str | None = None  # a destination step manifest to remove first (it would hide the entry)


def _target_format(to: str, entry: EntryRecord) -> Format:
    return get_format(storage_format(to, v1=entry.inner is not None).name)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def plan_convert(src: CacheIndex, dst: CacheIndex, to: str, allow_pickle: bool, overwrite: bool = False,
                 role: str | None = None) -> tuple[list[_Job], list[Issue]]:
    """Check the arguments and list what would be converted, before anything is written.

    Raises:
        CliError: bad ``to``, ``src`` not a cache, ``dst`` inside ``src``, pickle entries without
            ``allow_pickle``, unsupported source formats, or destination entries that exist (without
            ``overwrite``).
    """
    if to not in TARGETS:
        raise CliError(f"--to {to!r} is not valid; allowed values: {', '.join(TARGETS)}")
    runs = src.runs()
    # Real paths (the index resolves the roots it is given): a DST that is a link into SRC is inside SRC.
    if src.is_url == dst.is_url and (_inside(dst.root, src.root) or _inside(src.root, dst.root)):
        raise CliError(f"DST {dst.given} is {'inside' if _inside(dst.root, src.root) else 'a parent of'} "
                       f"SRC {src.given}; write the converted cache somewhere else")
    dst_item = dst.store.stat_item(dst.root)
    if dst_item is not None and dst_item.kind != "dir":
        raise CliError(f"DST {dst.given} exists and is not a directory")
    jobs: list[_Job] = []
    skipped: list[Issue] = []
    for run in runs:
        # DST is a dump dir: every run keeps its {experiment}_{project}/GBS..._N..._in..._out... below it.
        dump_root = run.path.rsplit("/", 2)[0]
        for step in run.steps:
            if role is not None and step.role != role:
                continue
            if not step.valid:
                skipped += step.issues()
                continue
            dest_step = f"{dst.root}/{step.path[len(dump_root) + 1:]}"
            manifest = f"{dest_step}/{MANIFEST_FILE}" if step.entries and step.entries[0].inner is not None else None
            if manifest is not None and dst.store.stat_item(manifest) is None:
                manifest = None
            for entry in step.entries:
                # V1 inner entries go in place: {step}/{inner}, whichever recording of the source they come from
                dest = f"{dest_step}/{entry.inner}" if entry.inner is not None else dest_step
                if entry.call is not None:  # a generation call's entry keeps its name in its step
                    dest = f"{dest_step}/{entry.call}"
                jobs.append(_Job(entry, dest, _target_format(to, entry), manifest))
    if role is not None and not jobs and not skipped:
        raise CliError(f"{src.given} has no steps of role {role!r}")
    pickled = [job.entry for job in jobs if FORMATS[str(job.entry.format)].uses_pickle]
    if pickled and not allow_pickle:
        formats = ", ".join(sorted({e.format or "?" for e in pickled}))
        raise CliError(
            f"{src.given} holds {len(pickled)} pickle-based entr{'y' if len(pickled) == 1 else 'ies'} (format "
            f"{formats}, as verl writes them; e.g. {pickled[0].path}). Reading them unpickles data: pass "
            "--allow-pickle to convert them through stepskip's allow-list unpickler, which refuses any global "
            "outside the data types such a file holds"
        )
    existing = [j.dest for j in jobs if dst.store.stat_item(j.dest) is not None]
    existing += sorted({j.manifest for j in jobs if j.manifest is not None})
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


def _recorded_inputs(src: CacheIndex, entry: EntryRecord) -> dict[str, bytes]:
    """The call arguments a stage recorded beside its result (``record_inputs``), checksums checked: they are
    stored in a format of their own, so they go to the converted entry byte for byte."""
    from stepskip._entries import legacy_format
    from stepskip._stage_inputs import INPUT_FILES, has_inputs

    if not has_inputs(entry.meta):
        return {}
    _, files = src.store.read_entry(entry.path, legacy_format(False).files, list(INPUT_FILES), True)
    return {name: bytes(files[name]) for name in INPUT_FILES}


def _convert_one(src: CacheIndex, dst: CacheIndex, job: _Job, allow_pickle: bool,
                 removed: set[str] | None = None) -> ConvertedEntry:
    """Convert one entry; ``removed`` holds the destination manifests removed already (one per step, not per job)."""
    entry, target = job.entry, job.target
    removed = set() if removed is None else removed
    result = ConvertedEntry(entry.path, job.dest, entry.format or "?", target.name)
    wrote = False
    try:
        value = src.read_entry(entry, allow_pickle=allow_pickle)
        files = target.encode(target.freeze(value, copy=False))
        files.update(_recorded_inputs(src, entry))
        if job.manifest is not None and job.manifest not in removed and dst.inside(job.manifest):
            dst.store.remove(job.manifest)  # the step is written in place now: its old commit point goes
            removed.add(job.manifest)
        result.bytes = dst.store.write_entry(job.dest, files, _new_meta(entry, target))
        wrote = True
        written = dst.scan_entry(job.dest, entry.step, entry.inner, entry.role)
        if written.state is not EntryStatus.PRESENT:
            raise CorruptEntryError(f"the written entry is {written.state.value}: {written.reason}")
        # Our own output, read back through the same allow-list readers.
        if value_digest(dst.read_entry(written, allow_pickle=True)) != value_digest(value):
            raise CorruptEntryError("the written entry decodes to other values than its source")
    # RuntimeError, ValueError: a codec (torch.save ...) refusing this value; the entry fails, the others go on.
    except (CorruptEntryError, UnreadableEntryError, UnstorableValueError, OSError, RuntimeError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}"
        if wrote:  # an entry that failed its check is not left behind
            dst.retire(job.dest)
    return result


def convert_cache(src: CacheIndex, dst: CacheIndex, to: str, allow_pickle: bool = False,
                  overwrite: bool = False, role: str | None = None,
                  on_entry: Callable[[ConvertedEntry], None] | None = None) -> ConvertReport:
    """Convert every valid entry under ``src`` into ``to``, written to the dump dir ``dst`` in the same layout.

    Args:
        src: the cache to read (a dump dir, experiment directory or run directory).
        dst: the dump dir to write (need not exist): each run keeps its
            ``{experiment}_{project}/GBS..._N..._in..._out...``
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
        >>> convert_cache(CacheIndex("~/.verl/rollout_dump"), CacheIndex("/data/safe_dump"), to="safe",
        ...               allow_pickle=True)  # doctest: +SKIP
    """
    jobs, skipped = plan_convert(src, dst, to, allow_pickle, overwrite, role)
    report = ConvertReport(skipped=skipped)
    removed: set[str] = set()  # destination manifests removed: the other jobs of their step skip them
    for job in jobs:
        done = _convert_one(src, dst, job, allow_pickle, removed)
        (report.failed if done.error else report.converted).append(done)
        if on_entry is not None:
            on_entry(done)
    return report
