"""The V1 trainer's two-phase role over TransferQueue (``rollout_tq``).

The submit phase (``_add_batch_to_generate``) either injects a cached step into the queue or
submits the prompts to rollout; the sample phase (``ReplayBuffer.sample``) saves what it sampled
(every field of those keys, read back from the queue) to ``{step}/{inner_idx}/``. With
``parameter_sync_step > 1`` one step samples several times, one inner entry each; a step is
complete, and replayable, only when all its inner entries exist and come from one recording run.

On local stores a step is built in a hidden ``.tmp-{step}-{token}`` directory beside it and
published whole (one rename, or an exchange with the step it replaces) once its last inner entry
is written: two runs recording one step at once end with one complete step, all of it from the
run that published last; a crashed recorder leaves only a stale temporary (``remove_leftovers``).
Object stores cannot rename a directory: there each recording goes to ``{step}/rec-{token}/{inner}/``
and is committed by the step's manifest ``{step}/step.json``, written last (:mod:`stepskip._manifest`):
readers resolve the manifest once and read only the recording it names, so two runs recording one
step at once also end with one complete step (the one whose manifest was written last), and a
crashed recorder's recording stays invisible until it is removed as stale. Steps without a manifest
(verl's, earlier stepskip versions') are read in place, ``{step}/{inner}/``, as before.

``action: match`` follows the prompts: every inner entry records, per trajectory, the digest of
the prompt it answers (``meta["row_prompts"]``), so the submit phase injects the recorded groups
of the batch's prompts and submits only the others.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any, ClassVar

from stepskip._dumping.commit import StepCommit, StepPublisher
from stepskip._matching.v1 import StepMatcher, StepMatchIndex
from stepskip._reading.classify import EntryStatus
from stepskip._reading.compare import StepComparer
from stepskip._reading.reader import prompt_digest, seconds_of
from stepskip._reading.steps import V1Steps, complete
from stepskip._storage.layered import Origin, origin_of
from stepskip.config import RolloutTqSkipConfig, select
from stepskip.errors import (
    CacheMissError,
    CorruptEntryError,
    SkipConfigError,
    StoreUnavailableError,
    UnreadableEntryError,
)
from stepskip._layout import Layout
from stepskip._manifest import StepRoot, read_manifest
from stepskip._policies import SkipAction
from stepskip._resolve import EXACT_ACTIONS, load_candidates, remap_v1
from stepskip.roles.base import register_skip
from stepskip.roles.cached import ROW_WISE_ACTIONS
from stepskip.roles.rollout import RolloutSkip

if TYPE_CHECKING:
    from stepskip.tq import TQClient  # stepskip.tq imports torch: only for type checkers

__all__ = ["RolloutTqSkip"]

logger = logging.getLogger(__name__)

#: More inner entries per step than any trainer uses: a bound on what a config may ask for.
MAX_PARAMETER_SYNC_STEP = 4096


@register_skip("rollout_tq")
class RolloutTqSkip(RolloutSkip):
    """Caches complete V1 steps: the trajectories ``ReplayBuffer.sample`` handed to the trainer.

    Wire it with ``SkipManager.annotate_tq(role="rollout_tq", phase="submit")`` on
    ``_add_batch_to_generate`` and ``phase="sample"`` on ``ReplayBuffer.sample``. The queue client
    is ``SkipManager.init(cfg, tq_client=...)``, or the real ``transfer_queue`` module.

    The two phases speak a small protocol that ``SkipManager.annotate_tq`` drives through the same
    decision plan as ``annotate``: :meth:`meet_precondition`, :meth:`inject` (the cached result),
    :meth:`begin_recording` (a miss submitted to rollout), :meth:`should_save` and :meth:`save_sample`;
    under ``action: match`` :meth:`match_inject`, under ``action: compare`` :meth:`compare_submit` and
    :meth:`compare_sample`.
    """

    config_class: ClassVar[type[Any]] = RolloutTqSkipConfig
    support_actions = ROW_WISE_ACTIONS
    v1 = True

    def __init__(self, local_config: Any, global_config: Any, *, publisher: StepPublisher | None = None) -> None:
        index = StepMatchIndex(self)
        #: The steps this run records, each published once its inner entries are written, by ``publisher``
        #: (None: the one the store supports, see :mod:`stepskip._dumping.commit`).
        self.step_commit = StepCommit(self, publisher, replacing=index.forget_step, published=self._hint_step)
        #: A step is ``parameter_sync_step`` inner entries, in place or in the recording its manifest names.
        self.entries: V1Steps = V1Steps(self)
        #: ``action: compare``: a recorded step read at submit, compared as its trajectories are sampled.
        self.comparer: StepComparer = StepComparer(self)
        super().__init__(local_config, global_config, commit=self.step_commit, entries=self.entries,
                         match_index=index, comparer=self.comparer)
        self.match_index: StepMatchIndex = index
        #: Steps whose submit phase the cache served whole (their engine work is skipped: ``was_replayed``).
        self.replayed_steps: set[int] = set()
        self.step_matcher = StepMatcher(self, index)
        mode = select(global_config, "trainer.v1.trainer_mode")
        key = f"trainer.v1.{mode}.parameter_sync_step"
        sync_step = select(global_config, key, 1) if mode else 1
        valid = isinstance(sync_step, int) and not isinstance(sync_step, bool)
        if not valid or not 1 <= sync_step <= MAX_PARAMETER_SYNC_STEP:
            raise SkipConfigError(
                f"{key} = {sync_step!r} is not valid; expected an int from 1 to {MAX_PARAMETER_SYNC_STEP}"
            )
        self.parameter_sync_step = sync_step

    # ------------------------------------------------------------------ queue and paths

    @property
    def tq_client(self) -> TQClient:
        """The TransferQueue client: ``runtime["tq_client"]`` or the ``transfer_queue`` module."""
        client: TQClient | None = self.runtime.get("tq_client")
        if client is not None:
            return client
        try:
            import transfer_queue
        except ImportError as err:
            raise SkipConfigError(
                "skip.rollout_tq needs a TransferQueue client: install `transferqueue`, or pass one with "
                "SkipManager.init(config, tq_client=...) (stepskip.tq.InProcessTQClient for an in-process queue)"
            ) from err
        module: TQClient = transfer_queue  # the module's functions are the client's interface
        return module

    def inner_dump_dir(self, step: int, inner_idx: int) -> str:
        """The entry directory of one sample call of ``step``: in the recording the step's manifest
        names (object stores), else ``{step}/{inner_idx}``."""
        return Layout.inner_path(self.entries.root(step).root, inner_idx)

    def _resolve_root(self, step: int) -> tuple[int, StepRoot | None]:
        """:meth:`resolve_load_step` and the root it validated: the step's inner entries are then read
        from the recording that was probed, its manifest not read again."""
        try:
            listed = () if self.action in EXACT_ACTIONS else self.listed_steps()
        except StoreUnavailableError as err:
            self.listing_unavailable(step, str(err))
            return -1, None
        for candidate in load_candidates(self.action, step, listed, self.seed):
            where = self.entries.root(candidate)
            if complete(self.entries.probed(candidate, where)):
                return candidate, where
        return -1, None

    # ------------------------------------------------------------------ verl's V1 interface

    def has_v1_cache(self, step: int) -> bool:
        """True when the action would load a complete cached step for ``step`` (False when the store did not
        answer for the listing: the step is then withheld, see :meth:`listing_unavailable`)."""
        return self.resolve_or_withhold(step) != -1

    def meet_precondition(self, step: int, *args: Any, **kwargs: Any) -> bool:
        action = self.action
        self.forget_withheld(step)
        if action is SkipAction.RECORD:
            hit = False
        elif action is SkipAction.REPLAY:
            return True
        else:
            probed = self.entries.probed(step)
            self.withhold_unavailable(step, probed)
            for path, probe in probed:
                if probe.state.kept:
                    raise self.reader.unreadable(probe.reason)  # the step would be re-recorded over it: never
                if action is SkipAction.CACHE and probe.state is EntryStatus.DAMAGED:
                    self.reader.report_corrupt(step, path, probe.reason)
            # cache loads the step itself: what was just probed decides (its manifest is not read again)
            hit = complete(probed) if action is SkipAction.CACHE else self.has_v1_cache(step)
        if not hit:
            self.stats.add(misses=1)
            if not self.step_withheld(step):  # else logged as an outage
                logger.info("%s miss: step %d has no complete entry under %s; generating and dumping it",
                            self.name, step, self.project_dump_dir)
        return hit

    def forget_withheld(self, step: int) -> None:
        """A new submit phase of ``step``: whether its store answers is decided afresh."""
        if self.withheld:
            self.withheld.forget_under(self.step_dump_dir(step))

    def withhold_unavailable(self, step: int, probed: list[tuple[str, Any]]) -> None:
        """Mark the inner entries of ``step`` the store did not answer for: the step is then not recorded
        over (:meth:`should_save`) until its next submit phase."""
        for path, probe in probed:
            if probe.state is EntryStatus.UNAVAILABLE:
                self.entry_unavailable(step, path, probe.reason)

    def step_withheld(self, step: int) -> bool:
        """Whether the store did not answer for an entry of ``step`` during its current call."""
        return bool(self.withheld) and self.withheld.under(self.step_dump_dir(step))

    def should_save(self, step: int, partition_id: str | None = "train") -> bool:
        """True when a train-partition sample of ``step`` must be written (no complete cache yet; never under
        ``read_only``)."""
        if partition_id != "train" or self.config.read_only:
            return False
        if self.step_withheld(step):  # an inner entry may be valid: the step is never recorded over unseen
            return False
        with self.step_commit.lock:
            record = self.step_commit.records.get(step)
            if record is not None and record.saved >= self.parameter_sync_step:
                return False
            if record is not None and record.regenerate:
                return True
        if self.action is SkipAction.MATCH:
            return False  # every prompt was replayed: nothing new to record
        return not self.has_v1_cache(step) and not self.step_withheld(step)  # a listing unanswered: never over it

    def maybe_load_and_inject(self, step: int, new_prompt_uids: list[str], partition_id: str = "train",
                              prompts: Any = None) -> bool:
        """Inject the cached step into the queue under the new uids; False (a miss) when there is none.

        The one-call form of the submit phase (``SkipManager.annotate_tq`` drives the same
        steps): on a miss the step is marked for recording.

        Args:
            step: the trainer step.
            new_prompt_uids: the uids ``_next_train_batch`` just assigned.
            partition_id: the queue partition.
            prompts: the batch itself, for the prompt-alignment check and the recorded digest.

        Raises:
            CacheMissError: under ``replay`` when the step is missing or damaged.
        """
        if self.meet_precondition(step):
            try:
                self.inject(step, new_prompt_uids, partition_id=partition_id, prompts=prompts)
                return True
            except CacheMissError:
                if self.action is SkipAction.REPLAY:
                    raise
        self.begin_recording(step, prompts)
        return False

    def inject(self, step: int, new_prompt_uids: list[str], partition_id: str = "train", prompts: Any = None) -> None:
        """The submit phase's cached result: put the step the action resolves into the queue.

        Raises:
            CacheMissError: nothing could be replayed (counted as a miss unless the action is ``replay``).
        """
        try:
            self.load_dump_data(step=step, new_prompt_uids=new_prompt_uids, n=self.layout.n,
                                global_steps=step, partition_id=partition_id, prompts=prompts)
        except CacheMissError as err:
            if self.action is not SkipAction.REPLAY:
                self.stats.add(misses=1)
                logger.warning("%s: step %d could not be replayed (%s); generating and dumping it",
                               self.name, step, err)
            raise

    def begin_recording(self, step: int, prompts: Any = None) -> None:
        """The submit phase's miss: the step's samples are to be saved as they are drawn (not while the store
        did not answer for one of its entries: :meth:`should_save`)."""
        if self.step_withheld(step):
            logger.warning("%s: step %d is not recorded: the store did not answer for one of its entries, which "
                           "may be valid and is left as it is", self.name, step)
            return
        # stepless: the trainer stamps the step on its prompts, and a prompt is the same at any step
        digest = prompt_digest(prompts, self.rebind_keys, stepless=True) if prompts is not None else None
        uid_prompts = self.uid_prompts_of(prompts)
        with self.step_commit.lock:  # a damaged cached step must be overwritten, not kept
            self.step_commit.new_recording(step, clock=time.perf_counter(), regenerate=True, digest=digest,
                                           uid_prompts=uid_prompts)

    def uid_prompts_of(self, prompts: Any) -> dict[str, str]:
        """Live prompt uid -> the stepless digest of its prompt (``rebind_keys`` excluded); empty when unknown."""
        if prompts is None:
            return {}
        from stepskip._fidelity import prompt_row_digests

        try:
            digests = prompt_row_digests(prompts, self.rebind_keys, stepless=True)
            uids = [str(u) for u in prompts["uid"]]
        except Exception as err:  # a batch the digest cannot read must not stop training: it just cannot match
            logger.debug("%s: no per-prompt digests for this batch (%s); it cannot serve action: match", self.name, err)
            return {}
        return dict(zip(uids, digests)) if len(uids) == len(digests) else {}

    def save_sample(self, step: int, sampled: Any) -> None:
        """The sample phase: save what ``ReplayBuffer.sample`` drew as the step's next inner entry."""
        self.prepare_data(step=step, batch=sampled, global_steps=step)

    def prepare_data(self, step: int, batch: Any = None, global_steps: int | None = None,  # type: ignore[override]
                     *args: Any, **kwargs: Any) -> None:  # verl's V1 signature, not the flat one
        """Save one sample call of ``step``: every field of ``batch.keys`` read back from the queue.

        Args:
            step: the trainer step (the entry directory).
            batch: what ``ReplayBuffer.sample`` returned (``keys``, ``tags``, ``partition_id``).
            global_steps: recorded in the entry; defaults to ``step``.
        """
        if batch is None:
            batch = args[0] if args else kwargs.get("result")
        global_steps = step if global_steps is None else global_steps
        now = time.perf_counter()
        with self.step_commit.lock:
            record = self.step_commit.records.get(step)
            if record is None:  # saved without a submit phase: a fresh recording
                record = self.step_commit.new_recording(step)
            inner = record.saved
            if inner >= self.parameter_sync_step:
                return
            record.saved = inner + 1
            started, record.clock = record.clock, now
            digest, uid_prompts, staging = record.digest, record.uid_prompts, record.staging
        from stepskip.tq.rows import num_rows

        path = Layout.inner_path(staging, inner)
        keys = list(batch.keys)
        row_prompts = [uid_prompts.get(str(key).split("_")[0]) for key in keys]
        try:
            data = self.tq_client.kv_batch_get(keys=keys, partition_id=batch.partition_id)
            if num_rows(data) != len(keys):
                raise ValueError(f"the queue returned {num_rows(data)} rows for {len(keys)} keys")
        except Exception as err:  # the dump boundary: a failing read-back must not stop training
            self.stats.add(dump_failures=1)
            logger.error("%s dump failed: step %d inner %d: reading %d keys back from the queue failed: %s: %s",
                         self.name, step, inner, len(keys), type(err).__name__, err)
            return
        payload = {"tensordict": data, "tags": [dict(t) for t in batch.tags], "keys": keys,
                   "global_steps": int(global_steps)}
        seconds = None if started is None else now - started
        prepared = self.dumper.snapshot(  # the read-back is already a private copy (a failure fails the step)
            step, path, payload, copy=False,
            meta=lambda: self.dumper.entry_meta(global_steps, seconds, num_trajectories=len(keys), inner_idx=inner,
                                                prompt_digest=digest, parameter_sync_step=self.parameter_sync_step,
                                                row_prompts=row_prompts if any(row_prompts) else None))
        if prepared is not None:
            self.dumper.submit(path, step, *prepared)

    def _hint_step(self, step: int, recording: str | None, metas: list[dict[str, Any]]) -> None:
        """The hint of a step just published (``action: match`` reads it before the step's entries)."""
        self.hints.add([(str(step), functools.partial(_add_step_hint, name=str(step), recording=recording,
                                                      metas=metas))])

    def load_dump_data(self, step: int, new_prompt_uids: list[str], n: int, global_steps: int,
                       partition_id: str = "train", prompts: Any = None) -> None:
        """Load the step the action resolves, remap it onto ``new_prompt_uids`` and put it in the queue.

        Trajectories are grouped by parent uid (``key.split("_")[0]``, any key order, groups in
        order of first appearance); prompt ``i`` gets group ``i % num_groups``; session ``s`` gets
        ``group[s % len(group)]`` under the key ``{uid}_{s}_0``. Tags get the current step as
        ``global_steps``/``min_global_steps``/``max_global_steps`` and lose ``is_prompt``. A second
        put marks every prompt ``finished`` so the replay buffer samples them at once.

        Raises:
            CacheMissError: no complete step to load; CorruptEntryError: a damaged inner entry.
        """
        load_step, where = self._resolve_root(step)
        if where is None and self.action is SkipAction.REPLAY:  # say why: damaged and unreadable are not missing
            awaited = False
            for path, probe in self.entries.probed(step):
                if probe.state.kept:
                    raise self.reader.unreadable(probe.reason)
                if probe.state is EntryStatus.DAMAGED:
                    self.reader.report_corrupt(step, path, probe.reason)
                    raise CorruptEntryError(f"{self.name}: step {step} at {path} is damaged: {probe.reason}")
                if probe.state is EntryStatus.UNAVAILABLE:
                    self._await_store(step, path)
                    awaited = True
            if awaited:  # the store answered every retried read: the step is looked at again
                load_step, where = self._resolve_root(step)
        if where is None:
            raise CacheMissError(
                f"{self.name}: no complete V1 entry for step {step} under {self.project_dump_dir} "
                f"(action {self.action.value!r}, parameter_sync_step {self.parameter_sync_step})"
            )
        from stepskip.tq.rows import concat_rows, num_rows, payload_problem, select_rows

        start = time.perf_counter()
        # every inner entry comes from the recording whose probes made the step complete (manifest read once)
        parts, keys, tags, nbytes, saved = [], [], [], 0, 0.0
        origin: Origin | None = None
        for inner in range(self.parameter_sync_step):
            path = Layout.inner_path(where.root, inner)
            try:
                payload, meta, _, size = self.reader.read(path, step, load_step, prompts if inner == 0 else None)
            except StoreUnavailableError as err:  # retried first under replay
                self.entry_unavailable(step, path, str(err.__cause__ or err))
                raise
            problem = payload_problem(payload)  # checksums prove the bytes, not that they are a V1 payload
            if problem is not None:
                self.reader.report_corrupt(step, path, problem)
                raise CorruptEntryError(f"{self.name}: step {load_step} at {path} is damaged: {problem}")
            parts.append(payload["tensordict"])
            keys.extend(payload["keys"])
            tags.extend(payload["tags"])
            nbytes += size
            saved += seconds_of(meta.get("generation_seconds"))
            if not inner and self.layered:  # a layered cache's step is read whole from one layer
                origin = origin_of(meta)
        try:
            data = concat_rows(parts)
            rows = num_rows(data)
        except Exception as err:  # inner entries of other columns, dtypes or shapes (crafted or damaged)
            reason = f"step {load_step}'s inner entries cannot be joined ({type(err).__name__}: {err})"
            self.reader.report_corrupt(step, self.step_dump_dir(load_step), reason)
            raise CorruptEntryError(f"{self.name}: {reason}") from err
        if rows != len(keys):
            reason = f"step {load_step} holds {rows} rows for {len(keys)} keys"
            self.reader.report_corrupt(step, self.step_dump_dir(load_step), reason)
            raise CorruptEntryError(f"{self.name}: {reason}")

        try:
            plan = remap_v1(keys, tags, new_prompt_uids, n, global_steps)
        except ValueError as err:
            raise CacheMissError(f"{self.name}: step {load_step} cannot be replayed: {err}") from err
        if plan.groups != len(new_prompt_uids):
            logger.warning("%s: step %d cached %d prompt groups for %d prompts; %s", self.name, load_step,
                           plan.groups, len(new_prompt_uids),
                           "cycling through them" if plan.groups < len(new_prompt_uids) else "using the first ones")
        new_keys, new_tags, sessions = plan.keys, plan.tags, plan.sessions
        client = self.tq_client
        # the decoded rows are this call's own: rows replayed in their recorded order go in as they are
        fields = data if list(plan.rows) == list(range(rows)) else select_rows(data, plan.rows)
        client.kv_batch_put(keys=new_keys, fields=fields, tags=new_tags, partition_id=partition_id)
        client.kv_batch_put(keys=list(new_prompt_uids), partition_id=partition_id,
                            tags=[{"is_prompt": True, "status": "finished", "global_steps": global_steps}
                                  for _ in new_prompt_uids])
        seconds = time.perf_counter() - start
        self.stats.add(hits=1, load_seconds=seconds, bytes_read=nbytes, saved_seconds=saved)
        if origin is not None:
            self.stats.add(**{origin.counter: 1})
        self.replayed_steps.add(step)
        logger.info("%s hit: step %d replayed from step %d at %s: %d trajectories for %d prompts x %d "
                    "(%d bytes, %.3fs)",
                    self.name, step, load_step,
                    self.step_dump_dir(load_step) if origin is None else origin.describe(Layout.step_dir_of(origin.path)),
                    len(new_keys), len(new_prompt_uids), sessions, nbytes, seconds)

    def _await_store(self, step: int, path: str) -> None:
        """Under ``replay``: read the inner entry (or the step's manifest) at ``path`` the store did not answer
        for, with the reader's bounded retries; it returns once the store answers.

        Raises:
            StoreUnavailableError: it never did (the error names the store's own).
        """
        step_dir = self.step_dump_dir(step)
        try:
            if path == self.layout.manifest_path(step):  # the step's manifest itself went unanswered
                self.reader.answered(path, step, lambda: _answer_of(self.store, step_dir))
            else:
                self.reader.read(path, step, step)
        except StoreUnavailableError as err:
            self.entry_unavailable(step, path, str(err.__cause__ or err))
            raise
        except CacheMissError:
            pass  # it answered: what the step holds is decided by the resolve that follows

    def was_replayed(self, step: int) -> bool:
        """True when the submit phase of ``step`` was served from the cache whole (nothing was generated)."""
        return step in self.replayed_steps

    # ------------------------------------------------------------------ action: compare

    def compare_submit(self, step: int, prompts: Any) -> None:
        """The submit phase of ``action: compare``: the batch goes to rollout either way; a complete recorded
        step is read and joined on the live prompts, to be compared as its trajectories are sampled; a
        step without one (or with a damaged one: counted and reported) is recorded as under ``cache``
        (:meth:`stepskip._reading.compare.StepComparer.submit`).

        Raises:
            UnreadableEntryError: an inner entry is intact but cannot be read here (never recorded over).
        """
        self.forget_withheld(step)
        self.comparer.submit(step, prompts)

    def compare_sample(self, step: int, sampled: Any) -> None:
        """The sample phase of ``action: compare``: compare the sampled trajectories with the recorded ones and,
        under ``train_on: recorded``, put the recorded fields in the queue
        (:meth:`stepskip._reading.compare.StepComparer.sample`).

        Raises:
            DriftError: a field drifted and ``on_drift`` is ``error``.
        """
        self.comparer.sample(step, sampled)

    # ------------------------------------------------------------------ action: match

    def match_inject(self, step: int, prompts: Any, partition_id: str = "train") -> Any:
        """The submit phase of ``action: match``: inject every prompt of the batch whose group was recorded.

        ``prompts`` is the batch ``_next_train_batch`` returned (one row per prompt, a ``uid``
        column). A prompt whose digest (``rebind_keys`` excluded) the index knows gets the recorded
        trajectories of its group under the live uid (``{uid}_{session}_0``, sessions cycling over
        the recorded ones, or missing under ``match_n: strict`` when their count is not ``n``), tags
        set to the live step, and is marked finished. When prompts are missing the step is marked
        for recording and the batch restricted to them is returned, for ``_submit_batch_to_rollout``.

        Returns:
            The missing prompts (the whole batch when none was recorded), or None when all were.

        Raises:
            SkipConfigError: the batch has no rows or no ``uid`` column.
        """
        self.forget_withheld(step)
        return self.step_matcher.inject(step, prompts, partition_id)

    def inject_extra(self, step: int, prompts: Any, partition_id: str = "train") -> Any:
        """Serve prompts added to a replayed step from the cache, by prompt: never generated.

        verl adds prompts to a step outside its submit phase: the replay buffer's refill (groups
        evicted as stale, failed or filtered) and, after a resume, the re-issued in-flight prompts.
        On a step the cache replays they must not reach the engine: each prompt whose group was
        recorded (at any step, as ``action: match`` finds it) is injected under its live uid
        (:meth:`stepskip._matching.v1.StepMatcher.inject_extra`).

        Args:
            step: the replayed step.
            prompts: the batch verl would submit (one row per prompt, a ``uid`` column).
            partition_id: the queue partition.

        Returns:
            The prompts the cache does not hold (None when it held them all): the caller decides
            what happens to them; they are never generated here.
        """
        return self.step_matcher.inject_extra(step, prompts, partition_id)

    # ------------------------------------------------------------------ verl's names (its tests and trainer use them)

    def _get_v1_inner_dir(self, step: int, inner_idx: int) -> Any:
        return self._path(self.inner_dump_dir(step, inner_idx))

    def _check_valid_v1_step(self, step: int) -> bool:
        return self.entries.present(step)

    def _check_valid_v1_step_path(self, path: Any) -> bool:
        return self.reader.probe(str(path)).state is EntryStatus.PRESENT

    def _find_first_missing_inner(self, step: int) -> int:
        for inner, (_, probe) in enumerate(self.entries.probed(step)):
            if probe.state is not EntryStatus.PRESENT:
                return inner
        return -1

    def _get_available_steps_v1(self) -> list[int]:
        return self.available_steps()

    def _resolve_load_step_v1(self, step: int) -> int:
        return self.resolve_load_step(step)


def _answer_of(store: Any, step_dir: str) -> None:
    """Read the manifest of ``step_dir`` once; returns once the store answered, whatever the answer (a damaged or
    newer manifest is judged by the resolve that follows)."""
    try:
        read_manifest(store, step_dir)
    except (CorruptEntryError, UnreadableEntryError):
        pass


def _add_step_hint(doc: Any, name: str, recording: str | None, metas: list[dict[str, Any]]) -> bool:
    return bool(doc.add_step(name, recording, metas))
