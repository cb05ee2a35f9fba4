"""A role's dump pipeline: snapshot on the caller's thread, write now or in the background, count.

The boundary of a dump: nothing about a result or the storage may stop the training run, so every
failure here is logged and counted in ``dump_failures``, never raised to the caller. What happens
once an entry is written (a flat entry is published by its own write; a V1 step waits for its last
inner entry) is the role's commit strategy (:mod:`stepskip._dumping.commit`).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import numpy as np

from stepskip._dumping.commit import Commit, Written
from stepskip._dumping.worker import default_worker
from stepskip._version import __version__
from stepskip._calls import CURRENT_CALL
from stepskip.config import SkipRoleConfig
from stepskip._entries import FormatSpec
from stepskip._stage_inputs import encode_entry
from stepskip._stats import RoleStats

__all__ = ["Dumper", "DumpOwner", "SMALL_DUMP_BYTES", "small_size"]

logger = logging.getLogger(__name__)

#: A snapshot holding less than this (tensors and estimated non-tensor part) is a small dump: it may
#: queue beyond the job bound and be committed in a batch with the small dumps queued next to it.
SMALL_DUMP_BYTES = 1 << 20
#: At most this many non-tensor objects are looked at to size a snapshot; more make it a large dump.
_SIZED_OBJECTS = 4096
_CONTAINERS = (list, tuple, set, frozenset)


class DumpOwner(Protocol):
    """What the dump pipeline reads from the role it writes for."""

    name: str
    run_id: str
    config: SkipRoleConfig
    stats: RoleStats
    format_spec: FormatSpec
    fingerprint: dict[str, Any]
    async_dump: bool

    @property
    def store(self) -> Any: ...

    @property
    def format(self) -> Any: ...


class Dumper:
    """The dumps of one role: snapshots, the writes (at once or queued), the dumps still queued.

    Args:
        owner: the role (its name, store, codec, counters and options).
        commit: what an entry's write commits (see :mod:`stepskip._dumping.commit`).
        wrote: called after every write attempt, queued or not, batched or not (the role's listing
            of its directory is then taken afresh).
    """

    def __init__(self, owner: DumpOwner, commit: Commit, wrote: Callable[[], None]) -> None:
        self.owner = owner
        self.commit = commit
        self._wrote = wrote
        #: Entry path -> the event set once its queued dump finished (written or failed).
        self.pending: dict[str, threading.Event] = {}
        self.lock = threading.Lock()

    def prepare(self, dumps: bool) -> None:
        """What a role's first call would otherwise pay for, done at its start-up: the codec imported
        (with its modules and their libraries), its threads and (``dumps`` in the background) the
        dump worker's started.

        Only in a process that imported torch already: a program without it (a plain function
        decorated, steps not cached) never loads torch through stepskip, whose codecs need it.
        """
        if "torch" not in sys.modules:
            return
        # the prompt digests of a hit's check and a miss's record, and a miss's hint tables
        importlib.import_module("stepskip._fidelity")
        importlib.import_module("stepskip._matching.hints")
        start_threads = getattr(self.owner.format, "start_threads", None)
        if start_threads is not None:
            start_threads()
        if dumps and self.owner.async_dump:
            default_worker().start()

    def after_fork(self) -> None:
        """In a forked child: the parent's queued dumps are not this process's to wait for (no thread
        here finishes them; a lock may have been held at the fork)."""
        self.pending = {}
        self.lock = threading.Lock()

    # ------------------------------------------------------------------ on the caller's thread

    def snapshot(self, step: int, path: str, value: Any, copy: bool,
                 meta: Callable[[], dict[str, Any]]) -> tuple[Any, dict[str, Any]] | None:
        """``(frozen value, meta)`` for a dump, or None after counting a failure (the dump boundary); None
        under ``read_only``, where a generated result is returned to its caller and never recorded."""
        if self.owner.config.read_only:
            logger.info("%s: step %d was generated and is not recorded (read_only: nothing is written under %s)",
                        self.owner.name, step, path.rpartition("/")[0])
            return None
        try:
            return self.owner.format.freeze(value, copy=copy), meta()
        except Exception as err:  # the dump boundary: nothing about a result may stop the training run
            self.failed(step, path, err)
            return None

    def entry_meta(self, step: int, generation_seconds: float | None, **extra: Any) -> dict[str, Any]:
        """The ``meta.json`` fields every entry of the role records, and ``extra``."""
        owner = self.owner
        return {
            "global_steps": int(step),
            "role": owner.name,
            "format": owner.format_spec.name,
            "stepskip_version": __version__,
            "run_id": owner.run_id,
            "created_unix": time.time(),
            "generation_seconds": generation_seconds,
            "fingerprint": owner.fingerprint,
            **extra,
        }

    def with_inputs(self, step: int, prepared: tuple[Any, dict[str, Any]], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The snapshot of a result with its call's arguments beside it (``record_inputs``); the result alone,
        with a warning naming the argument, when they cannot be stored safely."""
        from stepskip._stage_inputs import WithInputs, call_arguments, freeze_inputs, inputs_meta

        info = CURRENT_CALL.get()
        positional, keyword, method_of = call_arguments(info.function if info is not None else None, args, kwargs)
        frozen, meta = prepared
        try:
            inputs = freeze_inputs(positional, keyword, copy=self.owner.async_dump)
        except Exception as err:  # the dump boundary: the result is still recorded
            logger.warning("%s: step %d is recorded without its inputs (record_inputs): %s: %s", self.owner.name,
                           step, type(err).__name__, err)
            return prepared
        meta["inputs"] = inputs_meta(positional, keyword, method_of)
        return WithInputs(frozen, inputs), meta

    def submit(self, path: str, step: int, frozen: Any, meta: dict[str, Any]) -> None:
        """Write the entry now, or queue it (``async_dump``): a small one may be committed in a batch."""
        owner = self.owner
        if not owner.async_dump:
            try:
                self.write(path, step, frozen, meta)
            finally:  # after the commit's own publication too (a V1 step's)
                self._wrote()
            return
        done = threading.Event()
        with self.lock:
            self.pending[path] = done
        try:
            dump = _Dump(self, path, step, frozen, meta, done)
            nbytes = small_size(frozen)
            # consecutive small dumps are committed together (fsyncs batched) where the store can and the
            # commit strategy publishes each entry by its own write
            batches = nbytes is not None and self.commit.batches and owner.store.capabilities.batched_fsync
            default_worker().submit(dump, nbytes=nbytes, group=self.write_batch if batches else None)
        except BaseException as err:  # never queued (no thread to start, an interrupt): nothing waits for it
            self.finish(path, done)
            if not isinstance(err, Exception):
                raise
            self.failed(step, path, err)  # the dump boundary: training goes on

    def await_pending(self, path: str) -> None:
        """Wait for this run's queued dump of ``path``: a call at that step then replays it instead of
        generating (and dumping) the same step a second time."""
        done = self.pending.get(path)
        if done is not None and not default_worker().on_worker_thread():  # a job never waits for itself
            done.wait()

    def queued_in(self, directory: str) -> list[str]:
        """The names of the entries directly below ``directory`` whose dumps are still queued."""
        if not self.pending:
            return []
        own = directory + "/"
        with self.lock:
            return [p[len(own):].split("/", 1)[0] for p in self.pending if p.startswith(own)]

    # ------------------------------------------------------------------ on the worker's thread

    def finish(self, path: str, done: threading.Event) -> None:
        """A queued dump is over (written or not): whoever waits for it goes on."""
        self._wrote()  # every queued write ends here, batched or not
        with self.lock:
            if self.pending.get(path) is done:
                del self.pending[path]
        done.set()

    def write(self, path: str, step: int, frozen: Any, meta: dict[str, Any]) -> bool:
        """Encode and write one entry, then commit it; False after counting a failure (the dump boundary)."""
        owner = self.owner
        start = time.perf_counter()
        try:
            files = encode_entry(owner.format, frozen)
            written = owner.store.write_entry(path, files, meta)
        except Exception as err:  # the dump boundary: no storage error may stop the training run
            self.failed(step, path, err)
            return False
        seconds = time.perf_counter() - start
        owner.stats.add(dumps=1, dump_seconds=seconds, bytes_written=written)
        logger.info("%s dump: step %d written to %s (%d bytes, %.3fs)", owner.name, step, path, written, seconds)
        self.commit.entries_written([Written(path, step, meta)])
        return True

    def write_batch(self, dumps: list[_Dump]) -> None:
        """Write consecutive queued dumps as one batch (the worker's group for small entries).

        The store publishes each entry atomically and makes it durable before it counts as
        written, as :meth:`write` does, with the fsyncs of the whole batch issued together; a
        failure is counted for its own entry alone. Only dumps to a store that batches fsyncs come
        here. On a local store the batch goes to the helper processes once ready
        (:mod:`stepskip._dumping.helper`: encoding there leaves this process's GIL to the caller),
        else it is written on this thread.
        """
        from stepskip._dumping.helper import HelperUnavailable, helper_enabled, write_small_entries, write_with_helpers

        owner = self.owner
        try:
            start = time.perf_counter()
            items = [(dump.path, dump.frozen, dump.meta) for dump in dumps]
            sent: list[int | Exception | None] = [None] * len(items)
            store = owner.store
            if owner.config.dump_process and helper_enabled() and store.capabilities.local_files \
                    and store.root is not None and owner.format_spec.name == "safe":
                try:
                    sent = write_with_helpers(store.root, owner.format_spec.name, str(owner.config.compress), items)
                except HelperUnavailable:
                    pass  # not ready, or not for these snapshots: written here
            here = [i for i, result in enumerate(sent) if result is None]  # what the helpers did not write
            for i, result in zip(here, write_small_entries(store, owner.format, [items[i] for i in here])):
                sent[i] = result
            results = cast("list[int | Exception]", sent)  # one result per entry now
            written = [(d, r) for d, r in zip(dumps, results) if not isinstance(r, Exception)]
            seconds = (time.perf_counter() - start) / max(1, len(written))  # each entry's share of the batch
            self.commit.entries_written([Written(d.path, d.step, d.meta) for d, _ in written])
            for dump, result in zip(dumps, results):
                if isinstance(result, Exception):
                    self.failed(dump.step, dump.path, result)
                    continue
                owner.stats.add(dumps=1, dump_seconds=seconds, bytes_written=result)
                logger.info("%s dump: step %d written to %s (%d bytes, one of a batch of %d)",
                            owner.name, dump.step, dump.path, result, len(dumps))
        finally:
            for dump in dumps:
                self.finish(dump.path, dump.done)

    def failed(self, step: int, path: str, err: BaseException) -> None:
        """Count and log a dump that did not happen; the commit strategy hears of it too."""
        self.owner.stats.add(dump_failures=1)
        logger.error("%s dump failed: step %d not written to %s: %s: %s",
                     self.owner.name, step, path, type(err).__name__, err)
        self.commit.entry_failed(path, step)


@dataclass(eq=False, slots=True)
class _Dump:
    """One queued background dump; called alone, it writes its entry as :meth:`Dumper.write` does."""

    dumper: Dumper
    path: str
    step: int
    frozen: Any
    meta: dict[str, Any]
    done: threading.Event

    def __call__(self) -> None:
        try:
            self.dumper.write(self.path, self.step, self.frozen, self.meta)
        finally:
            self.dumper.finish(self.path, self.done)


def small_size(frozen: Any) -> int | None:
    """The bytes a snapshot holds when it is a small dump; None for a large or unknown one.

    Its tensors are counted exactly; its non-tensor part (the snapshot tree: text, message
    lists, numpy arrays ...) by :func:`_rough_bytes`, an estimate that bounds the queue's
    memory as the tensors' bytes do. A snapshot that is not sized cheaply is a large dump.
    """
    tensors = getattr(frozen, "tensors", None)
    if not isinstance(tensors, dict):
        return None
    total = 0
    for tensor in tensors.values():
        nbytes = getattr(tensor, "nbytes", None)
        if not isinstance(nbytes, int):
            return None
        total += nbytes
        if total >= SMALL_DUMP_BYTES:
            return None
    if not total:  # no tensors: not the one-sample entry that small dumps are for
        return None
    # a snapshot that lists the non-tensor values of its tree is sized by those (the rest of the tree is
    # a node per tensor or value, counted below), without walking every node
    leaves = getattr(frozen, "leaves", None)
    rest = _rough_bytes(leaves if isinstance(leaves, list) else getattr(frozen, "tree", None),
                        SMALL_DUMP_BYTES - total)
    if rest is None:
        return None
    nodes = len(tensors) + (len(leaves) if isinstance(leaves, list) else 0)
    return total + rest + 256 * nodes + 4096  # the tree's nodes, and the meta


def _rough_bytes(tree: Any, limit: int) -> int | None:
    """An estimate of the memory a snapshot tree holds outside its tensors, or None once it
    reaches ``limit`` or :data:`_SIZED_OBJECTS` objects (each distinct object counted once).

    numpy arrays count their ``nbytes`` (object arrays their items too), strings and bytes
    ``sys.getsizeof``, containers 8 bytes an item plus their items; deferred snapshots their
    snapshot. Other leaves (numbers, None) count 32 bytes.
    """
    total, seen, todo = 0, set(), [tree]
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(seen) > _SIZED_OBJECTS:
            return None
        sized = isinstance(value, (dict, *_CONTAINERS))
        items = value.size if isinstance(value, np.ndarray) else len(value) if sized else 0
        if items > _SIZED_OBJECTS:
            return None  # too many items to look at: given up before copying them into ``todo``
        if isinstance(value, (str, bytes)):
            total += sys.getsizeof(value)
        elif isinstance(value, np.ndarray):
            total += value.nbytes
            if value.dtype.hasobject:
                todo.extend(value.reshape(-1).tolist())
        elif isinstance(getattr(value, "nbytes", None), int):  # a tensor (torch is imported lazily here)
            total += value.nbytes
        elif isinstance(value, dict):
            total += 16 * len(value)
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, _CONTAINERS):
            total += 8 * len(value)
            todo.extend(value)
        elif hasattr(value, "snapshot") and hasattr(value, "items"):  # safe's deferred leaf
            todo.append(value.snapshot)
        else:
            total += 32
        if total >= limit:
            return None
    return total
