"""Writing batches of small entries: on the dump worker's thread, or in helper processes.

The fully async role writes one entry per sample. Encoding and staging one costs about a
millisecond, and in the training process that millisecond is spent under the GIL the caller
needs too: every system call of the dump worker hands the GIL over, and the caller's calls
slowed from 0.26 ms to 0.5-1.8 ms each while the worker had work (benchmarks/results/history.md). So
batches of small entries are written by :data:`HELPER_PROCESSES` helper processes, children
started as ``sys.executable -c ...`` (nothing of the training script runs there) that encode and
publish them with the same code, :func:`write_small_entries`, through their own
:class:`~stepskip._storage.EntryStore` of the same root. A batch's entries are dealt out between
them, so the kernel's part (creating each entry's directory and files) runs on several cores too.
Their results (the bytes written, or each entry's error) come back to the dump worker, which
counts and logs them as its own.

The helpers only ever speed things up:

- they start on the first batch and are used once they report ready; until then, and whenever
  none can be used (they failed to start, died, or a snapshot cannot be sent), the dump worker
  writes the entries itself. Entries sent to a helper that dies before answering are written
  again here: each entry is published atomically, so one the helper published first is
  replaced whole. Every entry stays durable before it is visible, as on the worker's thread.
- ``STEPSKIP_DUMP_PROCESS=0`` in the environment, or ``dump_process: false`` on a role, turns
  them off; they are never used for object stores (whose requests wait on the network, not on
  the GIL) nor for large entries (one batch of its own each).
- a child exits when its pipe from the parent closes (the parent exited or was killed), after
  finishing the batch it holds; a forked child of the parent does not use the parent's.

Requests and results travel over pipes as pickle frames between this package's own code at both
ends: no cache's data is ever unpickled (tensors travel as raw bytes beside the frame).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["DumpHelper", "HelperUnavailable", "default_helpers", "helper_enabled", "write_with_helpers",
           "write_small_entries", "ENV", "HELPER_PROCESSES"]

logger = logging.getLogger(__name__)

#: ``0`` turns the helper processes off for every role of this process (and of its children).
ENV = "STEPSKIP_DUMP_PROCESS"
#: The child's program: this stepskip (its directory put on the path unless there already), then :func:`main`.
_CHILD = ("import sys; root = sys.argv[1]; root in sys.path or sys.path.insert(0, root); "
          "from stepskip._dumping.helper import main; sys.exit(main(sys.argv[2:]))")
_HEAD = struct.Struct("<QI")  # pickle bytes, out-of-band buffers (each then as a little-endian u64 size)
_MAX_IOV = 512
#: Helper processes per training process: entries are dealt out between them, so that creating their
#: files (the kernel's time, as much as the encoding) runs on as many cores.
HELPER_PROCESSES = 2
#: A batch is dealt out to no more helpers than give each this many of its entries.
MIN_SHARE = 8
#: The request pipe's size, where the system allows it.
PIPE_BYTES = 1 << 20
#: How long :meth:`DumpHelper.close` waits for the child to exit.
CLOSE_WAIT_SECONDS = 30.0
#: A result frame larger than this is not a result of ours: the helper is not used again.
MAX_RESULT_BYTES = 64 << 20

#: One entry to write: its path, its snapshot (:class:`~stepskip._formats.safe.Frozen` or another
#: format's), its meta.json fields.
Item = tuple[str, Any, dict[str, Any]]


class HelperUnavailable(Exception):
    """The helper could not take or finish a batch: the caller writes it itself."""


def helper_enabled() -> bool:
    """False when the environment turns the helper off (``STEPSKIP_DUMP_PROCESS=0``)."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def write_small_entries(store: Any, codec: Any, items: Iterable[Item]) -> list[int | Exception]:
    """Encode ``items`` one by one and publish them with the store's batched fsyncs.

    Args:
        store: a store with ``write_entries`` (:meth:`~stepskip._storage.EntryStore.write_entries`).
        codec: the format whose ``encode`` turns a snapshot into the entry's files.
        items: ``(path, snapshot, meta)`` of each entry, in order; taken one by one as the store
            asks for the next entry (always to the end).

    Returns:
        Per item, in order: the bytes written, or the exception that kept it from being written
        (its encoding's or its write's); one entry's failure does not stop the others.
    """
    outcome: list[int | Exception | None] = []
    taken: list[int] = []  # items encoded and handed to the store, in order
    source = iter(items)

    def entries() -> Iterator[tuple[str, Any, dict[str, Any]]]:
        """Encoded one by one as the store takes them: encoding overlaps the syncs of those before."""
        for path, frozen, meta in source:
            outcome.append(None)
            try:
                files = codec.encode(frozen)
            except Exception as err:  # the dump boundary: this entry alone is lost
                outcome[-1] = err
                continue
            taken.append(len(outcome) - 1)
            yield path, files, meta

    try:
        results: list[int | Exception] = store.write_entries(entries())
    except Exception as err:  # not expected (the store reports failures per entry): all count as failed
        results = [err] * len(taken)
        outcome.extend(err for _ in source)  # never taken: never written
    for i, result in zip(taken, results):
        outcome[i] = result
    return [RuntimeError("the store returned no result for this entry") if result is None else result
            for result in outcome]


# ---------------------------------------------------------------------- frames


def _pack_tensor(tensor: torch.Tensor, buffers: list[Any]) -> tuple[str, tuple[int, ...], str, int]:
    """A CPU tensor as ``(dtype, shape, how, buffer index)``, its bytes appended to ``buffers``.

    Through numpy where its dtype has one (``how`` the numpy dtype: no torch call that hands the
    GIL over), else as raw bytes (bfloat16 ...)."""
    try:
        array = np.ascontiguousarray(tensor.numpy())
        how = array.dtype.str
    except (TypeError, RuntimeError):  # a dtype numpy lacks
        array, how = tensor.contiguous().reshape(-1).view(torch.uint8).numpy(), ""
    buffers.append(array.reshape(-1))
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), how, len(buffers) - 1


def _unpack_tensor(spec: tuple[str, tuple[int, ...], str, int], buffers: list[bytearray]) -> torch.Tensor:
    dtype, shape, how, index = spec
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise ValueError(f"not a torch dtype: {dtype!r}")
    raw = buffers[index]
    if not len(raw):
        return torch.empty(shape, dtype=kind)
    if how:
        return torch.from_numpy(np.frombuffer(raw, dtype=np.dtype(how)).reshape(shape))
    return torch.frombuffer(raw, dtype=torch.uint8).view(kind).reshape(shape)


def _write_all(fd: int, parts: list[Any]) -> None:
    views: list[memoryview] = []
    for part in parts:
        view = memoryview(part)
        if view.nbytes:  # (an empty one cannot be cast when its shape holds a zero)
            views.append(view.cast("B"))
    while views:
        done = os.writev(fd, views[:_MAX_IOV])
        while views and done >= views[0].nbytes:
            done -= views[0].nbytes
            views.pop(0)
        if done:
            views[0] = views[0][done:]


def frame(value: Any, buffers: Sequence[Any] = ()) -> list[Any]:
    """The parts of one frame: ``value`` pickled, then ``buffers`` as they are (each C-contiguous)."""
    data = pickle.dumps(value, protocol=5)
    sizes = [memoryview(b).nbytes for b in buffers]
    return [_HEAD.pack(len(data), len(sizes)) + struct.pack(f"<{len(sizes)}Q", *sizes), data, *buffers]


def send_frame(fd: int, value: Any, buffers: Sequence[Any] = ()) -> None:
    """Write ``value`` and ``buffers`` to ``fd`` as one frame (read back by :func:`receive_frame`)."""
    _write_all(fd, frame(value, buffers))


def _read_exact(fd: int, size: int, eof_ok: bool = False) -> bytearray | None:
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if not n:
            if eof_ok and not got:
                return None
            raise EOFError(f"pipe closed {got} bytes into a {size}-byte read")
        got += n
    return out


def receive_frame(fd: int, limit: int | None = None) -> tuple[Any, list[bytearray]] | None:
    """Read one frame written by :func:`send_frame`: ``(value, buffers)``, or None when the pipe
    closed before it began.

    Args:
        limit: the most bytes the frame may hold (a larger one is an ``EOFError``, read no further).
    """
    head = _read_exact(fd, _HEAD.size, eof_ok=True)
    if head is None:
        return None
    size, count = _HEAD.unpack(head)
    if limit is not None and (size > limit or count > limit // 8):
        raise EOFError(f"a frame of {size} bytes and {count} buffers, more than the {limit} bytes expected")
    sizes = struct.unpack(f"<{count}Q", _read_exact(fd, 8 * count) or b"") if count else ()
    if limit is not None and size + sum(sizes) > limit:
        raise EOFError(f"a frame of {size + sum(sizes)} bytes, more than the {limit} expected")
    data = _read_exact(fd, size)
    value = pickle.loads(data or b"")  # our own pipe, from our own process
    return value, [_read_exact(fd, n) or bytearray() for n in sizes]


def _check_item(frozen: Any) -> None:
    from stepskip._formats.safe import Frozen

    if type(frozen) is not Frozen or not all(t.device.type == "cpu" for t in frozen.tensors.values()):
        raise HelperUnavailable("a snapshot the helper does not take (not a CPU 'safe' snapshot)")
    if frozen.files is not None or frozen.buffers:  # encoded already, or pooled memory to give back here
        raise HelperUnavailable("a snapshot the dump worker encodes itself")


def _pack_item(item: Item, buffers: list[Any]) -> tuple[str, Any, dict[str, Any]]:
    path, frozen, meta = item
    with frozen.lock:
        tensors = {ref: _pack_tensor(t, buffers) for ref, t in frozen.tensors.items()}
        return path, (tensors, frozen.tree, frozen.deferred, frozen.holders), meta


def _unpack_item(packed: tuple[str, Any, dict[str, Any]], buffers: list[bytearray]) -> Item:
    from stepskip._formats.safe import Frozen

    path, (tensors, tree, deferred, holders), meta = packed
    frozen = Frozen(tensors={ref: _unpack_tensor(spec, buffers) for ref, spec in tensors.items()}, tree=tree,
                    deferred=deferred, holders=holders)
    return path, frozen, meta


def _portable(err: Exception) -> Exception:
    """``err`` if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        back = pickle.loads(pickle.dumps(err))  # made here, a moment ago
        if type(back) is type(err):
            return err
    except Exception:  # any exception type may refuse pickling
        pass
    return RuntimeError(f"{type(err).__name__}: {err}")


# ---------------------------------------------------------------------- the parent's side


class DumpHelper:
    """The helper process, as the dump worker uses it (from the worker's thread alone).

    Example:
        >>> DumpHelper().state  # nothing started until a batch asks (usable) or a test waits (wait_ready)
        'new'
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._to: int | None = None  # requests to the child
        self._from: int | None = None  # its results
        self._state = "new"  # new, starting, ready, broken
        self.pid: int | None = None

    @property
    def state(self) -> str:
        """``new``, ``starting``, ``ready`` or ``broken`` (not used again)."""
        return self._state

    def usable(self) -> bool:
        """True when a batch can go to the helper now; starts it on the first call (never waits)."""
        return self.wait_ready(0)

    def wait_ready(self, timeout: float) -> bool:
        """Start the helper if needed and wait up to ``timeout`` seconds for it to report ready."""
        if self._state == "new":
            self._start()
        if self._state == "starting":
            self._poll_ready(timeout)
        return self._state == "ready"

    def begin(self, root: str, format_name: str, compress: str, count: int) -> None:
        """Announce a batch of ``count`` entries under the local store ``root`` (then :meth:`send` each)."""
        if self._to is None:
            raise HelperUnavailable(f"the helper process is {self._state}")
        self._guard(lambda fd: _write_all(fd, frame(("batch", root, format_name, compress, count))), self._to)

    def send(self, item: Item) -> bool:
        """Stream one entry of the batch; False when its snapshot cannot be sent (the caller writes it)."""
        buffers: list[Any] = []
        try:
            parts = frame(_pack_item(item, buffers), buffers)
            sent = True
        except Exception:  # a snapshot that does not pickle, whatever the type
            parts, sent = frame(None), False
        if self._to is None:
            raise HelperUnavailable(f"the helper process is {self._state}")
        self._guard(lambda fd: _write_all(fd, parts), self._to)
        return sent

    def finish(self, count: int, unsent: set[int]) -> list[int | Exception | None]:
        """The batch's results, in order (None for the ``unsent`` entries)."""
        if self._from is None:
            raise HelperUnavailable(f"the helper process is {self._state}")
        answer = self._guard(lambda fd: receive_frame(fd, limit=MAX_RESULT_BYTES), self._from)
        results = None if answer is None else answer[0]
        if not (isinstance(results, list) and len(results) == count
                and all(r is None or (i not in unsent and isinstance(r, (int, Exception)) and not isinstance(r, bool))
                        for i, r in enumerate(results))):
            self._broken("it answered with something other than one result per entry" if results is not None
                         else "it exited")
            raise HelperUnavailable("the helper process failed")
        return results

    def _guard(self, action: Callable[[int], Any], fd: int) -> Any:
        try:
            return action(fd)
        except (OSError, EOFError, pickle.UnpicklingError) as err:
            self._broken(f"{type(err).__name__}: {err}")
            raise HelperUnavailable("the helper process failed") from err

    def close(self) -> None:
        """Close the pipes and let the child exit: at once when it is idle, after its current batch
        otherwise; one still starting (it holds nothing to write) is stopped."""
        proc, state = self._proc, self._state
        self._close_fds()
        self._state = "broken" if state != "new" else state
        if proc is None:
            return
        if state == "starting":
            proc.kill()
        try:
            proc.wait(timeout=CLOSE_WAIT_SECONDS)
        except subprocess.TimeoutExpired:  # a batch still being written: it finishes on its own
            logger.info("stepskip dump helper (pid %s) still writing at close", proc.pid)

    def _start(self) -> None:
        self._state = "starting"
        to_child = from_child = None
        try:
            to_child = os.pipe()
            from_child = os.pipe()
            package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env = dict(os.environ)
            env["CUDA_VISIBLE_DEVICES"] = ""  # the helper writes files: it never needs a GPU context
            env.setdefault("OMP_NUM_THREADS", "1")
            if not sys.executable:
                raise OSError("sys.executable is unknown")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, package_root, str(to_child[0]), str(from_child[1])],
                pass_fds=(to_child[0], from_child[1]), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        except Exception as err:  # no helper: every batch is written by the dump worker
            for pair in (to_child, from_child):
                for fd in pair or ():
                    os.close(fd)
            self._broken(f"it could not be started: {type(err).__name__}: {err}")
            return
        os.close(to_child[0])
        os.close(from_child[1])
        try:  # room for a few entries in flight (64 KiB by default: a switch to the child every half entry)
            fcntl.fcntl(to_child[1], fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except (OSError, AttributeError):  # a lower limit here (fs.pipe-max-size): the default size serves
            pass
        self._to, self._from, self.pid = to_child[1], from_child[0], self._proc.pid
        _started.append(self)

    def _poll_ready(self, timeout: float) -> None:
        assert self._from is not None
        try:
            readable, _, _ = select.select([self._from], [], [], timeout)
            if not readable:
                return
            answer = receive_frame(self._from, limit=1 << 16)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as err:
            self._broken(f"{type(err).__name__}: {err}")
            return
        hello = None if answer is None else answer[0]
        if hello != ("ready", __file__):
            self._broken("it exited while starting" if hello is None else f"it started another stepskip: {hello!r}")
            return
        self._state = "ready"
        logger.debug("stepskip dump helper ready (pid %s)", self.pid)

    def _broken(self, why: str) -> None:
        self._state = "broken"
        self._close_fds()
        code = self._proc.poll() if self._proc is not None else None
        if self._proc is not None and code is None:  # out of step with us: stopped (what it staged is never published)
            self._proc.kill()
        logger.warning("stepskip dump helper not used any more (%s%s): small entries are written by the dump "
                       "worker's thread", why, "" if code is None else f"; exit status {code}")

    def _close_fds(self) -> None:
        for fd in (self._to, self._from):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._to = self._from = None


_helpers: list[DumpHelper] = []
_default_lock = threading.Lock()
_started: list[DumpHelper] = []  # every helper this process started (a forked child closes their pipes)


def default_helpers() -> list[DumpHelper]:
    """The process-wide helpers, :data:`HELPER_PROCESSES` of them (none started until a batch asks)."""
    with _default_lock:
        if not _helpers:
            _helpers.extend(DumpHelper() for _ in range(max(1, min(HELPER_PROCESSES, os.cpu_count() or 1))))
        return list(_helpers)


def write_with_helpers(root: str, format_name: str, compress: str, items: Sequence[Item]
                       ) -> list[int | Exception | None]:
    """Have the ready helpers encode and publish ``items`` under the local store ``root``.

    The entries are dealt out in turn and streamed one frame each: a helper encodes and stages
    its first entry while the next ones are sent.

    Returns:
        As :func:`write_small_entries`, except None for an entry no helper wrote (its snapshot
        does not pickle, or its helper failed before answering): the caller writes those itself.

    Raises:
        HelperUnavailable: no helper is ready, or they do not take these snapshots: the caller
            writes the whole batch itself.
    """
    helpers = [helper for helper in default_helpers() if helper.usable()]
    if not helpers:
        raise HelperUnavailable("no helper process is ready")
    for _, frozen, _ in items:  # the whole batch goes, or none of it
        _check_item(frozen)
    # a share of at least MIN_SHARE entries each: a few entries are synced file by file, many by one syncfs
    helpers = helpers[:max(1, len(items) // MIN_SHARE)]
    n = len(helpers)
    counts = [len(range(k, len(items), n)) for k in range(n)]  # helper k takes items k, k + n, ...
    results: list[int | Exception | None] = [None] * len(items)
    live: dict[int, set[int]] = {}  # helper -> the positions in its share that were not sent
    for k, helper in enumerate(helpers):
        try:
            helper.begin(root, format_name, compress, counts[k])
            live[k] = set()
        except HelperUnavailable:
            pass  # its share is written by the caller
    for i, item in enumerate(items):
        k = i % n
        if k in live:
            try:
                if not helpers[k].send(item):
                    live[k].add(i // n)
            except HelperUnavailable:
                del live[k]
    for k, unsent in live.items():
        try:
            results[k::n] = helpers[k].finish(counts[k], unsent)
        except HelperUnavailable:
            continue
    return results


def close_default() -> None:
    """Close the process-wide helpers (at exit, after the last dump was flushed)."""
    with _default_lock:
        helpers = list(_helpers)
        _helpers.clear()
    for helper in helpers:
        helper.close()


def _forget_after_fork() -> None:
    """In a forked child: the parent's helper serves the parent; its pipes are closed here, so the
    helper still sees them close when the parent exits."""
    global _default_lock
    for helper in _started:
        helper._close_fds()
        helper._state = "broken"
        helper._proc = None
    _started.clear()
    _helpers.clear()
    _default_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------------- the child


def _serve(requests: int, results: int, header: Any, stores: dict[str, Any], codecs: dict[tuple[str, str], Any]
           ) -> None:
    """Write one batch: its entries are read as the store asks for them; its results sent at the end."""
    from stepskip._storage import open_store
    from stepskip._formats import get_format

    _, root, format_name, compress, count = header
    slots: list[bool] = []  # per entry: written here, or left to the parent (not sent, or not rebuilt here)

    def stream() -> Iterator[Item]:
        for _ in range(count):
            got = receive_frame(requests)
            if got is None:  # the parent is gone mid-batch: what is staged is removed, nothing published
                raise SystemExit(0)
            value, buffers = got
            if value is None:
                slots.append(False)
                continue
            try:
                item = _unpack_item(value, buffers)
            except Exception as err:  # not for this process (a value it cannot rebuild): the parent writes it
                logger.debug("an entry is left to the parent: %s: %s", type(err).__name__, err)
                slots.append(False)
                continue
            slots.append(True)
            yield item

    try:
        if root not in stores:
            stores[root] = open_store(root)
        if (format_name, compress) not in codecs:
            codecs[format_name, compress] = get_format(format_name, compress=compress)
        store, codec = stores[root], codecs[format_name, compress]
    except Exception as err:  # the whole batch is left to the parent
        logger.warning("cannot write under %s (%s: %s): the entries are left to the training process", root,
                       type(err).__name__, err)
        for _ in stream():
            pass
        send_frame(results, [None] * len(slots))
        return
    written = iter(write_small_entries(store, codec, stream()))
    answer: list[int | Exception | None] = []
    for here in slots:
        result = next(written) if here else None
        answer.append(_portable(result) if isinstance(result, Exception) else result)
    send_frame(results, answer)


def _warm_up(codec: Any) -> None:
    """Encode a small value once: the codec's lazy imports happen now, not during the first batch."""
    import stepskip._storage  # noqa: F401

    codec.encode(codec.freeze({"tokens": torch.zeros(1, 8, dtype=torch.int64), "text": np.array(["x"], dtype=object)},
                              copy=False))


def main(argv: list[str]) -> int:
    """The helper process: read batches until the parent's pipe closes, answer each with its results."""
    requests, results = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle: it closes the pipe
    logging.basicConfig(level=logging.WARNING, format=f"stepskip dump helper {os.getpid()}: %(levelname)s %(message)s")
    torch.set_num_threads(1)
    from stepskip._formats import get_format

    codecs: dict[tuple[str, str], Any] = {("safe", "auto"): get_format("safe", compress="auto")}
    _warm_up(codecs["safe", "auto"])
    stores: dict[str, Any] = {}
    try:
        send_frame(results, ("ready", __file__))
        while True:
            request = receive_frame(requests)
            if request is None:  # the parent closed the pipe, or exited
                return 0
            _serve(requests, results, request[0], stores, codecs)
    except (BrokenPipeError, EOFError):  # the parent went away mid-frame: nothing more to answer
        return 0

