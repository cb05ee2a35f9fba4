"""What a written entry commits: a flat entry itself, or (V1) the step once its last inner entry is in.

A flat entry is published atomically by its own write (:class:`EntryCommit`). A V1 step is built
from ``parameter_sync_step`` inner entries and becomes visible whole once the last one is written
(:class:`StepCommit`), in one of two ways (a :class:`StepPublisher`):

- :class:`PublishDirectory`: the inner entries are written into a hidden ``.tmp-{step}-{token}``
  directory beside the step, which is then renamed over it (stores that publish directories).
- :class:`PublishManifest`: they are written into a recording ``{step}/rec-{token}/`` and committed
  by the step's manifest, written last (object stores; :mod:`stepskip._manifest`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from stepskip._layout import Layout
from stepskip._manifest import new_recording, publish_manifest
from stepskip._stats import RoleStats

__all__ = ["Commit", "EntryCommit", "PublishDirectory", "PublishManifest", "StepCommit", "StepPublisher",
           "StepRecording", "Written", "publisher_for"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Written:
    """An entry just written: where, for which step, and the ``meta.json`` it holds."""

    path: str
    step: int
    meta: dict[str, Any]


class Commit(Protocol):
    """A role's commit strategy: told of every entry written and of every dump that failed."""

    #: Consecutive small entries may be written as one batch (each entry is published by its own write).
    batches: bool
    #: Called with the steps just committed (visible to readers), on the thread that committed them.
    committed: Callable[[list[int]], None] | None

    def entries_written(self, written: Sequence[Written]) -> None: ...

    def entry_failed(self, path: str, step: int) -> None: ...

    def in_progress(self) -> set[int]:
        """The steps being recorded whose commit is still to come (never removed meanwhile)."""
        ...

    def reset(self) -> None:
        """A new run: nothing it recorded is pending."""
        ...

    def after_fork(self) -> None:
        """In a forked child: locks are fresh (one may have been held at the fork)."""
        ...


class EntryCommit:
    """Flat entries: each is published by its own write; ``written`` hears of them (the digest tables).

    Args:
        written: called with the entries of each write or batch, once they are published.
    """

    batches = True

    def __init__(self, written: Callable[[Sequence[Written]], None] | None = None) -> None:
        self._written = written
        self.committed: Callable[[list[int]], None] | None = None

    def entries_written(self, written: Sequence[Written]) -> None:
        if self._written is not None and written:
            self._written(written)
        if self.committed is not None and written:
            self.committed([entry.step for entry in written])

    def entry_failed(self, path: str, step: int) -> None:
        """Nothing to undo: a flat entry that was not written was never published."""

    def in_progress(self) -> set[int]:
        """None: each entry is committed by its own write (the queued ones are the dumper's)."""
        return set()

    def reset(self) -> None:
        """Nothing is kept between entries."""

    def after_fork(self) -> None:
        """Nothing is locked."""


class StepPublisher(Protocol):
    """How a V1 step's inner entries are staged and then made visible at once."""

    def staging(self, layout: Layout, step: int) -> str:
        """A fresh place for one recording of ``step``'s inner entries."""
        ...

    def publish(self, store: Any, staging: str, step_dir: str, inner_entries: int, run_id: str) -> None:
        """Make the recording in ``staging`` the step at ``step_dir``."""
        ...

    def recording(self, staging: str) -> str | None:
        """The recording's name inside its step directory (None: it becomes the step directory itself)."""
        ...


class PublishDirectory:
    """Stage in a hidden directory beside the step and rename it over the step (one rename, or an
    exchange with the step it replaces): two runs recording one step end with one whole step."""

    def staging(self, layout: Layout, step: int) -> str:
        return layout.staging_dir(step, uuid.uuid4().hex[:12])

    def publish(self, store: Any, staging: str, step_dir: str, inner_entries: int, run_id: str) -> None:
        store.publish_dir(staging, step_dir)

    def recording(self, staging: str) -> str | None:
        return None


class PublishManifest:
    """Stage in a recording of its own, ``{step}/rec-{token}/``, committed by the step's manifest
    written last: for stores that cannot rename a directory."""

    def staging(self, layout: Layout, step: int) -> str:
        return layout.recording_dir(step, new_recording())

    def publish(self, store: Any, staging: str, step_dir: str, inner_entries: int, run_id: str) -> None:
        publish_manifest(store, step_dir, staging.rsplit("/", 1)[-1], inner_entries, run_id)

    def recording(self, staging: str) -> str | None:
        return staging.rsplit("/", 1)[-1]


def publisher_for(store: Any) -> StepPublisher:
    """The publisher a store supports: a directory rename where it publishes directories atomically, else a
    manifest."""
    return PublishDirectory() if store.capabilities.atomic_dir_publish else PublishManifest()


@dataclass(eq=False)
class StepRecording:
    """One V1 step this run records: where its inner entries go and how far they are.

    Args:
        staging: where its inner entries are written (see :class:`StepPublisher`).
        clock: when its rollout began, then when its latest inner sample was saved (``perf_counter``).
        regenerate: the submit phase decided to (re)generate it (a damaged cached step is overwritten).
        digest: the digest of the prompts submitted for it.
        uid_prompts: live prompt uid -> the digest of its prompt (``action: match``'s row digests).
        saved: inner entries written or queued.
        written: inner entries written into ``staging``.
        failed: an inner entry could not be written: the step is never published.
        metas: inner index -> the meta written (the step's hint once published).
    """

    staging: str
    clock: float | None = None
    regenerate: bool = False
    digest: str | None = None
    uid_prompts: dict[str, str] = field(default_factory=dict)
    saved: int = 0
    written: int = 0
    failed: bool = False
    metas: dict[int, dict[str, Any]] = field(default_factory=dict)

    def holds(self, path: str) -> bool:
        """Whether the inner entry at ``path`` belongs to this recording (not to one it replaced)."""
        return path.startswith(self.staging + "/")


class StepOwner(Protocol):
    """What a step commit reads from the V1 role it publishes for."""

    name: str
    run_id: str
    stats: RoleStats
    parameter_sync_step: int

    @property
    def store(self) -> Any: ...

    @property
    def layout(self) -> Layout: ...

    @property
    def row_wise(self) -> bool: ...

    def step_dump_dir(self, step: int) -> str: ...


class StepCommit:
    """V1 steps: the records of the steps this run records, each published once its inner entries are in.

    Args:
        owner: the V1 role.
        publisher: how steps are published; None: chosen by the store (:func:`publisher_for`).
        replacing: called with a step directory just before a recording replaces it.
        published: called with ``(step, recording, the inner entries' metas in order)`` once a step
            was published with every inner entry's meta known (the step's hint).
    """

    batches = False

    def __init__(self, owner: StepOwner, publisher: StepPublisher | None = None,
                 replacing: Callable[[str], None] | None = None,
                 published: Callable[[int, str | None, list[dict[str, Any]]], None] | None = None) -> None:
        self.owner = owner
        self._publisher = publisher
        self._replacing = replacing
        self._published = published
        self.committed: Callable[[list[int]], None] | None = None
        self.records: dict[int, StepRecording] = {}
        #: Held while a record is read or changed (the caller's thread and the dump worker's).
        self.lock = threading.Lock()

    @property
    def publisher(self) -> StepPublisher:
        """The publisher given, else the one the store supports (the store is known once bound)."""
        return self._publisher if self._publisher is not None else publisher_for(self.owner.store)

    def reset(self) -> None:
        """A new run: nothing recorded yet."""
        self.records = {}

    def after_fork(self) -> None:
        self.lock = threading.Lock()

    def new_recording(self, step: int, **fields: Any) -> StepRecording:
        """A fresh recording of ``step`` (caller holds :attr:`lock`), replacing any earlier one."""
        staging = self.publisher.staging(self.owner.layout, step)
        record = self.records[step] = StepRecording(staging=staging, **fields)
        return record

    def entries_written(self, written: Sequence[Written]) -> None:
        """Count each inner entry toward its step; a step whose last inner entry is in is published."""
        complete: list[tuple[int, StepRecording]] = []
        with self.lock:
            for entry in written:
                record = self.records.get(entry.step)
                if record is None or not record.holds(entry.path):
                    continue  # a recording replaced since it was queued: it publishes nothing
                inner = entry.meta.get("inner_idx")
                if isinstance(inner, int) and self.owner.row_wise and not record.failed:
                    record.metas[inner] = entry.meta
                record.written += 1
                if record.written == self.owner.parameter_sync_step and not record.failed:
                    complete.append((entry.step, record))
        for step, record in complete:
            self._publish(step, record)

    def in_progress(self) -> set[int]:
        """Steps begun (submitted, or some inner entries written) and neither published nor failed."""
        with self.lock:
            return {step for step, record in self.records.items()
                    if record.written < self.owner.parameter_sync_step and not record.failed}

    def entry_failed(self, path: str, step: int) -> None:
        """A step with an inner entry that could not be written is never published (nor hinted)."""
        with self.lock:
            record = self.records.get(step)
            if record is not None and record.holds(path):
                record.failed = True
                record.metas = {}

    def _publish(self, step: int, record: StepRecording) -> None:
        owner = self.owner
        target = owner.step_dump_dir(step)
        if self._replacing is not None:
            self._replacing(target)
        publisher = self.publisher
        try:
            publisher.publish(owner.store, record.staging, target, owner.parameter_sync_step, owner.run_id)
        except Exception as err:  # the dump boundary: publishing may fail like any write
            owner.stats.add(dump_failures=1)
            logger.error("%s dump failed: step %d not published from %s to %s: %s: %s",
                         owner.name, step, record.staging, target, type(err).__name__, err)
            with self.lock:
                record.metas = {}
            return
        logger.info("%s dump: step %d published at %s (%d inner entries)", owner.name, step, target,
                    owner.parameter_sync_step)
        with self.lock:
            metas, record.metas = record.metas, {}
        count = owner.parameter_sync_step
        if self._published is not None and sorted(metas) == list(range(count)):  # the hint of the step as published
            self._published(step, publisher.recording(record.staging), [metas[i] for i in range(count)])
        if self.committed is not None:
            self.committed([step])
