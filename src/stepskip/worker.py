"""The background dump worker: a bounded queue drained by one daemon thread.

A miss hands the worker a snapshot and returns; the queue bound gives back-pressure (a trainer
that produces rollouts faster than the disk takes them waits instead of piling up memory).
``flush`` waits for everything queued; an ``atexit`` hook flushes before the interpreter exits.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["DumpWorker", "default_worker"]

logger = logging.getLogger(__name__)


class DumpWorker:
    """Runs submitted jobs in order on one thread; jobs handle (log and count) their own errors."""

    def __init__(self, max_pending: int = 2) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=max_pending)
        self._pending = 0
        self._idle = threading.Condition()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job``; blocks while ``max_pending`` jobs are already waiting."""
        self._ensure_started()
        with self._idle:
            self._pending += 1
        self._queue.put(job)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; False if ``timeout`` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout)

    @property
    def pending(self) -> int:
        return self._pending

    def on_worker_thread(self) -> bool:
        """True inside a job: there, waiting for a queued job would wait for one that runs later."""
        return threading.current_thread() is self._thread

    def _ensure_started(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stepskip-dump", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is not None:
                    job()
            except BaseException:  # a job's own handler failed: keep the worker alive for the next one
                logger.exception("stepskip dump job failed unexpectedly")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()


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


@atexit.register
def _flush_at_exit() -> None:
    if _default is not None and _default.pending:
        logger.info("stepskip: waiting for %d pending dump(s) before exit", _default.pending)
        _default.flush()
