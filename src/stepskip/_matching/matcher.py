"""``action: match`` for roles whose output rows map one to one onto their prompt rows.

A call's batch is divided into the prompt groups recorded anywhere in the run (read before anything
is generated) and the groups to generate; the function runs once with the missing prompts, and the
live batch is put back together in live row order, recorded rows and generated rows alike. What was
generated is recorded as the step's entry (appended to the entry the step already has, so that no
recorded group is lost).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from stepskip._matching.batches import LoadedRows, MatchSplit, RecordedRow
from stepskip._reading.classify import EntryStatus
from stepskip._reading.reader import seconds_of
from stepskip._calls import CURRENT_CALL, added_columns
from stepskip._storage.layered import origin_of
from stepskip.errors import CacheMissError, CorruptEntryError, SkipConfigError, StoreUnavailableError, UnreadableEntryError
from stepskip._policies import MatchN

if TYPE_CHECKING:
    from stepskip.roles.cached import CachedRole

__all__ = ["Matcher", "row_prompts"]

logger = logging.getLogger(__name__)


class Matcher:
    """The ``match`` calls of one flat role (see the module docstring)."""

    def __init__(self, owner: CachedRole) -> None:
        self.owner = owner

    def split(self, step: int, prompts: Any) -> MatchSplit:
        """Divide the live batch into prompt groups recorded anywhere in this run and groups to generate.

        The entries holding the recorded groups are read here, before anything is generated: an entry
        that turns out damaged — unreadable bytes, or rows that disagree with its ``row_prompts`` —
        is counted corrupt, dropped from the prompt index (never deleted) and its groups are generated;
        one replaced or removed since it was indexed just has its groups generated.

        Raises:
            SkipConfigError: the prompts are not a batch of rows (``match`` needs DataProto-like or
                TensorDict prompts).
        """
        from stepskip._matching.batches import group_rows
        from stepskip._fidelity import prompt_row_digests

        owner = self.owner
        if owner.withheld:  # a new call of the step: whether its store answers is decided afresh
            owner.withheld.forget(owner.step_dump_dir(step))
        try:
            digests = prompt_row_digests(prompts, owner.rebind_keys)
        except ValueError as err:
            raise SkipConfigError(f"skip.{owner.name}.action = 'match': {err}") from err
        groups = group_rows(digests)
        index = owner.match_index.refresh()
        owner.match_index.tables.candidates(index, list(groups))
        strict = owner.config.match_n is MatchN.STRICT
        found: dict[int, RecordedRow] = {}
        missing: list[int] = []
        sources: dict[str, int] = {}
        for digest, rows in groups.items():
            where = index.groups.get(digest)
            if where is None or (strict and len(where.rows) != len(rows)):
                missing.extend(rows)
                continue
            sources[where.path] = sources.get(where.path, 0) + 1
            for session, row in enumerate(rows):  # a different sample count cycles, as the V1 remap does
                found[row] = RecordedRow(where.path, where.rows[session % len(where.rows)])
        damaged: list[str] = []
        loaded = self._load_found(step, found, digests, damaged)  # an entry that failed: its groups are generated
        return MatchSplit(digests=digests, found=found, missing_rows=missing, sources=sources).keeping(
            loaded, prompts, damaged)

    def _load_found(self, step: int, found: dict[int, RecordedRow], digests: list[str],
                    damaged: list[str]) -> dict[str, LoadedRows]:
        """Read the recorded rows ``found`` names, entry by entry.

        An entry is left out (its groups are then generated) when it cannot be read, when its data
        does not hold the rows its ``row_prompts`` describe (damage: counted), or when the rows no
        longer record the prompts they were indexed for (replaced since: not damage). Entries
        found damaged are appended to ``damaged``.
        """
        from stepskip._matching.batches import join_problem, rows_unlike_prompts, select_batch_rows

        owner = self.owner
        reader = owner.reader
        needed: dict[str, dict[int, str]] = {}  # entry -> recorded row -> the digest it must record
        for live_row in sorted(found):
            path, recorded_row = found[live_row]
            needed.setdefault(path, {})[recorded_row] = digests[live_row]
        loaded: dict[str, LoadedRows] = {}
        dropped: list[str] = []
        for path, wanted in needed.items():
            try:
                value, meta, _, size = reader.read(path, step, -1)
            except UnreadableEntryError:
                raise  # intact but not readable here: said, never regenerated over
            except StoreUnavailableError as err:  # not served, and not written over if it is the step's own
                owner.entry_unavailable(step, path, str(err.__cause__ or err))
                dropped.append(path)
                continue
            except CacheMissError as err:  # damaged (counted by the read), vanished, of other settings now
                logger.warning("%s match: %s; generating its %d prompt groups", owner.name, err,
                               len(set(wanted.values())))
                if isinstance(err, CorruptEntryError):
                    damaged.append(path)
                dropped.append(path)
                continue
            recorded = meta.get("row_prompts")
            problem = rows_unlike_prompts(value, recorded)
            if problem is not None or not isinstance(recorded, list):  # (a list whenever problem is None)
                reader.report_corrupt(step, path, str(problem))
                damaged.append(path)
                dropped.append(path)
                continue
            if any(row >= len(recorded) or recorded[row] != digest for row, digest in wanted.items()):
                logger.info("%s match: %s was replaced since it was indexed; generating its prompt groups",
                            owner.name, path)
                dropped.append(path)
                continue
            indices = list(wanted)
            origin = origin_of(meta)  # an entry of a layered cache (sources, replay_from): counted per entry
            if origin is not None:
                owner.stats.add(**{origin.counter: 1})
                logger.info("%s match: step %d reads %d rows of %s", owner.name, step, len(indices), origin.describe())
            try:  # decoding made a consistent batch (Batch and DataProto check their columns); others may not
                loaded[path] = LoadedRows(select_batch_rows(value, indices), indices, meta, size)
            except Exception as err:
                reader.report_corrupt(step, path, f"its rows cannot be selected ({type(err).__name__}: {err})")
                damaged.append(path)
                dropped.append(path)
        # entries that cannot be joined with the others would fail after generation: drop them now
        # (the ones that agree with the entry serving the most rows stay)
        if len(loaded) > 1:
            reference = max(loaded, key=lambda p: len(loaded[p].indices))
            for path in [p for p in loaded if p != reference]:
                problem = join_problem([loaded[reference].rows, loaded[path].rows])
                if problem is not None:
                    reader.report_corrupt(step, path, problem)
                    damaged.append(path)
                    dropped.append(path)
                    del loaded[path]
        owner.match_index.forget(dropped)
        return loaded

    def merge(self, step: int, split: MatchSplit, prompts: Any, generated: Any) -> Any:
        """The live batch in live row order: recorded rows for the found groups, ``generated`` for the rest.

        Records what was generated (the live batch as the step's entry, or appended to the entry the
        step already has, so that no recorded group is lost).
        """
        from stepskip._matching.batches import concat_batches, select_batch_rows

        owner = self.owner
        start = time.perf_counter()
        sources: list[Any] = []
        offsets: dict[str, tuple[int, dict[int, int]]] = {}  # entry -> (its first row in sources, row map)
        nbytes, saved, base = 0, 0.0, 0
        for path, loaded in split.loaded.items():  # split() read every found entry
            nbytes += loaded.nbytes
            recorded_rows = len(loaded.meta.get("row_prompts") or ()) or len(loaded.indices)
            saved += seconds_of(loaded.meta.get("generation_seconds")) * len(loaded.indices) / recorded_rows
            sources.append(loaded.rows)
            offsets[path] = (base, {row: i for i, row in enumerate(loaded.indices)})
            base += len(loaded.indices)
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
            owner.reader.rebind(merged, prompts)
        replayed = len(split.found)
        owner.stats.add(rows_replayed=replayed, rows_generated=len(split.missing_rows), bytes_read=nbytes,
                        load_seconds=time.perf_counter() - start if split.found else 0.0, saved_seconds=saved,
                        hits=0 if split.missing_rows else 1, misses=1 if split.missing_rows else 0)
        if split.found:
            origin = ", ".join(f"{n} from {self.short(path)}" for path, n in sorted(split.sources.items()))
            logger.info("%s match: step %d replayed %d of %d rows (%d prompt groups: %s); %d rows generated",
                        owner.name, step, replayed, len(split.digests), sum(split.sources.values()), origin,
                        len(split.missing_rows))
        if split.missing_rows:
            self._record(step, split, prompts, merged, generated)
        return merged

    def rejoin(self, step: int, split: MatchSplit, prompts: Any, generated: Any
               ) -> tuple[MatchSplit, list[int], Any] | None:
        """After generation: drop the recorded entries whose rows cannot be joined with ``generated``.

        An entry of other columns, dtypes or trailing shapes than the live rows (a crafted entry, or
        one another version recorded) is counted corrupt and forgotten by the index; its groups must
        then be generated as well, so that the live generation is never lost to a failed join.

        Returns:
            None when every loaded entry joins; else ``(the split without those entries, the live
            rows they were to serve, those rows' prompts)``: call the function with those prompts and
            pass its result to :meth:`regenerated`.
        """
        from stepskip._matching.batches import join_problem, select_batch_rows

        owner = self.owner
        if not split.found or generated is None or not split.loaded:
            return None
        bad: list[str] = []
        for path, loaded in split.loaded.items():
            problem = join_problem([generated, loaded.rows])
            if problem is not None:
                owner.reader.report_corrupt(step, path, f"{problem} (the live rows')")
                bad.append(path)
        if not bad:
            return None
        owner.match_index.forget(bad)
        redo = sorted(row for row, where in split.found.items() if where.path in bad)
        logger.warning("%s match: step %d generates %d more rows: their recorded entries do not join the live "
                       "rows", owner.name, step, len(redo))
        narrowed = split.keeping({p: v for p, v in split.loaded.items() if p not in bad}, prompts, bad)
        return narrowed, redo, select_batch_rows(prompts, redo)

    @staticmethod
    def regenerated(split: MatchSplit, narrowed: MatchSplit, redo: list[int], generated: Any, regenerated: Any) -> Any:
        """The rows of ``narrowed.missing_rows`` in order, from the first generation and the second.

        Args:
            split: the split ``generated`` was made for (rows ``split.missing_rows``).
            narrowed: the split :meth:`rejoin` returned for it; ``redo``: the rows it added.
            generated: the first call's rows; ``regenerated``: the rows of ``redo``, in order.

        Returns:
            One batch of the generated rows, in the order of ``narrowed.missing_rows``.
        """
        from stepskip._matching.batches import concat_batches, select_batch_rows

        at = {row: i for i, row in enumerate(split.missing_rows)}
        at.update({row: len(split.missing_rows) + i for i, row in enumerate(redo)})
        return select_batch_rows(concat_batches([generated, regenerated]), [at[row] for row in narrowed.missing_rows])

    def _record(self, step: int, split: MatchSplit, prompts: Any, merged: Any, generated: Any) -> None:
        from stepskip._matching.batches import concat_batches, join_problem, rows_unlike_prompts, select_batch_rows
        from stepskip._fidelity import prompt_row_digests

        owner = self.owner
        path = owner.step_dump_dir(step)
        info = CURRENT_CALL.get()
        seconds = info.generation_seconds if info is not None else None
        to_write, digests = merged, list(split.digests)
        if owner.withheld and owner.withheld.release(path):
            logger.warning("%s match: step %d not dumped: the store did not answer for its entry at %s, which may "
                           "be valid and is left as it is", owner.name, step, path)
            return
        # the step recorded other prompts before: keep them (unless this call found that entry damaged)
        probe = None if path in split.damaged else owner.reader.probe(path)
        if probe is not None and probe.state is EntryStatus.UNAVAILABLE:
            owner.entry_unavailable(step, path, probe.reason)
            owner.withheld.release(path)
            return
        if probe is not None and probe.state is EntryStatus.PRESENT:
            try:
                existing, meta, _, _ = owner.load_entry(step)
                recorded = meta.get("row_prompts")
                problem = rows_unlike_prompts(existing, recorded) or join_problem([generated, existing])
                if isinstance(recorded, list) and problem is not None:
                    owner.reader.report_corrupt(step, path, problem)  # the live rows are written alone
                elif isinstance(recorded, list):
                    subset = select_batch_rows(prompts, split.missing_rows) if split.found else prompts
                    to_write = concat_batches([existing, generated])
                    digests = list(recorded) + prompt_row_digests(subset, [*owner.rebind_keys,
                                                                           *added_columns(subset)])
            except UnreadableEntryError:
                raise  # intact but not readable here: never regenerated over
            except StoreUnavailableError as err:  # what it holds is not known: neither kept nor written over
                owner.entry_unavailable(step, path, str(err.__cause__ or err))
                owner.withheld.release(path)
                return
            except CacheMissError as err:  # damaged (counted) or vanished: the live batch replaces it
                logger.warning("%s match: step %d's entry is not kept (%s); writing this call's rows", owner.name,
                               step, err)
        dumper = owner.dumper
        prepared = dumper.snapshot(step, path, to_write, copy=owner.async_dump,
                                   meta=lambda: dumper.entry_meta(step, seconds, row_prompts=digests))
        if prepared is not None:
            dumper.submit(path, step, *prepared)
        index = owner.match_index
        index.forget([path])  # re-read from the entry once it is written
        with index.lock:
            index.tables.covered.get(owner.project_dump_dir, set()).discard(path.rpartition("/")[2])

    def short(self, path: str) -> str:
        """``step N`` for an entry of this run directory, ``{run}/step N`` for one of another."""
        run_dir, _, step = path.rpartition("/")
        return f"step {step}" if run_dir == self.owner.project_dump_dir else f"{run_dir.rsplit('/', 1)[-1]} step {step}"


def row_prompts(prompts: Any, result: Any, exclude: list[str]) -> list[str] | None:
    """One prompt digest per result row, for an entry of a role that ``match``es: what the prompt index
    is built of (None when ``result`` is not row-aligned with its prompts); ``exclude``: the columns
    left out (the identity columns, and those the call added to its prompts)."""
    if prompts is None:
        return None
    from stepskip._matching.batches import batch_rows
    from stepskip._fidelity import prompt_row_digests

    rows = batch_rows(result)
    if rows < 0 or batch_rows(prompts) != rows:
        return None  # not row-aligned with its prompts: this entry cannot serve prompt groups
    try:
        return prompt_row_digests(prompts, exclude)
    except (TypeError, ValueError):
        return None
