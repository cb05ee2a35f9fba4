"""What an entry store does, the same over every backend: the in-memory one (whose whole file is the
proof that a backend is a few primitives), the local filesystem, and fsspec's memory:// filesystem
(an object store: entries committed ``meta.json`` last).

Everything is real: real files under ``tmp_path``, fsspec's real ``MemoryFileSystem``; nothing is
mocked but the moment a writer strikes in the race tests (a read wrapped to replace the entry it is
reading), and the clock a clean-up judges staleness by.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from stepskip import CacheMissError, CorruptEntryError, SkipConfigError
from stepskip._storage import (
    META_FILE,
    STALE_SECONDS,
    Backend,
    EntryState,
    EntryStore,
    FsspecBackend,
    LocalBackend,
    MemoryBackend,
    check_meta,
    open_store,
    register_backend,
    registered_schemes,
)

FILES = {"data.json": b'{"rows": 2}', "data.safetensors": b"\x00tensor bytes" * 40}
LATER = 2 * STALE_SECONDS


class Cache:
    """A store over one backend, rooted at a dump dir, with raw access to put bytes anywhere in it."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        if kind == "memory":
            self.root = "/dump"
            self.backend: Backend = MemoryBackend(root=self.root)
        elif kind == "local":
            self.root = str(tmp_path / "dump")
            self.backend = LocalBackend(self.root)
        else:
            self.root = f"memory://entries-{uuid.uuid4().hex[:8]}/dump"
            self.backend = FsspecBackend(MemoryFileSystem(), root=self.root)
        self.store = EntryStore(self.backend, grace_seconds=0)

    def entry(self, step: int = 3) -> str:
        return f"{self.root}/run/{step}"

    def stored(self, path: str, name: str) -> str:
        """The path a data file of the entry at ``path`` is stored under (object stores name it per write)."""
        meta = self.store.probe(path).meta
        assert meta is not None
        return f"{path}/{meta['files'][name].get('object', name)}"

    def put(self, path: str, data: bytes) -> None:
        self.backend.put_file(path, data)

    def later(self) -> EntryStore:
        """The same store, judging staleness two hours from now."""
        return EntryStore(self.backend, grace_seconds=0, clock=lambda: time.time() + LATER)


@pytest.fixture(params=["memory", "local", "fsspec"])
def cache(request: pytest.FixtureRequest, tmp_path: Path) -> Cache:
    return Cache(request.param, tmp_path)


def written(cache: Cache, step: int = 3, **meta: Any) -> str:
    path = cache.entry(step)
    assert cache.store.write_entry(path, FILES, {"global_steps": step, **meta}) > sum(map(len, FILES.values()))
    return path


# --------------------------------------------------------------------------- write, probe, read


def test_a_written_entry_is_present_and_reads_back_whole(cache: Cache) -> None:
    path = written(cache)
    probe = cache.store.probe(path)
    assert probe.state is EntryState.PRESENT and check_meta(probe.meta) is None
    assert {n: i["bytes"] for n, i in probe.meta["files"].items()} == {n: len(d) for n, d in FILES.items()}
    meta, files = cache.store.read_entry(path)
    assert meta["global_steps"] == 3 and files == FILES
    assert cache.store.read_entry(path, names=["data.json"])[1] == {"data.json": FILES["data.json"]}
    assert cache.store.read_files(path, meta, ["data.safetensors"], verify=True) == {
        "data.safetensors": FILES["data.safetensors"]}
    assert cache.store.list_dir(f"{cache.root}/run") == ["3"]
    assert cache.store.list_dir(f"{cache.root}/run", dirs_only=True) == ["3"]
    assert cache.store.is_dir(path) and not cache.store.is_dir(f"{cache.root}/run/4")
    assert {i.name for i in cache.store.list_items(f"{cache.root}/run")} == {"3"}
    item = cache.store.stat_item(f"{cache.root}/run/3")
    assert item is not None and item.kind == "dir"


def test_a_missing_entry_is_a_miss_not_damage(cache: Cache) -> None:
    assert cache.store.probe(cache.entry()).state is EntryState.MISSING
    with pytest.raises(CacheMissError) as info:
        cache.store.read_entry(cache.entry())
    assert not isinstance(info.value, CorruptEntryError)


def test_overwrite_replaces_the_entry_and_without_it_the_first_stays(cache: Cache) -> None:
    path = written(cache, v=1)
    assert cache.store.write_entry(path, {"other.json": b"{}"}, {"global_steps": 3, "v": 2}, overwrite=False) == 0
    assert cache.store.read_entry(path)[0]["v"] == 1
    cache.store.write_entry(path, {"other.json": b"{}"}, {"global_steps": 3, "v": 2})
    meta, files = cache.store.read_entry(path)
    assert meta["v"] == 2 and files == {"other.json": b"{}"}


def test_a_data_file_name_that_leaves_the_entry_is_refused_and_nothing_is_written(cache: Cache) -> None:
    for name in ("../escape.json", "a/b", META_FILE, ""):
        with pytest.raises(OSError):
            cache.store.write_entry(cache.entry(), {name: b"x"}, {"global_steps": 3})
    assert cache.store.probe(cache.entry()).state is EntryState.MISSING


def test_a_batch_writes_each_entry_whole_and_a_bad_one_fails_alone(cache: Cache) -> None:
    items = [(cache.entry(i), FILES, {"global_steps": i}) for i in range(3)]
    items.insert(1, (cache.entry(9), {"../bad": b"x"}, {"global_steps": 9}))
    results = cache.store.write_entries(items)
    assert isinstance(results[1], OSError) and all(isinstance(results[i], int) for i in (0, 2, 3))
    assert sorted(cache.store.list_dir(f"{cache.root}/run")) == ["0", "1", "2"]
    for i in range(3):
        assert cache.store.read_entry(cache.entry(i)) == ({"global_steps": i, "files": cache.store.probe(
            cache.entry(i)).meta["files"]}, FILES)


def test_small_files_are_put_whole_and_read_bounded(cache: Cache) -> None:
    cache.store.put_small(f"{cache.root}/run/7/step.json", b'{"v": 1}')
    cache.store.put_small(f"{cache.root}/run/7/step.json", b'{"v": 2}')
    assert cache.store.read_small(f"{cache.root}/run/7/step.json", 64) == b'{"v": 2}'
    assert cache.store.read_small(f"{cache.root}/run/7/none.json", 64) is None
    with pytest.raises(CorruptEntryError):
        cache.store.read_small(f"{cache.root}/run/7/step.json", 4)


# --------------------------------------------------------------------------- damage


def test_a_flipped_byte_is_caught_by_its_checksum(cache: Cache) -> None:
    path = written(cache)
    where = cache.stored(path, "data.safetensors")
    cache.put(where, b"\xff" + FILES["data.safetensors"][1:])
    assert cache.store.probe(path).state is EntryState.PRESENT  # a probe checks sizes, not checksums
    with pytest.raises(CorruptEntryError, match="checksum"):
        cache.store.read_entry(path)
    assert cache.store.read_entry(path, verify=False)[1]["data.safetensors"][:1] == b"\xff"


def test_a_truncated_or_missing_data_file_is_damage(cache: Cache) -> None:
    path = written(cache)
    cache.put(cache.stored(path, "data.safetensors"), b"short")
    probe = cache.store.probe(path)
    assert probe.state is EntryState.DAMAGED and "bytes" in probe.reason
    written(cache, step=4)
    cache.backend.delete(cache.stored(cache.entry(4), "data.json"))
    probe = cache.store.probe(cache.entry(4))
    assert probe.state is EntryState.DAMAGED and "missing data file" in probe.reason
    with pytest.raises(CorruptEntryError):
        cache.store.read_entry(cache.entry(4))


@pytest.mark.parametrize("meta", [b"{not json", b"[]", json.dumps({"files": {}}).encode(),
                                  json.dumps({"global_steps": 3, "files": {"../x": {"bytes": 1, "checksum": "c"}}}
                                             ).encode(),
                                  json.dumps({"global_steps": float("nan")}).encode(), b"[" * 100_000],
                         ids=["garbage", "a list", "no global_steps", "a name leaving the entry", "nan", "deep"])
def test_a_meta_json_that_cannot_be_trusted_is_damage(cache: Cache, meta: bytes) -> None:
    path = written(cache)
    cache.put(f"{path}/{META_FILE}", meta)
    probe = cache.store.probe(path)
    assert probe.state is EntryState.DAMAGED and probe.reason
    with pytest.raises(CorruptEntryError):
        cache.store.read_entry(path)


def test_a_legacy_entry_is_present_with_one_of_its_data_files(cache: Cache) -> None:
    path = cache.entry()
    cache.put(f"{path}/{META_FILE}", json.dumps({"global_steps": 3}).encode())
    assert cache.store.probe(path, legacy_files=["gen_batch.dp"]).state is EntryState.DAMAGED
    cache.put(f"{path}/gen_batch.dp", b"pickle")
    assert cache.store.probe(path, legacy_files=["gen_batch.dp", "other.pt"]).state is EntryState.PRESENT
    assert cache.store.read_entry(path, legacy_files=["gen_batch.dp", "other.pt"])[1] == {"gen_batch.dp": b"pickle"}


# --------------------------------------------------------------------------- retire, remove, leftovers


def test_retiring_an_entry_leaves_its_siblings(cache: Cache) -> None:
    path, sibling = written(cache), written(cache, step=4)
    assert cache.store.retire_entry(path) is True
    assert cache.store.probe(path).state is EntryState.MISSING
    assert cache.store.retire_entry(path) is False
    assert cache.store.read_entry(sibling)[1] == FILES
    assert cache.store.list_dir(f"{cache.root}/run") == ["4"]


def test_nothing_outside_the_dump_dir_is_removed(cache: Cache) -> None:
    written(cache)
    with pytest.raises(OSError):
        cache.store.remove(f"{cache.root}/run/../../elsewhere")
    assert cache.store.probe(cache.entry()).state is EntryState.PRESENT


def test_what_an_interrupted_write_left_goes_once_stale_and_the_entry_stays(cache: Cache) -> None:
    path = written(cache)
    if cache.store.capabilities.atomic_dir_publish:  # a writer that died after staging its files
        staging = cache.backend.stage(cache.entry(5))
        staging.write("data.json", b"half")
        left = [n for n in cache.store.list_dir(f"{cache.root}/run") if n.startswith(".tmp-")]
        assert len(left) == 1
        leftover = f"{cache.root}/run/{left[0]}"
    else:  # a writer that died before its meta.json: an object no meta.json names
        leftover = f"{path}/data.0123456789ab.json"
        cache.put(leftover, b"half")
    assert cache.store.remove_leftovers(f"{cache.root}/run") == []  # not stale yet
    assert cache.later().remove_leftovers(f"{cache.root}/run") == [leftover]
    assert cache.store.read_entry(path)[1] == FILES
    assert cache.later().remove_leftovers(f"{cache.root}/run") == []


def test_a_replaced_entry_leaves_nothing_behind_once_its_grace_period_is_over(cache: Cache) -> None:
    path = written(cache, v=1)
    for v in (2, 3):
        cache.store.write_entry(path, FILES, {"global_steps": 3, "v": v})
    cache.later().remove_leftovers(f"{cache.root}/run")
    names = cache.store.list_dir(path)
    assert len(names) == len(FILES) + 1 and META_FILE in names  # only version 3's files
    assert cache.store.list_dir(f"{cache.root}/run") == ["3"]


# --------------------------------------------------------------------------- one version per read


def _content(version: int) -> dict[str, bytes]:
    return {"a.bin": bytes([version]) * (10 + version), "b.bin": bytes([version]) * 3}


def test_an_entry_replaced_under_a_read_is_read_as_one_version(cache: Cache, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """A writer replaces the entry between the read of meta.json and the read of its data: the read
    returns one version whole (the new one where the old files went away, the old one where they stay
    reachable through the pinned version), never a mix."""
    path = cache.entry()
    cache.store.write_entry(path, _content(1), {"global_steps": 3, "v": 1})
    entry_class = type(cache.backend.open_entry(path))
    real, swaps = entry_class.read, []

    def racing(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("a") and not swaps:
            swaps.append(1)
            cache.store.write_entry(path, _content(2), {"global_steps": 3, "v": 2})
        return real(self, name, *args, **kwargs)

    monkeypatch.setattr(entry_class, "read", racing)
    meta, files = cache.store.read_entry(path)
    assert swaps and files == _content(meta["v"])


def test_the_chooser_of_files_sees_the_version_read(cache: Cache) -> None:
    path = cache.entry()
    cache.store.write_entry(path, _content(1), {"global_steps": 3, "v": 1})
    seen: list[int] = []
    meta, files = cache.store.read_entry(path, names=lambda m: seen.append(m["v"]) or ["b.bin"])
    assert seen == [1] and files == {"b.bin": _content(1)["b.bin"]}
    with pytest.raises(CorruptEntryError):  # a name the version does not list
        cache.store.read_entry(path, names=["c.bin"])


def test_readers_racing_writers_see_a_miss_or_one_whole_version(cache: Cache) -> None:
    """Whatever the interleaving: every read returns files of the version its meta.json names."""
    path = cache.entry()
    stop, problems = threading.Event(), []

    def write() -> None:
        try:
            for version in range(1, 60):
                cache.store.write_entry(path, _content(version), {"global_steps": 3, "v": version})
                if version % 7 == 0:
                    cache.store.retire_entry(path)
        except Exception as err:  # noqa: BLE001 - a failed write is a finding, and must stop the readers
            problems.append(f"the writer failed: {type(err).__name__}: {err}")
        finally:
            stop.set()

    def read() -> None:
        while not stop.is_set():
            try:
                meta, files = cache.store.read_entry(path)
            except CorruptEntryError as err:
                problems.append(str(err))
            except CacheMissError:
                continue
            except Exception as err:  # noqa: BLE001 - anything else a reader raises is a finding too
                problems.append(f"a reader failed: {type(err).__name__}: {err}")
                return
            else:
                if files != _content(meta["v"]):
                    problems.append(f"version {meta['v']} read with other files")

    threads = [threading.Thread(target=write), threading.Thread(target=read), threading.Thread(target=read)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert problems == []


def test_a_probe_that_kept_a_small_entry_serves_the_read(cache: Cache) -> None:
    path = written(cache)
    probe = cache.store.probe(path, keep=1 << 20)
    assert probe.files == FILES
    cache.store.retire_entry(path)  # the read is served from what the probe kept: that version
    assert cache.store.read_entry(path, probe=probe) == (probe.meta, FILES)
    assert cache.store.probe(path, keep=1).files is None


def test_a_probe_stamp_is_reused_only_while_meta_json_is_the_same(cache: Cache) -> None:
    path = written(cache, v=1)
    probe = cache.store.probe(path)
    assert (probe.stamp is not None) == cache.store.capabilities.version_stamps
    assert cache.store.read_entry(path, probe=probe)[0]["v"] == 1
    cache.store.write_entry(path, FILES, {"global_steps": 3, "v": 2})
    assert cache.store.read_entry(path, probe=probe)[0]["v"] == 2


# --------------------------------------------------------------------------- memory from the caller


def test_big_files_go_into_the_memory_the_allocator_gives(cache: Cache) -> None:
    path = written(cache)
    asked: list[int] = []

    def allocator(size: int) -> memoryview | None:
        asked.append(size)
        return memoryview(bytearray(size)) if size > 100 else None

    meta, files = cache.store.read_entry(path, allocator=allocator)
    assert files == FILES
    if cache.kind == "fsspec":  # an object store hands back the bytes it fetched
        assert asked == []
    else:
        assert sorted(asked) == sorted(len(d) for d in FILES.values())  # the data files only, never meta.json
        assert isinstance(files["data.safetensors"], memoryview) and isinstance(files["data.json"], bytes)


# --------------------------------------------------------------------------- directories published whole


def test_a_directory_of_entries_is_published_at_once_where_the_backend_can(cache: Cache) -> None:
    if not cache.store.capabilities.atomic_dir_publish:
        with pytest.raises(NotImplementedError):
            cache.store.publish_dir(f"{cache.root}/run/.tmp-5-x", f"{cache.root}/run/5")
        return
    staging = f"{cache.root}/run/.tmp-5-{uuid.uuid4().hex[:8]}"
    for inner in range(2):
        cache.store.write_entry(f"{staging}/{inner}", FILES, {"global_steps": 5, "inner_idx": inner})
    assert cache.store.probe(f"{cache.root}/run/5/0").state is EntryState.MISSING
    cache.store.publish_dir(staging, f"{cache.root}/run/5")
    assert [cache.store.read_entry(f"{cache.root}/run/5/{i}")[0]["inner_idx"] for i in range(2)] == [0, 1]
    assert cache.store.list_dir(f"{cache.root}/run") == ["5"]
    with pytest.raises(OSError):
        cache.store.publish_dir(f"{cache.root}/run/not-hidden", f"{cache.root}/run/6")


# --------------------------------------------------------------------------- the registry


@pytest.fixture
def memtest() -> Any:
    assert register_backend("memtest", MemoryBackend) is None
    try:
        yield "memtest"
    finally:
        register_backend("memtest", None)


def test_a_registered_scheme_opens_its_backend_and_dump_dirs_share_one_tree(memtest: str) -> None:
    root = f"{memtest}://bucket-{uuid.uuid4().hex[:8]}/dump"
    assert memtest in registered_schemes()
    writer, reader = open_store(root), open_store(root)
    assert isinstance(writer.backend, MemoryBackend)
    writer.write_entry(f"{root}/run/1", FILES, {"global_steps": 1})
    assert reader.read_entry(f"{root}/run/1")[1] == FILES


def test_an_unknown_scheme_is_refused_naming_the_schemes_there_are() -> None:
    with pytest.raises(SkipConfigError, match="nosuchfs://") as info:
        open_store("nosuchfs://bucket/dump")
    assert "file://" in str(info.value) and "local://" in str(info.value)


@pytest.mark.parametrize(("scheme", "cls"), [("Bad Scheme", MemoryBackend), ("ok", dict), ("ok", "memory")])
def test_registering_something_that_is_not_a_backend_is_refused(scheme: str, cls: Any) -> None:
    with pytest.raises(SkipConfigError, match="register_backend"):
        register_backend(scheme, cls)
    assert "ok" not in registered_schemes()


def test_a_role_records_and_replays_through_a_registered_backend(memtest: str) -> None:
    """The whole runtime over the in-memory backend: record step 1, then a fresh run replays it."""
    from stepskip import Batch, SkipManager
    from stepskip.testing import make_rollout_batch

    dump_dir = f"{memtest}://bucket-{uuid.uuid4().hex[:8]}/dump"
    result = make_rollout_batch(2, 4, 4, n=1)
    calls: list[int] = []

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts: Any) -> Any:
            calls.append(1)
            return result

    config = {"trainer": {"experiment_name": "e", "project_name": "p"},
              "data": {"train_batch_size": 2, "max_prompt_length": 4, "max_response_length": 4},
              "actor_rollout_ref": {"rollout": {"n": 1}},
              "skip": {"rollout": {"enable": True, "dump_dir": dump_dir, "steps": [1], "async_dump": False}}}
    prompts = Batch.from_dict(non_tensors={"uid": ["u0", "u1"]})
    for _ in range(2):
        SkipManager.init(config)
        try:
            SkipManager.set_step(1)
            out = Loop().generate_sequences(prompts)
        finally:
            SkipManager.reset()
    assert calls == [1]  # the second run replayed the entry the first one wrote
    for key in result.batch.keys():
        assert out.batch[key].equal(result.batch[key]), key
