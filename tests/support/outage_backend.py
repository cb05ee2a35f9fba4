"""An in-memory store that stops answering reads on demand: a stand-in for an object store that does not
answer (a timeout, a dropped connection, a 503). The real-socket tests
(tests/integration/storage/test_store_outages.py) cover the fsspec path that turns a client's errors into
:class:`~stepskip._storage.outages.StoreOutage`; this one raises it where the backend would, so a unit test
can put any role behind an outage. Writes keep working: a write over the entry would go through.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from stepskip._storage.memory import MemoryBackend, MemoryEntry
from stepskip._storage.outages import StoreOutage
from stepskip._storage.registry import register_backend

SCHEME = "outagetest"


class OutageBackend(MemoryBackend):
    """The in-memory backend, whose entry reads raise :class:`StoreOutage` for the paths ``down`` names."""

    #: entry path -> whether the store does not answer for it (shared by every backend of the scheme)
    down: Callable[[str], bool] = staticmethod(lambda path: False)  # type: ignore[assignment]
    #: the entry paths a read was refused for, in order
    refused: list[str] = []

    def open_entry(self, path: str) -> MemoryEntry:
        if OutageBackend.down(path):
            OutageBackend.refused.append(path)
            raise StoreOutage(path, TimeoutError("Read timeout on endpoint URL (the test's outage)"))
        return super().open_entry(path)


@contextmanager
def outage_store() -> Iterator[str]:
    """A fresh dump dir of the outage scheme (registered for the block); every read answers until ``down`` says."""
    register_backend(SCHEME, OutageBackend)
    OutageBackend.down = staticmethod(lambda path: False)  # type: ignore[assignment]
    OutageBackend.refused = []
    try:
        yield f"{SCHEME}://bucket-{uuid.uuid4().hex[:8]}/dump"
    finally:
        OutageBackend.down = staticmethod(lambda path: False)  # type: ignore[assignment]
        register_backend(SCHEME, None)


def snapshot(root: str) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes, read past the outage."""
    backend = MemoryBackend(root, _shared=True)
    out: dict[str, bytes] = {}
    pending = [root]
    while pending:
        directory = pending.pop()
        for item in backend.items(directory):
            path = f"{directory}/{item.name}"
            if item.kind == "dir":
                pending.append(path)
            else:
                data = backend.read_file(path, 1 << 40)
                assert data is not None
                out[path] = data
    return out
