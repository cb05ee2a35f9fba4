"""One storage suite, four backends: local files (a path, local://), fsspec memory://, a real S3-compatible server."""

from __future__ import annotations

import threading

import pytest
import torch

from stepskip import Batch, CorruptEntryError, SkipManager
from stepskip._storage import GRACE_SECONDS, META_FILE, EntryState, FsspecBackend, open_store
from stepskip.tq import InProcessTQClient


def entry(backend, name="e1"):
    return f"{backend.dump_dir}/{name}"


def files_for(writer: int, size: int = 4096) -> dict[str, bytes]:
    return {"data.safetensors": bytes([writer % 256]) * size, "data.json": f'{{"writer": {writer}}}'.encode()}


def test_write_probe_read_round_trip(backend):
    store = open_store(backend.dump_dir, backend.storage_options)
    assert store.probe(entry(backend)).state is EntryState.MISSING
    written = store.write_entry(entry(backend), files_for(1), {"global_steps": 1})
    probe = store.probe(entry(backend))
    assert probe.state is EntryState.PRESENT and probe.meta["global_steps"] == 1
    assert written >= 4096
    assert store.read_files(entry(backend), probe.meta, ["data.safetensors", "data.json"], verify=True) == files_for(1)


def test_a_big_entry_encoded_in_pooled_memory_round_trips(backend):
    """Format 'safe' hands a big tensor file over as a view of recycled pages: every store writes its bytes."""
    from stepskip._formats.safe import SafeFormat

    fmt = SafeFormat()
    value = {"ids": torch.randint(0, 150_000, (64, 8192)), "logp": torch.randn(64, 8192)}
    files = fmt.encode(fmt.freeze(value, copy=True))
    assert isinstance(files["data.safetensors"], memoryview) and len(files["data.safetensors"]) > 4 << 20
    store = open_store(backend.dump_dir, backend.storage_options)
    written = store.write_entry(entry(backend), files, {"global_steps": 1})
    probe = store.probe(entry(backend))
    assert written > len(files["data.safetensors"]) and probe.state is EntryState.PRESENT
    read = store.read_files(entry(backend), probe.meta, ["data.safetensors", "data.json"], verify=True)
    assert read == {name: bytes(data) for name, data in files.items()}
    out = fmt.decode(read)
    assert all(torch.equal(out[k], v) for k, v in value.items())


def _objects(store, path) -> set[str]:
    meta = store.probe(path).meta
    return {info.get("object", name) for name, info in meta["files"].items()} | {META_FILE}


def test_overwrite_leaves_one_entry_and_no_stray_objects(backend):
    """Local entries are replaced at once; on object stores the replaced entry's objects stay for
    readers that still hold the old meta.json, until a later writer finds their grace period over."""
    store = open_store(backend.dump_dir, backend.storage_options)
    now = [1_000_000.0]
    if isinstance(store.backend, FsspecBackend):
        store.clock = lambda: now[0]
    store.write_entry(entry(backend), files_for(1), {"global_steps": 1})
    first = _objects(store, entry(backend)) - {META_FILE}
    store.write_entry(entry(backend), files_for(2), {"global_steps": 1})
    probe = store.probe(entry(backend))
    assert store.read_files(entry(backend), probe.meta, ["data.safetensors", "data.json"], verify=True) == files_for(2)
    second = _objects(store, entry(backend))
    if isinstance(store.backend, FsspecBackend):
        assert set(store.list_dir(entry(backend))) == second | first  # still readable by an old reader
        assert set(probe.meta["retired"]) == first
        now[0] += GRACE_SECONDS
        store.write_entry(entry(backend), files_for(3), {"global_steps": 1})
        third = _objects(store, entry(backend))
        assert set(store.list_dir(entry(backend))) == third | (second - {META_FILE})  # the first are gone
        now[0] += GRACE_SECONDS
        assert sorted(store.remove_leftovers(backend.dump_dir)) == sorted(
            f"{entry(backend)}/{o}" for o in second - {META_FILE})
        assert set(store.list_dir(entry(backend))) == third
    else:
        assert set(store.list_dir(entry(backend))) == second
    assert store.write_entry(entry(backend), files_for(4), {"global_steps": 1}, overwrite=False) == 0


def test_damage_is_detected(backend):
    store = open_store(backend.dump_dir, backend.storage_options)
    store.write_entry(entry(backend), files_for(1), {"global_steps": 1})
    probe = store.probe(entry(backend))
    obj = probe.meta["files"]["data.safetensors"].get("object", "data.safetensors")
    path = f"{entry(backend)}/{obj}"
    raw = bytearray(_get(store, path))
    raw[100] ^= 0xFF
    _put(store, path, bytes(raw))
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.read_files(entry(backend), probe.meta, ["data.safetensors"], verify=True)
    assert store.read_files(entry(backend), probe.meta, ["data.safetensors"], verify=False)["data.safetensors"] == raw
    _put(store, path, bytes(raw[:10]))
    assert store.probe(entry(backend)).state is EntryState.DAMAGED
    _put(store, f"{entry(backend)}/{META_FILE}", b"{not json")
    assert store.probe(entry(backend)).state is EntryState.DAMAGED
    store.remove(entry(backend))
    assert store.probe(entry(backend)).state is EntryState.MISSING


def _put(store, path, data):
    if isinstance(store.backend, FsspecBackend):
        store.backend.fs.pipe_file(store.backend.key(path), data)
    else:
        with open(path.removeprefix("local://"), "wb") as fh:
            fh.write(data)


def _get(store, path):
    if isinstance(store.backend, FsspecBackend):
        return bytes(store.backend.fs.cat_file(store.backend.key(path)))
    with open(path.removeprefix("local://"), "rb") as fh:
        return fh.read()


def test_concurrent_writers_never_mix_files(backend):
    store = open_store(backend.dump_dir, backend.storage_options)
    barrier = threading.Barrier(6)

    def write(writer):
        barrier.wait()
        store.write_entry(entry(backend), files_for(writer), {"global_steps": 1, "writer": writer})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    probe = store.probe(entry(backend))
    data = store.read_files(entry(backend), probe.meta, ["data.safetensors", "data.json"], verify=True)
    assert data == files_for(probe.meta["writer"])


def test_readers_never_see_partial_entries(backend):
    """A reader probing and reading while the entry is overwritten 14 times sees whole entries only.

    Each write waits until the reader has finished one more attempt, so reads and writes interleave
    whatever the scheduler does; the reader's last attempt starts after the last write and must read
    the final entry.
    """
    store = open_store(backend.dump_dir, backend.storage_options)
    store.write_entry(entry(backend), files_for(0), {"global_steps": 1, "writer": 0})
    stop, attempted = threading.Event(), threading.Event()
    seen, bad, last = [], [], []

    def attempt():
        probe = store.probe(entry(backend))
        if probe.state is not EntryState.PRESENT:
            return None
        try:
            data = store.read_files(entry(backend), probe.meta, ["data.safetensors", "data.json"], verify=True)
        except CorruptEntryError:
            return None  # replaced between meta and data: a retry reads the new entry
        if data != files_for(probe.meta["writer"]):
            bad.append(probe.meta["writer"])
        seen.append(probe.meta["writer"])
        return probe.meta["writer"]

    def read():
        while not stop.is_set():
            attempt()
            attempted.set()
        last.append(attempt())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for writer in range(1, 15):
            assert attempted.wait(300), "the reader thread made no progress"
            attempted.clear()
            store.write_entry(entry(backend), files_for(writer), {"global_steps": 1, "writer": writer})
    finally:
        stop.set()
        reader.join(300)
    assert not reader.is_alive()
    assert not bad and seen
    assert last == [14]


class Loop:
    def __init__(self):
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        rows = len(prompts)
        out = Batch.from_dict(tensors={"responses": torch.arange(rows * 5).reshape(rows, 5) + self.calls},
                              non_tensors={"uid": prompts.non_tensor_batch["uid"],
                                           "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(rows)]})
        out.batch["jagged"] = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(rows)],
                                                         layout=torch.jagged)
        return out


@pytest.mark.parametrize("fmt", ["safe", "verl"])
def test_record_then_replay_through_the_manager(backend, fmt):
    skip = {"enable": True, "steps": [1, 2], "dump_dir": backend.dump_dir, "storage_options": backend.storage_options,
            "format": fmt, "allow_pickle": fmt == "verl"}
    config = {"data": {"train_batch_size": 2}, "actor_rollout_ref": {"rollout": {"n": 2}}, "skip": {"rollout": skip}}
    outputs = []
    for _ in range(2):
        SkipManager.init(config)
        loop = Loop()
        run = []
        for step in (1, 2):
            SkipManager.set_step(step)
            run.append(loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b", "c", "d"]})))
        SkipManager.flush()
        outputs.append((loop.calls, run))
    assert [calls for calls, _ in outputs] == [2, 0]
    for recorded, replayed in zip(outputs[0][1], outputs[1][1]):
        assert torch.equal(recorded.batch["responses"], replayed.batch["responses"])
        assert [r.tolist() for r in replayed.batch["jagged"].unbind()] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3]]
        assert replayed.non_tensor_batch["messages"].tolist() == recorded.non_tensor_batch["messages"].tolist()
    assert SkipManager.skip_instances["rollout"].available_steps() == [1, 2]


def test_v1_steps_on_the_backend(backend):
    from v1_harness import V1Trainer

    config = {"actor_rollout_ref": {"rollout": {"n": 2}},
              "skip": {"rollout_tq": {"enable": True, "steps": [1], "dump_dir": backend.dump_dir,
                                      "storage_options": backend.storage_options}}}
    first = V1Trainer(config, InProcessTQClient())
    first.fit(1)
    SkipManager.reset()
    second = V1Trainer(config, InProcessTQClient())
    second.fit(1)
    assert (first.agent_loop.calls, second.agent_loop.calls) == (1, 0)


def test_stale_unreferenced_objects_are_removed(backend):
    store = open_store(backend.dump_dir, backend.storage_options)
    store.write_entry(entry(backend, "7"), files_for(1), {"global_steps": 7})
    if backend.name.startswith("local"):
        import os
        os.makedirs(f"{backend.dump_dir.removeprefix('local://')}/.tmp-7-dead", exist_ok=True)
        removed = store.remove_leftovers(backend.dump_dir, older_than=0)
        assert removed == [f"{backend.dump_dir}/.tmp-7-dead"]
    else:
        _put(store, f"{entry(backend, '7')}/data.deadbeef0000.safetensors", b"orphan of a crashed writer")
        removed = store.remove_leftovers(backend.dump_dir, older_than=0)
        assert removed == [f"{entry(backend, '7')}/data.deadbeef0000.safetensors"]
    assert store.probe(entry(backend, "7")).state is EntryState.PRESENT


def test_match_finds_prompts_across_batch_sizes_on_the_backend(backend):
    """``action: match`` on every store: prompts recorded with batch size 4 replay in batches of 2
    (another run directory), and only the never-recorded prompt is generated."""

    class Rollout:
        def __init__(self) -> None:
            self.seen: list[list[int]] = []

        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            ids = prompts.batch["ids"][:, 0].tolist()
            self.seen.append(ids)
            return Batch.from_dict(tensors={"out": prompts.batch["ids"] * 10 + len(self.seen)},
                                   non_tensors={"uid": prompts.non_tensor_batch["uid"]})

    def prompts(ids: list[int], tag: str) -> Batch:
        return Batch.from_dict(tensors={"ids": torch.tensor([[i, i] for i in ids])},
                               non_tensors={"uid": [f"{tag}{i}" for i in ids]})

    def config(gbs: int) -> dict:
        return {"data": {"train_batch_size": gbs},
                "skip": {"rollout": {"enable": True, "steps": "all", "action": "match", "dump_dir": backend.dump_dir,
                                     "storage_options": backend.storage_options}}}

    SkipManager.init(config(4))
    SkipManager.set_step(1)
    first = Rollout()
    recorded = first.generate_sequences(prompts([1, 2, 3, 4], "a"))
    SkipManager.flush()
    SkipManager.init(config(2))
    second = Rollout()
    SkipManager.set_step(1)
    replayed = second.generate_sequences(prompts([3, 1], "b"))
    SkipManager.set_step(2)
    mixed = second.generate_sequences(prompts([7, 2], "c"))
    SkipManager.flush()
    assert second.seen == [[7]]
    assert replayed.batch["out"].tolist() == [recorded.batch["out"][2].tolist(), recorded.batch["out"][0].tolist()]
    assert mixed.batch["out"].tolist() == [[71, 71], recorded.batch["out"][1].tolist()]
    assert mixed.non_tensor_batch["uid"].tolist() == ["c7", "c2"]
