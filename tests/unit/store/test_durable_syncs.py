"""The syncs behind an entry's durability: new directories' names, side-by-side fsyncs, close errors.

``os.fsync`` and ``os.close`` are wrapped (the real calls still run) to see which directories are
synced and which errors are kept; a barrier shows syncs that run side by side rather than one by one.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest

from stepskip._storage import EntryStore, LocalBackend
from stepskip._storage import _linux as store_module
from stepskip._storage._linux import Syncs as _Syncs
from stepskip._storage._localfs import LocalBatch

WAIT_S = 60  # a hang guard: only reached when the syncs do not run side by side


def _synced_dirs(monkeypatch) -> set[tuple[int, int]]:
    synced: set[tuple[int, int]] = set()
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    return synced


def _id(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def test_a_new_directory_is_made_durable_in_its_parent(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    synced = _synced_dirs(monkeypatch)
    store.write_entry(f"{tmp_path}/new/deeper/1", {"data.json": b"{}"}, {"global_steps": 1})
    assert _id(tmp_path) in synced and _id(tmp_path / "new") in synced


def test_a_staging_directory_is_made_durable_when_it_is_published(tmp_path, monkeypatch):
    """A V1 step's hidden staging directory is not synced into its parent when it is made (a crash may
    lose it: it is a temporary); publishing it syncs it and the parent, and the step is then whole."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    synced = _synced_dirs(monkeypatch)
    staging = f"{tmp_path}/run/.tmp-5-abc"
    store.write_entry(f"{staging}/0", {"data.json": b"{}"}, {"global_steps": 5})
    assert _id(tmp_path / "run") not in synced and _id(staging) in synced
    store.publish_dir(staging, f"{tmp_path}/run/5")
    assert _id(tmp_path / "run") in synced and _id(tmp_path / "run" / "5") in synced
    assert (tmp_path / "run" / "5" / "0" / "data.json").read_bytes() == b"{}"
    assert not os.path.exists(staging)


def test_only_the_last_directory_made_is_left_to_publish_dir(tmp_path, monkeypatch):
    """A directory named like a temporary higher up the path holds published entries: it is synced as any."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    synced = _synced_dirs(monkeypatch)
    store.write_entry(f"{tmp_path}/.tmp-like/run/1", {"data.json": b"{}"}, {"global_steps": 1})
    assert _id(tmp_path) in synced and _id(tmp_path / ".tmp-like") in synced


def test_a_missing_store_root_is_made_durable_in_its_parent(tmp_path, monkeypatch):
    root = tmp_path / "fresh" / "root"
    store = EntryStore(LocalBackend(str(root)))
    synced = _synced_dirs(monkeypatch)
    store.write_entry(f"{root}/run/1", {"data.json": b"{}"}, {"global_steps": 1})
    assert {_id(tmp_path), _id(tmp_path / "fresh"), _id(root)} <= synced


def test_a_small_file_is_renamed_durably(tmp_path, monkeypatch):
    """``put_small`` (a V1 step's manifest) syncs its directory after the rename, as an entry does."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run" / "3").mkdir(parents=True)
    synced = _synced_dirs(monkeypatch)
    store.put_small(f"{tmp_path}/run/3/step.json", b"{}")
    assert (tmp_path / "run" / "3" / "step.json").read_bytes() == b"{}"
    assert _id(tmp_path / "run" / "3") in synced
    with pytest.raises(OSError, match="cannot name an entry"):
        store.put_small(f"{tmp_path}/run/3/step\x00.json", b"{}")


def test_the_files_of_an_entry_are_synced_side_by_side(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    (tmp_path / "run").mkdir()
    files = {f"part{i}.bin": bytes([i]) * 10 for i in range(3)}
    together = len(files) + 2  # the files, meta.json and the entry's directory
    barrier = threading.Barrier(together, timeout=WAIT_S)
    calls, lock, real = [0], threading.Lock(), os.fsync

    def fsync(fd):
        with lock:
            calls[0] += 1
            first = calls[0] <= together
        if first:  # one by one, the first would wait here for the others forever (until the guard)
            barrier.wait()
        real(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    assert store.write_entry(f"{tmp_path}/run/1", files, {"global_steps": 1}) > 0
    assert calls[0] >= together


def test_an_error_from_close_counts_as_a_failed_sync(tmp_path, monkeypatch):
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    real = os.close

    def close(n):
        real(n)
        if n == fd:
            raise OSError(errno.EIO, "deferred write error (as NFS reports it at close)")

    monkeypatch.setattr(store_module.os, "close", close)
    syncs = _Syncs()
    syncs.start("entry", [fd])
    failed = syncs.wait()
    assert set(failed) == {"entry"} and failed["entry"].errno == errno.EIO


def test_a_close_error_keeps_that_entry_unpublished(tmp_path, monkeypatch):
    store = EntryStore(LocalBackend(str(tmp_path)))
    real, failing = os.close, set()
    real_staged = LocalBatch.staged

    def staged(self, key, staging):
        if staging.path.endswith("/2"):
            failing.update(staging.fds)  # every fd of entry 2
        return real_staged(self, key, staging)

    def close(n):
        real(n)
        if n in failing:
            failing.discard(n)
            raise OSError(errno.EIO, "deferred write error")

    monkeypatch.setattr(LocalBatch, "staged", staged)
    monkeypatch.setattr(store_module.os, "close", close)
    results = store.write_entries([(f"{tmp_path}/run/{i}", {"data.json": b"x"}, {"global_steps": i})
                                   for i in (1, 2, 3)])
    assert isinstance(results[0], int) and isinstance(results[2], int)
    assert isinstance(results[1], OSError) and results[1].errno == errno.EIO
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1", "3"]


@pytest.mark.parametrize("count", [1, 4])
def test_fsync_all_reports_each_failure_by_fd(tmp_path, count, monkeypatch):
    fds = [os.open(tmp_path / f"f{i}", os.O_CREAT | os.O_WRONLY) for i in range(count)]
    bad = fds[-1]
    real = os.fsync

    def fsync(fd):
        if fd == bad:
            raise OSError(errno.EIO, "sync failed")
        real(fd)

    monkeypatch.setattr(store_module.os, "fsync", fsync)
    try:
        failed = store_module.fsync_all(fds)
    finally:
        for fd in fds:
            os.close(fd)
    assert set(failed) == {bad}
