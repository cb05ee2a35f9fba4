"""``CachedRole``: the role that keeps its results in a cache, and decides each call from it.

The role holds the run's store, layout, format and counters, and decides every call under its
action (hit, miss, replay, record). The work is done by collaborators it owns: a reader
(:mod:`stepskip._reading`: probe, classify, read, fidelity, rebind; what one step consists of; the
reused listings), a dump pipeline (:mod:`stepskip._dumping`: snapshot, queue, batches, helper
processes, and what a write commits) and, for ``action: match``, a prompt index and its writers'
hints (:mod:`stepskip._matching`). A subclass that caches something else passes other collaborators
(the V1 role: a step of inner entries, published whole); it overrides no private hook.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from stepskip._dumping.commit import Commit, EntryCommit
from stepskip._dumping.dumper import Dumper
from stepskip._matching.batches import MatchSplit, row_count
from stepskip._matching.index import MatchIndex
from stepskip._matching.matcher import Matcher, row_prompts
from stepskip._matching.writer import HintWriter
from stepskip._reading.classify import EntryStatus
from stepskip._reading.compare import Comparer
from stepskip._reading.layers import open_layers
from stepskip._reading.unavailable import Withheld
from stepskip._reading.listing import StepListing
from stepskip._reading.reader import EntryReader, prompt_digest, seconds_of
from stepskip._reading.steps import FlatSteps, StepEntries
from stepskip._storage import Tree, check_dump_dir, open_store
from stepskip._access import check_writable, describe_store_access_error, is_store_access_error
from stepskip._calls import CURRENT_CALL, added_columns, call_prompts
from stepskip._storage.layered import origin_of
from stepskip._storage.outages import StoreOutage
from stepskip._storage.readonly import ReadOnlyStore
from stepskip.config import ROLLOUT_ROLES, SkipRoleConfig
from stepskip._entries import FormatSpec, legacy_format, storage_format
from stepskip.errors import CacheMissError, CorruptEntryError, ReplayMissError, SkipConfigError, StoreUnavailableError
from stepskip._identity import RunIdentity, fingerprint_of
from stepskip._layout import Layout
from stepskip._drift import DriftLog, Recorded
from stepskip._policies import SkipAction
from stepskip._resolve import EXACT_ACTIONS, load_candidates
from stepskip._retention import RETENTION_STAT_NAMES, Retention, start_read_only
from stepskip.roles._verl_names import VerlNames
from stepskip.roles.base import BaseSkip, RunContext
from stepskip._stats import COMPARE_STAT_NAMES, RoleStats
from stepskip._tracker import offer_samples

__all__ = ["CachedRole", "ALL_ACTIONS", "ROW_WISE_ACTIONS"]

logger = logging.getLogger(__name__)

ALL_ACTIONS = [SkipAction.CACHE, SkipAction.REPEAT, SkipAction.RANDOM, SkipAction.REPLAY, SkipAction.RECORD,
               SkipAction.COMPARE]
#: Roles whose output rows map one to one onto their prompt rows also replay by prompt (``match``).
ROW_WISE_ACTIONS = [*ALL_ACTIONS, SkipAction.MATCH]

#: A step's entry of at most this many bytes is read whole when its hit is decided, and served from
#: what was read: one confined walk to the entry a hit (a one-sample entry of the async role: about
#: 20 KB; a debugging batch of 32 rows: about 80 KB).
HIT_KEEP_BYTES = 256 << 10
#: The actions whose calls list the run directory: the start-up clean-up's listing is kept for their first call.
_LISTING_ACTIONS = frozenset({SkipAction.REPEAT, SkipAction.RANDOM, SkipAction.MATCH})


def _forget_dumps_after_fork() -> None:
    """In a forked child: the parent's queued dumps are not this process's to wait for (no thread
    here finishes them; a lock may have been held at the fork)."""
    for role in list(_ROLES):
        role.dumper.after_fork()
        role.dumper.commit.after_fork()
        role.listing.after_fork()
        role.hints.after_fork()
        role.match_index.after_fork()
        role.comparer.after_fork()
        if role.retention is not None:
            role.retention.after_fork()
        role._bind_lock = threading.Lock()


_ROLES: weakref.WeakSet[CachedRole] = weakref.WeakSet()
os.register_at_fork(after_in_child=_forget_dumps_after_fork)


class CachedRole(VerlNames, BaseSkip):
    """Base of every role that records results to a cache and replays them.

    Subclasses say what one cached unit is, by the collaborators they pass; the base decides every
    call. ``config_class`` must derive from :class:`~stepskip.SkipRoleConfig`.

    Args:
        local_config: the role's section (``skip.<role>``).
        global_config: the whole training config.
        commit: what a written entry commits (default: the entry itself, published by its own write;
            :mod:`stepskip._dumping.commit`).
        entries: what one step consists of (default: one flat entry; :mod:`stepskip._reading.steps`).
        match_index: the prompt index of ``action: match`` (default: over flat entries;
            :mod:`stepskip._matching.index`).
        comparer: what ``action: compare`` reads and compares (default: one flat entry per step;
            :mod:`stepskip._reading.compare`).
    """

    support_actions = ROW_WISE_ACTIONS
    config_class: ClassVar[type[Any]] = SkipRoleConfig
    #: Entries are V1 inner entries (``{step}/{inner}/``, verl's ``tq_batch.pt``).
    v1: ClassVar[bool] = False
    #: The role reads layered caches below its dump dir (``sources``, ``replay_from``): decided at start-up,
    #: so that a role without them spends nothing per call on telling where an entry came from.
    layered: bool = False

    def __init__(self, local_config: Any, global_config: Any, *, commit: Commit | None = None,
                 entries: StepEntries | None = None, match_index: MatchIndex | None = None,
                 comparer: Comparer | None = None) -> None:
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
        self.stats = RoleStats((*(COMPARE_STAT_NAMES if self.action is SkipAction.COMPARE else ()),
                                *(RETENTION_STAT_NAMES if config.retains else ())))
        self.drift_log = DriftLog()  # the records of action: compare (SkipManager.drift)
        self.fingerprint: dict[str, Any] = {}
        self._codec: Any = None
        self._layout: Layout | None = None
        self._store: Any = None
        self._bind_lock = threading.Lock()
        #: Store outages: the entries the store did not answer for during their step's call.
        self.withheld = Withheld(self)
        #: Reads entries (probe, classify, read, fidelity, rebind); ``entries``: what one step consists of.
        self.reader = EntryReader(self)
        self.entries: StepEntries = entries if entries is not None else FlatSteps(self)
        self.listing = StepListing(lambda: self.store)
        #: The prompt hints this role writes, the prompt index ``match`` reads, and the ``match`` calls.
        self.hints = HintWriter(self)
        self.match_index: MatchIndex = match_index if match_index is not None else MatchIndex(self)
        self.matcher = Matcher(self)
        #: ``action: compare``: the recorded result read before the call, compared with the live one after it.
        self.comparer: Comparer = comparer if comparer is not None else Comparer(self)
        #: The dump pipeline; what a write commits is ``commit`` (flat entries: each by its own write).
        self.dumper = Dumper(self, commit if commit is not None else EntryCommit(self.hints.entries_written),
                             wrote=self.listing.wrote)
        #: ``max_keep``/``max_bytes``: the steps removed after each commit (None: nothing is removed).
        self.retention: Retention | None = Retention(self) if config.retains else None
        if self.retention is not None:
            self.dumper.commit.committed = self.retention.after_commit
        _ROLES.add(self)
        self._new_run()

    def _new_run(self) -> None:
        """The state that belongs to the run the role is bound to (what it wrote, indexed and listed),
        emptied: at construction, and when a bound role is bound to a run again."""
        for part in (self.match_index, self.hints, self.reader, self.listing, self.dumper.commit, self.comparer):
            part.reset()
        if self.retention is not None:
            self.retention.reset()

    # ------------------------------------------------------------------ lifecycle

    def bind(self, context: RunContext) -> None:
        """Attach to the run: paths from its identity, the store, and (when enabled) a clean-up of
        temporaries that crashed writers left behind. A role bound before (to the run its config
        names, see :meth:`bind_to_config`) is bound to this run instead."""
        if self._layout is not None:
            self._new_run()
        super().bind(context)
        identity = context.identity.with_fingerprint(fingerprint_of(self.global_config, self.config.fingerprint_keys))
        if self.enable and identity.content is not None:  # read once per run, by the first role that serves
            identity = identity.with_fingerprint(identity.content.digests(
                weights=self.config.fingerprint_weights, code=self.config.fingerprint_code, run=context.run_id))
        self.fingerprint = dict(identity.fingerprint)
        self._layout = Layout.for_identity(self.dump_dir, identity, subdir=self.layout_subdir())
        self._store = open_store(self._layout.dump_dir, self.config.storage_options)
        self.layered = False  # until start() opens the layers
        if self.config.read_only:  # below every caller: a write that reaches the store is refused
            self._store = ReadOnlyStore(self._store, why=f"skip.{self.name}.read_only is true")
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
        return None if self.name in ROLLOUT_ROLES else self.name

    def start(self) -> None:
        """Startup I/O of an enabled role (after :meth:`bind`): a dump dir this process cannot use is
        a :class:`SkipConfigError` now, not a dump failure at every step; stale temporaries go."""
        where = f"skip.{self.name}"  # a stage role's config class is shared: its section says skip.<stage>
        key = f"{where}.dump_dir"
        if self.config.read_only:
            start_read_only(self, key)  # nothing is created, tried for writing or cleaned up
            return
        check_dump_dir(self.dump_dir, self.config.storage_options, key=key, entry_dir=self.layout.project_dir)
        local = self.store.capabilities.local_files
        if local and self.action is not SkipAction.REPLAY:
            check_writable(self.layout.dump_dir, self.layout.project_dir, key=key, fix=f"set {where}.read_only = true (or set {where}.action = replay)")
        try:  # on an object store, the first request: credentials and endpoint are tried here
            self.clean_up(self.store.scan(self.layout.project_dir))
        except Exception as err:
            if local or not is_store_access_error(err):
                raise
            raise SkipConfigError(f"{key} = {describe_store_access_error(self.dump_dir, err)}") from err
        layered = open_layers(self, self._store)  # sources, replay_from: read after the dump dir, never written
        if layered is not None:
            self._store = layered
        self.layered = layered is not None
        self.dumper.prepare(dumps=self.action is not SkipAction.REPLAY)

    def clean_up(self, tree: Tree | None) -> None:
        """Remove what interrupted writers left in this role's entries once it is stale (at start-up).

        Args:
            tree: one recursive listing of the run directory where the store lists a tree cheaply
                (:meth:`~stepskip._storage.EntryStore.scan`: object stores), from which only the entries
                that may hold a leftover are looked at: a bounded number of requests whatever the number
                of entries; None locally.
        """
        path = self.layout.project_dir
        can = self.store.capabilities
        if tree is None and self.action in _LISTING_ACTIONS and can.dir_versions and can.atomic_dir_publish:
            self.listing.clean_up(path)  # its listing is kept for the first call
        else:
            self.store.remove_leftovers(path, tree=tree)
        if tree is None:  # a local hint file (table, document) is written by rename: a crashed writer's temporary
            self.store.remove_leftovers(self.layout.hints_dir)
        self.entries.clean_up(tree)

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
            from stepskip._formats import get_format

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
        directory is unchanged (see :mod:`stepskip._reading.listing`).

        Raises:
            StoreUnavailableError: the store did not answer for the listing (a timeout, a connection error, a 5xx).
        """
        try:
            listed = self.listing.steps(self.project_dump_dir)
        except StoreOutage as err:  # no answer is not an empty directory (see listing_unavailable)
            raise StoreUnavailableError(str(err.strerror)) from err
        names = self.dumper.queued_in(self.project_dump_dir)
        if not names:
            return listed
        queued = {step for step in map(Layout.parse_step, names) if step is not None}
        return sorted(queued.union(listed)) if not queued.issubset(listed) else listed

    def available_steps(self) -> list[int]:
        """Steps with a valid entry, sorted (damaged and unreadable entries and temporaries are left out)."""
        return [step for step in self.listed_steps() if self.entries.present(step)]

    def resolve_load_step(self, step: int) -> int:
        """The step this role's action would load for a call at ``step``; -1 for none.

        ``cache``/``replay``: ``step`` itself. ``repeat``: ``step``, else the largest smaller
        available step, else the smallest larger one (as verl's ``repeat``). ``random``: an available step
        drawn reproducibly from ``seed`` and ``step``. ``record``: never loads. Re-resolved on
        every call; only the candidates tried are validated.
        """
        listed = () if self.action in EXACT_ACTIONS else self.listed_steps()
        for candidate in load_candidates(self.action, step, listed, self.seed, ordered=True):
            if self.entries.present(candidate):
                return candidate
        return -1

    def would_replay(self, step: int) -> bool:
        if step not in self._step_lookup or self.action is SkipAction.COMPARE:  # compare always runs the call
            return False
        if self.action is SkipAction.MATCH:  # looks prompts up, not steps: a run taking the recorded
            load_step = step if self.entries.present(step) else -1  # steps again finds them in the step's entry
        else:
            try:
                load_step = self.resolve_load_step(step)
            except StoreUnavailableError:  # not now: the call itself asks the store again
                return False
        return load_step != -1 and all(self.reader.servable(p.meta or {}) for _, p in self.entries.probed(load_step))

    def await_dump(self, path: str) -> None:
        """Wait for this run's queued dump of ``path``, if any (a read of it then finds it written)."""
        if self.dumper.pending:
            self.dumper.await_pending(path)

    # ------------------------------------------------------------------ the role protocol

    def meet_precondition(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> bool:
        """True when the call at ``step`` is served from the cache.

        Raises:
            UnreadableEntryError: the step's entry is intact but cannot be used here (it is kept).
        """
        action = self.action
        if self.withheld:
            self.withheld.forget(self.step_dump_dir(step))
        if action is SkipAction.REPLAY:
            return True  # warp_function raises when there is nothing to load
        if action is SkipAction.RECORD:
            hit = False  # every call generates: each is a miss
        elif action is SkipAction.CACHE:
            hit = self._exact_step_usable(step)
        elif action is SkipAction.REPEAT:
            # a damaged exact step is reported and regenerated, as under cache, not passed over for
            # another step in silence (a missing one is passed over, as verl's repeat does)
            hit = not self._exact_step_damaged(step) and self._resolve_for_call(step) != -1
        else:
            self._refuse_unreadable(step)  # the exact step would be regenerated over: never
            hit = self._resolve_for_call(step) != -1
        if not hit:
            self.stats.add(misses=1)
            if not self.withheld or self.step_dump_dir(step) not in self.withheld:  # else logged as an outage
                logger.info("%s miss: step %d has no usable entry under %s; generating and dumping it",
                            self.name, step, self.project_dump_dir)
        return hit

    def _resolve_for_call(self, step: int) -> int:
        """:meth:`resolve_load_step`, kept for this call's read (one listing of the directory a call)."""
        load_step = self.resolve_or_withhold(step)
        self.listing.keep_resolved(step, load_step)
        return load_step

    def resolve_or_withhold(self, step: int) -> int:
        """:meth:`resolve_load_step`; -1 when the store did not answer for the listing of the run directory
        (:meth:`listing_unavailable`)."""
        try:
            return self.resolve_load_step(step)
        except StoreUnavailableError as err:
            self.listing_unavailable(step, str(err))
            return -1

    def listing_unavailable(self, step: int, reason: str) -> None:
        """The store did not answer for the listing of the run directory during the call at ``step``: nothing is
        known of the steps that could serve it, the step's own included, so the call is a miss (counted
        ``unavailable`` once) whose result is not written over the step (see :class:`Withheld`)."""
        path = self.step_dump_dir(step)
        if not self.withheld.under(path):
            self.entry_unavailable(step, path, f"listing {self.project_dump_dir}: {reason}")

    def _exact_step_usable(self, step: int) -> bool:
        path = self.step_dump_dir(step)
        # a small entry is read whole by the probe: the hit that follows reads it from there
        probe = self.reader.probe_settled(path, keep=HIT_KEEP_BYTES)
        if probe.state.kept:
            raise self.reader.unreadable(probe.reason)
        if probe.state is EntryStatus.DAMAGED:
            self.reader.report_corrupt(step, path, probe.reason)
        elif probe.state is EntryStatus.UNAVAILABLE:
            self.entry_unavailable(step, path, probe.reason)
        if probe.state is EntryStatus.PRESENT:
            self.reader.keep_probe(path, probe)
        return probe.state is EntryStatus.PRESENT

    def _exact_step_damaged(self, step: int) -> bool:
        """Whether ``step``'s own entry is damaged (reported when it is): one probe when it is not, a
        second before calling it damaged (it may be mid-replacement). Flat entries only: ``rollout_tq``
        decides its steps in its own :meth:`meet_precondition`.

        Raises:
            UnreadableEntryError: the entry is intact but cannot be used here (it is kept, never regenerated over).
        """
        path = self.step_dump_dir(step)
        probe = self.reader.probe_settled(path)
        if probe.state.kept:
            raise self.reader.unreadable(probe.reason)
        if probe.state is EntryStatus.DAMAGED:
            self.reader.report_corrupt(step, path, probe.reason)
        elif probe.state is EntryStatus.UNAVAILABLE:  # another step may serve the call; this one is not written over
            self.entry_unavailable(step, path, probe.reason)
        return probe.state is EntryStatus.DAMAGED

    def _refuse_unreadable(self, step: int) -> None:
        for path, probe in self.entries.probed(step):
            if probe.state.kept:
                raise self.reader.unreadable(probe.reason)
            if probe.state is EntryStatus.UNAVAILABLE:
                self.entry_unavailable(step, path, probe.reason)

    def entry_unavailable(self, step: int, path: str, reason: str) -> None:
        """The store did not answer for the entry at ``path`` during the call at ``step``: counted (``unavailable``)
        and logged, and the call's result, generated instead, is never written over the entry (which may be
        valid). Under ``replay`` the read was retried first and the call fails. See :class:`Withheld`."""
        self.withheld.mark(step, path, reason)

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
            except StoreUnavailableError as err:  # retried first under replay
                self.entry_unavailable(step, path, str(err.__cause__ or err))
                self._regenerated()
                raise
            except CacheMissError:
                self._regenerated()
                raise
            else:
                return self._served(step, step, value, meta, time.perf_counter() - start, nbytes, prompts)
        load_step = self.listing.take_resolved(step)
        if load_step is None or load_step == -1 or not self.entries.present(load_step):  # gone since: look again
            load_step = self.resolve_or_withhold(step)
        if load_step == -1 and self.action is not SkipAction.RECORD:
            probe = self.reader.probe_settled(self.step_dump_dir(step))
            if probe.state is EntryStatus.PRESENT:
                load_step = step  # it appeared, or was being replaced, while we looked
            elif probe.state.kept:
                raise self.reader.unreadable(probe.reason)
            elif probe.state is EntryStatus.UNAVAILABLE:
                path = self.step_dump_dir(step)
                self.entry_unavailable(step, path, probe.reason)
                self._regenerated()
                raise StoreUnavailableError(f"{self.name}: step {step}: {probe.reason} (entry {path})")
            elif probe.state is EntryStatus.DAMAGED:
                path = self.step_dump_dir(step)
                self.reader.report_corrupt(step, path, probe.reason)
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
        saved = seconds_of(meta.get("generation_seconds"))
        self.stats.add(hits=1, load_seconds=seconds, bytes_read=nbytes, saved_seconds=saved,
                       rows_replayed=row_count(value))
        origin = origin_of(meta) if self.layered else None  # read from a layered cache (sources, replay_from)
        if origin is not None:
            self.stats.add(**{origin.counter: 1})
        offer_samples(self, step, load_step, value, prompts, replayed=True)
        logger.info("%s hit: step %d replayed from step %d at %s (%d bytes, %.3fs)", self.name, step, load_step,
                    self.step_dump_dir(load_step) if origin is None else origin.describe(), nbytes, seconds)
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
        # columns the call put into its own prompts are not what it was asked: the digests leave them out
        exclude = [*self.rebind_keys, *added_columns(prompts)]
        self.stats.add(rows_generated=row_count(result))
        offer_samples(self, step, step, result, prompts, replayed=False)
        if self.withheld and self.withheld.release(path):
            logger.warning("%s: step %d not dumped: the store did not answer for its entry at %s, which may be "
                           "valid and is left as it is", self.name, step, path)
            return

        def meta() -> dict[str, Any]:
            from stepskip._fidelity import shared_object_digests

            with shared_object_digests():  # both digests hash the same prompt objects: each is hashed once
                digests = row_prompts(prompts, result, exclude) if self.row_wise else None
                digest = prompt_digest(prompts, exclude)
            return self.dumper.entry_meta(step, seconds, prompt_digest=digest, row_prompts=digests, **rng)

        prepared = self.dumper.snapshot(step, path, result, copy=self.async_dump, meta=meta)
        if prepared is not None and getattr(self.config, "record_inputs", False):
            prepared = self.dumper.with_inputs(step, prepared, args, kwargs)
        if prepared is not None:
            self.dumper.submit(path, step, *prepared)

    # ------------------------------------------------------------------ action: compare

    def compare_read(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any
                     ) -> Recorded | None:
        """Read the entry of ``step`` for ``action: compare``, before the call runs live
        (:meth:`stepskip._reading.compare.Comparer.read`).

        Returns:
            What was read; None when there is nothing to compare with (the live result is then recorded).

        Raises:
            UnreadableEntryError: the entry is intact but cannot be read here (it is never recorded over).
        """
        return self.comparer.read(step)

    def compare_result(self, step: int, recorded: Recorded, live: Any, prompts: Any) -> Any:
        """Compare the live result of ``step`` with its recording, report the drift, and return the result
        ``train_on`` names (:meth:`stepskip._reading.compare.Comparer.result`).

        Raises:
            DriftError: a field drifted and ``on_drift`` is ``error``.
            PromptMismatchError: the prompts differ and ``check_prompts`` is ``error``.
        """
        return self.comparer.result(step, recorded, live, prompts)

    def capture_rng(self) -> dict[str, Any]:
        """``{"rng_state": ...}`` for an entry's meta when ``restore_rng`` is on (else empty); called
        right after the recorded call returns."""
        if not self.config.restore_rng:
            return {}
        from stepskip._rng import capture_rng_state

        return {"rng_state": capture_rng_state()}

    def restore_rng(self, meta: dict[str, Any], step: int, path: str) -> None:
        """Set the global generators to the state the entry's call left them in (``restore_rng``): see
        :meth:`stepskip._reading.reader.EntryReader.restore_rng`."""
        self.reader.restore_rng(meta, step, path)

    # ------------------------------------------------------------------ action: match

    @property
    def row_wise(self) -> bool:
        """Output rows map one to one onto prompt rows (stage roles say so with ``row_wise: true``)."""
        return SkipAction.MATCH in self.support_actions and bool(getattr(self.config, "row_wise", True))

    def match_split(self, step: int, prompts: Any) -> MatchSplit:
        """Divide the live batch into prompt groups recorded anywhere in this run and groups to generate
        (:meth:`stepskip._matching.matcher.Matcher.split`)."""
        return self.matcher.split(step, prompts)

    def match_rejoin(self, step: int, split: MatchSplit, prompts: Any, generated: Any
                     ) -> tuple[MatchSplit, list[int], Any] | None:
        """After generation: drop the recorded entries whose rows cannot be joined with ``generated``
        (:meth:`stepskip._matching.matcher.Matcher.rejoin`)."""
        return self.matcher.rejoin(step, split, prompts, generated)

    def match_regenerated(self, split: MatchSplit, narrowed: MatchSplit, redo: list[int], generated: Any,
                          regenerated: Any) -> Any:
        """The generated rows of ``narrowed`` in order (:meth:`stepskip._matching.matcher.Matcher.regenerated`)."""
        return self.matcher.regenerated(split, narrowed, redo, generated, regenerated)

    def match_merge(self, step: int, split: MatchSplit, prompts: Any, generated: Any) -> Any:
        """The live batch in live row order, what was generated recorded
        (:meth:`stepskip._matching.matcher.Matcher.merge`)."""
        return self.matcher.merge(step, split, prompts, generated)

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
