"""Big files written around the page cache (``O_DIRECT``): the same bytes, durable, the flag on
for all but the last partial block.

``os.write`` is wrapped (the real call still runs) to see which bytes went out with ``O_DIRECT`` set;
the filesystem under ``tmp_path`` must take the flag (ext4 here; the tests skip elsewhere).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os

import pytest

from stepskip._storage import EntryStore, FsspecBackend, LocalBackend
from stepskip._storage import _linux as store_module
from stepskip._storage._linux import _direct_write_bytes

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")

BIG = 4 << 20
ALIGN = store_module._DIRECT_ALIGN


@pytest.fixture(autouse=True)
def default_threshold(monkeypatch) -> None:
    """The default threshold, whatever ``STEPSKIP_DIRECT_WRITE_BYTES`` says where the tests run."""
    monkeypatch.setattr(store_module, "DIRECT_WRITE_BYTES", BIG)


@pytest.fixture
def takes_direct_io(tmp_path) -> None:
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError:
        pytest.skip("this filesystem takes no O_DIRECT")
    finally:
        os.close(fd)
        probe.unlink()


def _spy_writes(monkeypatch) -> dict[str, list[int]]:
    """File name (by its fd's link in /proc) -> sizes written with O_DIRECT set; 0 for one without."""
    real = os.write
    seen: dict[str, list[int]] = {}

    def write(fd, data):
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT
        written = real(fd, data)
        seen.setdefault(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), []).append(written if direct else 0)
        return written

    monkeypatch.setattr(store_module.os, "write", write)
    return seen


def _aligned(size: int) -> memoryview:
    """``size`` bytes at a page-aligned address, as the page pool hands out."""
    buffer = mmap.mmap(-1, size)
    buffer.write(os.urandom(size))
    return memoryview(buffer)


SOURCES = {
    "unaligned bytes, an odd tail": lambda: os.urandom(BIG + 1234),
    "aligned, an odd tail": lambda: _aligned(BIG + 4096 * 3 + 17),
    "aligned, whole blocks": lambda: _aligned(BIG + 4096),
    "unaligned, several staging chunks": lambda: os.urandom(2 * store_module._DIRECT_STAGE_BYTES + BIG + 999),
}


@pytest.mark.parametrize("source", SOURCES.values(), ids=SOURCES.keys())
def test_a_big_file_is_written_around_the_page_cache_and_reads_back_whole(tmp_path, takes_direct_io, source,
                                                                          monkeypatch):
    data = source()
    writes = _spy_writes(monkeypatch)
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/1", {"data.safetensors": data, "data.json": b"{}"}, {"global_steps": 1})
    assert sum(writes["data.safetensors"]) == len(data) - len(data) % ALIGN  # the tail goes through the cache
    assert writes["data.json"] == [0] and writes["meta.json"] == [0]  # small files do
    meta, files = store.read_entry(f"{tmp_path}/run/1")  # the checksum in meta.json is checked on read
    assert files["data.safetensors"] == bytes(data)


def test_format_safes_pooled_tensor_file_goes_to_the_disk_uncopied(tmp_path, takes_direct_io, monkeypatch):
    """The tensor file format ``safe`` builds in the page pool is page-aligned: it is written from
    where it lies, never through the staging buffer. (The pool is in service between
    ``SkipManager.init`` and ``close``; an earlier test's ``close`` released it.)"""
    import threading

    import torch

    from stepskip._formats.pages import POOL
    from stepskip._formats.st_small import save_pooled

    monkeypatch.setattr(POOL, "released", False)
    data = save_pooled({"ids": torch.arange(BIG // 8 + 7, dtype=torch.int64)})
    monkeypatch.setattr(store_module, "_direct_stage", threading.local())  # no buffer made yet, here
    writes = _spy_writes(monkeypatch)
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/1", {"data.safetensors": data}, {"global_steps": 1})
    assert sum(writes["data.safetensors"]) == len(data) - len(data) % ALIGN
    assert not hasattr(store_module._direct_stage, "buffer")
    assert store.read_entry(f"{tmp_path}/run/1")[1]["data.safetensors"] == bytes(data)


def test_a_batch_writes_its_big_entries_around_the_page_cache(tmp_path, takes_direct_io, monkeypatch):
    data = os.urandom(BIG + 5)
    writes = _spy_writes(monkeypatch)
    store = EntryStore(LocalBackend(str(tmp_path)))
    results = store.write_entries([(f"{tmp_path}/run/{i}", {"data.safetensors": data}, {"global_steps": i})
                                   for i in range(2)])
    assert all(isinstance(r, int) for r in results)
    assert sum(writes["data.safetensors"]) == 2 * (len(data) - len(data) % ALIGN)
    for i in range(2):
        assert store.read_entry(f"{tmp_path}/run/{i}")[1]["data.safetensors"] == data


def _refuse_direct_io(monkeypatch) -> None:
    """A filesystem without direct I/O (some FUSE ones) refuses the flag with EINVAL (simulated)."""
    real = fcntl.fcntl

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(store_module.fcntl, "fcntl", refusing)


OFF = {"turned off": lambda monkeypatch: monkeypatch.setattr(store_module, "DIRECT_WRITE_BYTES", 0),
       "refused by the filesystem": _refuse_direct_io}


@pytest.mark.parametrize("off", OFF.values(), ids=OFF.keys())
def test_without_direct_io_a_big_file_goes_through_the_page_cache(tmp_path, monkeypatch, off):
    off(monkeypatch)
    writes = _spy_writes(monkeypatch)
    data = os.urandom(BIG + 77)
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/1", {"data.safetensors": data}, {"global_steps": 1})
    assert set(writes["data.safetensors"]) == {0}
    assert store.read_entry(f"{tmp_path}/run/1")[1]["data.safetensors"] == data


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EFAULT, errno.EOPNOTSUPP], ids=errno.errorcode.get)
def test_a_direct_write_refused_midway_finishes_through_the_page_cache(tmp_path, takes_direct_io, monkeypatch, code):
    """A device wanting a stricter alignment (EINVAL), or memory or a file direct I/O cannot take,
    refuses a direct write (simulated after the first chunk): the rest of the file is written
    through the cache, the flag taken off first."""
    real = os.write
    direct_writes = []

    def write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            direct_writes.append(len(data))
            if len(direct_writes) > 1:
                raise OSError(code, os.strerror(code))
        return real(fd, data)

    monkeypatch.setattr(store_module.os, "write", write)
    data = os.urandom(2 * store_module._DIRECT_STAGE_BYTES + 3)
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/1", {"data.safetensors": data}, {"global_steps": 1})
    assert len(direct_writes) == 2
    assert store.read_entry(f"{tmp_path}/run/1")[1]["data.safetensors"] == data


def test_a_full_disk_still_fails_the_entry(tmp_path, monkeypatch):
    """A full disk fails the direct write and then the page cache's: nothing is published."""
    real = os.write

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("data.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(store_module.os, "write", write)
    store = EntryStore(LocalBackend(str(tmp_path)))
    with pytest.raises(OSError) as err:
        store.write_entry(f"{tmp_path}/run/1", {"data.safetensors": os.urandom(BIG)}, {"global_steps": 1})
    assert err.value.errno == errno.ENOSPC
    assert not (tmp_path / "run" / "1").exists()
    assert list((tmp_path / "run").iterdir()) == []  # no temporary left behind


def test_a_memoryview_of_wide_items_is_written_and_listed_by_its_bytes(tmp_path, takes_direct_io, monkeypatch):
    """A memoryview of float32 items is as many bytes as it holds: written by bytes (its items
    number more than the threshold, so the direct path slices it), and listed so in meta.json."""
    import numpy as np

    values = np.arange(BIG + 3, dtype=np.float32)
    writes = _spy_writes(monkeypatch)
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/1", {"data.safetensors": memoryview(values)}, {"global_steps": 1})
    assert sum(writes["data.safetensors"]) == values.nbytes - values.nbytes % ALIGN
    meta, files = store.read_entry(f"{tmp_path}/run/1")
    assert files["data.safetensors"] == values.tobytes()
    assert meta["files"]["data.safetensors"]["bytes"] == values.nbytes


def _strided(size: int) -> memoryview:
    import numpy as np

    return memoryview(np.frombuffer(os.urandom(2 * size), dtype=np.uint8))[::2]


def _fortran(rows: int) -> memoryview:
    import numpy as np

    return memoryview(np.asfortranarray(np.frombuffer(os.urandom(rows * 16), dtype=np.int32).reshape(rows, 4)))


STRIDED = {"every other byte, big": lambda: _strided(BIG + 5), "every other byte, small": lambda: _strided(333),
           "fortran order, big": lambda: _fortran(BIG // 4 + 3)}


@pytest.mark.parametrize("source", STRIDED.values(), ids=STRIDED.keys())
def test_a_memoryview_that_is_not_one_run_of_bytes_is_written_in_c_order(tmp_path, source):
    """A strided or Fortran-ordered memoryview is stored as ``tobytes`` reads it, on a local disk and
    in an object store, its checksum and size those of the bytes written."""
    from fsspec.implementations.memory import MemoryFileSystem

    view = source()
    assert not view.c_contiguous
    expected = view.tobytes()
    stores = [(EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/1"),
              (EntryStore(FsspecBackend(MemoryFileSystem(), root=f"memory://strided-{os.getpid()}-{id(view)}")),
               f"memory://strided-{os.getpid()}-{id(view)}/run/1")]
    for store, path in stores:
        total = store.write_entry(path, {"data.safetensors": view}, {"global_steps": 1})
        meta, files = store.read_entry(path)
        assert files["data.safetensors"] == expected
        assert meta["files"]["data.safetensors"]["bytes"] == len(expected)
        assert total > len(expected)  # the data and its meta.json


CUTS = {"whole blocks": lambda size: max(ALIGN, size // 3 - size // 3 % ALIGN),
        "off the blocks": lambda size: max(1, size // 3 + 123)}


@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_short_writes_still_write_every_byte_once(tmp_path, takes_direct_io, monkeypatch, cut):
    """A write may take fewer bytes than it was given (a signal, a device limit): what it did not
    take is written next, whether the cut falls on a block boundary or not, for an aligned and an
    unaligned source."""
    real = os.write
    cuts = []

    def short(fd, data):
        view = memoryview(data).cast("B")
        size = min(len(view), cut(len(view)))
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if size % ALIGN:  # the device took part of a block: as if the flag were off for this one write
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
        try:
            taken = real(fd, view[:size])
        finally:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        cuts.append(taken < len(view))
        return taken

    monkeypatch.setattr(store_module.os, "write", short)
    store = EntryStore(LocalBackend(str(tmp_path)))
    for i, data in enumerate([os.urandom(2 * store_module._DIRECT_STAGE_BYTES + 4097), _aligned(BIG + 3 * ALIGN + 9)]):
        store.write_entry(f"{tmp_path}/run/{i}", {"data.safetensors": data}, {"global_steps": i})
        assert store.read_entry(f"{tmp_path}/run/{i}")[1]["data.safetensors"] == bytes(data)
    assert any(cuts)


def test_threads_writing_big_entries_at_once_each_use_their_own_staging_buffer(tmp_path, takes_direct_io):
    """Unaligned big files from several threads at once: each thread copies through its own buffer
    (``os.write`` lets the others run while one buffer is written out), so every file reads back as
    its own bytes."""
    import threading

    store = EntryStore(LocalBackend(str(tmp_path)))
    datas = [os.urandom(2 * store_module._DIRECT_STAGE_BYTES + 1 + i) for i in range(4)]
    start = threading.Barrier(len(datas))
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            start.wait()
            for round_ in range(3):
                store.write_entry(f"{tmp_path}/run/{i}-{round_}", {"data.safetensors": datas[i]}, {"global_steps": i})
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(datas))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, data in enumerate(datas):
        for round_ in range(3):
            assert store.read_entry(f"{tmp_path}/run/{i}-{round_}")[1]["data.safetensors"] == data


def test_a_forked_child_gets_its_own_staging_buffer(tmp_path):
    """The buffer unaligned data is copied through is private: a child's copy of it is not the parent's."""
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/0", {"data.safetensors": os.urandom(BIG + 1)}, {"global_steps": 0})
    stage = store_module._direct_stage.buffer
    before = bytes(stage[:16])
    pid = os.fork()
    if pid == 0:  # the child scribbles over its copy and leaves at once
        stage[:16] = b"\xff" * 16
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert bytes(stage[:16]) == before


@pytest.mark.parametrize(("text", "expected"), [("", 4 << 20), ("0", 0), ("1048576", 1 << 20), (" 42 ", 42),
                                                ("-5", 0), ("4MiB", 4 << 20)])
def test_the_threshold_comes_from_the_environment(monkeypatch, caplog, text, expected):
    monkeypatch.setenv("STEPSKIP_DIRECT_WRITE_BYTES", text)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        assert _direct_write_bytes() == expected
    assert ("not a number of bytes" in caplog.text) == (text == "4MiB")
