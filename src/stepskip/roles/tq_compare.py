"""``action: compare`` for the V1 role (``rollout_tq``): what its submit and sample phases do.

At submit, the batch goes to rollout as under ``cache``; a complete recorded step is read and each
live trajectory key (``{uid}_{session}_0``) joined with the recorded trajectory of the same prompt
(by the prompt digests every inner entry records) and session — as a replay would put them, for
entries that record no digests (verl's). As the replay buffer samples the live trajectories they
are read back from the queue and, under ``train_on: recorded``, replaced there by the recorded
fields (the trainer reads those); once the step's last sample is in, the two are compared
(:mod:`stepskip.compare`) and the drift reported (:mod:`stepskip.drift`).

The role's ``compare_submit`` and ``compare_sample`` hooks call :func:`submit` and :func:`sample`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepskip.drift import Recorded
from stepskip.errors import CacheMissError, CorruptEntryError
from stepskip.policies import TrainOn
from stepskip.resolve import remap_v1
from stepskip.roles.rollout_tq import _complete
from stepskip._storage import EntryState

if TYPE_CHECKING:
    from stepskip.roles.rollout_tq import RolloutTqSkip

__all__ = ["Compared", "submit", "sample"]

logger = logging.getLogger(__name__)


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


def submit(role: RolloutTqSkip, step: int, prompts: Any) -> None:
    """The submit phase of ``action: compare``: the batch is submitted to rollout either way. A complete
    recorded step is read and its trajectories joined on the live prompt uids, as a replay would
    put them in the queue, to be compared as the live ones are sampled (:func:`sample`); a
    step without one (or with a damaged one: counted and reported) is recorded as under ``cache``.

    Raises:
        UnreadableEntryError: an inner entry is intact but cannot be read here (never recorded over).
    """
    probed = role._probed(step)
    for path, probe in probed:
        if probe.state is EntryState.UNREADABLE:
            raise role._unreadable(probe.reason)
    damage: tuple[str, str] | None = None
    if _complete(probed):
        try:
            compared = _read(role, step, prompts)
        except CorruptEntryError as err:  # counted by the read
            damage = (role.step_dump_dir(step), str(err))
        except CacheMissError as err:
            logger.info("%s compare: step %d not compared (%s)", role.name, step, err)
        else:
            with role._lock:
                for earlier in [s for s in role._compared if s != step][:-1]:  # steps never sampled whole
                    del role._compared[earlier]
                role._compared[step] = compared
            return
    for path, probe in probed:
        if probe.state is EntryState.DAMAGED:
            role._report_corrupt(step, path, probe.reason)
            damage = damage or (path, probe.reason)
    if damage is not None:
        role.drift_log.damaged(role, step, *damage)
    role.stats.add(misses=1)
    role.begin_recording(step, prompts)


def _read(role: RolloutTqSkip, step: int, prompts: Any) -> Compared:
    """The recorded step's trajectories and the recorded row each live trajectory key is compared with."""
    from stepskip.tq.rows import concat_rows, num_rows, payload_problem

    where = role._step_root(step)
    start = time.perf_counter()
    parts: list[Any] = []
    keys: list[str] = []
    tags: list[dict[str, Any]] = []
    digests: list[Any] = []
    nbytes, first_meta = 0, dict[str, Any]()
    for inner in range(role.parameter_sync_step):
        path = f"{where.root}/{inner}"
        payload, meta, _, size = role._read_entry(path, step, -1)
        recorded = meta.get("row_prompts")
        problem = payload_problem(payload, recorded if isinstance(recorded, list) else None)
        if problem is not None:
            role._report_corrupt(step, path, problem)
            raise CorruptEntryError(f"{role.name}: step {step} at {path} is damaged: {problem}")
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
        rows = _join_on_prompts(keys, digests, role._uid_prompts_of(prompts), role.layout.n)
        if rows is None:  # no prompt digests recorded (verl wrote it): joined as a replay puts them
            plan = remap_v1(keys, tags, [str(u) for u in prompts["uid"]], role.layout.n, step)
            rows = dict(zip(plan.keys, plan.rows))
    except Exception as err:  # crafted or damaged inner entries
        reason = f"step {step}'s inner entries cannot be joined on the live uids ({type(err).__name__}: {err})"
        role._report_corrupt(step, role.step_dump_dir(step), reason)
        raise CorruptEntryError(f"{role.name}: {reason}") from err
    seconds = time.perf_counter() - start
    role.stats.add(load_seconds=seconds, bytes_read=nbytes)
    path = role.step_dump_dir(step)
    recorded_step = Recorded(path, data, dict(first_meta), nbytes, seconds,
                             role._prompts_equal(step, path, first_meta, prompts))
    return Compared(recorded_step, rows)

def sample(role: RolloutTqSkip, step: int, sampled: Any) -> None:
    """The sample phase of ``action: compare``: join the sampled live trajectories with the recorded ones
    by key; under ``train_on: recorded`` put the recorded fields into the queue under the live keys
    (the trainer reads those); once the step's last sample is in, compare and report.

    Raises:
        DriftError: a field drifted and ``on_drift`` is ``error``.
    """
    from stepskip.compare import compare_values
    from stepskip.tq.rows import concat_rows, select_rows

    partition = getattr(sampled, "partition_id", None)
    with role._lock:
        compared = role._compared.get(step)
    if compared is None or partition != "train":
        return
    keys = [str(k) for k in sampled.keys]
    joined = [(i, compared.rows[k]) for i, k in enumerate(keys) if k in compared.rows]
    try:
        live = role.tq_client.kv_batch_get(keys=keys, partition_id=partition)
        recorded_part = select_rows(compared.recorded.value, [r for _, r in joined])
        live_part = live if len(joined) == len(keys) else select_rows(live, [i for i, _ in joined])
        if joined and role.config.train_on is TrainOn.RECORDED:
            role.tq_client.kv_batch_put(keys=[keys[i] for i, _ in joined], fields=recorded_part,
                                        partition_id=partition)
    except Exception as err:  # a report: the trainer goes on with what it sampled
        with role._lock:
            role._compared.pop(step, None)
        logger.error("%s compare: step %d not compared: the sampled trajectories could not be read back or "
                     "replaced in the queue: %s: %s", role.name, step, type(err).__name__, err)
        return
    with role._lock:
        compared.parts.append((recorded_part, live_part))
        compared.unjoined += len(keys) - len(joined)
        compared.samples += 1
        if compared.samples < role.parameter_sync_step:
            return
        del role._compared[step]
    if compared.unjoined:
        logger.warning("%s compare: step %d: %d sampled trajectories have keys no recorded trajectory maps to; "
                       "they are not compared", role.name, step, compared.unjoined)
    drift = compare_values(concat_rows([p[0] for p in compared.parts]), concat_rows([p[1] for p in compared.parts]),
                           role.tolerance, exclude=role.rebind_keys, prompts_equal=compared.recorded.prompts_equal)
    role.drift_log.report(role, step, drift, compared.recorded)
