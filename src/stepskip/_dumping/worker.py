"""The background dump worker: a bounded queue drained by one daemon thread.

A miss hands the worker a snapshot and returns; the queue bound gives back-pressure (a trainer
that produces rollouts faster than the disk takes them waits instead of piling up memory).
``flush`` waits for everything queued; an ``atexit`` hook flushes before the interpreter exits.

Small jobs (one-sample entries of the fully async role) may queue up to a byte budget rather than
the job bound, and consecutive jobs of one *group* are handed to the group together: a role then
commits many small entries with their fsyncs batched (each entry still published atomically and
durable before it counts as written).
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DumpWorker", "default_worker", "MAX_BATCH", "SMALL_BUDGET_BYTES"]

logger = logging.getLogger(__name__)

#: At most this many jobs of one group are handed over as one batch.
MAX_BATCH = 64
#: Queued small jobs (those submitted with ``nbytes``) may hold this many bytes in all ...
SMALL_BUDGET_BYTES = 64 << 20
#: ... and be at most this many.
MAX_QUEUED = 1024

Job = Callable[[], None]
Group = Callable[[list[Any]], None]


@dataclass
class _Queued:
    job: Job
    nbytes: int | None
    group: Group | None


class DumpWorker:
    """Runs submitted jobs in order on one thread; jobs handle (log and count) their own errors.

    Args:
        max_pending: jobs that may wait in the queue, whatever their size (more block ``submit``).
        small_budget: bytes that small jobs (``submit(..., nbytes=...)``) may hold in the queue
            beyond ``max_pending``.
        max_batch: the most jobs of one group handed over together.
    """

    def __init__(self, max_pending: int = 2, small_budget: int = SMALL_BUDGET_BYTES,
                 max_batch: int = MAX_BATCH) -> None:
        self._max_pending = max_pending
        self._small_budget = small_budget
        self._max_batch = max(1, max_batch)
        self._queue: collections.deque[_Queued] = collections.deque()
        self._waiting: collections.deque[_Queued] = collections.deque()  # submits not yet admitted, in order
        self._queued_bytes = 0
        self._pending = 0  # queued plus running
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Job, nbytes: int | None = None, group: Group | None = None) -> None:
        """Queue ``job``; blocks while the queue is full (submits are admitted in the order they arrive).

        Args:
            job: run alone as ``job()`` (also when its group has nothing else queued).
            nbytes: the memory the queued job holds, for a small job: it may then queue beyond
                ``max_pending`` while the small jobs' bytes stay within the budget. None: a job
                of unknown (large) size, bounded by ``max_pending`` alone.
            group: jobs submitted one after another with equal groups are run as ``group(jobs)``
                (in order, at most ``max_batch`` at once) instead of one by one; ``group`` must
                finish (or fail, logged and counted) every job it is given.
        """
        self._ensure_started()
        item = _Queued(job, nbytes, group)
        with self._cond:
            # in arrival order: a small job that comes after a waiting large one waits behind it, so
            # a stream of small jobs cannot keep a large one out of the queue
            self._waiting.append(item)
            self._cond.notify_all()  # for those watching ``waiting``
            try:
                self._cond.wait_for(lambda: self._waiting[0] is item and self._admits(item))
            finally:
                self._waiting.remove(item)  # admitted, or interrupted: the next in line may go
                self._cond.notify_all()
            self._queue.append(item)
            self._queued_bytes += nbytes or 0
            self._pending += 1

    @property
    def waiting(self) -> int:
        """Submits blocked for room in the queue."""
        return len(self._waiting)

    def _admits(self, item: _Queued) -> bool:
        if len(self._queue) < self._max_pending:
            return True
        return (item.nbytes is not None and len(self._queue) < MAX_QUEUED
                and self._queued_bytes + item.nbytes <= self._small_budget)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished, those still waiting for room in the queue
        included; False if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0 and not self._waiting, timeout=timeout)

    @property
    def pending(self) -> int:
        return self._pending

    def on_worker_thread(self) -> bool:
        """True inside a job: there, waiting for a queued job would wait for one that runs later."""
        return threading.current_thread() is self._thread

    def start(self) -> None:
        """Start the worker's thread now (a role's start-up) rather than in the first dump."""
        self._ensure_started()

    def _ensure_started(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stepskip-dump", daemon=True)
                self._thread.start()

    def _take(self) -> list[_Queued]:
        """The next job, with the jobs of its group queued right after it."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._queue))
            batch = [self._queue.popleft()]
            group = batch[0].group
            if group is not None:
                while self._queue and len(batch) < self._max_batch and self._queue[0].group == group:
                    batch.append(self._queue.popleft())
            self._queued_bytes -= sum(item.nbytes or 0 for item in batch)
            self._cond.notify_all()  # room for a blocked submit
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            try:
                group = batch[0].group
                if group is None or len(batch) == 1:
                    batch[0].job()
                else:
                    group([item.job for item in batch])
            except BaseException:  # a job's own handler failed: keep the worker alive for the next one
                logger.exception("stepskip dump job failed unexpectedly")
            finally:
                with self._cond:
                    self._pending -= len(batch)
                    self._cond.notify_all()


_default: DumpWorker | None = None
_default_lock = threading.Lock()


def default_worker() -> DumpWorker:
    """The process-wide worker, created on first use."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = DumpWorker()
    return _default


def _forget_after_fork() -> None:
    """In a forked child: the parent's queue and thread are not this process's (no thread runs its
    jobs here, and a lock may have been held at the fork); a dump made here gets a worker of its own."""
    global _default, _default_lock
    _default = None
    _default_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def _flush_at_exit() -> None:
    if _default is not None and _default.pending:
        logger.info("stepskip: waiting for %d pending dump(s) before exit", _default.pending)
        _default.flush()
    helper = sys.modules.get("stepskip._dumping.helper")
    if helper is not None:  # every dump is flushed: the helper processes may go (each exits once its pipe closes)
        helper.close_default()
