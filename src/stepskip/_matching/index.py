"""The prompt index a role keeps for ``action: match``, and how it is kept up to date.

It spans every run directory of the role's experiment whose prompt and response lengths are its
run's: a run with another batch size or sample count (``GBS``/``N``) still finds the prompts recorded
by the others. Only entries the role could replay are indexed, from their ``meta.json``; the first
time a run directory has many entries to index, the writers' digest tables are read instead
(:mod:`stepskip._matching.tables`): the entries they cover are indexed only once a live prompt points
at them. What a call costs beyond the listing is set operations over entry names, not a step per entry.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

from stepskip._matching.batches import PromptIndex
from stepskip._reading.classify import EntryStatus, Look
from stepskip.errors import CorruptEntryError
from stepskip._layout import RUN_DIR

if TYPE_CHECKING:
    from stepskip.roles.cached import CachedRole

__all__ = ["MatchIndex", "step_of"]

logger = logging.getLogger(__name__)

#: ``action: match`` reads the hint documents of a run directory once at least this many of its
#: entries are not indexed yet (fewer are read directly: as cheap as the documents' listing).
HINTED_FROM = 8
#: Hint documents read at most, and the rows they may describe in all (bounds should someone plant many).
MAX_HINT_DOCUMENTS = 1024
MAX_HINTED_ROWS = 1 << 25
MAX_HINT_BYTES = 64 << 20  # hint documents (or digest tables) read in all by one role


class MatchIndex:
    """The prompt index of one role's flat entries (see the module docstring)."""

    def __init__(self, owner: CachedRole) -> None:
        from stepskip._matching.tables import DigestTables

        self.owner = owner
        self.lock = threading.Lock()
        #: The digest tables in use, and the entries they cover (indexed once a live prompt points at them).
        self.tables = DigestTables(self)
        self.reset()

    def reset(self) -> None:
        """A new run: nothing indexed, listed or read yet."""
        self.prompts: PromptIndex | None = None  # built on first use
        self.hints_read: set[str] = set()  # run directories whose hint documents (or digest tables) were read
        self._indexed_listing: Any = None  # the listing refresh() last forgot entries by
        # calls of refresh() so far: an entry is ranked in the index (ties of one step) by the call that first
        # saw it, then its path, as if every entry were indexed when first listed, in path order
        self.generation = 0
        self._sources_of: Any = None  # the listing self._sources was made of
        self._sources: frozenset[str] = frozenset()
        self.tables.reset()

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def forget(self, paths: list[str]) -> None:
        """Drop the entries of ``paths`` from the index (damaged, or to be re-read once rewritten)."""
        if not paths:
            return
        with self.lock:
            if self.prompts is not None:
                for path in paths:
                    self.prompts.forget(path)

    def listing(self) -> dict[str, frozenset[str]]:
        """Run directory (with the role's subdirectory) -> the names of its step entries, for every run
        directory the index spans (reused while unchanged: :meth:`StepListing.runs`)."""
        return self.owner.listing.runs(self.owner.layout)

    def sources(self) -> frozenset[str]:
        """Every entry directory of the role in the run directories the index spans."""
        listing = self.listing()
        if self._sources_of is not listing:
            self._sources = frozenset(f"{project}/{name}" for project, names in listing.items() for name in names)
            self._sources_of = listing
        return self._sources

    def refresh(self) -> PromptIndex:
        """The prompt index, refreshed from entries it has not seen (one listing per run directory)."""
        owner = self.owner
        covered = self.tables.covered
        with self.lock:
            if self.prompts is None:
                self.prompts = PromptIndex()
            index = self.prompts
            self.generation += 1
            own = owner.project_dump_dir
            dumper = owner.dumper
            with dumper.lock:  # this run's queued dumps count: indexing one waits for it
                queued = {p.rsplit("/", 1)[1] for p in dumper.pending if p.rsplit("/", 1)[0] == own}
            listing = self.listing()
            if queued:  # indexed from what they hold once written, never from a table's earlier claim
                listing = {**listing, own: listing.get(own, frozenset()) | queued}
                covered.get(own, set()).difference_update(queued)
            if listing is not self._indexed_listing:  # listed afresh: what is no longer there is forgotten
                for project, names in list(index.by_dir.items()):
                    for name in names - listing.get(project, frozenset()):
                        index.forget(f"{project}/{name}")
                for project, still in covered.items():
                    still &= listing.get(project, frozenset())
                self._indexed_listing = listing
            fresh: dict[str, set[str]] = {}  # run directory -> names of entries neither indexed nor covered
            for project, listed in listing.items():
                new = listed.difference(index.by_dir.get(project, ()), covered.get(project, ()))
                if new:
                    fresh[project] = set(new)
            if sum(len(names) for names in fresh.values()) >= HINTED_FROM:
                self.tables.read(index, fresh, queued)
            for path in sorted(f"{project}/{name}" for project, names in fresh.items() for name in names):
                self.index_from_meta(index, path)
            return index

    def index_from_meta(self, index: PromptIndex, path: str, probe: Look | None = None, generation: int = 0) -> bool:
        """Index the entry at ``path`` from its ``meta.json`` (probed here unless given); False when it
        cannot serve prompt groups (not present, not servable here, no row digests). ``generation``: the
        call of :meth:`refresh` that first saw it (this one by default), which ranks it in a tie."""
        reader = self.owner.reader
        probe = reader.probe(path) if probe is None else probe
        meta = probe.meta or {}
        digests = meta.get("row_prompts")
        if (probe.state is EntryStatus.PRESENT and reader.servable(meta) and isinstance(digests, list)
                and all(isinstance(d, str) for d in digests)):
            index.add(path, step_of(meta), digests, (generation or self.generation, path))
            return True
        index.forget(path)
        return False

    # ------------------------------------------------------------------ the writers' hint files

    def index_files(self, wanted: AbstractSet[str], described_by: Callable[[str], tuple[str, str | None] | None],
                    kind: str) -> tuple[str, list[tuple[str, str]]]:
        """The files of the experiment's :data:`stepskip._matching.hints.HINTS_DIR` that ``described_by``
        names as the role's and that describe one of the run directories ``wanted``: the directory, and
        ``(file name, run directory)`` in name order, at most :data:`MAX_HINT_DOCUMENTS` of them (the
        others are left with a warning: their entries are read directly). ``kind`` names them in it."""
        owner = self.owner
        layout = owner.layout
        where = layout.hints_dir
        names: list[tuple[str, str]] = []
        for name in sorted(owner.store.list_dir(where)):
            described = described_by(name)
            if described is None or described[1] != layout.safe_subdir or RUN_DIR.match(described[0]) is None:
                continue  # not a writer's file, or one of another role
            project = layout.project_dir_of(described[0])
            if project in wanted:
                names.append((name, project))
        if len(names) > MAX_HINT_DOCUMENTS:
            logger.warning("%s match: %s holds %d %s for these run directories; reading %d of them (the entries "
                           "of the others are read directly)", owner.name, where, len(names), kind, MAX_HINT_DOCUMENTS)
            names = names[:MAX_HINT_DOCUMENTS]
        return where, names

    def read_index_files(self, where: str, names: list[tuple[str, str]], max_each: int,
                         kind: str) -> Iterator[tuple[str, str, bytes]]:
        """``(run directory, path, bytes)`` of each of ``names`` (from :meth:`index_files`) in turn, each
        read up to ``max_each`` bytes and :data:`MAX_HINT_BYTES` in all; one that cannot be read (a
        link, a directory, too large) is passed over with a warning naming it a ``kind``, one gone
        since listed silently."""
        owner = self.owner
        read_left = MAX_HINT_BYTES
        for name, project in names:
            document = f"{where}/{name}"
            if read_left <= 0:
                logger.warning("%s match: %d bytes of %ss read; the entries of the others are read directly",
                               owner.name, MAX_HINT_BYTES, kind)
                return
            try:
                raw = owner.store.read_small(document, min(max_each, read_left))
            except CorruptEntryError as err:
                logger.warning("%s match: ignoring the %s %s: %s", owner.name, kind, document, err)
                continue
            if raw is None:
                continue  # replaced or removed since listed
            read_left -= len(raw)
            yield project, document, raw

    def read_hints(self, projects: set[str], listed: set[str]) -> dict[str, Any]:
        """Entry path -> its hint, for the ``listed`` paths, from the hint documents of ``projects`` not
        read before (:mod:`stepskip._matching.hints`): one listing per run directory and one bounded read
        per document, at most :data:`MAX_HINT_BYTES` read in all.

        A document is used only when the hints it holds for the first two listed entries match those
        entries' ``meta.json`` (a planted or stale document, or one from a writer whose clock is off,
        is ignored with a warning: its entries are read directly). Two documents that say different
        things of one entry both lose that entry: its ``meta.json`` is read instead.
        """
        from stepskip._matching.hints import HINTS_MAX_BYTES, document_of, parse_hints, rows_of

        out: dict[str, Any] = {}
        disputed: set[str] = set()
        wanted = projects - self.hints_read
        if not wanted:
            return out
        self.hints_read |= wanted
        where, names = self.index_files(wanted, document_of, "hint documents")
        budget = MAX_HINTED_ROWS  # rows all documents may describe: what they cost in memory stays bounded
        for project, document, raw in self.read_index_files(where, names, HINTS_MAX_BYTES, "hint document"):
            hints, problem = parse_hints(raw, document, budget)
            mine = {f"{project}/{entry}": hint for entry, hint in hints.items() if f"{project}/{entry}" in listed}
            del hints  # only the hints of listed entries are kept: what a document costs stays bounded by them
            if not problem:
                sample = sorted(mine, key=lambda path: (len(path), path))[:2]  # its two lowest steps
                if not all(self.hint_holds(path, mine[path]) for path in sample):
                    problem = f"it describes {' or '.join(sample)} otherwise than its meta.json (checked before use)"
            if problem:
                logger.warning("%s match: ignoring the hint document %s: %s; the entries it describes are "
                               "read directly", self.owner.name, document, problem)
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

    def hint_holds(self, path: str, hint: Any) -> bool:
        """Whether ``hint`` says what the entry at ``path`` holds now (its identity, step and digests)."""
        probe = self.owner.reader.probe(path)
        meta = probe.meta or {}
        return (probe.state is EntryStatus.PRESENT and hint.describes(meta) and step_of(meta) == hint.step
                and meta.get("row_prompts") == hint.digests)


def step_of(meta: dict[str, Any]) -> int:
    """The step an entry's ``meta.json`` records, -1 when it records none."""
    step = meta.get("global_steps")
    return step if isinstance(step, int) and not isinstance(step, bool) else -1
