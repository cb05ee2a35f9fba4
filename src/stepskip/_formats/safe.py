"""``format: safe``: safetensors for tensors, JSON for structure and non-tensor data. No pickle.

An entry is two files: ``data.safetensors`` (every tensor, jagged tensors as values + offsets)
and ``data.json`` (a tree describing the container and holding the non-tensor values). The
supported containers are :class:`~stepskip.Batch`, verl's ``DataProto`` (duck-typed: ``batch``,
``non_tensor_batch``, ``meta_info``), :class:`tensordict.TensorDict` with regular, nested and
non-tensor entries, dicts, tensors, numpy arrays and JSON-like values.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_non_tensor

from stepskip._batch import Batch
from stepskip._calls import is_dataproto_like
from stepskip._entries import FileBytes
from stepskip.errors import CorruptEntryError, UnreadableEntryError, UnstorableValueError
from stepskip._formats.bounds import DecodeBudget, check_jagged, shape_of
from stepskip._formats.compact import decode_tensor, encode_tensor, find_concat, host_view, pack, unpack
from stepskip._formats.pages import POOL
from stepskip._formats.snapshot import IMMUTABLE, snapshot_object_array, snapshot_value
from stepskip._formats.st_read import load_view
from stepskip._formats.st_small import save_pooled, save_small
from stepskip._formats.values import (
    decode_object_array,
    decode_value,
    encode_value,
    is_plain,
    unstorable_recursion,
    unstorable_tensor,
)

__all__ = ["SafeFormat", "release_snapshot_buffers"]

TENSORS_FILE = "data.safetensors"
TREE_FILE = "data.json"
VERSION = 1
#: The version of a tree holding packed rows (``{"__t": "rows"}``, see :mod:`stepskip._formats.values`):
#: a reader of an older version meets a tag it does not know. Trees without them keep :data:`VERSION`.
ROWS_VERSION = 2
#: The version of a tree holding trimmed tensors whose runs are inline (lists, not part names: see
#: :data:`stepskip._formats.compact.INLINE_MAX_ROWS`); it may hold packed rows too.
INLINE_VERSION = 3
#: The version of a tree holding an object column whose rows share items (``"rows"``, see
#: :func:`_encode_items`); it may hold every layout before it.
SHARED_VERSION = 4
#: The newest tree version this stepskip reads; a newer one is unreadable (intact, never regenerated over).
READ_VERSION = SHARED_VERSION
_ROWS_MARK = '"__t":"rows"'
#: The container names the format has always recorded, for classes whose module was renamed since
#: (the bytes of an entry do not depend on where stepskip keeps its code).
_RECORDED_NAMES = {"stepskip._batch.Batch": "stepskip.batch.Batch"}  # format-name: a name in the bytes, not an import

_STORABLE_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
}


@dataclass
class Frozen:
    """A snapshot of a value, independent of the caller's objects, ready to be written.

    Non-tensor values are held as private snapshots (:mod:`stepskip._formats.snapshot`) in
    ``_Deferred`` leaves of ``tree``; :meth:`SafeFormat.encode` encodes them, on the background
    worker for async dumps, so a miss blocks the caller only for the snapshot.
    """

    tensors: dict[str, torch.Tensor]
    tree: dict[str, Any]
    deferred: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    #: pooled buffers the snapshot's tensors live in; back to the pool once encoded
    buffers: list[torch.Tensor] = field(default_factory=list, repr=False, compare=False)
    #: the encoded files, kept once the buffers went back (a second encode returns them)
    files: dict[str, FileBytes] | None = field(default=None, repr=False, compare=False)
    #: the non-tensor values ``tree`` holds (snapshots and plain values) until encoded: what sizing a queued
    #: snapshot looks at instead of walking the whole tree (see ``stepskip._dumping.dumper.small_size``)
    leaves: list[Any] | None = field(default=None, repr=False, compare=False)
    #: ``(node, key)`` of every ``_Deferred`` in ``tree``, in the order the tree's walk meets them: where
    #: :func:`_complete` encodes them without walking the tree
    holders: list[tuple[dict[str, Any], str]] = field(default_factory=list, repr=False, compare=False)


#: Tensors at least this large are snapshot into pooled buffers.
POOL_MIN_BYTES = 1 << 20
#: CPU tensors of at most this many bytes are snapshot by a numpy copy (no torch call, see
#: :func:`~stepskip._formats.compact.host_view`).
HOST_COPY_MAX_BYTES = 1 << 16
#: With ``compress: auto``, an entry whose stored tensors take fewer bytes than this is not compressed:
#: zstd decompresses at ~1 GB/s on the machines measured, while reading the same bytes from the page
#: cache and checking their checksum runs at several GB/s (a 256 x 1536 batch: 2.3 ms to decode from
#: 1.5 MB compressed, 1.8 ms from 4 MB not). Bigger entries (1024 rows up) are compressed where it pays.
ZSTD_ENTRY_MIN_BYTES = 8 << 20
#: Below this many bytes in all, the items of :func:`_parallel_map` run on the calling thread.
PARALLEL_MIN_BYTES = 1 << 20
#: A tensordict whose stored parts take fewer bytes than this decodes its tensors on the calling
#: thread: rebuilding a debugging batch's narrowed tensors is a few memory-bound copies (a 256-row
#: batch: 4 MB read, 15.7 MB written, 1.0-1.3 ms), which handing them to the pool did not make
#: faster on the 2-core machines measured (1.4-1.8 ms best). Trimmed and compressed parts (1024 rows
#: up) release the GIL for longer, and are decoded side by side.
DECODE_PARALLEL_MIN_BYTES = 8 << 20
#: At most this many bytes of free buffers are kept between snapshots.
POOL_MAX_BYTES = 4 << 30


class _BufferPool:
    """Snapshot buffers kept for the next snapshot of the same sizes.

    A fresh allocation of a few hundred MB costs a page fault (and a kernel zero-fill) per 4 KiB
    page: on the machines measured, cloning a 436 MB batch into fresh memory took ~10x as long as
    copying it into memory used before. Rollout batches have the same tensor sizes step after
    step, so the buffers of the last encoded snapshot serve the next miss: the memory cost is one
    batch's tensors kept between misses (:func:`release_snapshot_buffers` frees them).
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._bytes -= nbytes
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                nbytes = buffer.numel()
                if self._bytes + nbytes > POOL_MAX_BYTES:
                    break
                self._free.setdefault(nbytes, []).append(buffer)
                self._bytes += nbytes

    def clear(self) -> int:
        with self._lock:
            freed, self._free, self._bytes = self._bytes, {}, 0
        return freed


_BUFFERS = _BufferPool()


def release_snapshot_buffers() -> int:
    """Free the snapshot buffers kept for the next miss; returns the bytes released.

    Example:
        >>> release_snapshot_buffers() >= 0
        True
    """
    return _BUFFERS.clear()


class _Deferred:
    """A snapshot in the tree, encoded by :func:`_complete`: a value (``items=False``) or the items
    of an object array."""

    __slots__ = ("snapshot", "path", "items")

    def __init__(self, snapshot: Any, path: str, items: bool = False) -> None:
        self.snapshot, self.path, self.items = snapshot, path, items


class _Encoder:
    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.tensors: dict[str, torch.Tensor] = {}
        self._storages: set[int] = set()
        self._clones: list[str] = []  # refs whose tensor is still the caller's: cloned together by finish()
        self.buffers: list[torch.Tensor] = []  # pooled buffers the clones live in
        self.leaves: list[Any] = []  # every non-tensor value put in the tree (see Frozen.leaves)
        self.holders: list[tuple[dict[str, Any], str]] = []  # where the tree holds each deferred (Frozen.holders)

    @staticmethod
    def check(tensor: torch.Tensor, path: str) -> None:
        """Raise :class:`UnstorableValueError` for a tensor this format cannot store as one part."""
        if tensor.is_nested:
            raise UnstorableValueError(f"{path}: nested tensors are stored through their components")
        refused = unstorable_tensor(tensor, path, "safe")
        if refused is not None:
            raise refused
        if tensor.dtype not in _STORABLE_DTYPES:
            raise UnstorableValueError(
                f"{path}: tensors of dtype {tensor.dtype} cannot be stored by format 'safe'; "
                f"supported: {', '.join(sorted(str(d) for d in _STORABLE_DTYPES))}"
            )

    def add(self, tensor: torch.Tensor, path: str) -> str:
        self.check(tensor, path)
        t = tensor.detach() if tensor.requires_grad else tensor  # a torch call, skipped where it changes nothing
        ref = f"t{len(self.tensors)}"
        if t.device.type != "cpu":
            t = t.cpu()  # a copy already
        elif self.copy or not t.is_contiguous() or t.untyped_storage().data_ptr() in self._storages:
            # safetensors refuses tensors that share memory, and a snapshot must not see later writes.
            self._clones.append(ref)
        elif t.numel():
            self._storages.add(t.untyped_storage().data_ptr())
        self.tensors[ref] = t
        return ref

    def finish(self) -> None:
        """Copy the tensors :meth:`add` marked, side by side: a big one into a pooled buffer (a memcpy that
        releases the GIL; on a miss it is most of what the caller waits for), a small CPU one by numpy
        (:func:`~stepskip._formats.compact.host_view`: no torch call), any other by ``clone``."""
        refs, self._clones = self._clones, []
        sources = [self.tensors[r] for r in refs]
        targets: list[torch.Tensor | np.ndarray | None] = []  # a pooled buffer, numpy's view of a small source, or None
        total = 0
        for src in sources:
            nbytes = _nbytes(src)
            total += nbytes
            if nbytes < POOL_MIN_BYTES:
                targets.append(host_view(src) if nbytes <= HOST_COPY_MAX_BYTES else None)
                continue
            buffer = _BUFFERS.take(nbytes)
            self.buffers.append(buffer)
            targets.append(buffer.view(src.dtype).view(src.shape))

        def copy(i: int) -> torch.Tensor:
            target = targets[i]
            if isinstance(target, torch.Tensor):
                return target.copy_(sources[i])
            if target is not None:
                return torch.from_numpy(target.copy())  # C order, as the clone below
            return sources[i].clone(memory_format=torch.contiguous_format)

        copies = _parallel_map(copy, list(range(len(refs))), pool="snapshot", nbytes=total)
        self.tensors.update(zip(refs, copies))

    def value(self, node: dict[str, Any], key: str, value: Any, path: str) -> dict[str, Any]:
        """``node`` holding at ``key`` a snapshot of a non-tensor value, encoded later by :func:`_complete`
        (off the caller's thread)."""
        kind = type(value)
        if kind in IMMUTABLE and kind is not bytes:
            node[key] = value  # encodes as itself
        else:
            node[key] = _Deferred(snapshot_value(value, path, self.check, self.copy), path)
            self.holders.append((node, key))
        self.leaves.append(node[key])
        return node

    def node(self, value: Any, path: str) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return self.tensor_node(value, path)
        if isinstance(value, TensorDictBase):
            return self.tensordict_node(value, path)
        if is_dataproto_like(value):
            return self.batch_node(value, path)
        if isinstance(value, np.ndarray):
            return self.array_node(value, path)
        if type(value) is dict and all(type(k) is str for k in value):
            return {"kind": "dict", "entries": {k: self.node(v, f"{path}[{k!r}]") for k, v in value.items()}}
        return self.value({"kind": "value"}, "v", value, path)

    def tensor_node(self, tensor: torch.Tensor, path: str) -> dict[str, Any]:
        if not tensor.is_nested:
            return {"kind": "tensor", "ref": self.add(tensor, path)}
        if tensor.layout == torch.jagged:
            jagged: Any = tensor  # torch's stubs do not declare the jagged layout's accessors
            lengths = jagged.lengths()
            return {
                "kind": "jagged",
                "values": self.add(jagged.values(), f"{path}.values"),
                "offsets": self.add(jagged.offsets(), f"{path}.offsets"),
                "lengths": None if lengths is None else self.add(lengths, f"{path}.lengths"),
                "ragged_idx": jagged._ragged_idx,
            }
        parts = tensor.unbind()
        return {"kind": "nested", "parts": [self.add(p, f"{path}[{i}]") for i, p in enumerate(parts)]}

    def tensordict_node(self, td: TensorDictBase, path: str) -> dict[str, Any]:
        entries: dict[str, Any] = {}
        for key in td.keys():
            item = td.get(key)
            where = f"{path}[{key!r}]"
            if is_non_tensor(item):
                if isinstance(item, NonTensorStack):
                    rows = item.tolist()
                    entries[key] = self.value({"kind": "non_tensor_stack", "batch_size": list(item.batch_size)},
                                              "v", rows, where)
                else:
                    entries[key] = self.value({"kind": "non_tensor_data", "batch_size": list(item.batch_size)},
                                              "v", item.data, where)
            elif isinstance(item, TensorDictBase):
                entries[key] = self.tensordict_node(item, where)
            else:
                entries[key] = self.tensor_node(item, where)
        return {"kind": "tensordict", "batch_size": list(td.batch_size), "entries": entries}

    def array_node(self, array: np.ndarray, path: str) -> dict[str, Any]:
        if array.dtype.hasobject:
            snapshot = snapshot_object_array(array, path, self.check, self.copy)
            node = {"kind": "object_array", "shape": list(array.shape), "v": _Deferred(snapshot, path, items=True)}
            self.leaves.append(node["v"])
            self.holders.append((node, "v"))
            return node
        if array.dtype.kind in "biuf" and array.dtype.isnative:
            try:
                tensor = torch.from_numpy(np.ascontiguousarray(array))
            except TypeError:
                tensor = None
            if tensor is not None and tensor.dtype in _STORABLE_DTYPES:
                return {"kind": "array", "dtype": array.dtype.str, "shape": list(array.shape),
                        "ref": self.add(tensor, path)}
        return self.value({"kind": "value"}, "v", array, path)

    def batch_node(self, value: Any, path: str) -> dict[str, Any]:
        cls = type(value)
        td = value.batch
        name = f"{cls.__module__}.{cls.__qualname__}"
        node = {
            "kind": "batch",
            "cls": _RECORDED_NAMES.get(name, name),
            "batch": None if td is None else self.tensordict_node(td, f"{path}.batch"),
            "non_tensor_batch": {k: self.array_node(_column(v, f"{path}.non_tensor_batch[{k!r}]"),
                                                    f"{path}.non_tensor_batch[{k!r}]")
                                 for k, v in value.non_tensor_batch.items()},
        }
        return self.value(node, "meta_info", dict(value.meta_info), f"{path}.meta_info")


def _column(value: Any, path: str) -> np.ndarray:
    """A ``non_tensor_batch`` column as the numpy array DataProto keeps; ragged lists are refused by name."""
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as err:  # numpy 2 refuses ragged nested lists
        raise UnstorableValueError(
            f"{path}: a {type(value).__name__} that numpy cannot turn into an array ({err}); store an object "
            "array instead (out = np.empty(len(rows), dtype=object); out[:] = rows)"
        ) from err


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_POOLS: dict[str, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _forget_pools_after_fork() -> None:
    """In a forked child: the parent's pools have none of their threads here, and an executor that
    counts them as started never starts more, so work handed to it would wait forever."""
    global _POOLS_LOCK
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


#: The pools :func:`_parallel_map` uses: the background encoding's and the snapshot's.
_POOL_NAMES = ("codec", "snapshot")
_POOL_WORKERS = max(2, min(4, os.cpu_count() or 2))


def _pool(name: str) -> ThreadPoolExecutor:
    """The pool called ``name``, made on first use."""
    executor = _POOLS.get(name)
    if executor is None:
        with _POOLS_LOCK:
            executor = _POOLS.get(name)
            if executor is None:
                executor = _POOLS[name] = ThreadPoolExecutor(max_workers=_POOL_WORKERS,
                                                             thread_name_prefix=f"stepskip-{name}")
    return executor


def start_pools() -> None:
    """Start every thread of the codec and snapshot pools now (a role's start-up), not in a call.

    A pool starts a thread per job while none is idle: each start on a loaded machine waits for
    the scheduler, in the first hit or miss that hands work to the pool. Each thread is kept busy
    until all have started, so that every job here starts a thread of its own.
    """
    for name in _POOL_NAMES:
        executor = _pool(name)
        started = threading.Event()
        try:
            futures = [executor.submit(started.wait) for _ in range(_POOL_WORKERS)]
        except RuntimeError:  # the interpreter is shutting down: the calls run their items inline
            return
        finally:
            started.set()
        for future in futures:
            future.result()


def _parallel_map(fn: Callable[[Any], Any], items: list[Any], pool: str = "codec",
                  nbytes: int | None = None) -> list[Any]:
    """``map`` on a small thread pool (torch, numpy and zstd release the GIL); each item runs exactly once.

    ``pool`` names the pool: a miss's snapshot clones (``"snapshot"``, the caller's thread) never
    queue behind the background encoding of an earlier dump (``"codec"``). ``nbytes``, the data
    the items handle together, runs them here when it is below :data:`PARALLEL_MIN_BYTES`: handing
    an item to a thread costs more than copying or decoding a small tensor (one-sample entries of
    the async role). When the interpreter is shutting down (dumps still pending at exit are
    finished then), the pool refuses new work: the items it did not take run here. An exception
    raised by ``fn`` propagates.
    """
    if len(items) < 2 or (nbytes is not None and nbytes < PARALLEL_MIN_BYTES):
        return [fn(item) for item in items]
    executor = _pool(pool)
    futures = []
    try:
        for item in items:
            futures.append(executor.submit(fn, item))
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown": never raised by fn
        pass
    inline = [fn(item) for item in items[len(futures):]]
    return [future.result() for future in futures] + inline




class _Decoder:
    """Rebuilds a value from ``data.json``'s tree; every field is checked before it is trusted."""

    def __init__(self, tensors: dict[str, torch.Tensor], packed: Any, budget: DecodeBudget,
                 views: frozenset[str] = frozenset()) -> None:
        if not isinstance(packed, dict):
            raise CorruptEntryError(f"{TREE_FILE}: packed: a mapping is expected, not {type(packed).__name__}")
        self.tensors = tensors
        #: the parts that view the tensor file's buffer (see :func:`load_view`)
        self.views = views
        self.packed = packed
        self.budget = budget
        #: what the stored parts hold (compressed or not): small entries decode on the caller's thread
        self.stored_bytes = sum(map(_nbytes, tensors.values()))

    def tensor(self, ref: Any, field: str, owned: bool = True) -> torch.Tensor:
        """The stored part ``ref``, unpacked; ``owned=False`` when the caller copies it on, so that a
        part viewing the tensor file's buffer need not be copied out of it first."""
        # each stored part is used once: dropping it here frees it as soon as its output exists (a
        # part viewing the file's buffer frees its share of the buffer with the last of those parts)
        stored = self.tensors.pop(ref, None) if isinstance(ref, str) else None
        if stored is None:
            raise CorruptEntryError(f"{TREE_FILE}: {field}: tensor {str(ref)[:40]!r} is not in {TENSORS_FILE} "
                                    "(or another field already used it)")
        info = self.packed.get(ref)
        if info is not None:
            out = unpack(stored, info, self.budget, f"packed[{ref!r}]")
        elif owned and ref in self.views:  # the caller keeps it: memory of its own, not the whole file's
            out = POOL.empty(stored.shape, stored.dtype).copy_(stored)
        else:
            out = stored
        if out.dtype == torch.bool and out.numel() and int(out.view(torch.uint8).max()) > 1:
            # a bool is the byte 0 or 1: kernels given any other byte give undefined results
            raise CorruptEntryError(f"{TREE_FILE}: {field}: bool tensor {str(ref)[:40]!r} holds bytes other "
                                    "than 0 and 1")
        return out

    def getter(self, field: str, owned: bool = True) -> Callable[[str], torch.Tensor]:
        return lambda ref: self.tensor(ref, field, owned)

    def part(self, ref: Any, field: str) -> torch.Tensor:
        return self.tensor(ref, field) if not isinstance(ref, dict) else self.node(ref, field)

    def node(self, node: Any, field: str, sibling: Any = None) -> Any:
        if not isinstance(node, dict):
            raise CorruptEntryError(f"{TREE_FILE}: {field}: a node is expected, not {type(node).__name__}")
        kind = node.get("kind")
        if kind == "tensor":  # an encoded tensor copies its stored parts into its output
            return decode_tensor(node, self.getter(field, owned=node.get("enc") is None), sibling, self.budget, field)
        if kind == "jagged":
            return self.jagged(node, field)
        if kind == "nested":
            parts = node["parts"]
            if not isinstance(parts, list):
                raise CorruptEntryError(f"{TREE_FILE}: {field}.parts: a list is expected")
            tensors = [self.tensor(r, f"{field}.parts[{i}]") for i, r in enumerate(parts)]
            self.budget.charge(sum(t.numel() * t.element_size() for t in tensors), TREE_FILE, field)
            return torch.nested.nested_tensor(tensors)
        if kind == "tensordict":
            return self.tensordict(node, field)
        if kind == "batch":
            return self.batch(node, field)
        if kind == "array":
            stored = self.tensor(node["ref"], field)
            dtype = _numeric_dtype(node["dtype"], stored, field)
            shape = shape_of(node["shape"], TREE_FILE, f"{field}.shape")
            array = stored.numpy().view(dtype).reshape(shape)
            # (a part stored as bool was checked by tensor() already)
            if dtype.kind == "b" and stored.dtype != torch.bool and array.size and int(array.view(np.uint8).max()) > 1:
                raise CorruptEntryError(f"{TREE_FILE}: {field}: a bool array holds bytes other than 0 and 1")
            return array
        if kind == "object_array":
            shape = shape_of(node["shape"], TREE_FILE, f"{field}.shape")
            items = decode_object_array(node["v"], self.getter(field), node.get("plain", False) is True,
                                        self.budget, field)
            if "rows" in node:
                items = self.shared_rows(items, node["rows"], math.prod(shape), field)
            return items.reshape(shape)
        if kind == "dict":
            return {k: self.node(v, f"{field}[{k!r}]") for k, v in _mapping(node, "entries", field).items()}
        if kind == "value":
            return decode_value(node["v"], self.getter(field), self.budget, field)
        raise CorruptEntryError(f"{TREE_FILE}: {field}: unknown node kind {str(kind)[:40]!r}")

    def shared_rows(self, items: np.ndarray, rows: Any, count: int, field: str) -> np.ndarray:
        """The column of ``count`` rows, each the item of ``items`` that ``rows`` names: rows that
        shared one object when recorded share one again."""
        if type(rows) is not list or len(rows) != count:
            raise CorruptEntryError(f"{TREE_FILE}: {field}.rows: {count} item indices are expected, "
                                    f"not {str(rows)[:60]!r}")
        self.budget.charge(16 * count, TREE_FILE, f"{field}.rows")  # the index, and the column's pointers
        if not set(map(type, rows)) <= _INT_TYPE:  # bools, floats, lists ...: damage, never an index
            raise CorruptEntryError(f"{TREE_FILE}: {field}.rows: an item index that is not an integer")
        if count and (min(rows) < 0 or max(rows) >= len(items)):
            raise CorruptEntryError(f"{TREE_FILE}: {field}.rows: an item index outside the {len(items)} items")
        return items[np.array(rows, dtype=np.intp)]

    def jagged(self, node: dict[str, Any], field: str) -> torch.Tensor:
        values = self.part(node["values"], f"{field}.values")
        offsets = self.part(node["offsets"], f"{field}.offsets")
        lengths = node.get("lengths")
        lengths = None if lengths is None else self.part(lengths, f"{field}.lengths")
        check_jagged(values, offsets, lengths, node.get("ragged_idx"), TREE_FILE, field)
        return torch.nested.nested_tensor_from_jagged(values, offsets, lengths=lengths, jagged_dim=node["ragged_idx"])

    def batch_size(self, node: dict[str, Any], field: str) -> list[int]:
        # a batch size costs nothing until someone lists its rows: charge a reference per row
        dims = self.budget.tensor(node["batch_size"], 8, TREE_FILE, f"{field}.batch_size")
        return list(dims)

    def tensordict(self, node: dict[str, Any], field: str) -> TensorDict:
        batch_size = self.batch_size(node, field)
        entries = _mapping(node, "entries", field)
        if not all(isinstance(c, dict) for c in entries.values()):
            raise CorruptEntryError(f"{TREE_FILE}: {field}.entries: every entry must be a node")
        decoded: dict[str, Any] = {}  # the tensor entries: what a concatenation may name as its parts
        dense = [k for k, c in entries.items() if c.get("kind") == "tensor" and c.get("enc") not in (None, "concat")]
        if len(dense) > 1 and self.stored_bytes >= DECODE_PARALLEL_MIN_BYTES:
            # torch, numpy and zstd release the GIL: decode the big tensors side by side
            decoded.update(self._decode_side_by_side(entries, dense, field))
        # entries stored as a concatenation of siblings decode after those siblings
        order = sorted((k for k in entries if k not in decoded), key=lambda k: entries[k].get("enc") == "concat")
        values: dict[str, Any] = {}
        for key in order:
            child = entries[key]
            kind = child.get("kind")
            where = f"{field}[{key!r}]"
            if kind == "non_tensor_data":
                data = decode_value(child["v"], self.getter(where), self.budget, where)
                values[key] = NonTensorData(data=data, batch_size=self.batch_size(child, where))  # a TensorDict
            elif kind == "non_tensor_stack":
                rows = decode_value(child["v"], self.getter(where), self.budget, where)
                size = self.batch_size(child, where)
                if not isinstance(rows, list) or not size or len(rows) != size[0]:
                    raise CorruptEntryError(f"{TREE_FILE}: {where}: the rows do not match batch size {size}")
                # each row becomes a NonTensorData object (~600 bytes) however few bytes it took in data.json
                self.budget.charge(len(rows) * _NON_TENSOR_ROW_BYTES, TREE_FILE, where)
                values[key] = NonTensorStack(*(NonTensorData(data=r, batch_size=size[1:]) for r in rows))
            else:
                decoded[key] = self.node(child, where, _siblings(decoded, where))
        # built once, in the recorded key order (each value checked against the batch size as by set)
        return TensorDict({key: decoded[key] if key in decoded else values[key] for key in entries},
                          batch_size=batch_size)

    def _decode_side_by_side(self, entries: dict[str, Any], dense: list[str], field: str) -> dict[str, Any]:
        """Decode the ``dense`` entries on the pool, and with them each concatenation of two of them
        (``input_ids`` of ``prompts`` and ``responses``): it copies as soon as its parts exist,
        overlapping the decoding of the others instead of running after all of them."""
        dense_set = set(dense)
        joined = [k for k, c in entries.items() if c.get("kind") == "tensor" and c.get("enc") == "concat"
                  and isinstance(c.get("parts"), list) and len(c["parts"]) == 2
                  and all(isinstance(part, str) and part in dense_set for part in c["parts"])]
        decoded: dict[str, Any] = {}
        ready = {k: threading.Event() for k in dense}

        def job(key: str) -> Any:
            where = f"{field}[{key!r}]"
            if key in ready:
                try:
                    decoded[key] = self.node(entries[key], where)
                finally:  # a failed part still wakes its concatenation, which then finds it missing
                    ready[key].set()
                return decoded[key]
            for part in entries[key]["parts"]:
                ready[part].wait()
            return self.node(entries[key], where, _siblings(decoded, where))

        # the pool takes jobs in order: a concatenation starts only once both its parts have started
        keys = dense + joined
        return dict(zip(keys, _parallel_map(job, keys, nbytes=self.stored_bytes)))

    def batch(self, node: dict[str, Any], field: str) -> Any:
        td = None if node["batch"] is None else self.tensordict(node["batch"], f"{field}.batch")
        non_tensor = {k: self.node(v, f"{field}.non_tensor_batch[{k!r}]")
                      for k, v in _mapping(node, "non_tensor_batch", field).items()}
        meta_info = decode_value(node["meta_info"], self.getter(f"{field}.meta_info"), self.budget,
                                 f"{field}.meta_info")
        if node["cls"] == "verl.protocol.DataProto":
            try:
                from verl.protocol import DataProto  # type: ignore[import-not-found]

                return DataProto(batch=td, non_tensor_batch=non_tensor, meta_info=meta_info)
            except ImportError:
                pass
        return Batch(batch=td, non_tensor_batch=non_tensor, meta_info=meta_info)


_NON_TENSOR_ROW_BYTES = 1024
_INT_TYPE = frozenset({int})


def _siblings(decoded: dict[str, Any], field: str) -> Callable[[str], Any]:
    def sibling(key: str) -> Any:
        if not isinstance(key, str) or key not in decoded:
            raise CorruptEntryError(f"{TREE_FILE}: {field}.parts: {str(key)[:40]!r} is not a sibling decoded before it")
        return decoded[key]

    return sibling


def _mapping(node: dict[str, Any], key: str, field: str) -> dict[str, Any]:
    value = node[key]
    if not isinstance(value, dict):
        raise CorruptEntryError(f"{TREE_FILE}: {field}.{key}: a mapping is expected, not {type(value).__name__}")
    return value


def _numeric_dtype(text: Any, stored: torch.Tensor, field: str) -> np.dtype:
    """The numpy dtype an ``array`` node views its stored tensor as: numeric and just as wide, never objects."""
    try:
        dtype = np.dtype(text) if isinstance(text, str) and len(text) <= 8 else None
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.kind not in "biuf" or dtype.fields is not None or \
            dtype.itemsize != stored.element_size() or stored.is_nested:
        raise CorruptEntryError(f"{TREE_FILE}: {field}.dtype: {str(text)[:40]!r} is not a numeric dtype as wide "
                                f"as the stored {stored.dtype}")
    return dtype


class SafeFormat:
    """Encode and decode entries of ``format: safe``.

    Example:
        >>> fmt = SafeFormat()
        >>> files = fmt.encode(fmt.freeze({"x": torch.arange(3)}, copy=False))
        >>> fmt.decode(files)["x"].tolist()
        [0, 1, 2]
    """

    name = "safe"
    uses_pickle = False
    files = (TENSORS_FILE, TREE_FILE)

    def __init__(self, compress: str = "auto") -> None:
        self.compress = compress

    def start_threads(self) -> None:
        """Start the threads big entries are encoded and decoded on (at a role's start-up, so that no
        call waits for them)."""
        start_pools()

    def freeze(self, value: Any, copy: bool) -> Frozen:
        """Take a snapshot of ``value``; with ``copy`` it shares no memory with the caller's objects.

        Only the snapshot is taken here: tensors cloned, non-tensor values copied where mutable
        (each shared object once) and type-checked. Their JSON encoding waits for :meth:`encode`.
        Without ``copy`` the caller promises not to change ``value`` until :meth:`encode` ran.

        Raises:
            UnstorableValueError: a part of ``value`` cannot be stored; the message names it.
        """
        encoder = _Encoder(copy)
        try:
            root = encoder.node(value, "result")
        except RecursionError as err:
            raise unstorable_recursion(value, "result", self.name) from err
        encoder.finish()
        return Frozen(tensors=encoder.tensors, tree={"format": self.name, "version": VERSION, "root": root},
                      deferred=True, buffers=encoder.buffers, leaves=encoder.leaves, holders=encoder.holders)

    def encode(self, frozen: Frozen) -> dict[str, FileBytes]:
        """Serialise a snapshot into the entry's files, in the compact encodings unless ``compress`` is none."""
        with frozen.lock:
            if frozen.files is not None:
                return dict(frozen.files)
            _complete(frozen)
            files = self._encode(frozen.tree, frozen.tensors)
            if frozen.buffers:  # the bytes are out: the snapshot's memory can serve the next one
                frozen.files, frozen.tensors = files, {}
                buffers, frozen.buffers = frozen.buffers, []
                _BUFFERS.give(buffers)
            return dict(files)

    def _encode(self, tree: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, FileBytes]:
        inline = False
        if self.compress != "none":
            tree, tensors, inline = _compact(tree, tensors)
            refs = sorted(tensors)  # 'packed' in one order, whichever pool thread added its part first
            packed: dict[str, Any] = {}
            total = sum(map(_nbytes, tensors.values()))
            mode = self.compress if self.compress != "auto" or total >= ZSTD_ENTRY_MIN_BYTES else "none"
            for ref, (stored, info) in zip(refs, _parallel_map(lambda r: pack(tensors[r], mode), refs,
                                                               nbytes=total)):
                tensors[ref] = stored
                if info is not None:
                    packed[ref] = info
            if packed:
                tree = dict(tree, packed=packed)
        if inline and tree.get("version") == VERSION:  # the newest layout it holds says which readers can read it
            tree = dict(tree, version=INLINE_VERSION)
        text = json.dumps(tree, ensure_ascii=False, separators=(",", ":"))
        if _ROWS_MARK in text and tree.get("version") == VERSION:  # (a string holding the mark costs nothing)
            tree = dict(tree, version=ROWS_VERSION)
            text = json.dumps(tree, ensure_ascii=False, separators=(",", ":"))
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: JSON's \u escapes keep them exactly, and json.loads reads them
            data = json.dumps(tree, ensure_ascii=True, separators=(",", ":")).encode("ascii")
        # the bytes safetensors writes, without its per-tensor overhead or, for a big file, its fresh memory
        body: FileBytes | None = save_small(tensors)
        if body is None:
            body = save_pooled(tensors)
        return {TENSORS_FILE: st_save(tensors) if body is None else body, TREE_FILE: data}

    def decode(self, files: Mapping[str, bytes], consume: bool = False, max_bytes: int | None = None) -> Any:
        """Rebuild the value from the entry's files.

        Args:
            files: the entry's files by name.
            consume: empty ``files`` (a dict) while reading, so the raw bytes are freed before
                the tensors are expanded (lower peak memory when the caller is done with them).
            max_bytes: the most the decode may allocate (``max_decode_bytes``); by default
                :data:`~stepskip._formats.bounds.DECODE_RATIO` x the files' size plus
                :data:`~stepskip._formats.bounds.DECODE_FLOOR`.

        Raises:
            CorruptEntryError: the files cannot be parsed, or a field does not fit the stored bytes
                (the message names the file and the field).
            DecodeLimitError: decoding would allocate more than the bound.
        """
        try:
            budget = DecodeBudget.for_files(files, max_bytes)
            take = files.pop if consume and isinstance(files, dict) else files.__getitem__
            text = take(TREE_FILE)
            tree = json.loads(text if isinstance(text, bytes) else bytes(text))  # a big one: recycled pages
            del text
            if not isinstance(tree, dict) or not isinstance(tree.get("root"), dict):
                raise CorruptEntryError(f"{TREE_FILE}: not an object with a 'root' node")
            _check_version(tree.get("version", VERSION))
            raw = take(TENSORS_FILE)
            budget.charge(len(raw), TENSORS_FILE, "tensors")
            # a memoryview: the store read the file into recycled pages, and the tensors go there too
            # (parts that are widened or decompressed are read where they lie; the others are copied out.
            # The views hold raw's buffer until their last one goes: never release that memoryview here)
            viewed: set[str] = set()
            tensors = st_load(raw) if isinstance(raw, bytes) else load_view(memoryview(raw), TENSORS_FILE, viewed)
            del raw
            return _Decoder(tensors, tree.get("packed", {}), budget, frozenset(viewed)).node(tree["root"], "root")
        except (CorruptEntryError, UnreadableEntryError, MemoryError):  # the bound keeps hostile entries from
            raise  # causing a MemoryError
        except Exception as err:  # the decode boundary: any failure to parse these bytes is a damaged entry
            raise CorruptEntryError(f"cannot decode a 'safe' entry: {type(err).__name__}: {err}") from err


def _check_version(version: object) -> None:
    """Raise for a tree version this stepskip cannot read: unreadable when newer, damage when not a version."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CorruptEntryError(f"{TREE_FILE}: version is {str(version)[:40]!r}, not a format version")
    if version > READ_VERSION:
        raise UnreadableEntryError(f"{TREE_FILE}: version {version} was written by a newer stepskip; this one reads "
                                   f"versions up to {READ_VERSION}: upgrade stepskip to read it (left untouched)")


def _complete(frozen: Frozen) -> None:
    """Encode the snapshots a :class:`Frozen` holds (once; later calls find nothing left)."""
    with frozen.lock:
        if not frozen.deferred:
            return
        encoder = _Encoder(copy=False)  # the snapshots are private already: their tensors need no clone
        encoder.tensors = frozen.tensors
        encoder._storages = {t.untyped_storage().data_ptr() for t in frozen.tensors.values() if t.numel()}

        shared = False
        # in the order freeze met them (the tree's order): a deferred's tensors are named in that order
        for node, key in frozen.holders:
            deferred = node[key]
            if not deferred.items:
                node[key] = _encode_deferred(encoder, deferred)
                continue
            node[key], rows = _encode_items(encoder, deferred)
            if rows is not None:
                node["rows"], shared = rows, True
            node["plain"] = _all_plain(node[key])
        if shared:  # the newest layout it holds says which readers can read it
            frozen.tree["version"] = SHARED_VERSION
        encoder.finish()
        frozen.buffers.extend(encoder.buffers)
        frozen.deferred = False
        frozen.leaves, frozen.holders = None, []  # encoded now: the snapshots go with the tree


def _encode_deferred(encoder: _Encoder, deferred: _Deferred) -> Any:
    """A deferred value; an object column's items are encoded with their node (:func:`_encode_items`)."""
    assert not deferred.items, deferred.path
    path = deferred.path
    return encode_value(deferred.snapshot, path, lambda t: encoder.add(t, path))


def _encode_items(encoder: _Encoder, deferred: _Deferred) -> tuple[list[Any], list[int] | None]:
    """The encoded items of an object column and, when its rows share items, which one each row holds.

    verl's ``DataProto.repeat`` (and TRL's groups) give the n rows of a prompt one object per column:
    each shared object is encoded, written and read back once, not once per row. The rows keep
    sharing it after a hit, as they did when recorded. Items holding tensors are encoded per row
    (each stored tensor is read once). A column of few repeats is written item by item.
    """
    path = deferred.path
    items = deferred.snapshot.reshape(-1).tolist()
    slots: dict[int, int] = {}
    unique: list[Any] = []
    rows: list[int] = []
    leaves = set(map(type, items)) <= _JSON_LEAVES  # every item encodes as itself
    for i, item in enumerate(items):
        slot = slots.get(id(item))
        if slot is None:
            slot = len(unique)
            if leaves:
                unique.append(item)
            else:
                before = len(encoder.tensors)
                unique.append(encode_value(item, f"{path}[{i}]", lambda t: encoder.add(t, path)))
                if len(encoder.tensors) != before:
                    rows.append(slot)
                    continue
            slots[id(item)] = slot
        rows.append(slot)
    if not items or 2 * len(unique) > len(items):  # (an empty column is no reason for a newer version)
        return ([unique[slot] for slot in rows] if len(unique) < len(items) else unique), None
    return unique, rows


_JSON_LEAVES = frozenset({str, int, float, bool, type(None)})


def _all_plain(items: list[Any]) -> bool:
    seen: dict[int, bool] = {}
    for item in items:
        plain = seen.get(id(item))
        if plain is None:
            plain = seen[id(item)] = is_plain(item)
        if not plain:
            return False
    return True


def _compact(tree: dict[str, Any], tensors: dict[str, torch.Tensor]
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor], bool]:
    """Rewrite plain tensor nodes into compact encodings; other references stay valid.

    Returns the tree, the stored tensors and whether a node keeps its runs inline (tree version 3).
    """
    table = dict(tensors)
    inline: list[bool] = []

    def dense(node: dict[str, Any]) -> dict[str, Any]:
        # parts are named after the tensor they replace, so the bytes do not depend on thread timing
        base, parts = node["ref"], itertools.count()

        def add(tensor: torch.Tensor) -> str:
            ref = f"{base}.{next(parts)}"
            table[ref] = tensor.contiguous()
            return ref

        encoded = encode_tensor(table.pop(base), add, inline=True)
        if isinstance(encoded.get("left"), list):
            inline.append(True)
        return encoded

    def dense_many(nodes: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Encode sibling tensors, dense or jagged, side by side (torch releases the GIL)."""
        keys = list(nodes)
        # a jagged node's parts are its values, offsets and lengths; none of these walks maps in parallel
        # again (a nested map on the same pool could wait on itself)
        refs = [n.get(part) for n in nodes.values() for part in ("ref", "values", "offsets", "lengths")]
        total = sum(_nbytes(t) for ref in refs if isinstance(ref, str) and (t := table.get(ref)) is not None)
        return dict(zip(keys, _parallel_map(lambda k: walk(nodes[k]), keys, nbytes=total)))

    def walk(node: Any) -> Any:
        if not isinstance(node, dict) or "kind" not in node:
            return node
        kind = node["kind"]
        if kind == "tensor" and "enc" not in node:
            return dense(node)
        if kind == "jagged":
            out = dict(node)
            for part in ("values", "offsets", "lengths"):
                if isinstance(node.get(part), str):
                    out[part] = dense({"ref": node[part]})
            return out
        if kind == "tensordict":
            entries = node["entries"]
            plain = {k: table[v["ref"]] for k, v in entries.items() if v["kind"] == "tensor" and "enc" not in v}
            joined = find_concat(plain)
            # a V1 step's columns are jagged: they are narrowed side by side too
            encoded = dense_many({k: v for k, v in entries.items()
                                  if (k in plain and k not in joined) or v["kind"] == "jagged"})
            out_entries = {}
            for key, child in entries.items():
                if key in joined:
                    table.pop(child["ref"])
                    out_entries[key] = {"kind": "tensor", "enc": "concat", "dtype": str(plain[key].dtype)[6:],
                                        "parts": joined[key]}
                else:
                    out_entries[key] = encoded[key] if key in encoded else walk(child)
            return dict(node, entries=out_entries)
        if kind == "batch":
            return dict(node, batch=walk(node["batch"]),
                        non_tensor_batch={k: walk(v) for k, v in node["non_tensor_batch"].items()})
        if kind == "dict":
            return dict(node, entries={k: walk(v) for k, v in node["entries"].items()})
        return node

    root = walk(tree["root"])
    return dict(tree, root=root), table, bool(inline)
