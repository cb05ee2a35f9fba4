"""``action: match`` for the V1 role: the prompt index over complete steps' inner entries, and the
submit phase that injects the recorded prompt groups of a batch into the queue.

Every inner entry records, per trajectory, the digest of the prompt it answers
(``meta["row_prompts"]``). A step directory is read once (its manifest resolved, its inner entries
probed) the first time it is listed, or described by the recorder's hint document and validated only
when a call chooses it; it is forgotten when it is no longer listed or is about to be replaced.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stepskip._matching.batches import PromptIndex
from stepskip._matching.index import HINTED_FROM, MatchIndex, step_of
from stepskip._reading.classify import EntryStatus, root_state
from stepskip._reading.reader import seconds_of
from stepskip.errors import CacheMissError, SkipConfigError, StoreUnavailableError
from stepskip._layout import Layout
from stepskip._manifest import resolve_step
from stepskip._policies import MatchN
from stepskip._resolve import remap_v1

if TYPE_CHECKING:
    from stepskip.roles.rollout_tq import RolloutTqSkip

__all__ = ["StepMatchIndex", "StepMatcher"]

logger = logging.getLogger(__name__)


class StepMatchIndex(MatchIndex):
    """The prompt index over the inner entries of every complete step the V1 role could replay."""

    owner: RolloutTqSkip

    def __init__(self, owner: RolloutTqSkip) -> None:
        super().__init__(owner)

    def reset(self) -> None:
        super().reset()
        self.indexed: dict[str, list[str]] = {}  # step directory -> its inner entries in the prompt index
        self.hinted: dict[str, Any] = {}  # step directory -> the StepHint it was indexed from, until validated

    def refresh(self) -> PromptIndex:
        """The index, refreshed from the step directories :meth:`sources` lists: a step directory is
        read the first time it is listed, and forgotten when it is no longer there."""
        from stepskip._matching.hints import StepHint

        with self.lock:
            if self.prompts is None:
                self.prompts = PromptIndex()
            index = self.prompts
            listed = set(self.sources())
            for step_dir in [d for d in self.indexed if d not in listed]:
                for path in self.indexed.pop(step_dir):
                    index.forget(path)
                self.hinted.pop(step_dir, None)
            new = sorted(listed - set(self.indexed))
            hints = self.read_hints({d.rsplit("/", 1)[0] for d in new}, set(new)) if len(new) >= HINTED_FROM else {}
            for step_dir in new:
                hint = hints.get(step_dir)
                if isinstance(hint, StepHint) and len(hint.inner) == self.owner.parameter_sync_step:
                    root = Layout.recording_in(step_dir, hint.recording)
                    paths = [Layout.inner_path(root, inner) for inner in range(len(hint.inner))]
                    for path, part in zip(paths, hint.inner):  # validated when a call chooses the step
                        index.add(path, hint.step, part.digests)
                    self.indexed[step_dir] = paths
                    self.hinted[step_dir] = hint
                    continue
                added = self._index_step(index, step_dir)
                if added is not None:
                    self.indexed[step_dir] = added
            return index

    def hint_holds(self, path: str, hint: Any) -> bool:
        """Whether a step's hint says what its first inner entry holds now (identity, step, digests)."""
        from stepskip._matching.hints import StepHint

        if not isinstance(hint, StepHint) or not hint.inner:
            return False
        return super().hint_holds(Layout.inner_path(Layout.recording_in(path, hint.recording), 0), hint.inner[0])

    def forget_step(self, step_dir: str) -> None:
        """A recording is about to replace the step at ``step_dir``: its inner entries are indexed afresh."""
        with self.lock:
            indexed = self.indexed.pop(step_dir, [])
            if self.prompts is not None:
                for path in indexed:
                    self.prompts.forget(path)

    def validate_hints(self, index: PromptIndex, step_dirs: list[str]) -> None:
        """Index the hinted steps a call chose from their manifest and inner entries, as without hints
        (:meth:`_index_step`): what the hint said is replaced by what the step holds."""
        with self.lock:
            for step_dir in step_dirs:
                hint = self.hinted.pop(step_dir, None)
                if hint is None:
                    continue
                hinted = self.indexed.pop(step_dir, [])
                for path in hinted:
                    index.forget(path)
                added = self._index_step(index, step_dir)
                if added is not None:
                    self.indexed[step_dir] = added
                if added != hinted:
                    logger.debug("%s match: %s changed since its hint was written; indexed from its entries",
                                 self.owner.name, step_dir)

    def _index_step(self, index: PromptIndex, step_dir: str) -> list[str] | None:
        """Index the inner entries of a complete step; None (looked at again next time) for any other."""
        owner = self.owner
        where = resolve_step(owner.store, step_dir)
        if root_state(where) is not EntryStatus.PRESENT:
            return None
        root = where.root
        inner_names = sorted(int(n) for n in owner.store.list_dir(root, dirs_only=True) if n.isascii() and n.isdigit())
        paths = [Layout.inner_path(root, i) for i in inner_names]
        probes = [(path, owner.reader.probe(path)) for path in paths]
        metas = [p.meta or {} for _, p in probes]
        declared = metas[0].get("parameter_sync_step", 1) if metas else 0
        complete = (bool(probes) and inner_names == list(range(len(probes))) and declared == len(probes)
                    and all(p.state is EntryStatus.PRESENT and owner.reader.servable(p.meta or {}) for _, p in probes)
                    and len({m.get("run_id") for m in metas}) == 1)
        if not complete:
            return None  # half-written or mixed: never served
        added = []
        for (path, _), meta in zip(probes, metas):
            recorded = meta.get("row_prompts")
            if isinstance(recorded, list) and all(d is None or isinstance(d, str) for d in recorded):
                index.add(path, step_of(meta), [d or "" for d in recorded])
                added.append(path)
        return added


@dataclass
class _Part:
    """The trajectories one inner entry gives a call: the rows, their new keys and tags, the live rows
    they serve, and the generation time they save."""

    path: str
    rows: Any
    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    serves: set[int] = field(default_factory=set)
    saved: float = 0.0


class StepMatcher:
    """The submit phase of ``action: match`` for the V1 role."""

    def __init__(self, owner: RolloutTqSkip, index: StepMatchIndex) -> None:
        self.owner = owner
        self.index = index

    def inject(self, step: int, prompts: Any, partition_id: str = "train") -> Any:
        """Inject every prompt of the batch whose group was recorded (see ``RolloutTqSkip.match_inject``).

        Returns:
            The missing prompts (the whole batch when none was recorded), or None when all were.

        Raises:
            SkipConfigError: the batch has no rows or no ``uid`` column.
        """
        from stepskip._matching.batches import select_batch_rows

        owner = self.owner
        start = time.perf_counter()
        digests, found, nbytes, saved, sources = self._inject_by_prompt(step, prompts, partition_id)
        missing = [row for row in range(len(digests)) if row not in found]
        replayed = len(found)
        owner.stats.add(rows_replayed=replayed, rows_generated=len(missing), bytes_read=nbytes,
                        load_seconds=time.perf_counter() - start if found else 0.0, saved_seconds=saved,
                        hits=0 if missing else 1, misses=1 if missing else 0)
        if not missing:
            owner.replayed_steps.add(step)
        if found:
            logger.info("%s match: step %d injected %d of %d prompts (%s); %d prompts submitted to rollout",
                        owner.name, step, replayed, len(digests), self._origin(sources), len(missing))
        if not missing:
            return None
        owner.begin_recording(step, prompts)
        return prompts if not found else select_batch_rows(prompts, missing)

    def inject_extra(self, step: int, prompts: Any, partition_id: str = "train") -> Any:
        """Serve prompts added to a replayed step from the cache, by prompt (see ``RolloutTqSkip.inject_extra``).

        Returns:
            The prompts the cache does not hold (None when it held them all); never generated here.
        """
        from stepskip._matching.batches import select_batch_rows

        owner = self.owner
        start = time.perf_counter()
        digests, found, nbytes, saved, sources = self._inject_by_prompt(step, prompts, partition_id)
        missing = [row for row in range(len(digests)) if row not in found]
        owner.stats.add(rows_replayed=len(found), bytes_read=nbytes, saved_seconds=saved,
                        load_seconds=time.perf_counter() - start if found else 0.0)
        logger.info("%s: %d prompts added to replayed step %d: %d served from the cache (%s), %d not recorded",
                    owner.name, len(digests), step, len(found), self._origin(sources) or "none", len(missing))
        if not missing:
            return None
        return prompts if not found else select_batch_rows(prompts, missing)

    def _origin(self, sources: dict[str, int]) -> str:
        return ", ".join(f"{count} from {self.owner.matcher.short(path)}" for path, count in sorted(sources.items()))

    def _inject_by_prompt(self, step: int, prompts: Any, partition_id: str
                          ) -> tuple[list[str], set[int], int, float, dict[str, int]]:
        """Inject the recorded group of every prompt of ``prompts`` the cache holds, under its live uid.

        Returns:
            The prompts' digests, the rows injected, the bytes read, the generation seconds saved and
            how many rows each step directory served.

        Raises:
            SkipConfigError: the batch has no rows or no ``uid`` column.
        """
        from stepskip._fidelity import prompt_row_digests

        owner = self.owner
        try:
            digests = prompt_row_digests(prompts, owner.rebind_keys, stepless=True)
            uids = [str(u) for u in prompts["uid"]]
        except (KeyError, TypeError, ValueError) as err:
            raise SkipConfigError(f"skip.{owner.name}: prompts are looked up in the cache from the batch of "
                                  f"_next_train_batch, with one row per prompt and a 'uid' column: {err}") from err
        index = self.index.refresh()
        unknown = [row for row, digest in enumerate(digests) if digest not in index.groups]
        if unknown:  # steps recorded before stepless digests: their digests name the step, so match at it only
            earlier = prompt_row_digests(prompts, owner.rebind_keys)
            for row in unknown:
                if earlier[row] in index.groups:
                    digests[row] = earlier[row]
        strict = owner.config.match_n is MatchN.STRICT
        n = owner.layout.n
        while True:  # each round validates the hinted steps it chose: the hinted set shrinks, so it ends
            wanted: dict[str, list[int]] = {}  # inner entry -> live rows it serves
            for row, digest in enumerate(digests):
                where = index.groups.get(digest)
                if where is not None and not (strict and len(where.rows) != n):
                    wanted.setdefault(where.path, []).append(row)
            hinted = sorted({Layout.step_dir_of(path) for path in wanted} & set(self.index.hinted))
            if not hinted:
                break
            self.index.validate_hints(index, hinted)
        found, nbytes, saved, sources = self._inject_found(step, wanted, digests, uids, partition_id)
        return digests, found, nbytes, saved, sources

    def _part(self, step: int, path: str, rows: list[int], payload: Any, recorded: list[Any], digests: list[str],
              uids: list[str]) -> _Part | None:
        """The trajectories of the entry at ``path`` for the live ``rows`` (None: it serves none of them).

        Raises:
            IndexError, KeyError, TypeError, ValueError: its payload does not hold what its meta says.
        """
        from stepskip.tq.rows import select_rows

        entry_keys, entry_tags = list(payload["keys"]), list(payload["tags"])
        picked: list[int] = []
        part = _Part(path, None)
        for row in rows:
            group = [i for i, d in enumerate(recorded) if d == digests[row]]
            if not group:  # the entry was replaced by one of other prompts since it was indexed
                continue
            plan = remap_v1([entry_keys[i] for i in group], [entry_tags[i] for i in group],
                            [uids[row]], self.owner.layout.n, step)
            picked.extend(group[r] for r in plan.rows)
            part.keys.extend(plan.keys)
            part.tags.extend(plan.tags)
            part.serves.add(row)
        if not picked:
            return None
        part.rows = select_rows(payload["tensordict"], picked)
        part.saved = len(set(picked)) / max(len(entry_keys), 1)  # the entry's share (times its seconds)
        return part

    def _inject_found(self, step: int, wanted: dict[str, list[int]], digests: list[str], uids: list[str],
                      partition_id: str) -> tuple[set[int], int, float, dict[str, int]]:
        """Put the recorded trajectories of the ``wanted`` live rows into the queue; the rows injected."""
        from stepskip._matching.batches import join_problem
        from stepskip.tq.rows import concat_rows, num_rows, payload_problem

        owner = self.owner
        accepted: list[_Part] = []
        found: set[int] = set()
        nbytes, saved = 0, 0.0
        sources: dict[str, int] = {}
        for path, rows in wanted.items():
            try:
                payload, meta, _, size = owner.reader.read(path, step, -1)
                recorded = meta.get("row_prompts")
                if not isinstance(recorded, list):
                    raise CacheMissError(f"{path} no longer records the prompts of its trajectories")
            except StoreUnavailableError as err:  # not served; the step it is part of is not recorded over
                owner.entry_unavailable(step, path, str(err.__cause__ or err))
                logger.warning("%s match: submitting the %d prompts of %s to rollout", owner.name, len(rows), path)
                continue
            except CacheMissError as err:  # damaged, vanished or replaced since indexed: generate those prompts
                logger.warning("%s match: %s; submitting its %d prompts to rollout", owner.name, err, len(rows))
                self.index.forget([path])
                continue
            part = None
            try:  # metadata and data that disagree (a crafted or damaged entry) must not reach the trainer
                problem = payload_problem(payload, recorded)
                if problem is None:
                    part = self._part(step, path, rows, payload, recorded, digests, uids)
            except (IndexError, KeyError, TypeError, ValueError) as err:
                problem = f"its trajectories cannot be selected ({type(err).__name__}: {err})"
            if problem is not None:
                owner.reader.report_corrupt(step, path, problem)
                logger.warning("%s match: submitting the %d prompts of %s to rollout", owner.name, len(rows), path)
                self.index.forget([path])
                continue
            nbytes += size
            if part is not None:
                part.saved *= seconds_of(meta.get("generation_seconds"))
                accepted.append(part)
        # parts that would not join the others (other columns, dtypes, trailing shapes) cost their own
        # prompts, never the step: the ones that agree with the part serving the most trajectories stay
        reference = max(accepted, key=lambda a: num_rows(a.rows)).rows if len(accepted) > 1 else None
        parts, keys, tags = [], [], []
        for part in accepted:
            problem = None if reference is None or part.rows is reference else join_problem([reference, part.rows])
            if problem is not None:
                owner.reader.report_corrupt(step, part.path, problem)
                logger.warning("%s match: submitting the %d prompts of %s to rollout", owner.name,
                               len(part.serves), part.path)
                self.index.forget([part.path])
                continue
            parts.append(part.rows)
            keys.extend(part.keys)
            tags.extend(part.tags)
            found |= part.serves
            step_dir = Layout.step_dir_of(part.path)
            sources[step_dir] = sources.get(step_dir, 0) + len(part.serves)
            saved += part.saved
        if found:
            try:
                fields = concat_rows(parts)
            except Exception as err:  # each part was checked above; should the join still fail, generate them all
                logger.error("%s match: step %d's recorded trajectories cannot be joined (%s: %s); submitting every "
                             "prompt to rollout", owner.name, step, type(err).__name__, err)
                return set(), nbytes, 0.0, {}
            client = owner.tq_client
            client.kv_batch_put(keys=keys, fields=fields, tags=tags, partition_id=partition_id)
            client.kv_batch_put(keys=[uids[row] for row in sorted(found)], partition_id=partition_id,
                                tags=[{"is_prompt": True, "status": "finished", "global_steps": step} for _ in found])
        return found, nbytes, saved, sources
