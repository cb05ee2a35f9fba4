"""Recycled memory for the big tensors a hit hands back.

A fresh page costs its first write a page fault, and on a virtual machine a second one in the
host: rebuilding a 2048 x (1024 + 4096) batch (436 MB) faults in 106k pages, about half of the
time the whole load takes, while the bytes themselves are written in a fraction of it. glibc
cannot help: every block above its mmap threshold (32 MiB at most) is mapped fresh and unmapped
again when freed. So the decoders take their big outputs from :class:`PagePool`: private
anonymous mappings that go back to the pool when the last tensor (or numpy view) using them is
freed, and serve the next hit with pages already in place.

The pool keeps at most :data:`KEEP_BYTES` of idle mappings per process (environment variable
``STEPSKIP_KEEP_BYTES``, read at import, in bytes; ``0`` turns recycling off), the longest idle
dropped first when it must drop some: a trainer replaying step after step reuses the same
shapes, so between two hits about one batch's worth sits idle. ``SkipManager.close()`` releases
the pool: its idle pages are unmapped, and pages given back later (a batch still held then) are
unmapped as they come, until the next ``SkipManager.init``.

Example:
    >>> out = POOL.empty((4, 8), torch.int64)
    >>> out.shape
    torch.Size([4, 8])
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import mmap
import os
import threading
import weakref

import numpy as np
import numpy.typing as npt
import torch

from stepskip._env import env_bytes

__all__ = ["PagePool", "POOL", "KEEP_BYTES", "MIN_BYTES"]

#: Outputs smaller than this come from the ordinary allocator. Above it glibc maps fresh pages for
#: a block at first and trims freed heap back to the system: a 256-row batch's 1-3 MB tensors
#: faulted in a few hundred pages each on every hit, about a tenth of the hit.
MIN_BYTES = 256 << 10
_GRAIN = 2 << 20  # sizes are rounded up to this, so that one step's shapes map onto the last step's


logger = logging.getLogger(__name__)


def _keep_bytes() -> int:
    return env_bytes("STEPSKIP_KEEP_BYTES", 4 << 30, "e.g. 2147483648, or 0 to turn the page pool off",
                     "keeping at most 4 GiB of idle pages")


KEEP_BYTES = _keep_bytes()
_NUMPY = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
          torch.int32: np.int32, torch.int64: np.int64, torch.uint16: np.uint16, torch.uint32: np.uint32,
          torch.uint64: np.uint64, torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


class PagePool:
    """Hands out big arrays backed by recycled private mappings (thread-safe).

    An array's mapping returns to the pool when the array is freed, that is when nothing uses its
    memory any more: the tensor made from it, its views, numpy views of those. Mappings are
    ``MAP_PRIVATE``: a forked child gets its own copy, never a shared one.

    Args:
        keep: the most idle bytes kept for reuse; mappings beyond it are unmapped.
        min_bytes: smaller arrays come from numpy's allocator.
    """

    def __init__(self, keep: int = KEEP_BYTES, min_bytes: int = MIN_BYTES) -> None:
        self.keep = keep
        self.min_bytes = min_bytes
        self.released = False
        self._lock = threading.Lock()
        self._idle: list[tuple[int, int, mmap.mmap]] = []  # (size, when given back, mapping), by size
        self._given = 0
        # mappings given back and not yet filed: a finalizer may run on a thread that holds the lock (the
        # cyclic GC can free an array anywhere), so giving back never waits for the lock
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self.reused = 0  # arrays served from an idle mapping (tests and benchmarks read these)
        self.mapped = 0  # arrays that needed a new mapping
        pool = weakref.ref(self)

        def after_fork() -> None:
            alive = pool()
            if alive is not None:
                alive._forked()

        os.register_at_fork(after_in_child=after_fork)

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return sum(size for size, _, _ in self._idle)

    def array(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype``."""
        dtype = np.dtype(dtype)
        count = math.prod(shape)
        if count * dtype.itemsize < self.min_bytes or self.keep <= 0 or self.released:
            return np.empty(shape, dtype=dtype)
        size = -(-(count * dtype.itemsize) // _GRAIN) * _GRAIN
        buffer = self._take(size)
        if buffer is None:
            try:
                buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except OSError:  # out of address space or memory: numpy's allocator raises MemoryError for it
                return np.empty(shape, dtype=dtype)
        flat = np.frombuffer(buffer, dtype=dtype, count=count)
        # every view of it (numpy points them all at flat) and every tensor made from one holds flat:
        # when flat goes, nothing uses the mapping any more
        weakref.finalize(flat, self._give, buffer).atexit = False
        return flat.reshape(shape)

    def buffer(self, size: int) -> memoryview | None:
        """``size`` writable bytes in recycled pages for a file read whole (the storage layer's allocator,
        :data:`stepskip._storage.Allocator`); None below :attr:`min_bytes` (ordinary bytes are cheaper).

        Example:
            >>> POOL.buffer(16) is None, len(POOL.buffer(POOL.min_bytes))
            (True, 262144)
        """
        if size < self.min_bytes:
            return None
        return self.array((size,), np.uint8).data  # the memoryview holds the array, and so the pages

    def empty(self, shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor (its storage is not resizable when it comes from the pool)."""
        if math.prod(shape) * dtype.itemsize < self.min_bytes or self.keep <= 0 or self.released:
            return torch.empty(tuple(shape), dtype=dtype)
        if dtype == torch.bfloat16:  # numpy has no bfloat16: the same bits as int16
            return torch.from_numpy(self.array(tuple(shape), np.int16)).view(torch.bfloat16)
        numpy_dtype = _NUMPY.get(dtype)
        if numpy_dtype is None:
            return torch.empty(tuple(shape), dtype=dtype)
        return torch.from_numpy(self.array(tuple(shape), numpy_dtype))

    def clear(self) -> None:
        """Unmap every idle mapping."""
        with self._lock:
            self._file_returned()
            self._idle = []

    def release(self) -> None:
        """Unmap every idle mapping, and those given back from now on, until :meth:`resume`."""
        self.released = True
        self.clear()

    def resume(self) -> None:
        """Keep mappings for reuse again (after :meth:`release`)."""
        self.released = False

    def _take(self, size: int) -> mmap.mmap | None:
        with self._lock:
            self._file_returned()
            at = bisect.bisect_left(self._idle, (size,))
            # the smallest idle mapping that fits, wasting at most a quarter of the request and one grain
            if at < len(self._idle) and self._idle[at][0] <= size + size // 4 + _GRAIN:
                self.reused += 1
                return self._idle.pop(at)[2]
            self.mapped += 1
        return None

    def _give(self, buffer: mmap.mmap) -> None:
        self._returned.append(buffer)
        if self._lock.acquire(blocking=False):  # else whoever holds it files this one
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """File the mappings given back into the idle list (the lock held)."""
        while self._returned:
            buffer = self._returned.popleft()
            if self.released or len(buffer) > self.keep:
                continue  # unmapped when the last reference goes, just below
            self._given += 1
            bisect.insort(self._idle, (len(buffer), self._given, buffer), key=lambda item: item[:2])
        total = sum(item[0] for item in self._idle)
        while total > self.keep:  # the longest idle goes first
            oldest = min(range(len(self._idle)), key=lambda i: self._idle[i][1])
            total -= self._idle.pop(oldest)[0]

    def _forked(self) -> None:
        """In a forked child: a fresh lock (another thread of the parent may have held it) and no idle pages."""
        self._lock = threading.Lock()
        self._idle, self._returned = [], collections.deque()


#: The process's pool, shared by every decoder.
POOL = PagePool()
