"""Step manifests: how a V1 step recorded on an object store is committed whole.

A ``rollout_tq`` step is several inner entries (one per sample call). On a local disk the step is
built in a hidden directory and published with one rename (:meth:`stepskip._storage.entries.EntryStore.publish_dir`);
object stores have no directory rename, so there a step is committed by a manifest::

    {step}/rec-{token}/{inner}/meta.json ...   the inner entries of one recording (one recorder)
    {step}/step.json                           the manifest: names the recording readers use

Each recorder writes its inner entries under a recording directory of its own (``rec-`` and 12 hex
digits, random per recording), then — last, one atomic PUT — the manifest naming it. Readers read
the manifest first and only the recording it names, so they see exactly one recorder's complete
step: two recorders of one step at once end with the step of the one whose manifest was written
last (last writer wins); a recorder killed before its manifest leaves a recording that nothing
names, invisible to readers. A replaced recording is listed in the new manifest as ``retired``
with the time, and deleted by a later writer (or :func:`remove_stale_recordings`) once the store's
grace period has passed, so that a reader that resolved the old manifest can still read it. A
recording nothing names is deleted only once it has not been written for ``older_than`` seconds.
Nothing outside the step directory, and nothing not named like a recording, is ever deleted.

A step directory without a manifest is read as before (``{step}/{inner}/``, as verl and earlier
stepskip versions write it). The manifest is data someone else may have written: it is bounded in
size, must be a JSON object of the documented types, and may only name recordings (a single path
component ``rec-`` + 12 hex digits): anything else makes the step *damaged* (regenerated, raised
under ``replay``); a manifest of a newer version than this stepskip knows makes it *unreadable* (kept).

Example:
    >>> manifest = StepManifest(recording="rec-0123456789ab", inner_entries=2, run_id="r1")
    >>> parse_manifest(manifest.to_bytes()).recording
    'rec-0123456789ab'
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepskip._storage.base import EntryState, Tree, newest_below
from stepskip._storage.meta import (
    GRACE_SECONDS,
    MANIFEST_FILE,
    MAX_INNER_ENTRIES,
    STALE_SECONDS,
    bounded_int,
    is_number,
    load_json,
    show,
)
from stepskip._storage.objects import may_hold_leftovers
from stepskip._storage.outages import StoreOutage
from stepskip.errors import CorruptEntryError, StoreUnavailableError, UnreadableEntryError

__all__ = [
    "MANIFEST_FILE", "MANIFEST_MAX_BYTES", "MANIFEST_VERSION", "RECORDING_PREFIX", "StepManifest", "StepRoot",
    "is_recording", "new_recording", "parse_manifest", "publish_manifest", "read_manifest", "remove_stale_recordings",
    "resolve_step", "may_need_clean_up",
]

logger = logging.getLogger(__name__)

#: A manifest larger than this is damage (ours are a few hundred bytes).
MANIFEST_MAX_BYTES = 64 * 1024
#: The manifest version this stepskip writes and reads.
MANIFEST_VERSION = 1
RECORDING_PREFIX = "rec-"
_RECORDING = re.compile(r"rec-[0-9a-f]{12}")
#: Replaced recordings a manifest remembers (older ones are forgotten, then removed once stale).
_MAX_RETIRED = 64
_MAX_RUN_ID = 256
#: Lacking inner entries a message names (then a count): never a list as long as a hostile count.
_LISTED_LACKING = 8


def is_recording(name: object) -> bool:
    """True for the name of a recording directory (``rec-`` + 12 hex digits): one plain path component.

    Example:
        >>> is_recording("rec-0123456789ab"), is_recording("../rec-0123456789ab"), is_recording("0")
        (True, False, False)
    """
    return isinstance(name, str) and _RECORDING.fullmatch(name) is not None  # fullmatch: "$" admits a final "\\n"


def new_recording() -> str:
    """A fresh, run-unique recording directory name."""
    return f"{RECORDING_PREFIX}{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class StepManifest:
    """A parsed ``step.json``.

    Args:
        recording: the recording directory (a child of the step directory) readers use.
        inner_entries: how many inner entries it holds (the recorder's ``parameter_sync_step``).
        run_id: the recording run.
        created_unix: when the manifest was written.
        retired: recordings it replaced -> when (unix seconds); deleted once the grace period passed.
    """

    recording: str
    inner_entries: int
    run_id: str | None = None
    created_unix: float | None = None
    retired: dict[str, float] = field(default_factory=dict)

    def lacking(self, present: Iterable[int]) -> list[int]:
        """The inner entries this manifest counts that are not among ``present`` (ascending).

        Example:
            >>> StepManifest("rec-0123456789ab", 3).lacking([0, 2])
            [1]
        """
        have = set(present)
        return [i for i in range(self.inner_entries) if i not in have]

    def lacking_reason(self, lacking: Sequence[int]) -> str:
        """Why a step whose recording lacks the inner entries ``lacking`` is damaged: the manifest is
        written after every inner entry it counts, so one missing is damage, not a write in progress.

        Example:
            >>> StepManifest("rec-0123456789ab", 3).lacking_reason([1])
            'step.json names the recording rec-0123456789ab, which lacks inner entry 1'
        """
        shown = ", ".join(str(i) for i in lacking[:_LISTED_LACKING])
        more = f" and {len(lacking) - _LISTED_LACKING} more" if len(lacking) > _LISTED_LACKING else ""
        return (f"{MANIFEST_FILE} names the recording {self.recording}, which lacks inner "
                f"entr{'y' if len(lacking) == 1 else 'ies'} {shown}{more}")

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {"stepskip_manifest": MANIFEST_VERSION, "recording": self.recording,
                                "inner_entries": self.inner_entries, "run_id": self.run_id,
                                "created_unix": self.created_unix}
        if self.retired:
            body["retired"] = dict(self.retired)
        return json.dumps(body, indent=1, sort_keys=True).encode("utf-8")


def _time(value: object) -> bool:
    """A time a manifest may hold: a finite number >= 0 (a huge int is refused unconverted: no overflow)."""
    return is_number(value) and value >= 0  # type: ignore[operator]  # is_number made sure it is a number


def parse_manifest(raw: bytes) -> StepManifest:
    """Check and parse the bytes of a ``step.json``.

    Raises:
        CorruptEntryError: too large, not JSON, or a value of the wrong type or range; a recording
            name that is not ``rec-`` + 12 hex digits (a path, ``..``, an absolute path ...).
        UnreadableEntryError: a manifest version newer than this stepskip's.

    Example:
        >>> parse_manifest(b'{"stepskip_manifest": 1, "recording": "../x", "inner_entries": 1}')
        Traceback (most recent call last):
        ...
        stepskip.errors.CorruptEntryError: step.json: recording is '../x', expected rec- and 12 hex digits
    """
    try:
        return _parse_manifest(raw)
    except (ArithmeticError, TypeError, RecursionError) as err:  # a hostile value a check missed: damage, not a crash
        raise CorruptEntryError(f"{MANIFEST_FILE} holds a value stepskip cannot check "
                                f"({type(err).__name__}: {err})") from err


def _parse_manifest(raw: bytes) -> StepManifest:
    body, reason = load_json(raw, MANIFEST_MAX_BYTES, MANIFEST_FILE)
    if reason:
        raise CorruptEntryError(reason)
    if not isinstance(body, dict):
        raise CorruptEntryError(f"{MANIFEST_FILE} is not a JSON object")
    version = body.get("stepskip_manifest")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptEntryError(f"{MANIFEST_FILE}: stepskip_manifest is {show(version)}, expected {MANIFEST_VERSION}")
    if version > MANIFEST_VERSION:
        raise UnreadableEntryError(f"{MANIFEST_FILE} has version {version}; this stepskip reads version "
                                   f"{MANIFEST_VERSION}: upgrade stepskip to read this step (it was left untouched)")
    recording = body.get("recording")
    if not is_recording(recording):
        raise CorruptEntryError(f"{MANIFEST_FILE}: recording is {show(recording)}, expected "
                                f"{RECORDING_PREFIX} and 12 hex digits")
    inner: Any = body.get("inner_entries")
    problem = bounded_int({"inner_entries": inner}, "inner_entries", 1, MAX_INNER_ENTRIES, file=MANIFEST_FILE)
    if problem is not None:  # absent is None here: refused like any other value that is not an int
        raise CorruptEntryError(problem)
    run_id = body.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or len(run_id) > _MAX_RUN_ID):
        raise CorruptEntryError(f"{MANIFEST_FILE}: run_id is {show(run_id)}, expected a string or null")
    created = body.get("created_unix")
    if created is not None and not _time(created):
        raise CorruptEntryError(f"{MANIFEST_FILE}: created_unix is {show(created)}, expected a number >= 0 or null")
    retired = body.get("retired", {})
    if (not isinstance(retired, dict) or len(retired) > _MAX_RETIRED
            or not all(is_recording(k) and _time(v) for k, v in retired.items())):
        raise CorruptEntryError(f"{MANIFEST_FILE}: retired is {show(retired)}, expected at most {_MAX_RETIRED} "
                                "recording names with times")
    return StepManifest(str(recording), inner, run_id, None if created is None else float(created),
                        {str(k): float(v) for k, v in retired.items() if k != recording})


def read_manifest(store: Any, step_dir: str) -> StepManifest | None:
    """The manifest of ``step_dir``, or None when it has none (an in-place step, or no step).

    Raises:
        CorruptEntryError: the manifest is damaged (see :func:`parse_manifest`), not a regular file,
            or cannot be read.
        UnreadableEntryError: a newer manifest version.
        StoreUnavailableError: the store did not answer (a timeout, a connection error, a 5xx): nothing is
            known of the manifest, least of all that it is damaged.
    """
    try:
        raw = store.read_small(f"{step_dir}/{MANIFEST_FILE}", MANIFEST_MAX_BYTES)
    except StoreOutage as err:
        raise StoreUnavailableError(str(err.strerror)) from err
    if raw is None:
        return None
    try:
        return parse_manifest(raw)
    except CorruptEntryError as err:
        raise CorruptEntryError(f"{step_dir}/{err}") from None
    except UnreadableEntryError as err:
        raise UnreadableEntryError(f"{step_dir}/{err}") from None


@dataclass(frozen=True)
class StepRoot:
    """Where a step's inner entries are, as its manifest (if any) says.

    Args:
        root: the directory holding ``{inner}/``: the recording the manifest names, else the step directory.
        manifest: the manifest (None for a step written in place).
        state: ``PRESENT`` when the root can be read (a manifest or none); ``DAMAGED`` or
            ``UNREADABLE`` for a bad manifest, ``UNAVAILABLE`` when the store did not answer for it
            (the step may be perfectly valid), with ``reason``.
        reason: why the manifest cannot be used.
    """

    root: str
    manifest: StepManifest | None = None
    state: EntryState = EntryState.PRESENT
    reason: str = ""


def resolve_step(store: Any, step_dir: str) -> StepRoot:
    """Read ``step_dir``'s manifest once and say where its inner entries are; never raises.

    A reader resolves once per look at a step and reads every inner entry below that one root:
    a concurrent recorder publishing another manifest meanwhile cannot mix two recordings.
    """
    try:
        manifest = read_manifest(store, step_dir)
    except CorruptEntryError as err:
        return StepRoot(step_dir, None, EntryState.DAMAGED, str(err))
    except UnreadableEntryError as err:
        return StepRoot(step_dir, None, EntryState.UNREADABLE, str(err))
    except StoreUnavailableError as err:
        return StepRoot(step_dir, None, EntryState.UNAVAILABLE, str(err))
    if manifest is None:
        return StepRoot(step_dir)
    return StepRoot(f"{step_dir}/{manifest.recording}", manifest)


def publish_manifest(store: Any, step_dir: str, recording: str, inner_entries: int, run_id: str | None,
                     now: float | None = None) -> list[str]:
    """Commit the complete recording ``recording`` as ``step_dir``'s step: write its manifest last.

    The recording the current manifest names becomes ``retired`` (kept for the store's grace
    period); retired recordings past it are deleted after the new manifest is written.

    Returns:
        The recording directories deleted.

    Raises:
        FileNotFoundError: an inner entry of ``recording`` is missing or incomplete (another run may
            have removed a recording idle for long as stale): nothing was written, the current
            manifest stands.
        OSError: the manifest could not be written (nothing was deleted then).
        StoreUnavailableError: the store did not answer for the current manifest: nothing was written
            (what it names is never retired unseen).
    """
    grace = float(getattr(store, "grace_seconds", GRACE_SECONDS))
    now = float(getattr(store, "clock", time.time)()) if now is None else now
    # a manifest must never name an incomplete recording (and retire the good one): one probe per inner entry
    for inner in range(int(inner_entries)):
        probe = store.probe(f"{step_dir}/{recording}/{inner}")
        if probe.state is not EntryState.PRESENT:  # missing, or partly removed (as stale, by another run?)
            raise FileNotFoundError(f"{step_dir}/{recording}/{inner} is {probe.state.value}"
                                    f"{': ' + probe.reason if probe.reason else ''} (removed as stale by another "
                                    "run?); the recording is incomplete and was not published")
    try:
        current = read_manifest(store, step_dir)
    except (CorruptEntryError, UnreadableEntryError) as err:  # replaced: what it names is left to go stale
        logger.warning("replacing the unusable manifest of %s: %s", step_dir, err)
        current = None
    retired = dict(current.retired) if current is not None else {}
    if current is not None and current.recording != recording:
        retired[current.recording] = now
    retired.pop(recording, None)
    expired = [name for name, when in retired.items() if now - when >= grace]
    for name in expired:
        del retired[name]
    while len(retired) > _MAX_RETIRED:  # forgotten, not deleted: removed once stale (remove_stale_recordings)
        del retired[min(retired, key=lambda k: retired[k])]
    manifest = StepManifest(recording, int(inner_entries), run_id, now, retired)
    store.put_small(f"{step_dir}/{MANIFEST_FILE}", manifest.to_bytes())
    removed = []
    for name in expired:
        try:
            store.remove(f"{step_dir}/{name}")
            removed.append(f"{step_dir}/{name}")
        except OSError as err:  # left for a later writer or remove_stale_recordings
            logger.debug("could not delete the replaced recording %s/%s: %s", step_dir, name, err)
    return removed


def may_need_clean_up(store: Any, tree: Tree, step_dir: str, older_than: float = STALE_SECONDS,
                      now: float | None = None) -> bool:
    """False only when one recursive listing of the run directory (``tree``) shows that the start-up
    clean-up of ``step_dir`` (:func:`remove_stale_recordings`, then the store's ``remove_leftovers``
    in its inner entries) would delete nothing: then its manifest need not be read.

    A recording may go only when another one (or none) is what the manifest names, and not while it
    was written less than ``min(grace, older_than)`` seconds ago (it is kept for the grace period
    after its replacement, or until stale when nothing names it, both later than its last write); an
    inner entry may hold a leftover only when its objects come from more than one write
    (:func:`stepskip._storage.objects.may_hold_leftovers`). Only a lone recording under a manifest that names
    another (a damaged step) is kept on this account, which is what keeping when in doubt means.

    Example:
        >>> from stepskip._storage import DirItem
        >>> item = DirItem("meta.json", "file", 9, 100.0)
        >>> tree = Tree("s3://b/run", {"1/step.json": item, "1/rec-0123456789ab/0/meta.json": item})
        >>> may_need_clean_up(None, tree, "s3://b/run/1", now=200.0)
        False
    """
    grace = float(getattr(store, "grace_seconds", GRACE_SECONDS))
    now = float(getattr(store, "clock", time.time)()) if now is None else now
    young = min(grace, older_than)
    recordings = [name for name in tree.dirs(step_dir) if is_recording(name)]
    if recordings and not (MANIFEST_FILE in tree.files(step_dir) and len(recordings) == 1):
        for name in recordings:
            newest = tree.newest(f"{step_dir}/{name}")
            if newest is None or not 0 <= now - newest < young:
                return True
    for root in [step_dir, *(f"{step_dir}/{name}" for name in recordings)]:
        for inner in tree.dirs(root):
            if may_hold_leftovers(tree.files(f"{root}/{inner}"), now, young):
                return True
    return False


def remove_stale_recordings(store: Any, step_dir: str, older_than: float = STALE_SECONDS,
                            now: float | None = None, where: StepRoot | None = None,
                            tree: Tree | None = None) -> list[str]:
    """Delete the recordings of ``step_dir`` that no reader can reach and no writer is still writing.

    Kept: the recording the manifest names; a retired one within the store's grace period; a
    recording nothing names (a recorder killed before its manifest, or one still recording) that
    was written less than ``older_than`` seconds ago or whose age is unknown; everything when the
    manifest is damaged or unreadable (keep rather than delete when in doubt). Only directories
    named like recordings are considered.

    Args:
        where: ``step_dir`` as the caller just resolved it (:func:`resolve_step`); resolved here when None.
        tree: a recursive listing covering ``step_dir`` (the store's ``scan``), read instead of
            listing each recording.

    Returns:
        The recording directories deleted.
    """
    grace = float(getattr(store, "grace_seconds", GRACE_SECONDS))
    now = float(getattr(store, "clock", time.time)()) if now is None else now
    step = resolve_step(store, step_dir) if where is None else where
    if step.state is not EntryState.PRESENT:
        return []
    manifest = step.manifest
    removed = []
    listed = tree is not None and tree.covers(step_dir)
    for name in tree.dirs(step_dir) if tree is not None and listed else store.list_dir(step_dir, dirs_only=True):
        if not is_recording(name) or (manifest is not None and name == manifest.recording):
            continue
        when = manifest.retired.get(name) if manifest is not None else None
        if when is not None:
            if now - when < grace:
                continue
        else:
            path = f"{step_dir}/{name}"
            newest = tree.newest(path) if tree is not None and listed else newest_below(path, store.list_items)
            if newest is None or now - newest < older_than:
                continue
        try:
            store.remove(f"{step_dir}/{name}")
        except OSError as err:
            logger.debug("could not delete the recording %s/%s: %s", step_dir, name, err)
            continue
        removed.append(f"{step_dir}/{name}")
    return removed
