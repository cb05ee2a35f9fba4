"""Entries on the local backend (atomic entries, checksums, validity, leftovers, concurrency) and Layout (paths)."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import xxhash
from omegaconf import OmegaConf

from stepskip import CorruptEntryError, SkipConfigError
from stepskip._storage import (
    META_FILE,
    EntryState,
    EntryStore,
    FsspecBackend,
    LocalBackend,
    _localfs,
    checksum,
    open_store,
)
from stepskip._storage.base import token as _token
from stepskip._layout import Layout, safe_component

STORE = EntryStore(LocalBackend())
FILES = {"data.safetensors": b"\x00\x01tensors" * 50, "data.json": b'{"root": 1}'}


def write(path: Path, files: dict[str, bytes] | None = None, meta: dict[str, Any] | None = None,
          overwrite: bool = True) -> int:
    return STORE.write_entry(str(path), files if files is not None else FILES,
                             meta if meta is not None else {"global_steps": 3}, overwrite=overwrite)


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith((".tmp-", ".trash-")))


def read_all(path: Path, verify: bool = True) -> dict[str, bytes]:
    probe = STORE.probe(str(path))
    assert probe.state is EntryState.PRESENT, probe.reason
    return STORE.read_files(str(path), probe.meta, list(probe.meta["files"]), verify=verify)


# --------------------------------------------------------------------------- write, probe, read


def test_write_then_probe_and_read(tmp_path: Path) -> None:
    entry = tmp_path / "run" / "3"
    written = write(entry)
    assert written == sum(len(v) for v in FILES.values()) + (entry / META_FILE).stat().st_size
    probe = STORE.probe(str(entry))
    assert probe.state is EntryState.PRESENT
    assert probe.meta is not None and probe.meta["global_steps"] == 3
    assert STORE.read_files(str(entry), probe.meta, list(FILES), verify=True) == FILES
    assert sorted(os.listdir(entry)) == sorted([*FILES, META_FILE])
    assert leftovers(entry.parent) == []


def test_meta_lists_files_with_sizes_and_checksums(tmp_path: Path) -> None:
    entry = tmp_path / "7"
    write(entry, meta={"global_steps": 7, "format": "safe", "nested": {"a": [1, 2]}})
    meta = json.loads((entry / META_FILE).read_text())
    assert meta["global_steps"] == 7
    assert meta["format"] == "safe" and meta["nested"] == {"a": [1, 2]}
    assert set(meta["files"]) == set(FILES)
    for name, data in FILES.items():
        assert meta["files"][name]["bytes"] == len(data)
        assert meta["files"][name]["checksum"] == checksum(data) == "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def test_write_does_not_mutate_the_callers_meta(tmp_path: Path) -> None:
    meta = {"global_steps": 1}
    write(tmp_path / "1", meta=meta)
    assert meta == {"global_steps": 1}


def test_empty_and_binary_files(tmp_path: Path) -> None:
    files = {"empty.bin": b"", "all.bin": bytes(range(256)) * 4}
    write(tmp_path / "1", files=files)
    assert read_all(tmp_path / "1") == files


def test_read_subset_of_files(tmp_path: Path) -> None:
    write(tmp_path / "1")
    probe = STORE.probe(str(tmp_path / "1"))
    assert STORE.read_files(str(tmp_path / "1"), probe.meta, ["data.json"], verify=True) == {
        "data.json": FILES["data.json"]}


def test_probe_missing(tmp_path: Path) -> None:
    assert STORE.probe(str(tmp_path / "nope")).state is EntryState.MISSING
    assert STORE.probe(str(tmp_path / "nope" / "deeper")).state is EntryState.MISSING
    (tmp_path / "empty_dir").mkdir()
    assert STORE.probe(str(tmp_path / "empty_dir")).state is EntryState.MISSING


# --------------------------------------------------------------------------- damaged entries


@pytest.fixture
def entry(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "5"
    write(path, meta={"global_steps": 5})
    return path


@pytest.mark.parametrize("garbage", [b"{garbage", b"", b"\xff\xfe", b"[1, 2]", b'"text"', b"null"],
                         ids=["broken", "empty", "bad-utf8", "list", "string", "null"])
def test_unreadable_meta_is_damaged(entry: Path, garbage: bytes) -> None:
    (entry / META_FILE).write_bytes(garbage)
    probe = STORE.probe(str(entry))
    assert probe.state is EntryState.DAMAGED
    assert probe.reason


def test_meta_without_global_steps_is_damaged(entry: Path) -> None:
    meta = json.loads((entry / META_FILE).read_text())
    del meta["global_steps"]
    (entry / META_FILE).write_text(json.dumps(meta))
    assert STORE.probe(str(entry)).state is EntryState.DAMAGED


def test_truncated_data_file_is_damaged(entry: Path) -> None:
    data = entry / "data.safetensors"
    data.write_bytes(data.read_bytes()[:-1])
    probe = STORE.probe(str(entry))
    assert probe.state is EntryState.DAMAGED
    assert "data.safetensors" in probe.reason


def test_grown_data_file_is_damaged(entry: Path) -> None:
    with open(entry / "data.json", "ab") as fh:
        fh.write(b" ")
    assert STORE.probe(str(entry)).state is EntryState.DAMAGED


def test_missing_data_file_is_damaged(entry: Path) -> None:
    (entry / "data.json").unlink()
    probe = STORE.probe(str(entry))
    assert probe.state is EntryState.DAMAGED
    assert "data.json" in probe.reason


def test_malformed_file_list_is_damaged(entry: Path) -> None:
    (entry / META_FILE).write_text(json.dumps({"global_steps": 5, "files": ["data.json"]}))
    assert STORE.probe(str(entry)).state is EntryState.DAMAGED


def test_path_that_is_a_file_is_not_present(tmp_path: Path) -> None:
    path = tmp_path / "5"
    path.write_bytes(b"a file, not an entry")
    assert STORE.probe(str(path)).state is not EntryState.PRESENT


def test_path_that_is_a_file_is_damaged(tmp_path: Path) -> None:
    path = tmp_path / "5"
    path.write_bytes(b"a file, not an entry")
    assert STORE.probe(str(path)).state is EntryState.DAMAGED


def test_directory_without_meta_is_missing_not_present(tmp_path: Path) -> None:
    path = tmp_path / "5"
    path.mkdir()
    (path / "data.json").write_bytes(b"{}")
    assert STORE.probe(str(path)).state is EntryState.MISSING


def test_flipped_byte_fails_verification(entry: Path) -> None:
    data_path = entry / "data.safetensors"
    raw = bytearray(data_path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data_path.write_bytes(bytes(raw))
    probe = STORE.probe(str(entry))
    assert probe.state is EntryState.PRESENT  # same size: a probe cannot tell
    with pytest.raises(CorruptEntryError, match="checksum"):
        STORE.read_files(str(entry), probe.meta, list(FILES), verify=True)
    out = STORE.read_files(str(entry), probe.meta, list(FILES), verify=False)
    assert out["data.safetensors"] == bytes(raw)
    assert out["data.json"] == FILES["data.json"]


def test_read_files_detects_truncation_even_unverified(entry: Path) -> None:
    probe = STORE.probe(str(entry))
    data_path = entry / "data.json"
    data_path.write_bytes(data_path.read_bytes()[:-1])
    for verify in (True, False):
        with pytest.raises(CorruptEntryError):
            STORE.read_files(str(entry), probe.meta, list(FILES), verify=verify)


def test_read_files_missing_file_is_corrupt(entry: Path) -> None:
    probe = STORE.probe(str(entry))
    (entry / "data.json").unlink()
    with pytest.raises(CorruptEntryError):
        STORE.read_files(str(entry), probe.meta, list(FILES), verify=True)


def test_read_files_unlisted_name_is_corrupt(entry: Path) -> None:
    (entry / "extra.bin").write_bytes(b"x")
    probe = STORE.probe(str(entry))
    with pytest.raises(CorruptEntryError):
        STORE.read_files(str(entry), probe.meta, ["extra.bin"], verify=True)


def test_corrupt_entry_error_is_a_cache_miss() -> None:
    from stepskip import CacheMissError

    assert issubclass(CorruptEntryError, CacheMissError)


# --------------------------------------------------------------------------- legacy (verl-written) entries


def _legacy(tmp_path: Path, with_data: bool = True) -> Path:
    path = tmp_path / "legacy" / "3"
    path.mkdir(parents=True)
    (path / META_FILE).write_text(json.dumps({"global_steps": 3}))
    if with_data:
        (path / "gen_batch.dp").write_bytes(b"pickle bytes")
    return path


def test_legacy_entry_present_with_its_data_file(tmp_path: Path) -> None:
    path = _legacy(tmp_path)
    probe = STORE.probe(str(path), legacy_files=("gen_batch.dp",))
    assert probe.state is EntryState.PRESENT
    assert probe.meta == {"global_steps": 3}
    out = STORE.read_files(str(path), probe.meta, ["gen_batch.dp"], verify=True)  # nothing to verify against
    assert out == {"gen_batch.dp": b"pickle bytes"}


def test_legacy_entry_present_with_any_known_data_file(tmp_path: Path) -> None:
    path = _legacy(tmp_path)
    assert STORE.probe(str(path), legacy_files=("tq_batch.pt", "gen_batch.dp")).state is EntryState.PRESENT


def test_legacy_entry_without_data_file_is_damaged(tmp_path: Path) -> None:
    path = _legacy(tmp_path, with_data=False)
    assert STORE.probe(str(path), legacy_files=("gen_batch.dp",)).state is EntryState.DAMAGED


def test_legacy_entry_needs_legacy_files_named(tmp_path: Path) -> None:
    path = _legacy(tmp_path)
    assert STORE.probe(str(path)).state is EntryState.DAMAGED


# --------------------------------------------------------------------------- overwrite


def test_overwrite_replaces_the_entry_completely(tmp_path: Path) -> None:
    path = tmp_path / "run" / "3"
    write(path, files={"a.bin": b"first" * 10, "old_only.bin": b"old"}, meta={"global_steps": 3, "run": "A"})
    second = {"a.bin": b"second", "b.bin": b"new file"}
    assert write(path, files=second, meta={"global_steps": 3, "run": "B"}) > 0
    assert read_all(path) == second
    assert sorted(os.listdir(path)) == sorted(["a.bin", "b.bin", META_FILE])
    assert json.loads((path / META_FILE).read_text())["run"] == "B"
    assert sorted(os.listdir(path.parent)) == ["3"]


def test_overwrite_false_keeps_the_first(tmp_path: Path) -> None:
    path = tmp_path / "3"
    write(path, files={"a.bin": b"first"})
    assert write(path, files={"a.bin": b"second"}, overwrite=False) == 0
    assert read_all(path) == {"a.bin": b"first"}
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_overwrite_replaces_a_damaged_entry(entry: Path) -> None:
    (entry / META_FILE).write_bytes(b"{garbage")
    write(entry, files={"x.bin": b"fresh"}, meta={"global_steps": 5})
    assert read_all(entry) == {"x.bin": b"fresh"}
    assert leftovers(entry.parent) == []


def test_overwrite_replaces_a_stray_file(tmp_path: Path) -> None:
    path = tmp_path / "3"
    path.write_bytes(b"stray")
    write(path, files={"x.bin": b"fresh"})
    assert read_all(path) == {"x.bin": b"fresh"}
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- failures leave nothing partial


def test_parent_is_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"x")
    with pytest.raises(OSError):
        write(blocker / "3")
    with pytest.raises(OSError):
        write(blocker / "deeper" / "3")
    assert sorted(os.listdir(tmp_path)) == ["blocker"]
    assert blocker.read_bytes() == b"x"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_parent(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(OSError):
            write(parent / "3")
        assert os.listdir(parent) == []
    finally:
        parent.chmod(0o700)


def _fail_on_nth_write(monkeypatch: pytest.MonkeyPatch, n: int, err: int = errno.ENOSPC) -> None:
    real = _localfs.write_unsynced
    calls = {"n": 0}

    def flaky(dir_fd: int, name: str, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] == n:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as fh:  # a partial file, as a full disk leaves it
                fh.write(data[: len(data) // 2])
            raise OSError(err, os.strerror(err))
        return real(dir_fd, name, data)

    monkeypatch.setattr(_localfs, "write_unsynced", flaky)


@pytest.mark.parametrize("n", [1, 2, 3], ids=["first-file", "second-file", "meta"])
def test_disk_full_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    _fail_on_nth_write(monkeypatch, n)
    with pytest.raises(OSError) as info:
        write(tmp_path / "3")
    assert info.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_disk_full_during_overwrite_keeps_the_old_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "3"
    write(path, files={"a.bin": b"old"})
    _fail_on_nth_write(monkeypatch, 1)
    with pytest.raises(OSError):
        write(path, files={"a.bin": b"new"})
    assert read_all(path) == {"a.bin": b"old"}
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_unstorable_file_name_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        write(tmp_path / "3", files={"sub/dir/x.bin": b"x"})
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- leftovers


def test_remove_leftovers_only_stale_temporaries(tmp_path: Path) -> None:
    write(tmp_path / "3")
    write(tmp_path / "4")
    old = time.time() - 2 * 3600
    stale = [tmp_path / ".tmp-3-0123456789ab", tmp_path / ".trash-4-ba9876543210"]
    fresh = [tmp_path / ".tmp-5-aaaaaaaaaaaa", tmp_path / ".trash-5-bbbbbbbbbbbb"]
    for d in stale + fresh:
        d.mkdir()
        (d / "data.bin").write_bytes(b"partial")
    for d in stale:
        os.utime(d, (old, old))
    os.utime(tmp_path / "3", (old, old))  # an old step dir is still a step dir
    (tmp_path / "notes.txt").write_text("keep me")
    os.utime(tmp_path / "notes.txt", (old, old))

    removed = STORE.remove_leftovers(str(tmp_path))
    assert sorted(Path(p).name for p in removed) == sorted(d.name for d in stale)
    assert sorted(os.listdir(tmp_path)) == sorted(["3", "4", "notes.txt"] + [d.name for d in fresh])
    assert read_all(tmp_path / "3") == FILES
    assert read_all(tmp_path / "4") == FILES


def test_remove_leftovers_threshold(tmp_path: Path) -> None:
    d = tmp_path / ".tmp-1-abc"
    d.mkdir()
    old = time.time() - 100
    os.utime(d, (old, old))
    assert STORE.remove_leftovers(str(tmp_path), older_than=1000) == []
    assert d.exists()
    assert [Path(p).name for p in STORE.remove_leftovers(str(tmp_path), older_than=10)] == [".tmp-1-abc"]
    assert not d.exists()


def test_remove_leftovers_missing_dir() -> None:
    assert STORE.remove_leftovers("/nonexistent/stepskip/dir") == []


def test_remove_leftovers_stale_file(tmp_path: Path) -> None:
    f = tmp_path / ".trash-2-0123456789ab"
    f.write_bytes(b"x")
    old = time.time() - 2 * 3600
    os.utime(f, (old, old))
    removed = STORE.remove_leftovers(str(tmp_path))
    assert removed == [str(f)]
    assert not f.exists()


def test_failed_writes_leave_no_leftovers_to_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on_nth_write(monkeypatch, 2)
    with pytest.raises(OSError):
        write(tmp_path / "3")
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- concurrency


def _writer_files(i: int) -> dict[str, bytes]:
    # different sizes per writer, so that a mix of two writers' files cannot pass the size checks either
    return {"a.bin": bytes([i]) * (1000 + 37 * i), "b.bin": f"writer {i}".encode() * (3 + i)}


def _run_threads(targets: list[Any]) -> list[BaseException]:
    errors: list[BaseException] = []

    def wrap(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - reported by the test
                errors.append(err)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("round_", range(5))
def test_concurrent_writers_leave_exactly_one_complete_entry(tmp_path: Path, round_: int) -> None:
    path = tmp_path / "run" / "3"
    barrier = threading.Barrier(8)
    results: dict[int, int] = {}

    def writer(i: int) -> Any:
        def run() -> None:
            barrier.wait()
            results[i] = STORE.write_entry(str(path), _writer_files(i), {"global_steps": 3, "writer": i})
        return run

    errors = _run_threads([writer(i) for i in range(8)])
    assert not errors, errors
    assert all(v > 0 for v in results.values()) and len(results) == 8
    content = read_all(path)
    winners = [i for i in range(8) if _writer_files(i) == content]
    assert len(winners) == 1
    assert json.loads((path / META_FILE).read_text())["writer"] == winners[0]
    assert sorted(os.listdir(path.parent)) == ["3"]  # no .tmp-/.trash- leftovers


def test_concurrent_writers_without_overwrite_one_wins(tmp_path: Path) -> None:
    path = tmp_path / "3"
    barrier = threading.Barrier(8)
    results: dict[int, int] = {}

    def writer(i: int) -> Any:
        def run() -> None:
            barrier.wait()
            results[i] = STORE.write_entry(str(path), _writer_files(i), {"global_steps": 3}, overwrite=False)
        return run

    errors = _run_threads([writer(i) for i in range(8)])
    assert not errors, errors
    won = [i for i, n in results.items() if n > 0]
    assert len(won) == 1
    assert read_all(path) == _writer_files(won[0])
    assert sorted(os.listdir(tmp_path)) == ["3"]


def test_reader_racing_overwrites_sees_missing_or_one_complete_entry(tmp_path: Path) -> None:
    """A reader looping probe + read_files while 4 writers keep overwriting the entry.

    Each attempt must give MISSING or exactly one writer's content. A CorruptEntryError (or a DAMAGED
    probe) can only come from the reader racing a replace; it is counted. Once the writers are done,
    the reader's next attempt must read one complete entry: no damage outlives the writes. How many
    attempts overlap the writes is up to the scheduler, so nothing is asserted on that count.
    """
    path = tmp_path / "run" / "3"
    writers, writes_each = 4, 12
    expected = [_writer_files(i) for i in range(writers)]
    writers_done = threading.Event()
    stats = {"attempts": 0, "present": 0, "missing": 0, "corrupt": 0, "damaged": 0}
    wrong: list[Any] = []
    after_writes: list[str] = []  # the outcome of the first attempt started after every write

    def attempt() -> str:
        stats["attempts"] += 1
        probe = STORE.probe(str(path))
        if probe.state is EntryState.MISSING:
            stats["missing"] += 1
            return "missing"
        if probe.state is EntryState.DAMAGED:
            stats["damaged"] += 1
            return "damaged"
        try:
            content = STORE.read_files(str(path), probe.meta, list(probe.meta["files"]), verify=True)
        except CorruptEntryError:
            stats["corrupt"] += 1
            return "corrupt"
        stats["present"] += 1
        if content not in expected:
            wrong.append(sorted(content))
        return "present"

    def reader() -> None:
        while not writers_done.is_set():
            attempt()
        after_writes.append(attempt())

    def writer(i: int) -> Any:
        def run() -> None:
            for _ in range(writes_each):
                STORE.write_entry(str(path), expected[i], {"global_steps": 3})
        return run

    reader_thread = threading.Thread(target=reader)
    reader_thread.start()
    try:
        errors = _run_threads([writer(i) for i in range(writers)])
    finally:
        writers_done.set()
        reader_thread.join(timeout=300)
    assert not reader_thread.is_alive()
    assert not errors, errors
    assert not wrong, wrong
    assert after_writes == ["present"], (after_writes, stats)
    assert read_all(path) in expected
    assert sorted(os.listdir(path.parent)) == ["3"]
    print(f"\nreader racing overwrites: {stats}")


# --------------------------------------------------------------------------- open_store


def test_open_store() -> None:
    assert isinstance(open_store("/tmp/x").backend, LocalBackend)
    assert isinstance(open_store("file:///tmp/x").backend, LocalBackend)
    assert isinstance(open_store("~/x").backend, LocalBackend)
    assert open_store("~/x").root == os.path.expanduser("~/x")
    assert isinstance(open_store("memory://bucket/prefix").backend, FsspecBackend)
    with pytest.raises(SkipConfigError, match="nosuchfs://bucket"):
        open_store("nosuchfs://bucket/prefix")


# --------------------------------------------------------------------------- Layout


def _train_config(**overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "trainer": {"experiment_name": "exp", "project_name": "proj"},
        "data": {"gen_batch_size": 64, "train_batch_size": 32, "max_prompt_length": 512,
                 "max_response_length": 1024},
        "actor_rollout_ref": {"rollout": {"n": 8}},
    }
    for dotted, value in overrides.items():
        node = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def test_layout_seed_path_format(tmp_path: Path) -> None:
    lay = Layout.from_config(str(tmp_path), _train_config())
    assert lay.project_dir == f"{tmp_path}/exp_proj/GBS64_N8_in512_out1024"
    assert lay.step_dir(3) == f"{tmp_path}/exp_proj/GBS64_N8_in512_out1024/3"
    assert lay.inner_dir(3, 0) == f"{tmp_path}/exp_proj/GBS64_N8_in512_out1024/3/0"


@pytest.mark.parametrize("kind", ["dict", "dictconfig", "namespace"])
def test_layout_from_each_config_kind(tmp_path: Path, kind: str) -> None:
    cfg: Any = _train_config()
    if kind == "dictconfig":
        cfg = OmegaConf.create(cfg)
        OmegaConf.set_struct(cfg, True)
    elif kind == "namespace":
        cfg = json.loads(json.dumps(cfg), object_hook=lambda d: SimpleNamespace(**d))
    lay = Layout.from_config(str(tmp_path), cfg)
    assert lay.step_dir(1) == f"{tmp_path}/exp_proj/GBS64_N8_in512_out1024/1"


def test_layout_gen_batch_size_preferred_then_train_batch_size(tmp_path: Path) -> None:
    assert Layout.from_config(str(tmp_path), _train_config()).gbs == 64
    assert Layout.from_config(str(tmp_path), _train_config(data__gen_batch_size=None)).gbs == 32
    cfg = _train_config()
    del cfg["data"]["gen_batch_size"]
    assert Layout.from_config(str(tmp_path), cfg).gbs == 32
    del cfg["data"]["train_batch_size"]
    assert Layout.from_config(str(tmp_path), cfg).gbs == 0


def test_layout_gen_batch_size_interpolated(tmp_path: Path) -> None:
    cfg = OmegaConf.create(_train_config(data__gen_batch_size="${data.train_batch_size}"))
    assert Layout.from_config(str(tmp_path), cfg).gbs == 32


def test_layout_defaults(tmp_path: Path) -> None:
    for cfg in ({}, None, SimpleNamespace(), OmegaConf.create({})):
        lay = Layout.from_config(str(tmp_path), cfg)
        assert lay.project_dir == f"{tmp_path}/default_experiment_name_default_project_name/GBS0_N0_in0_out0"


def test_layout_tilde_expansion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    lay = Layout.from_config("~/.verl/rollout_dump", _train_config())
    assert lay.dump_dir == f"{tmp_path}/.verl/rollout_dump"
    assert lay.step_dir(2).startswith(f"{tmp_path}/.verl/rollout_dump/exp_proj/")


def test_layout_file_url_prefix(tmp_path: Path) -> None:
    lay = Layout.from_config(f"file://{tmp_path}/dump", _train_config())
    assert lay.dump_dir == f"{tmp_path}/dump"
    assert lay.step_dir(1) == f"{tmp_path}/dump/exp_proj/GBS64_N8_in512_out1024/1"


def test_layout_relative_and_trailing_slash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert Layout.from_config("rel/dump/", _train_config()).dump_dir == f"{tmp_path}/rel/dump"


@pytest.mark.parametrize(
    ("experiment", "project", "subdir"),
    [
        ("../../etc", "x", None),
        ("a/b", "../../c", None),
        ("..", "..", None),
        ("/abs", "/", None),
        ("e", "p", "../../../outside"),
        ("e", "p", ".."),
        ("e", "p", "a/../../b"),
        ("..\\..", "p\x00q", "\\x"),
    ],
)
def test_layout_names_cannot_escape_dump_dir(tmp_path: Path, experiment: str, project: str,
                                             subdir: str | None) -> None:
    dump = tmp_path / "dump"
    cfg = _train_config(trainer__experiment_name=experiment, trainer__project_name=project)
    lay = Layout.from_config(str(dump), cfg, subdir=subdir)
    root = os.path.realpath(dump)
    for path in (lay.project_dir, lay.step_dir(1), lay.inner_dir(1, 2)):
        resolved = os.path.realpath(path)
        assert resolved.startswith(root + os.sep), (path, resolved)
    # one component for the run identity, one for the run shape, (one for the subdir), then the step
    rel = os.path.relpath(os.path.realpath(lay.step_dir(1)), root).split(os.sep)
    assert len(rel) == (4 if subdir else 3)
    assert rel[-1] == "1"


@pytest.mark.parametrize("name", ["..", ".", "", "a/b", "../x", "x/..", "\x00", "a\\b"])
def test_safe_component_is_one_harmless_component(name: str) -> None:
    out = safe_component(name)
    assert out not in ("", ".", "..")
    assert "/" not in out and "\\" not in out and "\x00" not in out and ".." not in out


def test_safe_component_keeps_ordinary_names() -> None:
    assert safe_component("exp_proj") == "exp_proj"
    assert safe_component("my-run.v2") == "my-run.v2"


def test_layout_stage_subdir(tmp_path: Path) -> None:
    lay = Layout.from_config(str(tmp_path), _train_config(), subdir="reward")
    assert lay.step_dir(4) == f"{tmp_path}/exp_proj/GBS64_N8_in512_out1024/reward/4"


@pytest.mark.parametrize(
    ("name", "step"),
    [("0", 0), ("3", 3), ("128", 128), ("007", 7), (".tmp-3-abc", None), (".trash-3-abc", None),
     ("3a", None), ("-1", None), ("", None), ("meta.json", None), ("3.0", None), (" 3", None),
     ("\u00b2", None), ("\u0663", None), ("\uff13", None)],
)
def test_parse_step(name: str, step: int | None) -> None:
    assert Layout.parse_step(name) == step


def test_parse_step_roundtrips_step_dir(tmp_path: Path) -> None:
    lay = Layout(str(tmp_path))
    for step in (0, 1, 42, 10**6):
        assert Layout.parse_step(os.path.basename(lay.step_dir(step))) == step


class _CountingCache(dict):
    """fsspec's dircache (a mapping of path -> listing), counting the walks over all its keys."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_forget_listings_drops_the_subtree_only_and_never_walks_every_key():
    """Called once per step by the index: the run directory's listing stays cached, and a call costs the
    step's own listings (walked from its cached listing), not every key of the cache."""
    store = open_store("memory://forget/dump")
    run = store.backend.key("memory://forget/dump/run")  # the keys fsspec caches listings under
    step = f"{run}/1"

    def d(name):
        return {"name": name, "type": "directory"}

    cache = _CountingCache({
        run: [d(step), d(f"{run}/2")],
        step: [d(f"{step}/rec-0123456789ab"), d(f"{step}/0"), {"name": f"{step}/step.json", "type": "file"}],
        f"{step}/rec-0123456789ab": [d(f"{step}/rec-0123456789ab/0")],
        f"{step}/rec-0123456789ab/0": [{"name": f"{step}/rec-0123456789ab/0/meta.json", "type": "file"}],
        f"{step}/0": [],
        f"{run}/2": [d(f"{run}/2/0")],
        f"{run}/10": [],  # a sibling whose name starts like the step's
    })
    store.backend.fs.dircache = cache
    _CountingCache.walks = 0
    store.forget_listings("memory://forget/dump/run/1")
    assert _CountingCache.walks == 0
    assert sorted(cache) == sorted([run, f"{run}/2", f"{run}/10"])
    cache[f"{step}/rec-0123456789ab/0"] = []  # cached below the step while the step's own listing is not
    store.forget_listings("memory://forget/dump/run/1")  # no walk to take: the keys below it are looked for
    assert sorted(cache) == sorted([run, f"{run}/2", f"{run}/10"])


def test_temporary_names_never_repeat_and_a_forked_child_draws_its_own() -> None:
    """The tokens in ``.tmp-``/``.trash-`` names come from a per-process prefix and a counter (no
    system call per name); a forked child must not reuse its parent's, or two writers of one entry
    would build it in the same temporary directory."""
    tokens = [_token() for _ in range(50_000)]
    assert len(set(tokens)) == len(tokens)
    assert all(len(t) == 12 and int(t, 16) >= 0 for t in tokens)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next tokens and leave at once
        os.close(read_end)
        os.write(write_end, " ".join(_token() for _ in range(100)).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child = pipe.read().split()
    os.waitpid(pid, 0)
    parent = [_token() for _ in range(100)]
    assert len(child) == 100
    assert {t[:6] for t in child} != {tokens[0][:6]}  # a prefix of its own
    assert not set(child) & set(parent)
