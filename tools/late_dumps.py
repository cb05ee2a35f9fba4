"""A pytest plugin that starts every background dump late, to find tests that read too early.

A test that looks at a dump's files or counters without ``SkipManager.flush()`` first passes
only while the dump worker happens to be quick. With this plugin each job waits 0.3 s before it
runs, so such a test fails every time instead of once in a while under load::

    PYTHONPATH=src:tools python -m pytest -p late_dumps tests/unit

Only for hunting such tests: it is never loaded by ``make test``.
"""

from __future__ import annotations

import time
from typing import Any

from stepskip._dumping.worker import DumpWorker

DELAY_S = 0.3
_take = DumpWorker._take


def _late_take(self: DumpWorker) -> Any:
    """The worker's next job (or batch of one group's jobs), handed over ``DELAY_S`` late: the jobs
    themselves stay as submitted (a group looks at its jobs, not only calls them)."""
    batch = _take(self)
    time.sleep(DELAY_S)
    return batch


DumpWorker._take = _late_take  # type: ignore[method-assign]
