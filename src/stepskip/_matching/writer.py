"""Writing a role's prompt hints: its digest table (flat entries) and its hint document (V1 steps).

A hint is an optimisation for ``action: match`` readers (:mod:`stepskip._matching.hints`): the entries
are written first and stay the truth, so a failure here is logged, never raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stepskip._dumping.commit import Written

if TYPE_CHECKING:
    from stepskip.roles.cached import CachedRole

__all__ = ["HintWriter"]

logger = logging.getLogger(__name__)


class HintWriter:
    """The digest table and hint document one role writes in a run (one writer token each)."""

    def __init__(self, owner: CachedRole) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """A new run: a new table and document, made on first write."""
        self._document: Any = None  # the HintDocument this role writes (V1 steps), made on first write
        self._table: Any = None  # the TableWriter of this role's digest tables (flat entries), made on first write
        self._document_name = ""

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def entries_written(self, written: Sequence[Written]) -> None:
        """Describe the flat entries just ``written`` in this writer's digest table and rewrite it once; a
        table that grows past ``TABLE_ROLL_BYTES`` is written as it was and the next one starts."""
        owner = self.owner
        if owner.v1 or not owner.row_wise:
            return
        records = []
        for entry in written:
            parent, _, name = entry.path.rpartition("/")
            if parent == owner.project_dump_dir and isinstance(entry.meta.get("row_prompts"), list):
                records.append((name, entry.meta))
        if not records:
            return
        from stepskip._matching.hints import TableWriter, table_name

        with self.lock:
            try:
                if self._table is None:
                    self._table = TableWriter()
                for token, data in self._table.add(records):
                    self._put(table_name, token, data)
            except Exception as err:  # a hint is an optimisation: the entries are written, the run goes on
                logger.warning("%s: could not write the digest table of %s: %s: %s", owner.name,
                               ", ".join(name for name, _ in records), type(err).__name__, err)

    def add(self, records: list[tuple[str, Callable[[Any], bool]]]) -> None:
        """Add ``records`` (entry name, a function adding it to a document) to this writer's document and
        write it once; a document that grows past ``HINTS_ROLL_BYTES`` is written as it was and the
        next one starts."""
        if not records:
            return
        from stepskip._matching.hints import HINTS_ROLL_BYTES, HintDocument, document_name, new_writer_token

        owner = self.owner
        with self.lock:
            try:
                changed = False
                for name, add in records:
                    if self._document is None:
                        self._document, self._document_name = HintDocument(owner.run_id, owner.name), new_writer_token()
                    if not add(self._document):
                        continue
                    changed = True
                    if len(self._document.entries) > 1 and self._document.size > HINTS_ROLL_BYTES:
                        # the current document is full: written as it was, the next one starts with this entry
                        self._document.remove(name)
                        self._put(document_name, self._document_name, self._document.to_bytes())
                        stem, _, shard = self._document_name.partition("-")
                        self._document = HintDocument(owner.run_id, owner.name)
                        add(self._document)
                        self._document_name = f"{stem}-{int(shard or 0) + 1}"
                if changed:
                    self._put(document_name, self._document_name, self._document.to_bytes())
            except Exception as err:  # a hint is an optimisation: the entries are written, the run goes on
                logger.warning("%s: could not write the prompt hints of %s: %s: %s", owner.name,
                               ", ".join(name for name, _ in records), type(err).__name__, err)

    def _put(self, naming: Callable[[str, str | None, str], str], token: str, data: bytes) -> None:
        """Write one of this writer's hint documents or digest tables (named by ``naming`` for ``token``) atomically."""
        self.owner.store.put_small(self.owner.layout.hint_path(naming, token), data)
