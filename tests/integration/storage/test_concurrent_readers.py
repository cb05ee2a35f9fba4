"""Several writer processes replace one entry while reader processes read it: no valid entry is ever
reported damaged, and every read returns one writer's version whole (local files and a real S3 server).

Writers make a fixed number of writes; readers read at least a fixed number of times and on until
every writer has finished. The assertions hold whatever the interleaving.
"""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import pytest

from stepskip import CacheMissError, CorruptEntryError
from stepskip._storage import EntryState, open_store

pytestmark = pytest.mark.heavy

WRITERS, WRITES, READERS, READS = 3, 12, 3, 40
NAMES = ["data.safetensors", "data.json"]


def version(writer: int, k: int) -> dict[str, bytes]:
    # every (writer, write) has its own sizes: data from two versions can pass neither size nor checksum checks
    return {"data.safetensors": bytes([writer * 16 + k % 16]) * (20_000 + 997 * writer + 31 * k),
            "data.json": f'{{"writer": {writer}, "k": {k}}}'.encode() * (1 + writer)}


def _writer(dump_dir: str, options: dict[str, Any], grace: float, path: str, writer: int, start: Any) -> None:
    store = open_store(dump_dir, options, grace_seconds=grace)
    start.wait()
    for k in range(WRITES):
        store.write_entry(path, version(writer, k), {"global_steps": 1, "writer": writer, "k": k})


def _reader(dump_dir: str, options: dict[str, Any], grace: float, path: str, start: Any, done: Any,
            out: Any) -> None:
    store = open_store(dump_dir, options, grace_seconds=grace)
    counts = {"present": 0, "missing": 0, "damaged": 0, "wrong": 0, "probe_damaged": 0}
    reasons: list[str] = []
    start.wait()
    i = 0
    while i < READS or not done.is_set():
        i += 1
        if i % 4 == 0 and store.probe(path).state is EntryState.DAMAGED:
            counts["probe_damaged"] += 1
        try:
            meta, files = store.read_entry(path, names=NAMES)
        except CorruptEntryError as err:
            counts["damaged"] += 1
            reasons.append(str(err))
            continue
        except CacheMissError:
            counts["missing"] += 1
            continue
        counts["present"] += 1
        if files != version(meta["writer"], meta["k"]):
            counts["wrong"] += 1
    out.put((counts, reasons[:5]))


def _race(dump_dir: str, options: dict[str, Any], grace: float) -> dict[str, int]:
    path = f"{dump_dir}/exp_proj/GBS2_N1_in4_out4/1"
    open_store(dump_dir, options).write_entry(path, version(0, 0), {"global_steps": 1, "writer": 0, "k": 0})
    context = multiprocessing.get_context("fork")
    start, done, out = context.Event(), context.Event(), context.Queue()
    procs = [context.Process(target=_writer, args=(dump_dir, options, grace, path, w, start))
             for w in range(1, WRITERS + 1)]
    readers = [context.Process(target=_reader, args=(dump_dir, options, grace, path, start, done, out))
               for _ in range(READERS)]
    for p in procs + readers:
        p.start()
    start.set()
    for p in procs:
        p.join(300)
    done.set()
    results = [out.get(timeout=300) for _ in range(READERS)]
    for p in readers:
        p.join(60)
    procs += readers
    assert [p.exitcode for p in procs] == [0] * len(procs)
    total = {k: sum(r[0][k] for r in results) for k in results[0][0]}
    reasons = [reason for r in results for reason in r[1]]
    assert total["damaged"] == 0 and total["probe_damaged"] == 0, (total, reasons)
    assert total["wrong"] == 0, total
    assert total["missing"] == 0, total  # the entry exists throughout: replacing it never hides it
    assert total["present"] >= READERS * READS
    store = open_store(dump_dir, options)
    meta, files = store.read_entry(path, names=NAMES)
    assert files == version(meta["writer"], meta["k"])
    return total


def test_local_readers_never_see_damage_while_writers_replace(tmp_path):
    _race(str(tmp_path / "dump"), {}, 0.0)


@pytest.mark.parametrize("grace", [600.0, 0.0], ids=["grace", "no-grace"])
def test_s3_readers_never_see_damage_while_writers_replace(s3_server, grace):
    """With a grace period a reader holding an old meta.json finds its objects; without one (replaced
    objects deleted right after publishing) it reads the newer version instead."""
    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    bucket = f"stepskip-race-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    _race(f"s3://{bucket}/dump", options, grace)
