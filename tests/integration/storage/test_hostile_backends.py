"""A planted or damaged cache on every backend (local, local://, memory://, a real S3 server): the
readers call it damage, the writers replacing it delete nothing they did not write."""

from __future__ import annotations

import json

import pytest

from stepskip import CacheMissError, CorruptEntryError
from stepskip._storage import META_FILE, EntryState, FsspecBackend, checksum, open_store

FILES = {"data.safetensors": b"\x07" * 5000, "data.json": b'{"writer": 1}'}


def put(store, path: str, data: bytes) -> None:
    if isinstance(store.backend, FsspecBackend):
        store.backend.fs.pipe_file(store.backend.key(path), data)
    else:
        import os

        local = path.removeprefix("local://")
        os.makedirs(os.path.dirname(local), exist_ok=True)
        with open(local, "wb") as fh:
            fh.write(data)


def get(store, path: str) -> bytes:
    if isinstance(store.backend, FsspecBackend):
        return bytes(store.backend.fs.cat_file(store.backend.key(path)))
    with open(path.removeprefix("local://"), "rb") as fh:
        return fh.read()


@pytest.fixture
def cache(backend):
    store = open_store(backend.dump_dir, backend.storage_options)
    entry = f"{backend.dump_dir}/exp/3"
    store.write_entry(entry, FILES, {"global_steps": 3, "run_id": "r"})
    return store, backend.dump_dir, entry


@pytest.mark.parametrize("bad", [
    {"format": ["safe"]}, {"generation_seconds": "12"}, {"run_id": ["x"]}, {"parameter_sync_step": 10**9},
    {"global_steps": True}, {"files": ["data.json"]},
], ids=["format-list", "seconds-str", "run_id-list", "sync-1e9", "steps-bool", "files-list"])
def test_ill_typed_meta_is_damage(cache, bad):
    store, _, entry = cache
    meta = json.loads(get(store, f"{entry}/{META_FILE}"))
    put(store, f"{entry}/{META_FILE}", json.dumps({**meta, **bad}).encode())
    probe = store.probe(entry)
    assert probe.state is EntryState.DAMAGED and probe.reason
    with pytest.raises(CorruptEntryError):
        store.read_entry(entry)


@pytest.mark.parametrize("raw", [b"", b"[" * 100_000 + b"]" * 100_000, b'{"global_steps": 3, "x": "' + b"y" * (2 << 20)
                                 + b'"}'], ids=["empty", "deep", "oversized"])
def test_unparsable_meta_is_damage(cache, raw):
    store, _, entry = cache
    put(store, f"{entry}/{META_FILE}", raw)
    assert store.probe(entry).state is EntryState.DAMAGED
    with pytest.raises(CorruptEntryError):
        store.read_entry(entry)


def test_object_names_leaving_the_entry_are_damage_and_never_deleted(cache):
    store, root, entry = cache
    victim = f"{root}/other/data.0123456789ab.json"
    put(store, victim, b"another cache's data")
    meta = json.loads(get(store, f"{entry}/{META_FILE}"))
    meta["files"]["data.json"] = {"bytes": 20, "checksum": checksum(b"another cache's data"),
                                  "object": "../other/data.0123456789ab.json"}
    put(store, f"{entry}/{META_FILE}", json.dumps(meta).encode())
    assert "single file name" in store.probe(entry).reason
    with pytest.raises(CorruptEntryError):
        store.read_entry(entry)
    store.write_entry(entry, FILES, {"global_steps": 3})  # regenerated over the damaged entry
    store.write_entry(entry, FILES, {"global_steps": 3})
    assert get(store, victim) == b"another cache's data"
    assert store.read_entry(entry)[1] == FILES


def test_a_foreign_file_named_by_a_valid_meta_is_never_deleted(cache):
    store, _, entry = cache
    if not isinstance(store.backend, FsspecBackend):
        pytest.skip("a local entry is replaced as a whole directory")
    store.grace_seconds = 0  # replaced objects would go at once: only stepskip's own may
    put(store, f"{entry}/README", b"notes")
    meta = json.loads(get(store, f"{entry}/{META_FILE}"))
    meta["files"]["data.json"] = {"bytes": 5, "checksum": checksum(b"notes"), "object": "README"}
    put(store, f"{entry}/{META_FILE}", json.dumps(meta).encode())
    assert store.read_entry(entry, names=["data.json"])[1] == {"data.json": b"notes"}
    store.write_entry(entry, FILES, {"global_steps": 3})
    assert get(store, f"{entry}/README") == b"notes"
    assert "README" in store.list_dir(entry)


def test_retired_and_missing_entries(cache):
    store, root, entry = cache
    assert store.retire_entry(entry) is True
    assert store.probe(entry).state is EntryState.MISSING
    with pytest.raises(CacheMissError) as info:
        store.read_entry(entry)
    assert not isinstance(info.value, CorruptEntryError)
    assert store.retire_entry(entry) is False
    with pytest.raises(OSError):
        store.remove(f"{root}/exp/../exp/3")


class Loop:
    def __init__(self):
        self.calls = 0

    def generate_sequences(self, prompts):
        import torch

        from stepskip import Batch

        self.calls += 1
        return Batch.from_dict(tensors={"responses": torch.arange(8).reshape(2, 4) + self.calls},
                               non_tensors={"uid": prompts.non_tensor_batch["uid"]})


def test_a_planted_entry_is_regenerated_through_the_manager(backend):
    """Training meets an entry whose meta.json points outside the entry: counted as corrupt,
    generated again and overwritten; the file it pointed at is untouched."""
    from stepskip import Batch, SkipManager

    store = open_store(backend.dump_dir, backend.storage_options)
    skip = {"enable": True, "steps": [1], "dump_dir": backend.dump_dir, "storage_options": backend.storage_options}
    config = {"data": {"train_batch_size": 2}, "actor_rollout_ref": {"rollout": {"n": 1}}, "skip": {"rollout": skip}}

    def run() -> Loop:
        SkipManager.init(config)
        loop = Loop()
        SkipManager.set_step(1)
        SkipManager.annotate(role="rollout")(Loop.generate_sequences)(loop, Batch.from_dict(
            non_tensors={"uid": ["a", "b"]}))
        SkipManager.flush()
        return loop

    assert run().calls == 1
    role = SkipManager.skip_instances["rollout"]
    entry = role.step_dump_dir(1)
    victim = f"{backend.dump_dir}/victim.0123456789ab.json"
    put(store, victim, b"not yours")
    meta = json.loads(get(store, f"{entry}/{META_FILE}"))
    meta["files"]["data.json"]["object"] = "../../../victim.0123456789ab.json"
    put(store, f"{entry}/{META_FILE}", json.dumps(meta).encode())
    SkipManager.reset()
    assert run().calls == 1  # not replayed from the planted file
    assert SkipManager.stats()["skip/rollout/corrupt"] >= 1
    assert get(store, victim) == b"not yours"
    SkipManager.reset()
    assert run().calls == 0  # the regenerated entry replays
