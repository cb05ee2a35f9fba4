"""Batches of local entries (``EntryStore.write_entries`` over the local backend) with ``syncfs``: one
sync per filesystem for a batch of small entries, each entry still durable before its rename, and the
per-file fsyncs back whenever ``syncfs`` fails.

``syncfs``, ``os.fsync``, ``os.rename`` and ``os.close`` are wrapped (the real calls still run) to see
which syncs ran and in which order.
"""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from stepskip._storage import EntryState, EntryStore, LocalBackend
from stepskip._storage import _linux as store_module
from stepskip._storage._linux import SYNCFS_CHUNK_ENTRIES, SYNCFS_MIN_ENTRIES
from stepskip._storage._localfs import LocalBatch

pytestmark = pytest.mark.skipif(store_module._SYNCFS is None, reason="needs Linux 5.8+ syncfs")


def _entries(root, count, start=0):
    return [(f"{root}/run/{i}", {"data.json": json.dumps({"i": i}).encode(), "data.bin": bytes([i % 256]) * 10},
             {"global_steps": i}) for i in range(start, start + count)]


def _spy(monkeypatch, syncfs_result=None):
    """Record ('syncfs' | 'fsync' | 'rename', ...) in call order; ``syncfs_result`` replaces its result."""
    calls: list[tuple[str, int | str]] = []
    real_syncfs, real_fsync, real_rename = store_module._SYNCFS, os.fsync, os.rename

    def syncfs(fd):
        calls.append(("syncfs", os.fstat(fd).st_dev))
        result = real_syncfs(fd)
        return result if syncfs_result is None else syncfs_result

    def fsync(fd):
        calls.append(("fsync", fd))
        real_fsync(fd)

    def rename(src, dst, **kwargs):
        calls.append(("rename", str(dst)))
        real_rename(src, dst, **kwargs)

    monkeypatch.setattr(store_module, "_SYNCFS", syncfs)
    monkeypatch.setattr(store_module, "_dirty_bytes", lambda: 0)  # a quiet system: no one else's dirty pages
    monkeypatch.setattr(store_module.os, "fsync", fsync)
    monkeypatch.setattr(store_module.os, "rename", rename)
    return calls


def test_a_batch_is_synced_once_before_any_entry_is_published(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    calls = _spy(monkeypatch)
    results = store.write_entries(_entries(tmp_path, 8))
    assert all(isinstance(r, int) and r > 0 for r in results)
    kinds = [kind for kind, _ in calls]
    first_rename = kinds.index("rename")
    assert kinds[:first_rename] == ["syncfs"]  # no per-file fsync: the one syncfs covers every file
    assert kinds[first_rename:].count("rename") == 8 and "syncfs" not in kinds[first_rename:]
    for i in range(8):
        meta, files = store.read_entry(f"{tmp_path}/run/{i}")
        assert meta["global_steps"] == i and json.loads(files["data.json"]) == {"i": i}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(str(i) for i in range(8))


def _stage_spy(monkeypatch, calls):
    """Record ('stage', name) for each entry's temporary directory as it is made."""
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        calls.append(("stage", str(path)))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(store_module.os, "mkdir", mkdir)


def test_a_long_batch_is_synced_in_chunks_while_the_next_entries_are_staged(tmp_path, monkeypatch):
    """Creating files slows down the longer a filesystem goes unsynced: a long batch is synced every
    SYNCFS_CHUNK_ENTRIES entries, in the background while the next entries are staged. Nothing is
    published before every entry is durable: the last syncfs starts after the last entry is staged."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    calls = _spy(monkeypatch)
    spied_syncfs = store_module._SYNCFS
    staged_meanwhile = threading.Event()
    first = threading.Event()

    def syncfs(fd):
        if not first.is_set():  # the first chunk's sync lasts until the last entry is being staged
            first.set()
            assert staged_meanwhile.wait(60), "the next entries were not staged while the first chunk synced"
        return spied_syncfs(fd)

    monkeypatch.setattr(store_module, "_SYNCFS", syncfs)
    _stage_spy(monkeypatch, calls)
    real_stage, stages = LocalBatch.stage, []
    count = 2 * SYNCFS_CHUNK_ENTRIES + SYNCFS_MIN_ENTRIES

    def stage(self, path):
        stages.append(path)
        if len(stages) == count:
            staged_meanwhile.set()
        return real_stage(self, path)

    monkeypatch.setattr(LocalBatch, "stage", stage)
    assert all(isinstance(r, int) and r > 0 for r in store.write_entries(_entries(tmp_path, count)))
    kinds = [kind for kind, _ in calls]
    first_rename = kinds.index("rename")
    before = kinds[:first_rename]
    # the first chunk's syncfs, then (none other while it ran) one for the rest once all are staged
    assert before.count("syncfs") == 2 and "fsync" not in before  # every file covered by a syncfs
    assert max(i for i, k in enumerate(before) if k == "stage") < max(i for i, k in enumerate(before) if k == "syncfs")
    assert kinds[first_rename:].count("rename") == count  # then the parent's fsync, for the renames
    assert sorted(int(p.name) for p in (tmp_path / "run").iterdir()) == list(range(count))


def test_after_a_failed_chunk_sync_the_rest_of_the_batch_is_synced_file_by_file(tmp_path, monkeypatch):
    """A failed syncfs may have taken the writeback error of a file staged while it ran: no later
    syncfs of the batch is trusted, every later entry gets its own fsyncs."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    calls = _spy(monkeypatch, syncfs_result=-1)
    count = 3 * SYNCFS_CHUNK_ENTRIES
    assert all(isinstance(r, int) and r > 0 for r in store.write_entries(_entries(tmp_path, count)))
    kinds = [kind for kind, _ in calls]
    first_rename = kinds.index("rename")
    assert kinds.count("syncfs") == 1  # the first chunk's, failed: never another
    assert kinds[:first_rename].count("fsync") == count * 4  # two data files, meta.json, the directory
    for i in range(count):
        meta, files = store.read_entry(f"{tmp_path}/run/{i}")
        assert meta["global_steps"] == i and json.loads(files["data.json"]) == {"i": i}


def test_a_system_holding_much_dirty_data_keeps_per_file_fsyncs(tmp_path, monkeypatch):
    """syncfs would also write back everyone else's dirty pages (a checkpoint being saved): not then."""
    store = EntryStore(LocalBackend())
    calls = _spy(monkeypatch)
    monkeypatch.setattr(store_module, "_dirty_bytes", lambda: store_module.SYNCFS_MAX_DIRTY_BYTES + 1)
    results = store.write_entries(_entries(tmp_path, 8))
    assert all(isinstance(r, int) for r in results)
    assert not [c for c in calls if c[0] == "syncfs"] and [c for c in calls if c[0] == "fsync"]
    monkeypatch.setattr(store_module, "_dirty_bytes", lambda: None)  # unknown: the same, per file
    store.write_entries(_entries(tmp_path, 8, start=8))
    assert not [c for c in calls if c[0] == "syncfs"]


def test_a_fuse_mount_keeps_per_file_fsyncs(tmp_path, monkeypatch):
    """FUSE's kernel side answers syncfs without asking the daemon: only a file's fsync reaches it."""
    store = EntryStore(LocalBackend())
    calls = _spy(monkeypatch)
    monkeypatch.setattr(store_module, "_fs_type", lambda device: "fuse.juicefs")
    assert all(isinstance(r, int) for r in store.write_entries(_entries(tmp_path, 8)))
    assert not [c for c in calls if c[0] == "syncfs"] and [c for c in calls if c[0] == "fsync"]


def test_the_filesystem_type_comes_from_mountinfo(tmp_path):
    assert store_module._fs_type(os.stat(tmp_path).st_dev) is not None


def test_the_system_dirty_bytes_are_read_from_meminfo():
    dirty = store_module._dirty_bytes()
    assert dirty is not None and dirty >= 0  # Linux (the module is skipped elsewhere)


def test_small_batches_keep_their_per_file_fsyncs(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    calls = _spy(monkeypatch)
    count = SYNCFS_MIN_ENTRIES - 1
    assert all(isinstance(r, int) for r in store.write_entries(_entries(tmp_path, count)))
    kinds = [kind for kind, _ in calls]
    assert "syncfs" not in kinds
    first_rename = kinds.index("rename")
    assert kinds[:first_rename].count("fsync") == count * 4  # two data files, meta.json, the directory


def test_a_failed_syncfs_falls_back_to_an_fsync_per_file(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    calls = _spy(monkeypatch, syncfs_result=-1)
    results = store.write_entries(_entries(tmp_path, 6))
    assert all(isinstance(r, int) for r in results)
    kinds = [kind for kind, _ in calls]
    first_rename = kinds.index("rename")
    assert kinds[0] == "syncfs" and kinds[1:first_rename].count("fsync") == 6 * 4


def test_after_a_failed_syncfs_a_failing_fsync_costs_its_entry_alone(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    _spy(monkeypatch, syncfs_result=-1)
    real_staged, bad = LocalBatch.staged, set()

    def staged(self, key, staging):
        if staging.path.endswith("/run/2"):
            bad.update(staging.fds)  # the entry's files and directory, written and not yet synced
        return real_staged(self, key, staging)

    spied_fsync = store_module.os.fsync

    def fsync(fd):
        if fd in bad:
            raise OSError(errno.EIO, "writeback failed")
        spied_fsync(fd)

    monkeypatch.setattr(LocalBatch, "staged", staged)
    monkeypatch.setattr(store_module.os, "fsync", fsync)
    results = store.write_entries(_entries(tmp_path, 5))
    assert isinstance(results[2], OSError) and results[2].errno == errno.EIO
    assert all(isinstance(results[i], int) for i in (0, 1, 3, 4))
    assert store.probe(f"{tmp_path}/run/2").state is EntryState.MISSING
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["0", "1", "3", "4"]  # nothing partial


def test_a_close_error_after_syncfs_keeps_that_entry_unpublished(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    _spy(monkeypatch)
    real_close, real_staged, failing = os.close, LocalBatch.staged, set()

    def staged(self, key, staging):
        if staging.path.endswith("/run/1"):
            failing.update(staging.fds)
        return real_staged(self, key, staging)

    def close(fd):
        real_close(fd)
        if fd in failing:
            failing.discard(fd)
            raise OSError(errno.EIO, "deferred write error")

    monkeypatch.setattr(LocalBatch, "staged", staged)
    monkeypatch.setattr(store_module.os, "close", close)
    results = store.write_entries(_entries(tmp_path, 5))
    assert isinstance(results[1], OSError) and results[1].errno == errno.EIO
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["0", "2", "3", "4"]


def test_each_filesystem_of_a_batch_gets_its_own_syncfs(tmp_path, monkeypatch):
    other = "/dev/shm"
    if not os.path.isdir(other) or os.stat(other).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs a second filesystem (/dev/shm)")
    import tempfile

    with tempfile.TemporaryDirectory(dir=other) as second:
        store = EntryStore(LocalBackend())  # no root: entries anywhere
        calls = _spy(monkeypatch)
        items = _entries(tmp_path, 4) + _entries(second, 4, start=10)
        assert all(isinstance(r, int) for r in store.write_entries(items))
        synced = {device for kind, device in calls if kind == "syncfs"}
        assert synced == {os.stat(tmp_path).st_dev, os.stat(second).st_dev}
        assert store.read_entry(f"{second}/run/12")[0]["global_steps"] == 12


def test_an_entry_source_that_raises_leaves_no_fd_open_and_nothing_published(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    def open_here() -> list[str]:  # fds open on files of this test (other threads may open their own meanwhile)
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed since it was listed
                continue
            if target.startswith(str(tmp_path)):
                found.append(target)
        return found

    before = open_here()

    def items():
        yield from _entries(tmp_path, 5)
        raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="producer"):
        store.write_entries(items())
    assert open_here() == before
    assert list((tmp_path / "run").iterdir()) == []


def test_a_long_batch_is_written_when_the_sync_pool_refuses_work_at_exit(tmp_path, monkeypatch):
    """Dumps pending at exit are written after concurrent.futures stopped taking work: the chunk syncs
    then run on the writing thread."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    calls = _spy(monkeypatch)

    class Closed:
        def submit(self, *args, **kwargs):
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(store_module, "_sync_pool", lambda: Closed())
    count = 2 * SYNCFS_CHUNK_ENTRIES + SYNCFS_MIN_ENTRIES
    assert all(isinstance(r, int) and r > 0 for r in store.write_entries(_entries(tmp_path, count)))
    assert [kind for kind, _ in calls].count("syncfs") >= 2
    assert sorted(int(p.name) for p in (tmp_path / "run").iterdir()) == list(range(count))
