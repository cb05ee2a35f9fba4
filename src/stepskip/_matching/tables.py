"""The writers' digest tables, as a ``match`` reader uses them (:mod:`stepskip._matching.hints`).

A table says which prompt keys each entry of one run directory holds. A reader that trusts a table
leaves the entries it covers unread until a live prompt's key points at one of them, then reads that
entry's ``meta.json`` (the truth) before serving anything from it. A table is trusted only once what it
says of two of its entries is exactly what their ``meta.json`` say, and dropped the moment it is caught
describing an entry otherwise: its entries are then read directly, as without it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import numpy as np

from stepskip._matching.batches import PromptIndex
from stepskip._reading.classify import EntryStatus

if TYPE_CHECKING:
    from stepskip._matching.index import MatchIndex

__all__ = ["DigestTables", "TableClaims"]

logger = logging.getLogger(__name__)

#: Entries one ``match`` call may read for what the digest tables say of its prompts, beyond two per
#: distinct prompt (then they are given up: every entry they cover is read directly).
CANDIDATE_READS = 64
#: Key rows one ``match`` call may look at in the digest tables (honest tables file a prompt's key once
#: per entry holding it, the latest first: a call looks at one or two rows per prompt).
CANDIDATE_SCAN = 1 << 16
_NO_NAMES: frozenset[str] = frozenset()

#: ``((step, rank), the claims, the entry's index in its table, step)`` of an entry a table names.
_Candidate = tuple[tuple[int, tuple[int, str]], "TableClaims", int, int]


@dataclasses.dataclass(eq=False)
class TableClaims:
    """A digest table a reader uses: the table, the run directory whose entries it describes, the
    names of the entries it was taken to cover, and whether it is still believed."""

    table: Any  # a stepskip._matching.hints.KeyTable
    project: str
    generation: int  # the call of MatchIndex.refresh that read it (how its entries rank in a tie)
    covered: set[str] = dataclasses.field(default_factory=set)
    alive: bool = True

    def first_covered(self, heads: dict[int, int], end: int, best: tuple[Any, ...], covered: AbstractSet[str],
                      scan: list[int]) -> _Candidate | None:
        """The latest entry of one key's rows, from ``heads[id(self)]`` to ``end`` (latest first), that
        is still ``covered`` and would beat ``best`` (``(step, rank)`` of the entry the index serves the
        prompt from) once indexed; None when there is none. The head moves past the entries indexed
        already; each row looked at counts against ``scan[0]`` (None once it is spent)."""
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


class DigestTables:
    """The digest tables one role's prompt index uses, and the entries they cover (see the module docstring)."""

    def __init__(self, index: MatchIndex) -> None:
        self.index = index
        self.reset()

    def reset(self) -> None:
        self.claims: list[TableClaims] = []  # the tables in use
        # run directory -> the listed entries a table covers, not indexed yet: read when a live prompt's key
        # points at them (see candidates)
        self.covered: dict[str, set[str]] = {}
        self.covered_in: dict[str, int] = {}  # run directory -> the refresh whose call covered its entries

    def read(self, index: PromptIndex, fresh: dict[str, set[str]], queued: set[str]) -> None:
        """Read the digest tables of the run directories of ``fresh`` not read before: one listing and
        one bounded read per table. The entries a table covers (listed, not indexed, not this run's
        ``queued`` dumps) are taken out of ``fresh`` and covered: indexed once a live prompt points at them.

        A table is used only once what it files under its two lowest such entries of the version it
        names (identity; entries no other table names first) is exactly the keys of their
        ``meta.json``: a planted or damaged table is ignored with a warning, and its entries read
        directly. The entries checked are indexed.
        """
        from stepskip._matching.hints import TABLE_MAX_BYTES, parse_table, table_of
        from stepskip._matching.index import MAX_HINTED_ROWS

        owner = self.index.owner
        wanted = set(fresh) - self.index.hints_read
        if not wanted:
            return
        self.index.hints_read |= wanted
        where, names = self.index.index_files(wanted, table_of, "digest tables")
        budget = MAX_HINTED_ROWS  # keys all tables may hold: what they cost in memory stays bounded
        parsed: list[TableClaims] = []  # every table read, before any is checked
        for project, document, raw in self.index.read_index_files(where, names, TABLE_MAX_BYTES, "digest table"):
            table, problem = parse_table(raw, document, MAX_HINTED_ROWS)
            if table is None:
                logger.warning("%s match: ignoring the digest table %s: %s; the entries it describes are read "
                               "directly", owner.name, document, problem)
                continue
            claims = TableClaims(table, project, self.index.generation)
            open_names = fresh.get(project, set())
            if project == owner.project_dump_dir:
                open_names = open_names - queued
            # the entries it names that are listed and not indexed (an entry two tables name is covered
            # by both: the later writer's describes what it holds now)
            claims.covered = open_names.intersection(map(str, table.names.tolist()))
            parsed.append(claims)
        tables_of: dict[str, list[TableClaims]] = {}
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
                problem = self._problem(index, claims, shared)
            claims.covered -= index.by_dir.get(project, set())  # (the entries its check read)
            if not problem:
                budget -= len(claims.table.keys)
                self.claims.append(claims)
                self.covered.setdefault(project, set()).update(claims.covered)
                self.covered_in[project] = self.index.generation
            else:
                logger.warning("%s match: ignoring the digest table %s: %s; the entries it describes are read "
                               "directly", owner.name, claims.table.document, problem)
        for project, left in fresh.items():  # what is left is read directly
            left.difference_update(self.covered.get(project, ()), index.by_dir.get(project, ()))

    def _problem(self, index: PromptIndex, claims: TableClaims, shared: AbstractSet[str] = _NO_NAMES) -> str:
        """Why the table of ``claims`` is not to be used ("" when it is): what it files under its two
        lowest covered entries of the version it names — those not in ``shared`` (named by other tables
        too) first — must be the keys of their ``meta.json`` exactly. Entries rewritten since (another
        identity) are passed over, four looked at in all; each entry looked at is indexed from what was
        read."""
        from stepskip._matching.hints import digest_keys, identity_key

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
            probe = self.index.owner.reader.probe(path)
            self.index.index_from_meta(index, path, probe)
            meta = probe.meta or {}
            digests = meta.get("row_prompts")
            if probe.state is not EntryStatus.PRESENT or identity_key(meta) != int(table.identities[entry]) \
                    or not isinstance(digests, list) or not all(isinstance(d, str) for d in digests):
                continue  # gone, damaged or rewritten since: no evidence either way
            if not np.array_equal(digest_keys(digests), table.keys_of(entry)):
                return f"it describes {path} otherwise than its meta.json (checked before use)"
            confirmed += 1
        if confirmed < min(2, len(claims.covered)):
            return f"none of the {looked} entries it was checked on holds the version it describes"
        return ""

    def candidates(self, index: PromptIndex, digests: list[str]) -> None:
        """Index, from their ``meta.json``, the entries the digest tables say hold the live ``digests``
        (distinct) and that could win them: for each digest the latest step first, and only while a
        table names an entry that would beat the one the index already serves it from (a later step,
        or the same step ranked higher: :meth:`MatchIndex.index_from_meta`), as if every entry were
        indexed. A key two digests share costs one more read.

        A table whose claimed entry, of the version it names, holds no such key is ignored from then
        on (the entries only it covers are read directly). More than :data:`CANDIDATE_READS`
        ``+ 2 x digests`` reads in one call (tables that keep naming entries that hold nothing, or were
        rewritten since) end the use of tables: every entry they cover is read directly, as without them.
        """
        if not self.claims or not digests:
            return
        from stepskip._matching.hints import digest_key

        with self.index.lock:
            keys = np.fromiter((digest_key(d) for d in digests), dtype=np.uint64, count=len(digests))
            spans = [(claims, np.searchsorted(claims.table.keys, keys, "left"),
                      np.searchsorted(claims.table.keys, keys, "right")) for claims in self.claims]
            hits = sorted({int(j) for _, lo, hi in spans for j in np.flatnonzero(hi > lo)})
            allowed = reads_left = CANDIDATE_READS + 2 * len(digests)
            scan = [CANDIDATE_SCAN]  # key rows looked at in all (a planted table may file a key under many)
            for j in hits:
                digest, key = digests[j], int(keys[j])
                heads = {id(claims): int(lo[j]) for claims, lo, _ in spans}
                while True:
                    where = index.groups.get(digest)
                    best = index.key_of(where.path)[:2] if where is not None else (-1,)
                    pick: _Candidate | None = None
                    for claims, _, hi in spans:
                        covered = self.covered.get(claims.project, _NO_NAMES)
                        found = claims.first_covered(heads, int(hi[j]), best, covered, scan) if claims.alive else None
                        # the one that would win once indexed (the latest step, then the rank the index
                        # breaks ties by); one that would not beat the entry indexed already is never read
                        if found is not None and (pick is None or found[0] > pick[0]):
                            pick = found
                    if scan[0] < 0 or (pick is not None and reads_left == 0):  # past a cap
                        logger.warning("%s match: the digest tables named more than %d entries (or filed more "
                                       "than %d keys) for %d prompts without serving them; reading the entries "
                                       "they cover directly", self.index.owner.name, allowed, CANDIDATE_SCAN,
                                       len(digests))
                        self._drop(index, list(self.claims))
                        return
                    if pick is None:
                        break
                    reads_left -= 1
                    self._read_candidate(index, pick[1], pick[2], pick[3], key)

    def _read_candidate(self, index: PromptIndex, claims: TableClaims, entry: int, step: int, key: int) -> None:
        """Index the entry of ``step`` from its ``meta.json``; ``claims`` says it holds ``key`` (as its
        ``entry``). The table is ignored from then on when that version of the entry holds no such key."""
        from stepskip._matching.hints import digest_key, identity_key

        name = self.index.owner.name
        path = f"{claims.project}/{step}"
        probe = self.index.owner.reader.probe(path)
        self.covered.get(claims.project, set()).discard(str(step))
        self.index.index_from_meta(index, path, probe, claims.generation)
        meta = probe.meta or {}
        if probe.state is not EntryStatus.PRESENT or identity_key(meta) != int(claims.table.identities[entry]):
            logger.debug("%s match: %s changed since its digest table was written; indexed from its meta.json",
                         name, path)
            return
        digests = meta.get("row_prompts")
        if isinstance(digests, list) and any(isinstance(d, str) and digest_key(d) == key for d in digests):
            return  # the prompt looked for, or one sharing its key
        logger.warning("%s match: the digest table %s describes %s otherwise than its meta.json; ignoring that "
                       "table (the entries it covers are read directly)", name, claims.table.document, path)
        self._drop(index, [claims])

    def _drop(self, index: PromptIndex, dropped: list[TableClaims]) -> None:
        """Stop using the tables of ``dropped``: the entries no other table covers are indexed from their
        ``meta.json`` now (the direct path, one read per entry)."""
        for claims in dropped:
            claims.alive = False
        self.claims = [claims for claims in self.claims if claims.alive]
        orphans: list[tuple[str, int]] = []
        for project in {claims.project for claims in dropped}:
            covered = self.covered.get(project, set())
            kept = covered & set().union(*[c.covered for c in self.claims if c.project == project])
            orphans.extend((f"{project}/{name}", self.covered_in.get(project, 0)) for name in covered - kept)
            self.covered[project] = kept
        for path, generation in sorted(orphans):
            self.index.index_from_meta(index, path, generation=generation)
