"""Reading one role's entries: probe and classify, read and decode, check fidelity, rebind.

What an entry is — present, missing, damaged (regenerated; raised under ``replay``), or kept
(unsupported or unreadable here: an error naming the entry and the fix; never regenerated over or
deleted, only ``action: record`` replaces it) — is decided by :func:`stepskip._reading.classify.classify`,
the one decision the cache index takes too, given what the role is (its name, its kind of entries).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from stepskip._reading.classify import EntryStatus, Look, classify
from stepskip._storage import EntryState, Probe
from stepskip._storage.layered import origin_of
from stepskip.config import SkipRoleConfig
from stepskip._entries import FormatSpec, format_spec
from stepskip.errors import (
    CacheMissError,
    CorruptEntryError,
    FingerprintMismatchError,
    PickleRefusedError,
    PromptMismatchError,
    ReplayMissError,
    StoreUnavailableError,
    TruncatedEntryError,
    UnreadableEntryError,
)
from stepskip._identity import fingerprint_diff
from stepskip._policies import CheckPrompts, OnMismatch, SkipAction
from stepskip._stats import RoleStats

__all__ = ["EntryReader", "ReadOwner", "prompt_digest", "seconds_of"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_RETRY_SECONDS = 0.05
#: At most this many probes of hits are kept for the reads that follow them (see :meth:`EntryReader.take_probe`).
_HIT_PROBES_MAX = 256
#: Under ``replay``, the waits before each new try of a read the store did not answer: a blip of up to
#: about 1.4 s is ridden out; a longer outage fails the call.
OUTAGE_RETRY_SECONDS = (0.2, 0.4, 0.8)


class ReadOwner(Protocol):
    """What the reader reads from the role it reads for."""

    name: str
    action: SkipAction
    config: SkipRoleConfig
    stats: RoleStats
    legacy: FormatSpec
    allow_pickle: bool
    verify: bool
    fingerprint: dict[str, Any]
    on_mismatch: Any  # an OnMismatch once the config is validated
    check_prompts: Any  # a CheckPrompts once the config is validated
    rebind_keys: list[str]
    layered: bool
    retention: Any  # a Retention while max_keep / max_bytes remove steps, else None

    @property
    def v1(self) -> bool:
        """The role's entries are V1 inner entries."""
        ...

    @property
    def store(self) -> Any: ...

    def await_dump(self, path: str) -> None:
        """Wait for this run's queued dump of ``path``, if any."""
        ...


class EntryReader:
    """Reads the entries of one role (see the module docstring)."""

    def __init__(self, owner: ReadOwner) -> None:
        self.owner = owner
        #: Under ``replay``: the waits between tries of a read the store did not answer, and how to wait
        #: (tests pass a function that records the waits instead of sleeping).
        self.outage_retry: tuple[float, ...] = OUTAGE_RETRY_SECONDS
        self.sleep: Any = time.sleep
        #: Warnings given once per run: ``("rng",)``, and each set of fingerprint differences.
        self.warned: set[tuple[str, ...]] = set()
        self.reset()

    def reset(self) -> None:
        """A new run: no probe of a hit is kept."""
        # entry path -> the probe meet_precondition took of it (present), for the read that follows. Keyed
        # by path, so calls in flight at once (the async role) do not take each other's; one of another
        # call at the same path serves as well: the store uses a probe only while meta.json is that file
        self._hit_probes: dict[str, Look] = {}

    # ------------------------------------------------------------------ probing

    def probe(self, path: str, keep: int = 0) -> Look:
        """Probe and classify the entry at ``path`` as this role sees it; ``keep``: as
        :meth:`~stepskip._storage.EntryStore.probe`'s."""
        self.owner.await_dump(path)
        return self.classify(path, self.owner.store.probe(path, self.owner.legacy.files, keep))

    def classify(self, path: str, probe: Probe) -> Look:
        """The store's ``probe`` of ``path`` classified for this role (:func:`~stepskip._reading.classify.classify`:
        an entry of another role, or a pickle of the other kind of entries, is unreadable here)."""
        owner = self.owner
        return classify(path, probe, owner.legacy, role=owner.name, v1=owner.v1)

    def probe_settled(self, path: str, keep: int = 0) -> Look:
        """Probe, looking twice before calling an entry damaged (it may be mid-replacement)."""
        probe = self.probe(path, keep)
        if probe.state is EntryStatus.DAMAGED:
            time.sleep(_RETRY_SECONDS)
            probe = self.probe(path, keep)
        return probe

    def servable(self, meta: dict[str, Any]) -> bool:
        """False when an entry's meta alone shows a call would not be served from it."""
        owner = self.owner
        spec = format_spec(meta.get("format", owner.legacy.name))
        if spec is None or (spec.uses_pickle and not owner.allow_pickle):
            return False
        recorded = meta.get("fingerprint")
        return not (owner.on_mismatch is OnMismatch.REGENERATE and isinstance(recorded, dict)
                    and fingerprint_diff(recorded, owner.fingerprint))

    def keep_probe(self, path: str, probe: Look) -> None:
        """Keep the probe of a hit for the read that follows it (:meth:`take_probe`)."""
        if len(self._hit_probes) >= _HIT_PROBES_MAX:  # probes of hits whose read never came
            self._hit_probes.clear()
        self._hit_probes[path] = probe

    def take_probe(self, path: str) -> Look | None:
        """The probe kept of ``path``, once (None when there is none)."""
        return self._hit_probes.pop(path, None)

    # ------------------------------------------------------------------ reading

    def read(self, path: str, step: int, load_step: int | None = None,
             prompts: Any = None) -> tuple[Any, dict[str, Any], float, int]:
        """Read and decode the entry at ``path`` for a call at ``step``: ``(value, meta, seconds, bytes)``.

        Raises:
            CorruptEntryError: damaged entry (logged and counted).
            CacheMissError: the entry vanished, or the fingerprint differs and ``on_mismatch`` is
                ``regenerate``.
            UnreadableEntryError: intact but not decodable here, or a pickle while ``allow_pickle`` is false.
            SkipConfigError: a fingerprint or prompt mismatch under the ``error`` policy.
        """
        start = time.perf_counter()
        try:  # the store reads one version, and retries itself when a writer replaces the entry meanwhile
            value, meta, nbytes = self.read_once(path, step, load_step, prompts)
        except CorruptEntryError as err:
            self.report_corrupt(step, path, str(err))
            raise
        return value, meta, time.perf_counter() - start, nbytes

    def read_once(self, path: str, step: int, load_step: int | None,
                  prompts: Any, probe: Look | None = None) -> tuple[Any, dict[str, Any], int]:
        """As :meth:`read`, without counting damage or timing; ``probe``: one taken of the entry just
        before (its meta is then not read again while it is that file)."""
        owner = self.owner
        load_step = step if load_step is None else load_step
        chosen: list[FormatSpec] = []

        def files_of(meta: dict[str, Any]) -> tuple[str, ...]:
            """Called with the checked meta of the version being read, before any data is read."""
            chosen.clear()
            look = self.classify(path, Probe(EntryState.PRESENT, meta))
            if look.state.kept:
                raise self.unreadable(look.reason)
            self.check_fidelity(meta, path, step, load_step, prompts)
            spec = format_spec(meta.get("format", owner.legacy.name))
            assert spec is not None  # classify made sure
            if spec.uses_pickle and not owner.allow_pickle:
                raise PickleRefusedError(
                    f"{path} holds a pickle-based entry (format {spec.name!r}, as verl writes it) and "
                    f"skip.{owner.name}.allow_pickle is false. Either set skip.{owner.name}.allow_pickle=true "
                    "(read through an allow-list unpickler), or convert the cache once with "
                    "`stepskip convert SRC DST --to safe --allow-pickle`. The entry was left untouched."
                )
            chosen.append(spec)
            return spec.files

        waits = iter(self.outage_retry if owner.action is SkipAction.REPLAY else ())
        tries = 0
        retention = owner.retention
        if retention is not None:  # a step being read is not removed meanwhile (nor just after: see Retention)
            retention.hold(load_step)
        try:  # the hold spans every try
            while True:
                tries += 1
                try:  # one version of the entry, even while a writer replaces it
                    # big files in recycled pages, for the format that reads buffers (the unpicklers read bytes)
                    meta, files = owner.store.read_entry(path, owner.legacy.files, files_of, owner.verify,
                                                         allocator=lambda size: None if chosen[0].uses_pickle
                                                         else _recycled(size),
                                                         probe=None if probe is None else probe.probe)
                    break
                except StoreUnavailableError as err:  # no answer: not a miss, not damage (retried under replay)
                    wait = next(waits, None)
                    if wait is None:
                        raise StoreUnavailableError(self._unavailable_message(path, step, tries, err)) from err
                    logger.warning("%s: step %d: %s (try %d); trying again in %.1fs", owner.name, step, err, tries,
                                   wait)
                    self.sleep(wait)
                    probe = None  # what it kept may be of a version since replaced
                except CorruptEntryError:
                    raise
                except CacheMissError as err:
                    raise ReplayMissError(f"{owner.name}: the entry at {path} vanished (removed while it was read)"
                                          ) from err
        finally:
            if retention is not None:
                retention.release(load_step)
        from stepskip._formats import get_format

        spec = chosen[0]
        nbytes = sum(len(b) for b in files.values())
        try:
            value = get_format(spec.name).decode(files, consume=True, max_bytes=owner.config.max_decode_bytes)
            return value, meta, nbytes
        except CorruptEntryError as err:
            raise self._decode_failure(path, meta, spec, err) from err

    def answered(self, path: str, step: int, attempt: Callable[[], _T]) -> _T:
        """``attempt()``, a look at ``path`` for the call at ``step`` (a step's manifest, say), tried again after
        each of the bounded waits of :attr:`outage_retry` while the store does not answer (under ``replay``
        only; once otherwise).

        Raises:
            StoreUnavailableError: the store never answered; the message names its error and the tries.
        """
        waits = iter(self.outage_retry if self.owner.action is SkipAction.REPLAY else ())
        tries = 0
        while True:
            tries += 1
            try:
                return attempt()
            except StoreUnavailableError as err:
                wait = next(waits, None)
                if wait is None:
                    raise StoreUnavailableError(self._unavailable_message(path, step, tries, err)) from err
                logger.warning("%s: step %d: %s (try %d); trying again in %.1fs", self.owner.name, step, err, tries,
                               wait)
                self.sleep(wait)

    def _unavailable_message(self, path: str, step: int, tries: int, err: StoreUnavailableError) -> str:
        owner = self.owner
        retried = f" ({tries} tries over {sum(self.outage_retry[:tries - 1]):.1f}s)" if tries > 1 else ""
        fix = ", or use action: cache to generate the step while it is down" if owner.action is SkipAction.REPLAY else ""
        return (f"{owner.name}: step {step}: {err}{retried}. The entry at {path} was left untouched; check the store "
                f"(its endpoint, its health) and run again{fix}")

    def _decode_failure(self, path: str, meta: dict[str, Any], spec: FormatSpec, err: CorruptEntryError) -> Exception:
        """Bytes that did not decode: damage only when they are provably not what was written."""
        listed = meta.get("files")
        if isinstance(listed, dict) and listed:
            if not self.owner.verify:  # the bytes were not checked: check them now, to tell damage apart
                try:
                    self.owner.store.read_files(path, meta, spec.files, True)
                except CorruptEntryError as damage:
                    return damage
            intact = "its files match their checksums"
        elif isinstance(err, TruncatedEntryError):
            return err  # no checksums (verl wrote it), but the bytes end early: damage
        else:
            intact = "its file is complete"
        return self.unreadable(
            f"the entry at {path} cannot be decoded by this stepskip although {intact}: {err}. It was left "
            "untouched; read it with the stepskip (or verl) that wrote it, or re-record the step with action: record"
        )

    def check_fidelity(self, meta: dict[str, Any], path: str, step: int, load_step: int, prompts: Any) -> None:
        """Compare the entry's run fingerprint and prompt digest with the live run and call."""
        owner = self.owner
        origin = origin_of(meta) if owner.layered else None  # from a layered cache: messages name its run
        if origin is not None:
            path = origin.describe()
        recorded = meta.get("fingerprint")
        if isinstance(recorded, dict):
            diffs = fingerprint_diff(recorded, owner.fingerprint)
            if diffs:
                message = (f"{owner.name}: the entry at {path} was recorded with other rollout settings: "
                           + "; ".join(diffs))
                if owner.on_mismatch is OnMismatch.ERROR:
                    raise FingerprintMismatchError(message + f" (skip.{owner.name}.on_mismatch = error)")
                if owner.on_mismatch is OnMismatch.REGENERATE:
                    logger.warning("%s; regenerating step %d", message, step)
                    raise CacheMissError(message)
                if tuple(diffs) not in self.warned:
                    self.warned.add(tuple(diffs))
                    logger.warning("%s; replaying it anyway (set skip.%s.on_mismatch to error or regenerate)",
                                   message, owner.name)
        recorded_digest = meta.get("prompt_digest")
        if owner.check_prompts is CheckPrompts.OFF or load_step != step or prompts is None or not recorded_digest:
            return
        from stepskip._fidelity import digest_like

        digest = digest_like(recorded_digest, prompts, owner.rebind_keys)  # None: an earlier scheme, not comparable
        if digest is None or digest == recorded_digest:
            return
        message = (f"{owner.name}: step {step} was recorded for other prompts than this call's (entry {path}); "
                   "the data order or dataset changed since it was recorded (e.g. another shuffle seed)")
        if owner.check_prompts is CheckPrompts.ERROR:
            raise PromptMismatchError(message + f" (skip.{owner.name}.check_prompts = error)")
        logger.warning("%s; replaying it anyway (set skip.%s.check_prompts to error or off)", message, owner.name)

    def restore_rng(self, meta: dict[str, Any], step: int, path: str) -> None:
        """Set the global generators to the state the entry's call left them in (``restore_rng``).

        An entry recorded without the option replays with a warning (once): its call's random
        state is unknown.

        Raises:
            CorruptEntryError: the recorded state is damaged (counted; nothing was changed).
        """
        owner = self.owner
        if not owner.config.restore_rng:
            return
        recorded = meta.get("rng_state")
        if recorded is None:
            if ("rng",) not in self.warned:
                self.warned.add(("rng",))
                logger.warning("%s: the entry at %s was recorded without restore_rng; replaying it without "
                               "restoring the random state (code drawing random numbers after the call will "
                               "differ from the recording; re-record with action: record)", owner.name, path)
            return
        from stepskip._rng import restore_rng_state

        try:
            skipped = restore_rng_state(recorded, path)
        except CorruptEntryError as err:
            self.report_corrupt(step, path, str(err))
            raise
        for reason in skipped:
            logger.warning("%s: step %d replayed without part of its random state: %s", owner.name, step, reason)

    # ------------------------------------------------------------------ what a read found

    def report_corrupt(self, step: int, path: str, reason: str) -> None:
        """Count and log a damaged entry (regenerated and overwritten, unless the action is ``replay``)."""
        owner = self.owner
        owner.stats.add(corrupt=1)
        if owner.action is SkipAction.REPLAY:
            logger.error("%s corrupt entry for step %d at %s: %s", owner.name, step, path, reason)
        else:
            logger.warning("%s corrupt entry for step %d at %s: %s; it will be regenerated and overwritten",
                           owner.name, step, path, reason)

    def unreadable(self, reason: str) -> UnreadableEntryError:
        """The error of an entry that is intact but cannot be used here (it is kept)."""
        return UnreadableEntryError(f"{self.owner.name}: {reason}")

    def rebind(self, value: Any, prompts: Any) -> None:
        """Copy identity columns (``rebind_keys``) row-wise from the live prompts onto a replayed batch."""
        keys = self.owner.rebind_keys
        target = getattr(value, "non_tensor_batch", None)
        source = getattr(prompts, "non_tensor_batch", None)
        if not keys or not isinstance(target, dict) or not isinstance(source, dict):
            return
        for key in keys:
            if key in target and key in source and len(target[key]) == len(source[key]):
                target[key] = np.array(source[key], copy=True)
            elif key in target and key in source:
                logger.debug("%s: not rebinding %r: %d replayed rows vs %d live rows",
                             self.owner.name, key, len(target[key]), len(source[key]))


def _recycled(size: int) -> memoryview | None:
    """Recycled pages for a big file of an entry read whole (a fresh buffer of its size would fault in
    every page); the page pool is imported only where a decoder that reads buffers asks for it."""
    from stepskip._formats.pages import POOL

    return POOL.buffer(size)


def prompt_digest(prompts: Any, exclude: Any, stepless: bool = False) -> str | None:
    """The digest of a call's prompts (``exclude``: the identity columns; ``stepless``: the columns a
    trainer sets per step too), as an entry records it."""
    from stepskip._fidelity import prompt_digest as digest  # hashes tensors: torch loads with the first dump

    return digest(prompts, exclude, stepless)


def seconds_of(value: Any) -> float:
    """A recorded duration as a float; anything else (a planted string, a NaN) counts as zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        return 0.0
    return float(value)
