"""A pytest plugin that starts every background dump late, to find tests that read too early.

A test that looks at a dump's files or counters without ``SkipManager.flush()`` first passes
only while the dump worker happens to be quick. With this plugin each job waits 0.3 s before it
runs, so such a test fails every time instead of once in a while under load::

    PYTHONPATH=src:tools python -m pytest -p late_dumps tests/unit

Only for hunting such tests: it is never loaded by ``make test``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from stepskip.worker import DumpWorker

DELAY_S = 0.3
_submit = DumpWorker.submit


def _late_submit(self: DumpWorker, job: Callable[[], None]) -> None:
    def late() -> None:
        time.sleep(DELAY_S)
        job()

    _submit(self, late)


DumpWorker.submit = _late_submit  # type: ignore[method-assign]
