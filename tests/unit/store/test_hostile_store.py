"""A cache written by someone else: what the stores refuse to read, follow or delete.

Every reader here runs against real files (local) or a real fsspec memory:// filesystem. Reads that
could hang or exhaust memory when broken (FIFOs, /dev/zero, deep nesting) run in a forked child with
an address-space limit and a hang guard (tests/support/forked.py), so a regression fails the test instead
of the test run.
"""

from __future__ import annotations

import json
import math
import os
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from forked import HANG_GUARD_S, limit_memory, run_forked
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from stepskip import CacheMissError, CorruptEntryError
from stepskip._storage import (
    META_FILE,
    META_MAX_BYTES,
    EntryState,
    EntryStore,
    FsspecBackend,
    LocalBackend,
    check_meta,
    checksum,
    open_store,
    valid_name,
)

FILES = {"data.safetensors": b"\x00tensor bytes" * 20, "data.json": b'{"root": 1}'}
NAMES = list(FILES)


# --------------------------------------------------------------------------- helpers


def in_child(fn: Callable[[], Any], timeout: float = HANG_GUARD_S, extra_memory: int = 512 << 20) -> Any:
    """Run ``fn`` in a forked child limited to its current address space plus ``extra_memory``;
    return its result, or fail when it raises, hangs or dies."""
    return run_forked(fn, before=limit_memory(extra_memory), timeout=timeout)


def probe_in_child(store: Any, path: str, **kw: Any) -> tuple[str, str]:
    def look() -> tuple[str, str]:
        probe = store.probe(path, **kw)
        return probe.state.value, probe.reason
    return in_child(look)


def read_in_child(store: Any, path: str, **kw: Any) -> str:
    """What read_entry did: 'present', 'missing: ...' or 'damaged: ...' (never an exception)."""
    def read() -> str:
        try:
            store.read_entry(path, **kw)
        except CorruptEntryError as err:
            return f"damaged: {err}"
        except CacheMissError as err:
            return f"missing: {err}"
        return "present"
    return in_child(read)


class Local:
    """A store on the local backend rooted at a dump dir, with raw access for planting things."""

    name = "local"

    def __init__(self, root: Path) -> None:
        self.root = str(root / "dump")
        os.makedirs(self.root)
        self.store = open_store(self.root)
        assert isinstance(self.store.backend, LocalBackend)

    def put(self, path: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)


class Memory:
    name = "memory"

    def __init__(self, root: Path) -> None:
        self.root = f"memory://hostile-{uuid.uuid4().hex[:8]}/dump"
        self.store = open_store(self.root)
        assert isinstance(self.store.backend, FsspecBackend)

    def put(self, path: str, data: bytes) -> None:
        self.store.backend.fs.pipe_file(self.store.backend.key(path), data)

    def exists(self, path: str) -> bool:
        return bool(self.store.backend.fs.exists(self.store.backend.key(path)))


@pytest.fixture(params=["local", "memory"])
def cache(request: pytest.FixtureRequest, tmp_path: Path) -> Local | Memory:
    return Local(tmp_path) if request.param == "local" else Memory(tmp_path)


def entry_of(cache: Local | Memory, step: int = 3) -> str:
    return f"{cache.root}/exp_proj/GBS4_N2_in8_out8/{step}"


def written(cache: Local | Memory, step: int = 3, meta: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    path = entry_of(cache, step)
    cache.store.write_entry(path, FILES, meta or {"global_steps": step, "format": "safe", "run_id": "r1"})
    probe = cache.store.probe(path)
    assert probe.state is EntryState.PRESENT
    return path, dict(probe.meta)


def plant_meta(cache: Local | Memory, path: str, meta: Any) -> None:
    cache.put(f"{path}/{META_FILE}", meta if isinstance(meta, bytes) else json.dumps(meta).encode())


def assert_damaged(cache: Local | Memory, path: str, *words: str) -> str:
    probe = cache.store.probe(path)
    assert probe.state is EntryState.DAMAGED, probe
    for word in words:
        assert word in probe.reason, probe.reason
    with pytest.raises(CorruptEntryError):
        cache.store.read_entry(path, names=NAMES)
    return probe.reason


# --------------------------------------------------------------------------- names in meta.json


@pytest.mark.parametrize("name", ["data.json", "gen_batch.dp", "data.0123456789ab.safetensors", "x", "é.bin"])
def test_valid_names(name: str) -> None:
    assert valid_name(name)


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "a/b", "/etc/hostname", "a\\b", "x\x00y", "a..b",
                                  "x" * 256, "\ud800", 3, None])
def test_invalid_names(name: Any) -> None:
    assert not valid_name(name)


@pytest.mark.parametrize("bad", ["../../other/3/data.json", "/etc/hostname", "..", "sub/data.json", "a\\..\\b", ""])
@pytest.mark.parametrize("where", ["object", "key"])
def test_file_names_that_leave_the_entry_are_damage(cache: Local | Memory, bad: str, where: str) -> None:
    victim_path, victim_meta = written(cache, step=4)  # real data a planted name could point at
    path, meta = written(cache)
    info = dict(meta["files"]["data.json"])
    if where == "object":
        info["object"] = bad
        meta["files"]["data.json"] = info
    else:
        meta["files"] = {bad: info, "data.safetensors": meta["files"]["data.safetensors"]}
    plant_meta(cache, path, meta)
    assert_damaged(cache, path, META_FILE)
    assert cache.store.probe(victim_path).state is EntryState.PRESENT


def test_object_pointing_at_a_sibling_entry_is_not_followed(tmp_path: Path) -> None:
    """The issue's case: meta.json's object names another cache's data, with its size and checksum."""
    cache = Local(tmp_path)
    other = tmp_path / "other" / "data.json"
    other.parent.mkdir()
    other.write_bytes(b'{"planted": true}')
    path, meta = written(cache)
    rel = os.path.relpath(other, path)
    meta["files"]["data.json"] = {"bytes": other.stat().st_size, "checksum": checksum(other.read_bytes()),
                                  "object": rel}
    plant_meta(cache, path, meta)
    assert_damaged(cache, path)
    with pytest.raises(CorruptEntryError):
        cache.store.read_files(path, meta, ["data.json"], verify=True)


# --------------------------------------------------------------------------- malformed metadata


def _base() -> dict[str, Any]:
    return {"global_steps": 3, "format": "safe", "run_id": "r", "generation_seconds": 1.5, "created_unix": 1e9,
            "role": "rollout", "stepskip_version": "0.1", "fingerprint": {"n": 2}, "prompt_digest": None}


def _with(**changes: Any) -> dict[str, Any]:
    meta = _base()
    for key, value in changes.items():
        if value is _DROP:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


_DROP = object()

MALFORMED = {
    "global_steps-missing": _with(global_steps=_DROP),
    "global_steps-negative": _with(global_steps=-1),
    "global_steps-bool": _with(global_steps=True),
    "global_steps-str": _with(global_steps="3"),
    "global_steps-float": _with(global_steps=3.0),
    "global_steps-huge": _with(global_steps=2**64),
    "format-list": _with(format=["safe"]),
    "format-null": _with(format=None),
    "format-int": _with(format=1),
    "run_id-list": _with(run_id=["a"]),
    "run_id-dict": _with(run_id={"a": 1}),
    "role-int": _with(role=3),
    "generation_seconds-str": _with(generation_seconds="12"),
    "generation_seconds-negative": _with(generation_seconds=-1),
    "generation_seconds-bool": _with(generation_seconds=True),
    "generation_seconds-list": _with(generation_seconds=[1]),
    "created_unix-str": _with(created_unix="yesterday"),
    "prompt_digest-int": _with(prompt_digest=7),
    "fingerprint-list": _with(fingerprint=[1, 2]),
    "parameter_sync_step-1e9": _with(parameter_sync_step=10**9),
    "parameter_sync_step-0": _with(parameter_sync_step=0),
    "parameter_sync_step-bool": _with(parameter_sync_step=True),
    "parameter_sync_step-str": _with(parameter_sync_step="4"),
    "inner_idx-negative": _with(inner_idx=-1),
    "inner_idx-1e9": _with(inner_idx=10**9),
    "num_trajectories-str": _with(num_trajectories="8"),
    "num_trajectories-float": _with(num_trajectories=8.5),
    "files-list": _with(files=["data.json"]),
    "files-str": _with(files="data.json"),
    "file-info-list": _with(files={"data.json": [11, "x"]}),
    "file-bytes-str": _with(files={"data.json": {"bytes": "11", "checksum": "x"}}),
    "file-bytes-negative": _with(files={"data.json": {"bytes": -1, "checksum": "x"}}),
    "file-bytes-bool": _with(files={"data.json": {"bytes": True, "checksum": "x"}}),
    "file-bytes-missing": _with(files={"data.json": {"checksum": "x"}}),
    "file-checksum-int": _with(files={"data.json": {"bytes": 11, "checksum": 5}}),
    "file-object-int": _with(files={"data.json": {"bytes": 11, "checksum": "x", "object": 5}}),
    "file-named-meta": _with(files={META_FILE: {"bytes": 11, "checksum": "x"}}),
    "file-name-too-long": _with(files={"x" * 300: {"bytes": 11, "checksum": "x"}}),
    "retired-list": _with(retired=["data.0123456789ab.json"]),
    "retired-bad-time": _with(retired={"data.0123456789ab.json": "now"}),
    "retired-outside": _with(retired={"../data.0123456789ab.json": 1.0}),
    "nested-40": _with(fingerprint=json.loads("[" * 40 + "]" * 40)),
    "not-an-object": [1, 2, 3],
    "string": "text",
    "null": None,
}


@pytest.mark.parametrize("meta", list(MALFORMED.values()), ids=list(MALFORMED))
def test_check_meta_names_what_is_wrong(meta: Any) -> None:
    reason = check_meta(meta)
    assert reason and isinstance(reason, str)


@pytest.mark.parametrize("meta", [MALFORMED[k] for k in ("format-list", "generation_seconds-str", "run_id-list",
                                                         "parameter_sync_step-1e9", "file-bytes-str", "files-list",
                                                         "global_steps-bool", "nested-40")],
                         ids=["format-list", "generation_seconds-str", "run_id-list", "parameter_sync_step-1e9",
                              "file-bytes-str", "files-list", "global_steps-bool", "nested-40"])
def test_malformed_meta_on_disk_is_damage_not_an_exception(cache: Local | Memory, meta: Any) -> None:
    path, _ = written(cache)
    plant_meta(cache, path, meta)
    assert_damaged(cache, path)


def test_the_reason_names_the_key() -> None:
    assert "format" in check_meta(MALFORMED["format-list"])
    assert "parameter_sync_step" in check_meta(MALFORMED["parameter_sync_step-1e9"])
    assert "generation_seconds" in check_meta(MALFORMED["generation_seconds-str"])
    assert "run_id" in check_meta(MALFORMED["run_id-list"])


@pytest.mark.parametrize("meta", [
    {"global_steps": 0},
    _base(),
    _with(generation_seconds=None, created_unix=None, prompt_digest="abc"),
    _with(generation_seconds=0),
    {"global_steps": 2, "num_trajectories": 16, "inner_idx": 3, "parameter_sync_step": 4, "run_id": ""},
    {"global_steps": 1, "files": {"gen_batch.dp": {"bytes": 0, "checksum": "xxh3_64:0"}}},
    {"global_steps": 1, "files": {"data.json": {"bytes": 3, "checksum": "c", "object": "data.0123456789ab.json"}},
     "retired": {"data.ba9876543210.json": 1.5}},
])
def test_check_meta_accepts_what_stepskip_and_verl_write(meta: dict[str, Any]) -> None:
    assert check_meta(meta) is None


def test_written_meta_passes_check_meta(cache: Local | Memory) -> None:
    _, meta = written(cache, meta={**_base(), "parameter_sync_step": 2, "inner_idx": 1, "num_trajectories": 8})
    assert check_meta(meta) is None


def test_nan_and_infinity_are_damage(cache: Local | Memory) -> None:
    path, _ = written(cache)
    for token in ("NaN", "Infinity", "-Infinity"):
        plant_meta(cache, path, f'{{"global_steps": 3, "generation_seconds": {token}}}'.encode())
        assert_damaged(cache, path, "generation_seconds")
    assert check_meta({"global_steps": 3, "generation_seconds": math.nan})


def test_100k_deep_nesting_is_damage_in_bounded_memory(cache: Local | Memory) -> None:
    path, _ = written(cache)
    depth = 100_000
    plant_meta(cache, path, b'{"global_steps": 3, "x": ' + b"[" * depth + b"]" * depth + b"}")
    state, reason = probe_in_child(cache.store, path)
    assert state == "damaged" and "nests deeper" in reason
    assert read_in_child(cache.store, path, names=NAMES).startswith("damaged")
    plant_meta(cache, path, b'{"global_steps": 3, "x": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}")
    assert probe_in_child(cache.store, path)[0] == "damaged"


def test_oversized_meta_is_damage_without_parsing(cache: Local | Memory) -> None:
    path, _ = written(cache)
    plant_meta(cache, path, b'{"global_steps": 3, "pad": "' + b"x" * META_MAX_BYTES + b'"}')
    assert_damaged(cache, path, "bytes")


def test_huge_integer_literal_is_damage(cache: Local | Memory) -> None:
    path, _ = written(cache)
    plant_meta(cache, path, b'{"global_steps": ' + b"9" * 100_000 + b"}")
    assert_damaged(cache, path)


@pytest.mark.parametrize("key", ["generation_seconds", "created_unix"])
def test_huge_integer_time_is_damage_not_an_overflow(cache: Local | Memory, key: str) -> None:
    """math.isfinite(10**400) raises OverflowError: a probe must report damage instead."""
    path, _ = written(cache)
    plant_meta(cache, path, b'{"global_steps": 1, "%s": 1' % key.encode() + b"0" * 400 + b', "files": {}}')
    assert_damaged(cache, path, key)
    assert check_meta({"global_steps": 1, key: 10**400})


def test_lone_surrogate_string_is_damage(cache: Local | Memory) -> None:
    path, _ = written(cache)
    plant_meta(cache, path, b'{"global_steps": 3, "run_id": "\\ud800"}')
    assert_damaged(cache, path, "Unicode")


# --------------------------------------------------------------------------- links, FIFOs, devices (local)


@pytest.fixture(params=["openat2", "walk"])
def local(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Local:
    """A local cache, read with Linux openat2 where the kernel has it, and by the component-wise walk
    that older kernels (and seccomp filters refusing openat2) get."""
    if request.param == "walk":
        from stepskip._storage import _linux

        monkeypatch.setattr(_linux, "_SYSCALL", None)
    return Local(tmp_path)


def test_symlinked_data_file_is_damage_even_with_matching_checksum(local: Local, tmp_path: Path) -> None:
    path, _ = written(local)
    outside = tmp_path / "outside.json"
    outside.write_bytes(FILES["data.json"])  # same bytes: size and checksum match
    os.remove(f"{path}/data.json")
    os.symlink(outside, f"{path}/data.json")
    assert_damaged(local, path, "symbolic link")
    with pytest.raises(CorruptEntryError, match="symbolic link"):
        local.store.read_files(path, json.loads(Path(path, META_FILE).read_text()), ["data.json"], verify=True)


def test_symlinked_meta_is_damage(local: Local, tmp_path: Path) -> None:
    path, _ = written(local)
    real = tmp_path / "meta-elsewhere.json"
    real.write_bytes(Path(path, META_FILE).read_bytes())
    os.remove(f"{path}/{META_FILE}")
    os.symlink(real, f"{path}/{META_FILE}")
    assert_damaged(local, path, "symbolic link")


def test_hard_link_to_dev_zero_impossible_so_symlink_is_refused(local: Local) -> None:
    path, meta = written(local)
    os.remove(f"{path}/data.safetensors")
    os.symlink("/dev/zero", f"{path}/data.safetensors")
    meta["files"]["data.safetensors"]["bytes"] = 1 << 40
    plant_meta(local, path, meta)
    assert probe_in_child(local.store, path)[0] == "damaged"
    assert read_in_child(local.store, path, names=NAMES).startswith("damaged")


def test_fifo_data_file_never_hangs(local: Local) -> None:
    path, _ = written(local)
    os.remove(f"{path}/data.json")
    os.mkfifo(f"{path}/data.json")
    state, reason = probe_in_child(local.store, path)
    assert state == "damaged" and "regular file" in reason
    assert "regular file" in read_in_child(local.store, path, names=NAMES)


def test_fifo_meta_never_hangs(local: Local) -> None:
    path, _ = written(local)
    os.remove(f"{path}/{META_FILE}")
    os.mkfifo(f"{path}/{META_FILE}")
    state, reason = probe_in_child(local.store, path)
    assert state == "damaged" and "regular file" in reason


def test_fifo_legacy_file_never_hangs(local: Local) -> None:
    path = entry_of(local)
    os.makedirs(path)
    Path(path, META_FILE).write_text(json.dumps({"global_steps": 3}))
    os.mkfifo(f"{path}/gen_batch.dp")
    assert probe_in_child(local.store, path, legacy_files=("gen_batch.dp",))[0] == "damaged"
    os.remove(f"{path}/gen_batch.dp")
    os.symlink("/dev/zero", f"{path}/gen_batch.dp")
    assert probe_in_child(local.store, path, legacy_files=("gen_batch.dp",))[0] == "damaged"


def test_device_node_as_data_file_is_never_read(local: Local) -> None:
    path, meta = written(local)
    os.remove(f"{path}/data.safetensors")
    try:
        os.mknod(f"{path}/data.safetensors", stat.S_IFCHR | 0o666, os.makedev(1, 5))  # /dev/zero
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    meta["files"]["data.safetensors"]["bytes"] = 1 << 40
    plant_meta(local, path, meta)
    assert probe_in_child(local.store, path)[0] == "damaged"
    assert "regular file" in read_in_child(local.store, path, names=NAMES)


def test_file_larger_than_recorded_is_never_read_past_its_size(local: Local) -> None:
    path, _ = written(local)
    with open(f"{path}/data.json", "ab") as fh:
        fh.truncate(1 << 40)  # a sparse terabyte: reading it whole would exhaust memory
    assert "bytes" in read_in_child(local.store, path, names=NAMES)


def test_symlinked_step_dir_is_not_read_listed_or_followed_on_delete(local: Local, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere" / "3"
    EntryStore(LocalBackend()).write_entry(str(target), FILES, {"global_steps": 3})
    run_dir = entry_of(local).rsplit("/", 1)[0]
    os.makedirs(run_dir)
    os.symlink(target, f"{run_dir}/3")
    store = local.store
    assert_damaged(local, f"{run_dir}/3", "symbolic link")
    assert store.list_dir(run_dir, dirs_only=True) == []
    assert store.list_dir(run_dir) == ["3"]  # the name is there, it just is not a directory of the cache
    assert not store.is_dir(f"{run_dir}/3")
    assert store.list_dir(f"{run_dir}/3") == []
    store.write_entry(f"{run_dir}/3", {"x.bin": b"fresh"}, {"global_steps": 3})  # replaces the link only
    assert store.read_entry(f"{run_dir}/3")[1] == {"x.bin": b"fresh"}
    assert EntryStore(LocalBackend()).read_entry(str(target))[1] == FILES
    os.rename(f"{run_dir}/3", f"{run_dir}/4")
    os.symlink(target, f"{run_dir}/3")
    assert store.retire_entry(f"{run_dir}/3") is True
    assert not os.path.lexists(f"{run_dir}/3") and EntryStore(LocalBackend()).read_entry(str(target))[1] == FILES
    os.symlink(target, f"{run_dir}/3")
    store.remove(f"{run_dir}/3")
    assert not os.path.lexists(f"{run_dir}/3") and EntryStore(LocalBackend()).read_entry(str(target))[1] == FILES


def test_symlinked_run_dir_is_neither_read_nor_written_nor_deleted_through(local: Local, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    EntryStore(LocalBackend()).write_entry(str(elsewhere / "3"), FILES, {"global_steps": 3})
    (elsewhere / ".tmp-3-0123456789ab").mkdir()
    run_dir = entry_of(local).rsplit("/", 1)[0]
    os.makedirs(os.path.dirname(run_dir))
    os.symlink(elsewhere, run_dir)
    store = local.store
    assert store.probe(f"{run_dir}/3").state is EntryState.MISSING
    with pytest.raises(CacheMissError):
        store.read_entry(f"{run_dir}/3")
    assert store.list_dir(run_dir) == [] and not store.is_dir(run_dir)
    assert store.list_dir(os.path.dirname(run_dir), dirs_only=True) == []
    with pytest.raises(OSError, match="symbolic link"):
        store.write_entry(f"{run_dir}/5", FILES, {"global_steps": 5})
    with pytest.raises(OSError):
        store.remove(f"{run_dir}/3")
    with pytest.raises(OSError):
        store.retire_entry(f"{run_dir}/3")
    assert store.remove_leftovers(run_dir, older_than=0) == []
    assert sorted(os.listdir(elsewhere)) == [".tmp-3-0123456789ab", "3"]
    assert EntryStore(LocalBackend()).read_entry(str(elsewhere / "3"))[1] == FILES


def test_symlinked_legacy_file_is_not_an_entry(local: Local, tmp_path: Path) -> None:
    path = entry_of(local)
    os.makedirs(path)
    Path(path, META_FILE).write_text(json.dumps({"global_steps": 3}))
    outside = tmp_path / "gen_batch.dp"
    outside.write_bytes(b"someone else's pickle")
    os.symlink(outside, f"{path}/gen_batch.dp")
    assert local.store.probe(path, legacy_files=("gen_batch.dp",)).state is EntryState.DAMAGED


# --------------------------------------------------------------------------- deletion confinement


def _fsspec_local(tmp_path: Path) -> EntryStore:
    return EntryStore(FsspecBackend(LocalFileSystem(auto_mkdir=True), root=str(tmp_path / "dump")))


@pytest.mark.parametrize("kind", ["memory", "fsspec-local", "local-url"])
def test_replacing_a_planted_entry_deletes_only_its_own_objects(tmp_path: Path, kind: str) -> None:
    """A damaged meta.json naming things outside the entry (or not written by stepskip) makes the
    replacing writer delete none of them."""
    if kind == "memory":
        root = f"memory://confine-{uuid.uuid4().hex[:8]}/dump"
        store: Any = EntryStore(FsspecBackend(MemoryFileSystem(), root=root), grace_seconds=0)
        fs = store.backend.fs
    elif kind == "fsspec-local":
        root = str(tmp_path / "dump")
        store = EntryStore(FsspecBackend(LocalFileSystem(auto_mkdir=True), root=root), grace_seconds=0)
        fs = store.backend.fs
    else:
        root = f"local://{tmp_path}/dump"
        store = open_store(root)
        assert isinstance(store.backend, LocalBackend)
        fs = LocalFileSystem(auto_mkdir=True)
    base = root.split("://", 1)[-1]
    victims = [f"{base}/victim/data.0123456789ab.json", f"{base}/exp/notes.0123456789ab.txt",
               f"{tmp_path}/outside.0123456789ab.json"]
    for victim in victims:
        fs.pipe_file(victim, b"keep me")
    path = f"{root}/exp/3"
    fs.pipe_file(f"{base}/exp/3/README", b"a user's note in the entry")
    planted = {"global_steps": 3, "files": {
        "a.json": {"bytes": 7, "checksum": checksum(b"keep me"), "object": "../victim/data.0123456789ab.json"},
        "b.json": {"bytes": 7, "checksum": checksum(b"keep me"), "object": "README"}}}
    fs.pipe_file(f"{base}/exp/3/{META_FILE}", json.dumps(planted).encode())
    store.write_entry(path, FILES, {"global_steps": 3})  # over a damaged entry
    planted_valid = {"global_steps": 3, "files": {
        "b.json": {"bytes": 7, "checksum": checksum(b"keep me"), "object": "README"}},
        "retired": {"notes.0123456789ab.txt": 0.0, "README": 0.0}}
    fs.pipe_file(f"{base}/exp/3/{META_FILE}", json.dumps(planted_valid).encode())
    store.write_entry(path, FILES, {"global_steps": 3})  # over a well-formed entry naming a foreign file
    store.write_entry(path, FILES, {"global_steps": 3})
    for victim in victims:
        assert fs.cat_file(victim) == b"keep me", victim
    if kind != "local-url":  # a local entry is replaced as a whole directory, README included
        assert fs.cat_file(f"{base}/exp/3/README") == b"a user's note in the entry"
    assert store.read_entry(path)[1] == FILES
    with pytest.raises(OSError):
        store.remove(f"{root}/../outside.0123456789ab.json")
    if isinstance(store.backend, FsspecBackend):  # object stores have no links: their root is their boundary
        with pytest.raises(OSError):
            store.remove(str(tmp_path / "outside.0123456789ab.json"))
        with pytest.raises(OSError):
            store.remove(root)
    assert fs.cat_file(victims[2]) == b"keep me"


def test_remove_leftovers_on_object_stores_deletes_only_stepskip_objects() -> None:
    root = f"memory://lo-{uuid.uuid4().hex[:8]}/dump"
    store = EntryStore(FsspecBackend(MemoryFileSystem(), root=root), grace_seconds=0)
    path = f"{store.root}/3"
    store.write_entry(path, FILES, {"global_steps": 3})
    for name in ("README", "data.0123456789ab.json", ".hidden"):
        store.backend.fs.pipe_file(f"{path}/{name}", b"x")
    removed = store.remove_leftovers(store.root, older_than=0)
    assert removed == [f"{path}/data.0123456789ab.json"]
    assert {"README", ".hidden"} <= set(store.list_dir(path))


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_retire_entry(tmp_path: Path, kind: str) -> None:
    cache = Local(tmp_path) if kind == "local" else Memory(tmp_path)
    path, _ = written(cache)
    sibling, _ = written(cache, step=4)
    assert cache.store.retire_entry(path) is True
    assert cache.store.probe(path).state is EntryState.MISSING
    assert cache.store.retire_entry(path) is False
    assert cache.store.probe(sibling).state is EntryState.PRESENT
    assert [n for n in cache.store.list_dir(path.rsplit("/", 1)[0]) if n.startswith(".")] == []
    with pytest.raises(OSError):
        cache.store.retire_entry(f"{cache.root}/exp_proj/../exp_proj/GBS4_N2_in8_out8/4")


# --------------------------------------------------------------------------- one version per read


def test_vanished_entry_is_a_miss(cache: Local | Memory) -> None:
    path, _ = written(cache)
    cache.store.retire_entry(path)
    assert cache.store.probe(path).state is EntryState.MISSING
    with pytest.raises(CacheMissError) as info:
        cache.store.read_entry(path)
    assert not isinstance(info.value, CorruptEntryError)


def test_entry_replaced_between_meta_and_data_reads_the_new_version(local: Local,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer swaps the entry after the reader opened meta.json: the reader gets version 2 whole."""
    from stepskip._storage import _localfs

    path = entry_of(local)
    local.store.write_entry(path, {"a.bin": b"1" * 10}, {"global_steps": 3, "v": 1})
    real = _localfs.read_at_stat
    swaps = []

    def racing(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
               allocator: Any = None) -> tuple[bytes, Any]:
        if name == "a.bin" and not swaps:
            swaps.append(1)
            EntryStore(LocalBackend()).write_entry(path, {"a.bin": b"2" * 20}, {"global_steps": 3, "v": 2})
        return real(dir_fd, name, expected, limit, allocator)

    monkeypatch.setattr(_localfs, "read_at_stat", racing)
    meta, files = local.store.read_entry(path)
    assert swaps and meta["v"] == 2 and files == {"a.bin": b"2" * 20}


def test_object_store_reader_holding_old_meta_reads_old_objects() -> None:
    now = [1000.0]
    root = f"memory://grace-{uuid.uuid4().hex[:8]}/d"
    store = EntryStore(FsspecBackend(MemoryFileSystem(), root=root), clock=lambda: now[0])
    path = f"{store.root}/3"
    store.write_entry(path, {"a.bin": b"old"}, {"global_steps": 3})
    old = store.probe(path).meta
    store.write_entry(path, {"a.bin": b"new!"}, {"global_steps": 3})
    assert store.read_files(path, old, ["a.bin"], verify=True) == {"a.bin": b"old"}  # within the grace period
    assert store.read_entry(path)[1] == {"a.bin": b"new!"}
    now[0] += store.grace_seconds
    store.write_entry(path, {"a.bin": b"newer"}, {"global_steps": 3})
    with pytest.raises(CorruptEntryError):
        store.read_files(path, old, ["a.bin"], verify=True)


def test_object_store_entry_replaced_and_purged_mid_read_reads_the_new_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from stepskip._storage import objects

    root = f"memory://race-{uuid.uuid4().hex[:8]}/d"
    store = EntryStore(FsspecBackend(MemoryFileSystem(), root=root), grace_seconds=0)
    path = f"{store.root}/3"
    store.write_entry(path, {"a.bin": b"1" * 10}, {"global_steps": 3, "v": 1})
    real = objects.read_exact
    swaps = []

    def racing(backend: Any, obj_path: str, size: int) -> bytes:
        if not swaps:
            swaps.append(1)  # grace 0: the replaced objects are deleted as soon as meta.json is published
            store.write_entry(path, {"a.bin": b"2" * 20}, {"global_steps": 3, "v": 2})
        return real(backend, obj_path, size)

    monkeypatch.setattr(objects, "read_exact", racing)
    meta, files = store.read_entry(path)
    assert swaps and meta["v"] == 2 and files == {"a.bin": b"2" * 20}


def test_read_entry_reads_a_subset_and_refuses_unlisted_names(cache: Local | Memory) -> None:
    path, _ = written(cache)
    assert cache.store.read_entry(path, names=["data.json"])[1] == {"data.json": FILES["data.json"]}
    with pytest.raises(CorruptEntryError, match="not listed"):
        cache.store.read_entry(path, names=["other.bin"])


def test_read_entry_of_a_legacy_entry(cache: Local | Memory) -> None:
    path = entry_of(cache)
    cache.put(f"{path}/{META_FILE}", b'{"global_steps": 3}')
    cache.put(f"{path}/gen_batch.dp", b"pickle bytes")
    meta, files = cache.store.read_entry(path, legacy_files=("gen_batch.dp",), names=["gen_batch.dp"])
    assert meta == {"global_steps": 3} and files == {"gen_batch.dp": b"pickle bytes"}


def test_checksum_mismatch_is_damage_not_a_retry(cache: Local | Memory) -> None:
    path, meta = written(cache)
    obj = meta["files"]["data.json"].get("object", "data.json")
    cache.put(f"{path}/{obj}", b'{"root": 2}')  # same size, other bytes
    with pytest.raises(CorruptEntryError, match="checksum"):
        cache.store.read_entry(path)
    assert cache.store.read_entry(path, verify=False)[1]["data.json"] == b'{"root": 2}'


# --------------------------------------------------------------------------- local:// and writing


def test_local_url_store_writes_and_creates_the_dump_dir(tmp_path: Path) -> None:
    root = f"local://{tmp_path}/not/yet/there"
    store = open_store(root)
    assert isinstance(store.backend, LocalBackend)
    store.write_entry(f"{root}/exp/3", FILES, {"global_steps": 3})
    assert EntryStore(LocalBackend()).read_entry(f"{tmp_path}/not/yet/there/exp/3")[1] == FILES
    assert store.read_entry(f"{root}/exp/3")[1] == FILES


@pytest.mark.parametrize("name", ["../x.bin", "a/b.bin", META_FILE, "", "x\x00"])
def test_writers_refuse_names_that_are_not_one_component(cache: Local | Memory, name: str) -> None:
    with pytest.raises(OSError):
        cache.store.write_entry(entry_of(cache), {name: b"x"}, {"global_steps": 3})
    assert cache.store.probe(entry_of(cache)).state is EntryState.MISSING


def test_sparse_file_larger_than_memory_is_damage_not_a_crash(local: Local) -> None:
    """A recorded size that matches a sparse 64 GiB file: the read cannot allocate it and says so."""
    path, meta = written(local)
    with open(f"{path}/data.safetensors", "r+b") as fh:
        fh.truncate(64 << 30)
    meta["files"]["data.safetensors"]["bytes"] = 64 << 30
    plant_meta(local, path, meta)
    assert probe_in_child(local.store, path)[0] == "present"  # sizes agree: only a read can tell
    assert "does not fit in memory" in read_in_child(local.store, path, names=NAMES)


# --------------------------------------------------------------------------- fuzzing meta.json


def _fuzz(cache_kind: str, root: str) -> int:
    """Hypothesis-generated meta.json documents (near-valid ones and arbitrary JSON or bytes) fed to
    probe, read_entry and check_meta: only Probe results and the two cache errors ever come out."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    store: Any = open_store(root)
    path = f"{root}/exp/3"
    store.write_entry(path, FILES, {"global_steps": 3})
    valid = json.loads(store.read_small(f"{path}/{META_FILE}", META_MAX_BYTES))
    put = ((lambda p, d: store.backend.fs.pipe_file(store.backend.key(p), d)) if cache_kind == "memory"
           else (lambda p, d: Path(p).write_bytes(d)))
    scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                        st.sampled_from(["..", "../data.json", "/etc/hostname", "data.json", "", "a/b", META_FILE]))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
    keys = st.sampled_from(["global_steps", "format", "run_id", "generation_seconds", "created_unix", "files",
                            "parameter_sync_step", "inner_idx", "num_trajectories", "fingerprint", "retired",
                            "prompt_digest", "role"])
    file_keys = st.sampled_from(["bytes", "checksum", "object"])
    seen = {"n": 0}

    def check(raw: bytes) -> None:
        seen["n"] += 1
        put(f"{path}/{META_FILE}", raw)
        probe = store.probe(path, legacy_files=("gen_batch.dp",))
        assert probe.state in (EntryState.PRESENT, EntryState.DAMAGED), probe
        if probe.state is EntryState.PRESENT:
            assert check_meta(probe.meta) is None
        try:
            store.read_entry(path, legacy_files=("gen_batch.dp",), names=None)
        except CacheMissError:
            pass
        try:
            check_meta(json.loads(raw))
        except (ValueError, RecursionError):
            pass

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(key=keys, value=values)
    def top_level(key: str, value: Any) -> None:
        check(json.dumps({**valid, key: value}).encode())

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(name=st.sampled_from(list(FILES)), key=file_keys, value=values, rename=st.none() | scalars)
    def file_entry(name: str, key: str, value: Any, rename: Any) -> None:
        meta = json.loads(json.dumps(valid))
        meta["files"][name][key] = value
        if isinstance(rename, str):
            meta["files"][rename] = meta["files"].pop(name)
        check(json.dumps(meta).encode())

    @settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(doc=values | st.binary(max_size=200))
    def anything(doc: Any) -> None:
        check(doc if isinstance(doc, bytes) else json.dumps(doc).encode())

    top_level()
    file_entry()
    anything()
    return seen["n"]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_fuzzed_meta_json_never_escapes_the_readers(tmp_path: Path, kind: str) -> None:
    root = str(tmp_path / "dump") if kind == "local" else f"memory://fuzz-{uuid.uuid4().hex[:8]}/dump"
    assert in_child(lambda: _fuzz(kind, root), timeout=300) >= 400


# --------------------------------------------------------------------------- read_entry with a chooser


def test_read_entry_lets_the_caller_choose_files_from_the_version_read(cache: Local | Memory) -> None:
    path, _ = written(cache, meta={"global_steps": 3, "format": "safe"})
    seen: list[dict[str, Any]] = []

    def choose(meta: dict[str, Any]) -> list[str]:
        seen.append(meta)
        return ["data.json"] if meta["format"] == "safe" else ["gen_batch.dp"]

    meta, files = cache.store.read_entry(path, names=choose)
    assert files == {"data.json": FILES["data.json"]} and seen == [meta]


def test_a_chooser_that_refuses_stops_the_read(cache: Local | Memory, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepskip import UnreadableEntryError

    path, _ = written(cache)

    def refuse(meta: dict[str, Any]) -> list[str]:
        raise UnreadableEntryError(f"format {meta['format']!r} refused")

    with pytest.raises(UnreadableEntryError, match="refused"):
        cache.store.read_entry(path, names=refuse)


def test_the_chooser_sees_the_version_that_is_read(local: Local, monkeypatch: pytest.MonkeyPatch) -> None:
    from stepskip._storage import _localfs

    path = entry_of(local)
    local.store.write_entry(path, {"a.bin": b"1" * 10}, {"global_steps": 3, "v": 1})
    real = _localfs.read_at_stat
    seen: list[int] = []

    def racing(dir_fd: int, name: str, expected: int | None, limit: int | None = None,
               allocator: Any = None) -> tuple[bytes, Any]:
        if name == "a.bin" and len(seen) == 1:
            EntryStore(LocalBackend()).write_entry(path, {"a.bin": b"2" * 20}, {"global_steps": 3, "v": 2})
        return real(dir_fd, name, expected, limit, allocator)

    monkeypatch.setattr(_localfs, "read_at_stat", racing)
    meta, files = local.store.read_entry(path, names=lambda m: seen.append(m["v"]) or ["a.bin"])
    assert seen == [1, 2] and meta["v"] == 2 and files == {"a.bin": b"2" * 20}
