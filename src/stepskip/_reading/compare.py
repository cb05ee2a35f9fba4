"""``action: compare``: a step's recording read before its call runs live, then compared with the live result.

A flat role reads the step's entry before the call (:meth:`Comparer.read`) and compares it with the
live result after it (:meth:`Comparer.result`); the drift is counted, said and written beside the
entry (:mod:`stepskip._drift`), and the call returns the result ``train_on`` names. A step with nothing
to compare with (no entry, a damaged one, one of other settings to regenerate) is recorded as under
``cache``. The V1 role compares a whole step, sample call by sample call (:class:`StepComparer`).

The prompts are compared with the recorded digest after the call, as they were when it was recorded:
a column the call adds to its own prompts (verl's agent loop adds ``priority``) is left out.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepskip._reading.classify import EntryStatus
from stepskip._reading.steps import complete
from stepskip._storage import EntryState
from stepskip._calls import added_columns
from stepskip._drift import Recorded
from stepskip.errors import CacheMissError, CorruptEntryError, PromptMismatchError, StoreUnavailableError
from stepskip._layout import Layout
from stepskip._policies import CheckPrompts, TrainOn
from stepskip._resolve import remap_v1

if TYPE_CHECKING:
    from stepskip._compare import Tolerance
    from stepskip.roles.cached import CachedRole
    from stepskip.roles.rollout_tq import RolloutTqSkip

__all__ = ["Comparer", "StepComparer", "Compared"]

logger = logging.getLogger(__name__)


class Comparer:
    """``action: compare`` for a role of flat entries (see the module docstring)."""

    def __init__(self, owner: CachedRole) -> None:
        self.owner = owner

    def reset(self) -> None:
        """A new run: nothing is being compared."""

    def after_fork(self) -> None:
        """Nothing is locked."""

    @property
    def tolerance(self) -> Tolerance:
        """What ``action: compare`` requires of a live result (``rtol``, ``atol``, ``compare_min_match``)."""
        from stepskip._compare import Tolerance

        config = self.owner.config
        return Tolerance(rtol=config.rtol, atol=config.atol, min_match=config.compare_min_match)

    def read(self, step: int) -> Recorded | None:
        """Read the entry of ``step``, before the call runs live.

        Returns:
            What was read; None when there is nothing to compare with: no entry, a damaged one (counted
            and reported), or one of other settings under ``on_mismatch: regenerate``. The live result
            is then recorded, as under ``cache``.

        Raises:
            UnreadableEntryError: the entry is intact but cannot be read here (it is never recorded over).
        """
        owner = self.owner
        reader = owner.reader
        path = owner.step_dump_dir(step)
        probe = reader.probe_settled(path)
        if probe.state.kept:
            raise reader.unreadable(probe.reason)
        if probe.state is EntryStatus.DAMAGED:
            reader.report_corrupt(step, path, probe.reason)
            owner.drift_log.damaged(owner, step, path, probe.reason)
        elif probe.state is EntryStatus.UNAVAILABLE:  # nothing to compare with; not recorded over
            owner.entry_unavailable(step, path, probe.reason)
        elif probe.state is EntryStatus.PRESENT:
            try:
                value, meta, seconds, nbytes = reader.read(path, step, -1)  # prompts: compared after the call
            except CorruptEntryError as err:  # counted by the read
                owner.drift_log.damaged(owner, step, path, str(err))
            except StoreUnavailableError as err:
                owner.entry_unavailable(step, path, str(err))
            except CacheMissError as err:  # removed meanwhile, or recorded with settings to regenerate
                logger.info("%s compare: step %d not compared (%s)", owner.name, step, err)
            else:
                owner.stats.add(load_seconds=seconds, bytes_read=nbytes)
                return Recorded(path, value, meta, nbytes, seconds)
        owner.stats.add(misses=1)
        if probe.state is EntryStatus.MISSING:
            logger.info("%s compare: step %d has no entry under %s; generating and recording it", owner.name, step,
                        owner.project_dump_dir)
        return None

    def prompts_equal(self, step: int, path: str, meta: dict[str, Any], prompts: Any) -> bool | None:
        """Whether the live prompts are those the entry recorded (None: not known, or ``check_prompts: off``).

        Raises:
            PromptMismatchError: they differ and ``check_prompts`` is ``error``.
        """
        owner = self.owner
        recorded = meta.get("prompt_digest")
        if owner.check_prompts is CheckPrompts.OFF or prompts is None or not recorded:
            return None
        from stepskip._fidelity import digest_like

        # None: an earlier digest scheme, not comparable
        digest = digest_like(recorded, prompts, [*owner.rebind_keys, *added_columns(prompts)])
        if digest is None:
            return None
        if digest != recorded and owner.check_prompts is CheckPrompts.ERROR:
            raise PromptMismatchError(f"{owner.name}: step {step} was recorded for other prompts than this call's "
                                      f"(entry {path}); action: compare cannot judge the live result "
                                      f"(skip.{owner.name}.check_prompts = error)")
        return bool(digest == recorded)

    def result(self, step: int, recorded: Recorded, live: Any, prompts: Any) -> Any:
        """Compare the live result of ``step`` with its recording, report the drift, and return the result
        ``train_on`` names (the recorded one with the live identity columns, or the live one).

        Raises:
            DriftError: a field drifted and ``on_drift`` is ``error``.
            PromptMismatchError: the prompts differ and ``check_prompts`` is ``error``.
        """
        from stepskip._compare import compare_values

        owner = self.owner
        recorded.prompts_equal = self.prompts_equal(step, recorded.path, recorded.meta, prompts)
        drift = compare_values(recorded.value, live, self.tolerance, exclude=owner.rebind_keys,
                               prompts_equal=recorded.prompts_equal)
        owner.drift_log.report(owner, step, drift, recorded)
        if owner.config.train_on is TrainOn.LIVE:
            return live
        try:
            owner.reader.restore_rng(recorded.meta, step, recorded.path)
        except CorruptEntryError:  # counted: the live result (and the live random state) go on
            return live
        owner.reader.rebind(recorded.value, prompts)
        return recorded.value


@dataclass
class Compared:
    """A recorded V1 step under ``action: compare``: read at submit, compared once its samples are in.

    Args:
        recorded: the step's trajectories (``value``: one TensorDict) and what else was read.
        rows: live trajectory key (``{uid}_{session}_0``) -> the recorded row it is compared with.
        parts: ``(recorded rows, live rows)`` of each sample call so far, joined by key.
        unjoined: live trajectories sampled whose key no recorded row maps to.
        samples: sample calls so far.
    """

    recorded: Recorded
    rows: dict[str, int]
    parts: list[tuple[Any, Any]] = field(default_factory=list)
    unjoined: int = 0
    samples: int = 0


class StepComparer(Comparer):
    """``action: compare`` for the V1 role: a whole step, compared as its trajectories are sampled.

    At submit, the batch goes to rollout as under ``cache``; a complete recorded step is read and each
    live trajectory key (``{uid}_{session}_0``) joined with the recorded trajectory of the same prompt
    (by the prompt digests every inner entry records) and session — as a replay would put them, for
    entries that record no digests (verl's). As the replay buffer samples the live trajectories they
    are read back from the queue and, under ``train_on: recorded``, replaced there by the recorded
    fields (the trainer reads those); once the step's last sample is in, the two are compared.
    """

    owner: RolloutTqSkip

    def __init__(self, owner: RolloutTqSkip) -> None:
        super().__init__(owner)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """A new run: no step is being compared."""
        self.compared: dict[int, Compared] = {}  # step -> its recording joined on the live prompts

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def submit(self, step: int, prompts: Any) -> None:
        """The submit phase: the batch is submitted to rollout either way. A complete recorded step is read
        and its trajectories joined on the live prompt uids, to be compared as the live ones are sampled
        (:meth:`sample`); a step without one (or with a damaged one: counted and reported) is recorded as
        under ``cache``.

        Raises:
            UnreadableEntryError: an inner entry is intact but cannot be read here (never recorded over).
        """
        owner = self.owner
        probed = owner.entries.probed(step)
        for _, probe in probed:
            if probe.state.kept:
                raise owner.reader.unreadable(probe.reason)
        owner.withhold_unavailable(step, probed)  # nothing to compare with; the step is not recorded over
        damage: tuple[str, str] | None = None
        if complete(probed):
            try:
                compared = self._read_step(step, prompts)
            except CorruptEntryError as err:  # counted by the read
                damage = (owner.step_dump_dir(step), str(err))
            except StoreUnavailableError as err:  # the step is not recorded over
                owner.entry_unavailable(step, owner.step_dump_dir(step), str(err.__cause__ or err))
            except CacheMissError as err:
                logger.info("%s compare: step %d not compared (%s)", owner.name, step, err)
            else:
                with self.lock:
                    for earlier in [s for s in self.compared if s != step][:-1]:  # steps never sampled whole
                        del self.compared[earlier]
                    self.compared[step] = compared
                return
        for path, probe in probed:
            if probe.state is EntryStatus.DAMAGED:
                owner.reader.report_corrupt(step, path, probe.reason)
                damage = damage or (path, probe.reason)
        if damage is not None:
            owner.drift_log.damaged(owner, step, *damage)
        owner.stats.add(misses=1)
        owner.begin_recording(step, prompts)

    def _read_step(self, step: int, prompts: Any) -> Compared:
        """The recorded step's trajectories and the recorded row each live trajectory key is compared with."""
        from stepskip.tq.rows import concat_rows, num_rows, payload_problem

        owner = self.owner
        where = owner.entries.root(step)
        if where.state is EntryState.UNAVAILABLE:  # answered a moment ago, not now: never read in place instead
            raise StoreUnavailableError(where.reason)
        start = time.perf_counter()
        parts: list[Any] = []
        keys: list[str] = []
        tags: list[dict[str, Any]] = []
        digests: list[Any] = []
        nbytes, first_meta = 0, dict[str, Any]()
        for inner in range(owner.parameter_sync_step):
            path = Layout.inner_path(where.root, inner)
            payload, meta, _, size = owner.reader.read(path, step, -1)
            recorded = meta.get("row_prompts")
            problem = payload_problem(payload, recorded if isinstance(recorded, list) else None)
            if problem is not None:
                owner.reader.report_corrupt(step, path, problem)
                raise CorruptEntryError(f"{owner.name}: step {step} at {path} is damaged: {problem}")
            first_meta = first_meta or dict(meta)
            parts.append(payload["tensordict"])
            keys.extend(str(k) for k in payload["keys"])
            tags.extend(payload["tags"])
            digests.extend(recorded if isinstance(recorded, list) else [None] * len(payload["keys"]))
            nbytes += size
        try:
            data = concat_rows(parts)
            if num_rows(data) != len(keys):
                raise ValueError(f"{num_rows(data)} rows for {len(keys)} keys")
            rows = _join_on_prompts(keys, digests, owner.uid_prompts_of(prompts), owner.layout.n)
            if rows is None:  # no prompt digests recorded (verl wrote it): joined as a replay puts them
                plan = remap_v1(keys, tags, [str(u) for u in prompts["uid"]], owner.layout.n, step)
                rows = dict(zip(plan.keys, plan.rows))
        except Exception as err:  # crafted or damaged inner entries
            reason = f"step {step}'s inner entries cannot be joined on the live uids ({type(err).__name__}: {err})"
            owner.reader.report_corrupt(step, owner.step_dump_dir(step), reason)
            raise CorruptEntryError(f"{owner.name}: {reason}") from err
        seconds = time.perf_counter() - start
        owner.stats.add(load_seconds=seconds, bytes_read=nbytes)
        path = owner.step_dump_dir(step)
        recorded_step = Recorded(path, data, dict(first_meta), nbytes, seconds,
                                 self.prompts_equal(step, path, first_meta, prompts))
        return Compared(recorded_step, rows)

    def sample(self, step: int, sampled: Any) -> None:
        """The sample phase: join the sampled live trajectories with the recorded ones by key; under
        ``train_on: recorded`` put the recorded fields into the queue under the live keys (the trainer
        reads those); once the step's last sample is in, compare and report.

        Raises:
            DriftError: a field drifted and ``on_drift`` is ``error``.
        """
        from stepskip._compare import compare_values
        from stepskip.tq.rows import concat_rows, select_rows

        owner = self.owner
        partition = getattr(sampled, "partition_id", None)
        with self.lock:
            compared = self.compared.get(step)
        if compared is None or partition != "train":
            return
        keys = [str(k) for k in sampled.keys]
        joined = [(i, compared.rows[k]) for i, k in enumerate(keys) if k in compared.rows]
        try:
            live = owner.tq_client.kv_batch_get(keys=keys, partition_id=partition)
            recorded_part = select_rows(compared.recorded.value, [r for _, r in joined])
            live_part = live if len(joined) == len(keys) else select_rows(live, [i for i, _ in joined])
            if joined and owner.config.train_on is TrainOn.RECORDED:
                owner.tq_client.kv_batch_put(keys=[keys[i] for i, _ in joined], fields=recorded_part,
                                             partition_id=partition)
        except Exception as err:  # a report: the trainer goes on with what it sampled
            with self.lock:
                self.compared.pop(step, None)
            logger.error("%s compare: step %d not compared: the sampled trajectories could not be read back or "
                         "replaced in the queue: %s: %s", owner.name, step, type(err).__name__, err)
            return
        with self.lock:
            compared.parts.append((recorded_part, live_part))
            compared.unjoined += len(keys) - len(joined)
            compared.samples += 1
            if compared.samples < owner.parameter_sync_step:
                return
            del self.compared[step]
        if compared.unjoined:
            logger.warning("%s compare: step %d: %d sampled trajectories have keys no recorded trajectory maps to; "
                           "they are not compared", owner.name, step, compared.unjoined)
        drift = compare_values(concat_rows([p[0] for p in compared.parts]),
                               concat_rows([p[1] for p in compared.parts]), self.tolerance,
                               exclude=owner.rebind_keys, prompts_equal=compared.recorded.prompts_equal)
        owner.drift_log.report(owner, step, drift, compared.recorded)


def _join_on_prompts(keys: list[str], digests: list[Any], uid_prompts: dict[str, str], n: int
                     ) -> dict[str, int] | None:
    """Live trajectory key (``{uid}_{session}_0``) -> the recorded row of the same prompt and session.

    Recorded trajectories are grouped by the digest of their prompt (``row_prompts``), live prompts
    found by theirs; a session the recording lacks takes the group's rows in turn, as a replay does.
    None when the recording or the live batch carries no prompt digests.
    """
    if not uid_prompts or len(digests) != len(keys) or not any(digests):
        return None
    groups: dict[str, dict[str, int]] = {}
    for row, (key, digest) in enumerate(zip(keys, digests)):
        if isinstance(digest, str):
            parts = key.split("_")
            groups.setdefault(digest, {}).setdefault(parts[1] if len(parts) > 1 else str(row), row)
    rows: dict[str, int] = {}
    for uid, digest in uid_prompts.items():
        group = groups.get(digest)
        if not group:
            continue
        ordered = list(group.values())
        for session in range(max(n, len(group))):
            rows[f"{uid}_{session}_0"] = group.get(str(session), ordered[session % len(ordered)])
    return rows
