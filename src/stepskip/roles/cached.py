"""``CachedRole``: everything a role that keeps its results in a cache shares.

It owns the store, the layout, the format, the counters, the fidelity checks and the bookkeeping
of background dumps; the concrete roles (``rollout``, ``async_rollout``, ``rollout_tq``, stage
roles, custom roles) only say what a call's unit of caching is. Entries are in one of four
states (SPEC §6): *missing*, *present*, *damaged* (regenerated; raised under ``replay``) and
*unreadable* (intact but not decodable here: an error naming the entry and the fix; never
regenerated over or deleted — only ``action: record`` replaces it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from stepskip._dumping.commit import Commit, EntryCommit, Written
from stepskip._dumping.dumper import Dumper
from stepskip._reading.listing import StepListing
from stepskip._reading.reader import EntryReader, prompt_digest, seconds_of
from stepskip._reading.steps import FlatSteps, StepEntries
from stepskip.access import check_writable, describe_store_access_error, is_store_access_error
from stepskip.calls import CURRENT_CALL, call_prompts
from stepskip.config import SkipRoleConfig
from stepskip.entries import (
    FileBytes,
    FormatSpec,
    format_spec,
    legacy_format,
    storage_format,
    unsupported_format_message,
)
from stepskip.errors import (
    CacheMissError,
    CorruptEntryError,
    FingerprintMismatchError,
    PickleRefusedError,
    PromptMismatchError,
    ReplayMissError,
    SkipConfigError,
    TruncatedEntryError,
    UnreadableEntryError,
)
from stepskip.identity import RunIdentity, fingerprint_diff, fingerprint_of
from stepskip.layout import RUN_DIR, Layout, is_url, safe_component
from stepskip.policies import CheckPrompts, MatchN, OnMismatch, SkipAction
from stepskip.resolve import load_candidates
from stepskip.roles.base import BaseSkip, RunContext
from stepskip.stats import RoleStats
from stepskip.store import EntryState, LocalStore, Probe, Tree, check_dump_dir, open_store, settled

__all__ = ["CachedRole", "ALL_ACTIONS", "ROW_WISE_ACTIONS", "VERL_LAYOUT_ROLES"]

logger = logging.getLogger(__name__)

ALL_ACTIONS = [SkipAction.CACHE, SkipAction.REPEAT, SkipAction.RANDOM, SkipAction.REPLAY, SkipAction.RECORD]
#: Roles whose output rows map one to one onto their prompt rows also replay by prompt (``match``).
ROW_WISE_ACTIONS = [*ALL_ACTIONS, SkipAction.MATCH]

#: Roles whose entries live directly in the run directory, as verl lays them out (seed §2.5).
#: Every other role gets ``{run}/{role}/``, so that two roles never read each other's entries.
VERL_LAYOUT_ROLES = frozenset({"rollout", "async_rollout", "rollout_tq"})

#: A step's entry of at most this many bytes is read whole when its hit is decided, and served from
#: what was read (a one-sample entry of the async role: about 20 KB).
HIT_KEEP_BYTES = 64 << 10
#: ``action: match`` reads the hint documents of a run directory once at least this many of its
#: entries are not indexed yet (fewer are read directly: as cheap as the documents' listing).
_HINTED_FROM = 8
#: Hint documents read at most, and the rows they may describe in all (bounds should someone plant many).
_MAX_HINT_DOCUMENTS = 1024
_MAX_HINTED_ROWS = 1 << 25
_MAX_HINT_BYTES = 64 << 20  # hint documents (or digest tables) read in all by one role
#: Entries one ``match`` call may read for what the digest tables say of its prompts, beyond two per
#: distinct prompt (then they are given up: every entry they cover is read directly).
_CANDIDATE_READS = 64
#: The actions whose calls list the run directory: the start-up clean-up's listing is kept for their first call.
_LISTING_ACTIONS = frozenset({SkipAction.REPEAT, SkipAction.RANDOM, SkipAction.MATCH})
#: Key rows one ``match`` call may look at in the digest tables (honest tables file a prompt's key once
#: per entry holding it, the latest first: a call looks at one or two rows per prompt).
_CANDIDATE_SCAN = 1 << 16
_NO_NAMES: frozenset[str] = frozenset()


def _forget_dumps_after_fork() -> None:
    """In a forked child: the parent's queued dumps are not this process's to wait for (no thread
    here finishes them; a lock may have been held at the fork)."""
    for role in list(_ROLES):
        role.dumper.after_fork()
        role.listing.after_fork()
        role._hint_lock, role._index_lock = threading.Lock(), threading.Lock()
        role._bind_lock = threading.Lock()


_ROLES: weakref.WeakSet[CachedRole] = weakref.WeakSet()
os.register_at_fork(after_in_child=_forget_dumps_after_fork)


class CachedRole(BaseSkip):
    """Base of every role that records results to a cache and replays them.

    Subclasses say what one cached unit is; the base does the rest. ``config_class`` must derive
    from :class:`~stepskip.SkipRoleConfig`.
    """

    support_actions = ROW_WISE_ACTIONS
    config_class: ClassVar[type[Any]] = SkipRoleConfig
    #: Entries are V1 inner entries (``{step}/{inner}/``, verl's ``tq_batch.pt``).
    v1: ClassVar[bool] = False

    def __init__(self, local_config: Any, global_config: Any, *, commit: Commit | None = None,
                 entries: StepEntries | None = None) -> None:
        super().__init__(local_config, global_config)
        config = self.local_config
        if not isinstance(config, SkipRoleConfig):
            raise SkipConfigError(
                f"{type(self).__name__}.config_class = {type(config).__qualname__} must derive from "
                "stepskip.SkipRoleConfig: a cached role reads dump_dir, format, verify ... from it"
            )
        self.config: SkipRoleConfig = config
        self.format_spec: FormatSpec = storage_format(config.format, self.v1)
        self.legacy: FormatSpec = legacy_format(self.v1)
        self.allow_pickle = config.allow_pickle
        self.verify = config.verify
        self.async_dump = config.async_dump
        self.seed = config.seed
        self.rebind_keys = list(config.rebind_keys)
        self.check_prompts = config.check_prompts
        self.on_mismatch = config.on_mismatch
        self.stats = RoleStats()
        self.fingerprint: dict[str, Any] = {}
        self._codec: Any = None
        self._layout: Layout | None = None
        self._store: Any = None
        self._bind_lock = threading.Lock()
        #: Reads entries (probe, classify, read, fidelity, rebind); ``entries``: what one step consists of.
        self.reader = EntryReader(self)
        self.entries: StepEntries = entries if entries is not None else FlatSteps(self)
        self.listing = StepListing(lambda: self.store)
        #: The dump pipeline; what a write commits is ``commit`` (flat entries: each by its own write).
        self.dumper = Dumper(self, commit if commit is not None else EntryCommit(self._hint_written),
                             wrote=self._forget_listing)
        _ROLES.add(self)
        self._hint_lock = threading.Lock()
        self._index_lock = threading.Lock()
        self._new_run()

    def _new_run(self) -> None:
        """The state that belongs to the run the role is bound to (what it wrote, indexed and listed),
        empty: at construction, and when a bound role is bound to a run again."""
        self._index: Any = None  # the prompt index of ``action: match``, built on first use
        self._hints_read: set[str] = set()  # run directories whose hint documents (or digest tables) were read
        # the listed entries a digest table covers, not indexed yet: read when a live prompt's key points
        # at them (see _index_candidates)
        self._covered: dict[str, set[str]] = {}  # run directory -> names of the entries covered
        self._tables: list[_Claims] = []  # the digest tables in use
        self._indexed_listing: Any = None  # the listing _match_index last forgot entries by
        # calls of _match_index so far, and run directory -> the one whose call covered its entries: an
        # entry is ranked in the index (ties of one step) by the call that first saw it, then its path, as
        # if every entry were indexed when first listed, in path order
        self._generation = 0
        self._covered_in: dict[str, int] = {}
        self._hints: Any = None  # the HintDocument this role writes (V1 steps; see stepskip.hints), made on first write
        self._table: Any = None  # the TableWriter of this role's digest tables (entries), made on first write
        self._hint_name = ""
        self._source_paths: tuple[Any, frozenset[str]] | None = None  # (listing, its entry paths)
        self.reader.reset()
        self.listing.reset()

    # ------------------------------------------------------------------ lifecycle

    def bind(self, context: RunContext) -> None:
        """Attach to the run: paths from its identity, the store, and (when enabled) a clean-up of
        temporaries that crashed writers left behind. A role bound before (to the run its config
        names, see :meth:`bind_to_config`) is bound to this run instead."""
        if self._layout is not None:
            self._new_run()
        super().bind(context)
        identity = context.identity.with_fingerprint(fingerprint_of(self.global_config, self.config.fingerprint_keys))
        self.fingerprint = dict(identity.fingerprint)
        self._layout = Layout.for_identity(self.dump_dir, identity, subdir=self.layout_subdir())
        self._store = open_store(self._layout.dump_dir, self.config.storage_options)
        if self.enable:
            self.start()

    def bind_to_config(self) -> None:
        """Bind a role used before ``SkipManager.init`` to the run its global config names.

        verl's own tests, and code written against verl's role objects, construct a role with
        ``(local_config, global_config)`` and call it directly. Such a role binds itself on first use
        (the constructor does no I/O) as ``SkipManager.init`` would bind it: the identity read from
        the global config (``trainer.experiment_name``, ``data.gen_batch_size`` ...) and a fresh run
        id. A later :meth:`bind` (``SkipManager.init``'s) replaces this binding.

        Raises:
            RuntimeError: the role was constructed without a global config to name the run.
            SkipConfigError: the config names no usable run (a bad value, a dump dir this process
                cannot use); the role stays unbound.

        Example:
            >>> from stepskip.roles import RolloutSkip
            >>> config = {"trainer": {"experiment_name": "exp", "project_name": "proj"},
            ...           "skip": {"rollout": {"enable": False, "dump_dir": "/tmp/d"}}}
            >>> role = RolloutSkip(config["skip"]["rollout"], config)
            >>> role.step_dump_dir(3)  # bound on first use
            '/tmp/d/exp_proj/GBS0_N0_in0_out0/3'
        """
        with self._bind_lock:
            if self._layout is not None:
                return
            if self.global_config is None:
                raise RuntimeError(f"{type(self).__name__} is not bound to a run yet: construct it with the "
                                   "training config as its global config, or call SkipManager.init first")
            context = RunContext(name=self.name or type(self).__name__, run_id=uuid.uuid4().hex,
                                 identity=RunIdentity.from_config(self.global_config))
            try:
                self.bind(context)
            except BaseException:
                self._layout = self._store = None  # unusable: the next use tries (and says why) again
                raise
            logger.info("%s: used before SkipManager.init: bound to the run %s names (run %s)", self.name,
                        self.layout.project_dir, self.run_id[:12])

    def layout_subdir(self) -> str | None:
        """The directory under the run directory that holds this role's steps (None: the run directory)."""
        return None if self.name in VERL_LAYOUT_ROLES else self.name

    def start(self) -> None:
        """Startup I/O of an enabled role (after :meth:`bind`): a dump dir this process cannot use is
        a :class:`SkipConfigError` now, not a dump failure at every step; stale temporaries go."""
        where = f"skip.{self.name}"  # a stage role's config class is shared: its section says skip.<stage>
        key = f"{where}.dump_dir"
        check_dump_dir(self.dump_dir, self.config.storage_options, key=key, entry_dir=self.layout.project_dir)
        local = isinstance(self.store, LocalStore)
        if local and self.action is not SkipAction.REPLAY:
            check_writable(self.layout.dump_dir, self.layout.project_dir, key=key, fix=f"set {where}.action = replay")
        try:  # on an object store, the first request: credentials and endpoint are tried here
            self.clean_up(self.store.scan(self.layout.project_dir))
        except Exception as err:
            if local or not is_store_access_error(err):
                raise
            raise SkipConfigError(f"{key} = {describe_store_access_error(self.dump_dir, err)}") from err

    def clean_up(self, tree: Tree | None) -> None:
        """Remove what interrupted writers left in this role's entries once it is stale (at start-up).

        Args:
            tree: one recursive listing of the run directory on object stores (:meth:`~stepskip.store.
                FsspecStore.scan`), from which only the entries that may hold a leftover are looked
                at: a bounded number of requests whatever the number of entries; None locally.
        """
        path = self.layout.project_dir
        if tree is None and self.action in _LISTING_ACTIONS and isinstance(self.store, LocalStore):
            self.listing.clean_up(path)  # its listing is kept for the first call
        else:
            self.store.remove_leftovers(path, tree=tree)
        if tree is None:  # a local hint file (table, document) is written by rename: a crashed writer's temporary
            from stepskip.hints import HINTS_DIR

            self.store.remove_leftovers(f"{self.layout.experiment_dir}/{HINTS_DIR}")

    @property
    def layout(self) -> Layout:
        """Every path of this role's cache (a role not bound yet binds itself: :meth:`bind_to_config`)."""
        if self._layout is None:
            self.bind_to_config()
            assert self._layout is not None
        return self._layout

    @property
    def store(self) -> Any:
        """The store holding this role's entries (a role not bound yet binds itself: :meth:`bind_to_config`)."""
        if self._store is None:
            self.bind_to_config()
        return self._store

    @property
    def format(self) -> Any:
        """The codec that writes this role's entries (imported on first use)."""
        if self._codec is None:
            from stepskip.formats import get_format

            self._codec = get_format(self.format_spec.name, compress=str(self.config.compress))
        return self._codec

    # ------------------------------------------------------------------ paths and lookups

    @property
    def project_dump_dir(self) -> str:
        """The directory holding this role's step entries."""
        return self.layout.project_dir

    def step_dump_dir(self, step: int) -> str:
        """The entry directory of ``step``."""
        return self.layout.step_dir(step)

    def listed_steps(self) -> list[int]:
        """Steps that have a directory, and those this run's queued dumps will write (one listing;
        nothing is read or validated): ``repeat`` and ``random`` see a step dumped in the background as
        they would a synchronous dump (validating it waits for it). The listing is reused while the
        directory is unchanged (see :mod:`stepskip._reading.listing`)."""
        listed = self.listing.steps(self.project_dump_dir)
        names = self.dumper.queued_in(self.project_dump_dir)
        if not names:
            return listed
        queued = {step for step in map(Layout.parse_step, names) if step is not None}
        return sorted(queued.union(listed)) if not queued.issubset(listed) else listed

    def _forget_listing(self) -> None:
        """This role wrote (or tried to write) an entry: the next listing is taken afresh."""
        self.listing.wrote()

    def available_steps(self) -> list[int]:
        """Steps with a valid entry, sorted (damaged and unreadable entries and temporaries are left out)."""
        return [step for step in self.listed_steps() if self._present(step)]

    def resolve_load_step(self, step: int) -> int:
        """The step this role's action would load for a call at ``step``; -1 for none.

        ``cache``/``replay``: ``step`` itself. ``repeat``: ``step``, else the largest smaller
        available step, else the smallest larger one (seed §2.3). ``random``: an available step
        drawn reproducibly from ``seed`` and ``step``. ``record``: never loads. Re-resolved on
        every call; only the candidates tried are validated.
        """
        listed = () if self.action in (SkipAction.CACHE, SkipAction.REPLAY) else self.listed_steps()
        for candidate in load_candidates(self.action, step, listed, self.seed):
            if self._present(candidate):
                return candidate
        return -1

    def would_replay(self, step: int) -> bool:
        if step not in self._step_lookup:
            return False
        load_step = self.resolve_load_step(step)
        return load_step != -1 and all(self.reader.servable(p.meta or {}) for p in self._probes(load_step))

    def await_dump(self, path: str) -> None:
        """Wait for this run's queued dump of ``path``, if any (a read of it then finds it written)."""
        if self.dumper.pending:
            self.dumper.await_pending(path)

    def _probe(self, path: str, keep: int = 0) -> Probe:
        return self.reader.probe(path, keep)

    def _probes(self, step: int) -> list[Probe]:
        """The probes of every entry ``step`` consists of."""
        return [probe for _, probe in self.entries.probed(step)]

    def _present(self, step: int) -> bool:
        """True when ``step`` has a complete, usable-looking entry (no data read)."""
        return self.entries.present(step)

    # ------------------------------------------------------------------ the role protocol

    def meet_precondition(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> bool:
        """True when the call at ``step`` is served from the cache.

        Raises:
            UnreadableEntryError: the step's entry is intact but cannot be used here (it is kept).
        """
        action = self.action
        if action is SkipAction.REPLAY:
            return True  # warp_function raises when there is nothing to load
        if action is SkipAction.RECORD:
            hit = False  # every call generates: each is a miss
        elif action is SkipAction.CACHE:
            hit = self._exact_step_usable(step)
        elif action is SkipAction.REPEAT:
            # a damaged exact step is reported and regenerated, as under cache, not passed over for
            # another step in silence (a missing one is passed over: seed §2.3)
            hit = not self._exact_step_damaged(step) and self.resolve_load_step(step) != -1
        else:
            self._refuse_unreadable(step)  # the exact step would be regenerated over: never
            hit = self.resolve_load_step(step) != -1
        if not hit:
            self.stats.add(misses=1)
            logger.info("%s miss: step %d has no usable entry under %s; generating and dumping it",
                        self.name, step, self.project_dump_dir)
        return hit

    def _exact_step_usable(self, step: int) -> bool:
        path = self.step_dump_dir(step)
        # a small entry is read whole by the probe: the hit that follows reads it from there
        probe = self.reader.probe_settled(path, keep=HIT_KEEP_BYTES)
        if probe.state is EntryState.UNREADABLE:
            raise self.reader.unreadable(probe.reason)
        if probe.state is EntryState.DAMAGED:
            self._report_corrupt(step, path, probe.reason)
        if probe.state is EntryState.PRESENT:
            self.reader.keep_probe(path, probe)
        return probe.state is EntryState.PRESENT

    def _exact_step_damaged(self, step: int) -> bool:
        """Whether ``step``'s own entry is damaged (reported when it is): one probe when it is not, a
        second before calling it damaged (it may be mid-replacement). Flat entries only: ``rollout_tq``
        decides its steps in its own :meth:`meet_precondition`.

        Raises:
            UnreadableEntryError: the entry is intact but cannot be used here (it is kept, never regenerated over).
        """
        path = self.step_dump_dir(step)
        probe = self.reader.probe_settled(path)
        if probe.state is EntryState.UNREADABLE:
            raise self.reader.unreadable(probe.reason)
        if probe.state is EntryState.DAMAGED:
            self._report_corrupt(step, path, probe.reason)
        return probe.state is EntryState.DAMAGED

    def _refuse_unreadable(self, step: int) -> None:
        for probe in self._probes(step):
            if probe.state is EntryState.UNREADABLE:
                raise self.reader.unreadable(probe.reason)

    def warp_function(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Load the entry the action resolves for ``step`` and rebind identity columns.

        Raises:
            ReplayMissError: nothing to load (a ``CacheMissError`` and a ``RuntimeError``, as verl's).
            CorruptEntryError: the entry is damaged.
            UnreadableEntryError: the entry is intact but cannot be decoded here, or is a pickle
                while ``allow_pickle`` is false.
        """
        prompts = call_prompts(args, kwargs)
        if self.action in (SkipAction.CACHE, SkipAction.REPLAY):
            # the step itself or nothing: the read checks the entry as a probe would, so it is not
            # probed first (one look at meta.json per hit, not three); an entry found missing or
            # damaged takes the general path below, which looks again and says why
            path = self.step_dump_dir(step)
            self.await_dump(path)
            start = time.perf_counter()
            try:
                value, meta, nbytes = self.reader.read_once(path, step, step, prompts, self.reader.take_probe(path))
            except (ReplayMissError, CorruptEntryError):
                pass
            except CacheMissError:
                self._regenerated()
                raise
            else:
                return self._served(step, step, value, meta, time.perf_counter() - start, nbytes, prompts)
        load_step = self.resolve_load_step(step)
        if load_step == -1 and self.action is not SkipAction.RECORD:
            probe = self.reader.probe_settled(self.step_dump_dir(step))
            if probe.state is EntryState.PRESENT:
                load_step = step  # it appeared, or was being replaced, while we looked
            elif probe.state is EntryState.UNREADABLE:
                raise self.reader.unreadable(probe.reason)
            elif probe.state is EntryState.DAMAGED:
                path = self.step_dump_dir(step)
                self._report_corrupt(step, path, probe.reason)
                raise CorruptEntryError(f"{self.name}: entry for step {step} at {path} is damaged: {probe.reason}")
        if load_step == -1:
            raise ReplayMissError(
                f"{self.name}: no entry for step {step} under {self.project_dump_dir} (action {self.action.value!r}); "
                "record it first with action 'cache' or 'record', or check dump_dir and the run shape "
                "(GBS/N/in/out) in the directory name"
            )
        try:
            value, meta, seconds, nbytes = self.load_entry(load_step, step, prompts=prompts)
        except CacheMissError:
            self._regenerated()
            raise
        return self._served(step, load_step, value, meta, seconds, nbytes, prompts)

    def _regenerated(self) -> None:
        if self.action is not SkipAction.REPLAY:
            self.stats.add(misses=1)  # the call is regenerated

    def _served(self, step: int, load_step: int, value: Any, meta: dict[str, Any], seconds: float, nbytes: int,
                prompts: Any) -> Any:
        """A loaded entry made the call's result: the generators restored, identity columns rebound, counted."""
        try:
            self.restore_rng(meta, step, self.step_dump_dir(load_step))
        except CacheMissError:
            self._regenerated()
            raise
        self.reader.rebind(value, prompts)
        saved = _seconds(meta.get("generation_seconds"))
        self.stats.add(hits=1, load_seconds=seconds, bytes_read=nbytes, saved_seconds=saved)
        logger.info("%s hit: step %d replayed from step %d at %s (%d bytes, %.3fs)",
                    self.name, step, load_step, self.step_dump_dir(load_step), nbytes, seconds)
        return value

    def prepare_data(self, step: int, result: Any, *args: Any, **kwargs: Any) -> None:
        """Snapshot ``result`` and write it as the entry of ``step`` (in the background with ``async_dump``).

        Failures are logged and counted in ``dump_failures``; they never reach the caller.
        """
        rng = self.capture_rng()  # first: nothing after the call may move the generators before they are saved
        path = self.step_dump_dir(step)
        info = CURRENT_CALL.get()
        seconds = info.generation_seconds if info is not None else None
        prompts = call_prompts(args, kwargs)

        def meta() -> dict[str, Any]:
            from stepskip.fidelity import shared_object_digests

            with shared_object_digests():  # both digests hash the same prompt objects: each is hashed once
                row_prompts = self._row_prompts(prompts, result)
                digest = prompt_digest(prompts, self.rebind_keys)
            return self.dumper.entry_meta(step, seconds, prompt_digest=digest, row_prompts=row_prompts, **rng)

        prepared = self.dumper.snapshot(step, path, result, copy=self.async_dump, meta=meta)
        if prepared is not None:
            self.dumper.submit(path, step, *prepared)

    def capture_rng(self) -> dict[str, Any]:
        """``{"rng_state": ...}`` for an entry's meta when ``restore_rng`` is on (else empty); called
        right after the recorded call returns."""
        if not self.config.restore_rng:
            return {}
        from stepskip.rng import capture_rng_state

        return {"rng_state": capture_rng_state()}

    def restore_rng(self, meta: dict[str, Any], step: int, path: str) -> None:
        """Set the global generators to the state the entry's call left them in (``restore_rng``): see
        :meth:`stepskip._reading.reader.EntryReader.restore_rng`."""
        self.reader.restore_rng(meta, step, path)

    def _row_prompts(self, prompts: Any, result: Any) -> list[str] | None:
        """One prompt digest per result row, for roles that ``match``: what the prompt index is built of."""
        if not self.row_wise or prompts is None:
            return None
        from stepskip.fidelity import prompt_row_digests
        from stepskip.matching import batch_rows

        rows = batch_rows(result)
        if rows < 0 or batch_rows(prompts) != rows:
            return None  # not row-aligned with its prompts: this entry cannot serve prompt groups
        try:
            return prompt_row_digests(prompts, self.rebind_keys)
        except (TypeError, ValueError):
            return None

    # ------------------------------------------------------------------ action: match

    @property
    def row_wise(self) -> bool:
        """Output rows map one to one onto prompt rows (stage roles say so with ``row_wise: true``)."""
        return SkipAction.MATCH in self.support_actions and bool(getattr(self.config, "row_wise", True))

    def match_split(self, step: int, prompts: Any) -> Any:
        """Divide the live batch into prompt groups recorded anywhere in this run and groups to generate.

        The entries holding the recorded groups are read here, before anything is generated: an entry
        that turns out damaged — unreadable bytes, or rows that disagree with its ``row_prompts`` —
        is counted corrupt, dropped from the prompt index (never deleted) and its groups are generated;
        one replaced or removed since it was indexed just has its groups generated.

        Raises:
            SkipConfigError: the prompts are not a batch of rows (``match`` needs DataProto-like or
                TensorDict prompts).
        """
        from stepskip.fidelity import prompt_row_digests
        from stepskip.matching import MatchSplit, group_rows

        try:
            digests = prompt_row_digests(prompts, self.rebind_keys)
        except ValueError as err:
            raise SkipConfigError(f"skip.{self.name}.action = 'match': {err}") from err
        groups = group_rows(digests)
        index = self._match_index()
        self._index_candidates(index, list(groups))
        strict = self.config.match_n is MatchN.STRICT
        found: dict[int, tuple[str, int]] = {}
        missing: list[int] = []
        sources: dict[str, int] = {}
        for digest, rows in groups.items():
            where = index.groups.get(digest)
            if where is None or (strict and len(where[1]) != len(rows)):
                missing.extend(rows)
                continue
            path, recorded_rows = where
            sources[path] = sources.get(path, 0) + 1
            for session, row in enumerate(rows):  # a different sample count cycles, as the V1 remap does
                found[row] = (path, recorded_rows[session % len(recorded_rows)])
        damaged: list[str] = []
        loaded = self._load_found(step, found, digests, damaged)  # an entry that failed: its groups are generated
        return MatchSplit(digests=digests, found=found, missing_rows=missing, sources=sources).keeping(
            loaded, prompts, damaged)

    def _load_found(self, step: int, found: dict[int, tuple[str, int]], digests: list[str],
                    damaged: list[str]) -> dict[str, tuple[Any, list[int], dict[str, Any], int]]:
        """Read the recorded rows ``found`` names: entry -> ``(those rows, their recorded indices, meta, bytes)``.

        An entry is left out (its groups are then generated) when it cannot be read, when its data
        does not hold the rows its ``row_prompts`` describe (damage: counted), or when the rows no
        longer record the prompts they were indexed for (replaced since: not damage). Entries
        found damaged are appended to ``damaged``.
        """
        from stepskip.matching import join_problem, rows_unlike_prompts, select_batch_rows

        needed: dict[str, dict[int, str]] = {}  # entry -> recorded row -> the digest it must record
        for live_row in sorted(found):
            path, recorded_row = found[live_row]
            needed.setdefault(path, {})[recorded_row] = digests[live_row]
        loaded: dict[str, tuple[Any, list[int], dict[str, Any], int]] = {}
        dropped: list[str] = []
        for path, wanted in needed.items():
            try:
                value, meta, _, size = self._read_entry(path, step, -1)
            except UnreadableEntryError:
                raise  # intact but not readable here: said, never regenerated over
            except CacheMissError as err:  # damaged (counted by the read), vanished, of other settings now
                logger.warning("%s match: %s; generating its %d prompt groups", self.name, err,
                               len(set(wanted.values())))
                if isinstance(err, CorruptEntryError):
                    damaged.append(path)
                dropped.append(path)
                continue
            recorded = meta.get("row_prompts")
            problem = rows_unlike_prompts(value, recorded)
            if problem is not None or not isinstance(recorded, list):  # (a list whenever problem is None)
                self._report_corrupt(step, path, str(problem))
                damaged.append(path)
                dropped.append(path)
                continue
            if any(row >= len(recorded) or recorded[row] != digest for row, digest in wanted.items()):
                logger.info("%s match: %s was replaced since it was indexed; generating its prompt groups",
                            self.name, path)
                dropped.append(path)
                continue
            indices = list(wanted)
            try:  # decoding made a consistent batch (Batch and DataProto check their columns); others may not
                loaded[path] = (select_batch_rows(value, indices), indices, meta, size)
            except Exception as err:
                self._report_corrupt(step, path, f"its rows cannot be selected ({type(err).__name__}: {err})")
                damaged.append(path)
                dropped.append(path)
        # entries that cannot be joined with the others would fail after generation: drop them now
        # (the ones that agree with the entry serving the most rows stay)
        if len(loaded) > 1:
            reference = max(loaded, key=lambda p: len(loaded[p][1]))
            for path in [p for p in loaded if p != reference]:
                problem = join_problem([loaded[reference][0], loaded[path][0]])
                if problem is not None:
                    self._report_corrupt(step, path, problem)
                    damaged.append(path)
                    dropped.append(path)
                    del loaded[path]
        if dropped:
            with self._index_lock:
                if self._index is not None:
                    for path in dropped:
                        self._index.forget(path)
        return loaded

    def _match_index(self) -> Any:
        """The prompt index, refreshed from entries it has not seen (one listing per run directory).

        It spans every run directory of this experiment whose prompt and response lengths are this
        run's: a run with another batch size or sample count (``GBS``/``N``) still finds the prompts
        recorded by the others. Only entries this role could replay are indexed. The first time a
        run directory has many entries to index, the writers' digest tables are read instead
        (:meth:`_read_tables`): the entries they cover are indexed only once a live prompt points at
        them (:meth:`_index_candidates`); every other entry is indexed from its ``meta.json``. What a
        call costs beyond the listing is set operations over entry names, not a step per entry.
        """
        from stepskip.matching import PromptIndex

        with self._index_lock:
            if self._index is None:
                self._index = PromptIndex()
            index = self._index
            self._generation += 1
            own = self.project_dump_dir
            dumper = self.dumper
            with dumper.lock:  # this run's queued dumps count: indexing one waits for it
                queued = {p.rsplit("/", 1)[1] for p in dumper.pending if p.rsplit("/", 1)[0] == own}
            listing = self._match_listing()
            if queued:  # indexed from what they hold once written, never from a table's earlier claim
                listing = {**listing, own: listing.get(own, frozenset()) | queued}
                self._covered.get(own, set()).difference_update(queued)
            if listing is not self._indexed_listing:  # listed afresh: what is no longer there is forgotten
                for project, names in list(index.by_dir.items()):
                    for name in names - listing.get(project, frozenset()):
                        index.forget(f"{project}/{name}")
                for project, names in self._covered.items():
                    names &= listing.get(project, frozenset())
                self._indexed_listing = listing
            fresh: dict[str, set[str]] = {}  # run directory -> names of entries neither indexed nor covered
            for project, names in listing.items():
                new = names.difference(index.by_dir.get(project, ()), self._covered.get(project, ()))
                if new:
                    fresh[project] = set(new)
            if sum(len(names) for names in fresh.values()) >= _HINTED_FROM:
                self._read_tables(index, fresh, queued)
            for path in sorted(f"{project}/{name}" for project, names in fresh.items() for name in names):
                self._index_from_meta(index, path)
            return index

    def _index_from_meta(self, index: Any, path: str, probe: Probe | None = None, generation: int = 0) -> bool:
        """Index the entry at ``path`` from its ``meta.json`` (probed here unless given); False when it
        cannot serve prompt groups (not present, not servable here, no row digests). ``generation``: the
        call of :meth:`_match_index` that first saw it (this one by default), which ranks it in a tie."""
        probe = self.reader.probe(path) if probe is None else probe
        meta = probe.meta or {}
        digests = meta.get("row_prompts")
        if (probe.state is EntryState.PRESENT and self.reader.servable(meta) and isinstance(digests, list)
                and all(isinstance(d, str) for d in digests)):
            index.add(path, _step_of(meta), digests, (generation or self._generation, path))
            return True
        index.forget(path)
        return False

    def _index_files(self, wanted: AbstractSet[str], described_by: Callable[[str], tuple[str, str | None] | None],
                     kind: str) -> tuple[str, list[tuple[str, str]]]:
        """The files of this experiment's :data:`stepskip.hints.HINTS_DIR` that ``described_by`` names as
        this role's and that describe one of the run directories ``wanted``: the directory, and
        ``(file name, run directory)`` in name order, at most :data:`_MAX_HINT_DOCUMENTS` of them (the
        others are left with a warning: their entries are read directly). ``kind`` names them in it."""
        from stepskip.hints import HINTS_DIR

        layout = self.layout
        subdir = safe_component(layout.subdir) if layout.subdir else None
        where = f"{layout.experiment_dir}/{HINTS_DIR}"
        names: list[tuple[str, str]] = []
        for name in sorted(self.store.list_dir(where)):
            described = described_by(name)
            if described is None or described[1] != subdir or RUN_DIR.match(described[0]) is None:
                continue  # not a writer's file, or one of another role
            project = f"{layout.experiment_dir}/{described[0]}" + (f"/{subdir}" if subdir else "")
            if project in wanted:
                names.append((name, project))
        if len(names) > _MAX_HINT_DOCUMENTS:
            logger.warning("%s match: %s holds %d %s for these run directories; reading %d of them (the entries "
                           "of the others are read directly)", self.name, where, len(names), kind, _MAX_HINT_DOCUMENTS)
            names = names[:_MAX_HINT_DOCUMENTS]
        return where, names

    def _read_index_files(self, where: str, names: list[tuple[str, str]], max_each: int,
                          kind: str) -> Iterator[tuple[str, str, bytes]]:
        """``(run directory, path, bytes)`` of each of ``names`` (from :meth:`_index_files`) in turn, each
        read up to ``max_each`` bytes and :data:`_MAX_HINT_BYTES` in all; one that cannot be read (a
        link, a directory, too large) is passed over with a warning naming it a ``kind``, one gone
        since listed silently."""
        read_left = _MAX_HINT_BYTES
        for name, project in names:
            document = f"{where}/{name}"
            if read_left <= 0:
                logger.warning("%s match: %d bytes of %ss read; the entries of the others are read directly",
                               self.name, _MAX_HINT_BYTES, kind)
                return
            try:
                raw = self.store.read_small(document, min(max_each, read_left))
            except CorruptEntryError as err:
                logger.warning("%s match: ignoring the %s %s: %s", self.name, kind, document, err)
                continue
            if raw is None:
                continue  # replaced or removed since listed
            read_left -= len(raw)
            yield project, document, raw

    def _read_tables(self, index: Any, fresh: dict[str, set[str]], queued: set[str]) -> None:
        """Read the digest tables of the run directories of ``fresh`` not read before (:mod:`stepskip.hints`):
        one listing and one bounded read per table, at most :data:`_MAX_HINT_BYTES` in all. The entries
        a table covers (listed, not indexed, not this run's ``queued`` dumps) are taken out of ``fresh``
        and covered: indexed once a live prompt points at them.

        A table is used only once what it files under its two lowest such entries of the version it
        names (identity; entries no other table names first) is exactly the keys of their
        ``meta.json``: a planted or damaged table is ignored with a warning, and its entries read
        directly. The entries checked are indexed.
        """
        from stepskip.hints import TABLE_MAX_BYTES, parse_table, table_of

        wanted = set(fresh) - self._hints_read
        if not wanted:
            return
        self._hints_read |= wanted
        where, names = self._index_files(wanted, table_of, "digest tables")
        budget = _MAX_HINTED_ROWS  # keys all tables may hold: what they cost in memory stays bounded
        parsed: list[_Claims] = []  # every table read, before any is checked
        for project, document, raw in self._read_index_files(where, names, TABLE_MAX_BYTES, "digest table"):
            table, problem = parse_table(raw, document, _MAX_HINTED_ROWS)
            if table is None:
                logger.warning("%s match: ignoring the digest table %s: %s; the entries it describes are read "
                               "directly", self.name, document, problem)
                continue
            claims = _Claims(table, project, self._generation)
            open_names = fresh.get(project, set())
            if project == self.project_dump_dir:
                open_names = open_names - queued
            # the entries it names that are listed and not indexed (an entry two tables name is covered
            # by both: the later writer's describes what it holds now)
            claims.covered = open_names.intersection(map(str, table.names.tolist()))
            parsed.append(claims)
        tables_of: dict[str, list[_Claims]] = {}
        for claims in parsed:
            tables_of.setdefault(claims.project, []).append(claims)
        for claims in parsed:
            project = claims.project
            if len(claims.table.keys) > budget:
                problem = f"it files {len(claims.table.keys)} digest keys, more than the {budget} left to read"
            else:
                # checked first on entries no other table names: one another run recorded again is named by
                # its table too, and holds another version than this one describes (a run directory
                # with one table, the usual case, has none: no pass over its names)
                others = [other.covered for other in tables_of[project] if other is not claims]
                shared = claims.covered.intersection(*others) if len(others) == 1 else \
                    {n for n in claims.covered if any(n in other for other in others)} if others else _NO_NAMES
                problem = self._table_problem(index, claims, shared)
            claims.covered -= index.by_dir.get(project, set())  # (the entries its check read)
            if not problem:
                budget -= len(claims.table.keys)
                self._tables.append(claims)
                self._covered.setdefault(project, set()).update(claims.covered)
                self._covered_in[project] = self._generation
            else:
                logger.warning("%s match: ignoring the digest table %s: %s; the entries it describes are read "
                               "directly", self.name, claims.table.document, problem)
        for project, left in fresh.items():  # what is left is read directly
            left.difference_update(self._covered.get(project, ()), index.by_dir.get(project, ()))

    def _table_problem(self, index: Any, claims: _Claims, shared: AbstractSet[str] = _NO_NAMES) -> str:
        """Why the table of ``claims`` is not to be used ("" when it is): what it files under its two
        lowest covered entries of the version it names — those not in ``shared`` (named by other tables
        too) first — must be the keys of their ``meta.json`` exactly. Entries rewritten since (another
        identity) are passed over, four looked at in all; each entry looked at is indexed from what was
        read."""
        from stepskip.hints import digest_keys, identity_key

        table, project = claims.table, claims.project
        confirmed, looked = 0, 0
        by_dir = index.by_dir.get(project, set())
        # the four lowest of each kind are enough: at most four are looked at (the table lists its entries
        # in ascending order: walked from the lowest, it usually stops after four)
        lone: list[int] = []
        again: list[int] = []
        for step in table.names.tolist():
            name = str(step)
            if name not in claims.covered or name in by_dir:
                continue
            kind = again if name in shared else lone
            if len(kind) < 4:
                kind.append(step)
            if len(lone) == 4 and (len(again) == 4 or len(again) == len(shared)):
                break
        for step in lone + again:
            if confirmed == 2 or looked == 4:
                break
            if str(step) in index.by_dir.get(project, ()):
                continue  # (checked with another table)
            entry = int(np.searchsorted(table.names, step))
            looked += 1
            path = f"{project}/{step}"
            probe = self.reader.probe(path)
            self._index_from_meta(index, path, probe)
            meta = probe.meta or {}
            digests = meta.get("row_prompts")
            if probe.state is not EntryState.PRESENT or identity_key(meta) != int(table.identities[entry]) \
                    or not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
                continue  # gone, damaged or rewritten since: no evidence either way
            if not np.array_equal(digest_keys(digests), table.keys_of(entry)):
                return f"it describes {path} otherwise than its meta.json (checked before use)"
            confirmed += 1
        if confirmed < min(2, len(claims.covered)):
            return f"none of the {looked} entries it was checked on holds the version it describes"
        return ""

    def _index_candidates(self, index: Any, digests: list[str]) -> None:
        """Index, from their ``meta.json``, the entries the digest tables say hold the live ``digests``
        (distinct) and that could win them: for each digest the latest step first, and only while a
        table names an entry that would beat the one the index already serves it from (a later step,
        or the same step ranked higher: :meth:`_index_from_meta`), as if every entry were indexed. A
        key two digests share costs one more read.

        A table whose claimed entry, of the version it names, holds no such key is ignored from then
        on (the entries only it covers are read directly). More than :data:`_CANDIDATE_READS`
        ``+ 2 x digests`` reads in one call (tables that keep naming entries that hold nothing, or were
        rewritten since) end the use of tables: every entry they cover is read directly, as without them.
        """
        if not self._tables or not digests:
            return
        from stepskip.hints import digest_key

        with self._index_lock:
            keys = np.fromiter((digest_key(d) for d in digests), dtype=np.uint64, count=len(digests))
            spans = [(claims, np.searchsorted(claims.table.keys, keys, "left"),
                      np.searchsorted(claims.table.keys, keys, "right")) for claims in self._tables]
            hits = sorted({int(j) for _, lo, hi in spans for j in np.flatnonzero(hi > lo)})
            allowed = reads_left = _CANDIDATE_READS + 2 * len(digests)
            scan = [_CANDIDATE_SCAN]  # key rows looked at in all (a planted table may file a key under many)
            for j in hits:
                digest, key = digests[j], int(keys[j])
                heads = {id(claims): int(lo[j]) for claims, lo, _ in spans}
                while True:
                    where = index.groups.get(digest)
                    best = index.key_of(where[0])[:2] if where is not None else (-1,)
                    pick: tuple[tuple[int, tuple[int, str]], _Claims, int, int] | None = None
                    for claims, _, hi in spans:
                        covered = self._covered.get(claims.project, _NO_NAMES)
                        found = claims.first_covered(heads, int(hi[j]), best, covered, scan) if claims.alive else None
                        # the one that would win once indexed (the latest step, then the rank the index
                        # breaks ties by); one that would not beat the entry indexed already is never read
                        if found is not None and (pick is None or found[0] > pick[0]):
                            pick = found
                    if scan[0] < 0 or (pick is not None and reads_left == 0):  # past a cap
                        logger.warning("%s match: the digest tables named more than %d entries (or filed more "
                                       "than %d keys) for %d prompts without serving them; reading the entries "
                                       "they cover directly", self.name, allowed, _CANDIDATE_SCAN, len(digests))
                        self._drop_tables(index, list(self._tables))
                        return
                    if pick is None:
                        break
                    reads_left -= 1
                    self._read_candidate(index, pick[1], pick[2], pick[3], key)

    def _read_candidate(self, index: Any, claims: _Claims, entry: int, step: int, key: int) -> None:
        """Index the entry of ``step`` from its ``meta.json``; ``claims`` says it holds ``key`` (as its
        ``entry``). The table is ignored from then on when that version of the entry holds no such key."""
        from stepskip.hints import digest_key, identity_key

        path = f"{claims.project}/{step}"
        probe = self.reader.probe(path)
        self._covered.get(claims.project, set()).discard(str(step))
        self._index_from_meta(index, path, probe, claims.generation)
        meta = probe.meta or {}
        if probe.state is not EntryState.PRESENT or identity_key(meta) != int(claims.table.identities[entry]):
            logger.debug("%s match: %s changed since its digest table was written; indexed from its meta.json",
                         self.name, path)
            return
        digests = meta.get("row_prompts")
        if isinstance(digests, list) and any(isinstance(d, str) and digest_key(d) == key for d in digests):
            return  # the prompt looked for, or one sharing its key
        logger.warning("%s match: the digest table %s describes %s otherwise than its meta.json; ignoring that "
                       "table (the entries it covers are read directly)", self.name, claims.table.document, path)
        self._drop_tables(index, [claims])

    def _drop_tables(self, index: Any, dropped: list[_Claims]) -> None:
        """Stop using the tables of ``dropped``: the entries no other table covers are indexed from their
        ``meta.json`` now (the direct path, one read per entry)."""
        for claims in dropped:
            claims.alive = False
        self._tables = [claims for claims in self._tables if claims.alive]
        orphans: list[tuple[str, int]] = []
        for project in {claims.project for claims in dropped}:
            covered = self._covered.get(project, set())
            kept = covered & set().union(*[c.covered for c in self._tables if c.project == project])
            orphans.extend((f"{project}/{name}", self._covered_in.get(project, 0)) for name in covered - kept)
            self._covered[project] = kept
        for path, generation in sorted(orphans):
            self._index_from_meta(index, path, generation=generation)

    def _read_hints(self, projects: set[str], listed: set[str]) -> dict[str, Any]:
        """Entry path -> its hint, for the ``listed`` paths, from the hint documents of ``projects`` not
        read before (:mod:`stepskip.hints`): one listing per run directory and one bounded read per
        document, at most :data:`_MAX_HINT_BYTES` read in all.

        A document is used only when the hints it holds for the first two listed entries match those
        entries' ``meta.json`` (a planted or stale document, or one from a writer whose clock is off,
        is ignored with a warning: its entries are read directly). Two documents that say different
        things of one entry both lose that entry: its ``meta.json`` is read instead.
        """
        from stepskip.hints import HINTS_MAX_BYTES, document_of, parse_hints, rows_of

        out: dict[str, Any] = {}
        disputed: set[str] = set()
        wanted = projects - self._hints_read
        if not wanted:
            return out
        self._hints_read |= wanted
        where, names = self._index_files(wanted, document_of, "hint documents")
        budget = _MAX_HINTED_ROWS  # rows all documents may describe: what they cost in memory stays bounded
        for project, document, raw in self._read_index_files(where, names, HINTS_MAX_BYTES, "hint document"):
            hints, problem = parse_hints(raw, document, budget)
            mine = {f"{project}/{entry}": hint for entry, hint in hints.items() if f"{project}/{entry}" in listed}
            del hints  # only the hints of listed entries are kept: what a document costs stays bounded by them
            if not problem:
                sample = sorted(mine, key=lambda path: (len(path), path))[:2]  # its two lowest steps
                if not all(self._hint_holds(path, mine[path]) for path in sample):
                    problem = f"it describes {' or '.join(sample)} otherwise than its meta.json (checked before use)"
            if problem:
                logger.warning("%s match: ignoring the hint document %s: %s; the entries it describes are "
                               "read directly", self.name, document, problem)
                continue
            budget -= rows_of(mine)
            for path, hint in mine.items():
                current = out.get(path)
                if current is not None and current != dataclasses.replace(hint, document=current.document):
                    disputed.add(path)  # never decided by a writer's own clock: the entry itself is read
                out.setdefault(path, hint)
        for path in disputed:
            out.pop(path, None)
        return out

    def _hint_holds(self, path: str, hint: Any) -> bool:
        """Whether ``hint`` says what the entry at ``path`` holds now (its identity, step and digests)."""
        probe = self.reader.probe(path)
        meta = probe.meta or {}
        return (probe.state is EntryState.PRESENT and hint.describes(meta) and _step_of(meta) == hint.step
                and meta.get("row_prompts") == hint.digests)

    def _match_sources(self) -> frozenset[str]:
        """Every entry directory of this role in the run directories :meth:`_match_index` spans."""
        listing = self._match_listing()
        cached = self._source_paths
        if cached is None or cached[0] is not listing:
            paths = frozenset(f"{project}/{name}" for project, names in listing.items() for name in names)
            self._source_paths = cached = (listing, paths)
        return cached[1]

    def _match_listing(self) -> dict[str, frozenset[str]]:
        """Run directory (with this role's subdirectory) -> the names of its step entries, for every run
        directory :meth:`_match_index` spans (reused while unchanged: :meth:`StepListing.runs`)."""
        return self.listing.runs(self.layout)

    def match_merge(self, step: int, split: Any, prompts: Any, generated: Any) -> Any:
        """The live batch in live row order: recorded rows for the found groups, ``generated`` for the rest.

        Records what was generated (the live batch as the step's entry, or appended to the entry the
        step already has, so that no recorded group is lost).
        """
        from stepskip.matching import concat_batches, select_batch_rows

        start = time.perf_counter()
        sources: list[Any] = []
        offsets: dict[str, tuple[int, dict[int, int]]] = {}  # entry -> (its first row in sources, row map)
        nbytes, saved, base = 0, 0.0, 0
        for path, (selected, rows, meta, size) in split.loaded.items():  # match_split read every found entry
            nbytes += size
            recorded_rows = len(meta.get("row_prompts") or ()) or len(rows)
            saved += _seconds(meta.get("generation_seconds")) * len(rows) / recorded_rows
            sources.append(selected)
            offsets[path] = (base, {row: i for i, row in enumerate(rows)})
            base += len(rows)
        if not split.found:
            merged = generated
        else:
            generated_at = {row: base + i for i, row in enumerate(split.missing_rows)}
            order = []
            for live_row in range(len(split.digests)):
                if live_row in split.found:
                    path, recorded_row = split.found[live_row]
                    first, positions = offsets[path]
                    order.append(first + positions[recorded_row])
                else:
                    order.append(generated_at[live_row])
            if generated is not None:
                sources.append(generated)
            merged = select_batch_rows(concat_batches(sources), order)
            self.reader.rebind(merged, prompts)
        replayed = len(split.found)
        self.stats.add(rows_replayed=replayed, rows_generated=len(split.missing_rows), bytes_read=nbytes,
                       load_seconds=time.perf_counter() - start if split.found else 0.0, saved_seconds=saved,
                       hits=0 if split.missing_rows else 1, misses=1 if split.missing_rows else 0)
        if split.found:
            origin = ", ".join(f"{n} from {self._short(path)}" for path, n in sorted(split.sources.items()))
            logger.info("%s match: step %d replayed %d of %d rows (%d prompt groups: %s); %d rows generated",
                        self.name, step, replayed, len(split.digests), sum(split.sources.values()), origin,
                        len(split.missing_rows))
        if split.missing_rows:
            self._record_match(step, split, prompts, merged, generated)
        return merged

    def match_rejoin(self, step: int, split: Any, prompts: Any, generated: Any
                     ) -> tuple[Any, list[int], Any] | None:
        """After generation: drop the recorded entries whose rows cannot be joined with ``generated``.

        An entry of other columns, dtypes or trailing shapes than the live rows (a crafted entry, or
        one another version recorded) is counted corrupt and forgotten by the index; its groups must
        then be generated as well, so that the live generation is never lost to a failed join.

        Returns:
            None when every loaded entry joins; else ``(the split without those entries, the live
            rows they were to serve, those rows' prompts)``: call the function with those prompts and
            pass its result to :meth:`match_regenerated`.
        """
        from stepskip.matching import join_problem, select_batch_rows

        if not split.found or generated is None or not split.loaded:
            return None
        bad: list[str] = []
        for path, (selected, _, _, _) in split.loaded.items():
            problem = join_problem([generated, selected])
            if problem is not None:
                self._report_corrupt(step, path, f"{problem} (the live rows')")
                bad.append(path)
        if not bad:
            return None
        with self._index_lock:
            if self._index is not None:
                for path in bad:
                    self._index.forget(path)
        redo = sorted(row for row, (path, _) in split.found.items() if path in bad)
        logger.warning("%s match: step %d generates %d more rows: their recorded entries do not join the live "
                       "rows", self.name, step, len(redo))
        narrowed = split.keeping({p: v for p, v in split.loaded.items() if p not in bad}, prompts, bad)
        return narrowed, redo, select_batch_rows(prompts, redo)

    def match_regenerated(self, split: Any, narrowed: Any, redo: list[int], generated: Any, regenerated: Any) -> Any:
        """The rows of ``narrowed.missing_rows`` in order, from the first generation and the second.

        Args:
            split: the split ``generated`` was made for (rows ``split.missing_rows``).
            narrowed: the split :meth:`match_rejoin` returned for it; ``redo``: the rows it added.
            generated: the first call's rows; ``regenerated``: the rows of ``redo``, in order.

        Returns:
            One batch of the generated rows, in the order of ``narrowed.missing_rows``.
        """
        from stepskip.matching import concat_batches, select_batch_rows

        at = {row: i for i, row in enumerate(split.missing_rows)}
        at.update({row: len(split.missing_rows) + i for i, row in enumerate(redo)})
        return select_batch_rows(concat_batches([generated, regenerated]), [at[row] for row in narrowed.missing_rows])

    def _record_match(self, step: int, split: Any, prompts: Any, merged: Any, generated: Any) -> None:
        from stepskip.fidelity import prompt_row_digests
        from stepskip.matching import concat_batches, join_problem, rows_unlike_prompts, select_batch_rows

        path = self.step_dump_dir(step)
        info = CURRENT_CALL.get()
        seconds = info.generation_seconds if info is not None else None
        to_write, digests = merged, list(split.digests)
        # the step recorded other prompts before: keep them (unless this call found that entry damaged)
        if path not in split.damaged and self.reader.probe(path).state is EntryState.PRESENT:
            try:
                existing, meta, _, _ = self.load_entry(step)
                recorded = meta.get("row_prompts")
                problem = rows_unlike_prompts(existing, recorded) or join_problem([generated, existing])
                if isinstance(recorded, list) and problem is not None:
                    self._report_corrupt(step, path, problem)  # the live rows are written alone
                elif isinstance(recorded, list):
                    subset = select_batch_rows(prompts, split.missing_rows) if split.found else prompts
                    to_write = concat_batches([existing, generated])
                    digests = list(recorded) + prompt_row_digests(subset, self.rebind_keys)
            except UnreadableEntryError:
                raise  # intact but not readable here: never regenerated over
            except CacheMissError as err:  # damaged (counted) or vanished: the live batch replaces it
                logger.warning("%s match: step %d's entry is not kept (%s); writing this call's rows", self.name,
                               step, err)
        prepared = self.dumper.snapshot(step, path, to_write, copy=self.async_dump,
                                        meta=lambda: self.dumper.entry_meta(step, seconds, row_prompts=digests))
        if prepared is not None:
            self.dumper.submit(path, step, *prepared)
        with self._index_lock:
            if self._index is not None:
                self._index.forget(path)  # re-read from the entry once it is written
            self._covered.get(self.project_dump_dir, set()).discard(path.rpartition("/")[2])

    def _short(self, path: str) -> str:
        """``step N`` for an entry of this run directory, ``{run}/step N`` for one of another."""
        run_dir, _, step = path.rpartition("/")
        return f"step {step}" if run_dir == self.project_dump_dir else f"{run_dir.rsplit('/', 1)[-1]} step {step}"

    def _hint_written(self, written: Sequence[Written]) -> None:
        """Describe the entries just ``written`` in this writer's digest table and
        rewrite it once (:mod:`stepskip.hints`); a table that grows past ``TABLE_ROLL_BYTES`` is written
        as it was and the next one starts. A failure is logged, never raised (the dump boundary)."""
        if self.v1 or not self.row_wise:
            return
        records = []
        for entry in written:
            parent, _, name = entry.path.rpartition("/")
            if parent == self.project_dump_dir and isinstance(entry.meta.get("row_prompts"), list):
                records.append((name, entry.meta))
        if not records:
            return
        from stepskip.hints import TableWriter, table_name

        with self._hint_lock:
            try:
                if self._table is None:
                    self._table = TableWriter()
                for token, data in self._table.add(records):
                    self._put_hint_file(table_name, token, data)
            except Exception as err:  # a hint is an optimisation: the entries are written, the run goes on
                logger.warning("%s: could not write the digest table of %s: %s: %s", self.name,
                               ", ".join(name for name, _ in records), type(err).__name__, err)

    def _add_hints(self, records: list[tuple[str, Callable[[Any], bool]]]) -> None:
        """Add ``records`` (entry name, a function adding it to a document) to this writer's document and
        write it once; a document that grows past ``HINTS_ROLL_BYTES`` is written as it was and the
        next one starts. A failure is logged, never raised (the dump boundary)."""
        if not records:
            return
        from stepskip.hints import HINTS_DIR, HINTS_ROLL_BYTES, HintDocument, new_writer_token

        with self._hint_lock:
            try:
                changed = False
                for name, add in records:
                    if self._hints is None:
                        self._hints, self._hint_name = HintDocument(self.run_id, self.name), new_writer_token()
                    if not add(self._hints):
                        continue
                    changed = True
                    if len(self._hints.entries) > 1 and self._hints.size > HINTS_ROLL_BYTES:
                        # the current document is full: written as it was, the next one starts with this entry
                        self._hints.remove(name)
                        self._put_hints(HINTS_DIR)
                        stem, _, shard = self._hint_name.partition("-")
                        self._hints = HintDocument(self.run_id, self.name)
                        add(self._hints)
                        self._hint_name = f"{stem}-{int(shard or 0) + 1}"
                if changed:
                    self._put_hints(HINTS_DIR)
            except Exception as err:  # a hint is an optimisation: the entries are written, the run goes on
                logger.warning("%s: could not write the prompt hints of %s: %s: %s", self.name,
                               ", ".join(name for name, _ in records), type(err).__name__, err)

    def _put_hints(self, hints_dir: str) -> None:
        from stepskip.hints import document_name

        self._put_hint_file(document_name, self._hint_name, self._hints.to_bytes(), hints_dir)

    def _put_hint_file(self, naming: Callable[[str, str | None, str], str], token: str, data: bytes,
                       hints_dir: str = "") -> None:
        """Write one of this writer's hint documents or digest tables (named by ``naming`` for ``token``) atomically."""
        from stepskip.hints import HINTS_DIR

        layout = self.layout
        name = naming(layout.run_name, safe_component(layout.subdir) if layout.subdir else None, token)
        self.store.put_small(f"{layout.experiment_dir}/{hints_dir or HINTS_DIR}/{name}", data)

    # ------------------------------------------------------------------ loading

    def load_entry(self, load_step: int, step: int | None = None,
                   prompts: Any = None) -> tuple[Any, dict[str, Any], float, int]:
        """Read and decode the entry of ``load_step``: ``(value, meta, seconds, bytes)``.

        Args:
            load_step: the entry to read.
            step: the step of the call being served (defaults to ``load_step``).
            prompts: the live call's prompts, compared with the entry's prompt digest when the
                entry's step is the call's step.

        Raises:
            CorruptEntryError: damaged entry (logged and counted).
            CacheMissError: the entry vanished, or the fingerprint differs and ``on_mismatch`` is
                ``regenerate``.
            UnreadableEntryError: intact but not decodable here, or a pickle while ``allow_pickle`` is false.
            SkipConfigError: a fingerprint or prompt mismatch under the ``error`` policy.
        """
        step = load_step if step is None else step
        return self.reader.read(self.step_dump_dir(load_step), step, load_step, prompts)

    def _read_entry(self, path: str, step: int, load_step: int | None = None,
                    prompts: Any = None) -> tuple[Any, dict[str, Any], float, int]:
        return self.reader.read(path, step, load_step, prompts)

    def _report_corrupt(self, step: int, path: str, reason: str) -> None:
        self.reader.report_corrupt(step, path, reason)

    # ------------------------------------------------------------------ verl's names (its tests and trainer use them)

    def _path(self, path: str) -> Any:
        return path if is_url(path) else Path(path)

    def _get_project_dump_dir(self) -> Any:
        return self._path(self.project_dump_dir)

    def _get_step_dump_dir(self, step: int) -> Any:
        return self._path(self.step_dump_dir(step))

    def _check_valid_step_path(self, path: Any) -> bool:
        return self.reader.probe(str(path)).state is EntryState.PRESENT

    def _get_available_steps(self) -> list[int]:
        return self.available_steps()

    def _find_latest_step(self, step: int) -> int:
        for candidate in load_candidates(SkipAction.REPEAT, step, self.listed_steps()):
            if self._present(candidate):
                return candidate
        return -1

    @property
    def exp_name(self) -> str:
        return self.layout.experiment_name

    @property
    def project_name(self) -> str:
        return self.layout.project_name

    @property
    def gbs(self) -> int:
        return self.layout.gbs

    @property
    def n(self) -> int:
        return self.layout.n

    @property
    def prompt_len(self) -> int:
        return self.layout.prompt_len

    @property
    def response_len(self) -> int:
        return self.layout.response_len

    prompt_length = prompt_len
    response_length = response_len


@dataclasses.dataclass(eq=False)
class _Claims:
    """A digest table a reader uses (:meth:`CachedRole._read_tables`): the table, the run directory
    whose entries it describes, the names of the entries it was taken to cover, and whether it is
    still believed."""

    table: Any  # a stepskip.hints.KeyTable
    project: str
    generation: int  # the call of CachedRole._match_index that read it (how its entries rank in a tie)
    covered: set[str] = dataclasses.field(default_factory=set)
    alive: bool = True

    def first_covered(self, heads: dict[int, int], end: int, best: tuple[Any, ...], covered: AbstractSet[str],
                      scan: list[int]) -> tuple[tuple[int, tuple[int, str]], _Claims, int, int] | None:
        """``((step, rank), self, its index here, step)`` of the latest entry of one key's rows, from
        ``heads[id(self)]`` to ``end`` (latest first), that is still ``covered`` and would beat ``best``
        (``(step, rank)`` of the entry the index serves the prompt from) once indexed; None when there is
        none. The head moves past the entries indexed already; each row looked at counts against
        ``scan[0]`` (None once it is spent)."""
        table, head = self.table, heads[id(self)]
        found = None
        while head < end:
            scan[0] -= 1
            if scan[0] < 0:
                break
            entry = int(table.owners[head])
            step = int(table.names[entry])
            key = (step, (self.generation, f"{self.project}/{step}"))
            if key <= best:
                break  # the rest are earlier steps: none of them could win this prompt
            if str(step) in covered:
                found = (key, self, entry, step)
                break
            head += 1
        heads[id(self)] = head
        return found


def _step_of(meta: dict[str, Any]) -> int:
    step = meta.get("global_steps")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


_seconds = seconds_of
