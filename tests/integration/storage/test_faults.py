"""A full disk and several writer processes: training goes on, nothing partial, one complete entry."""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess
import uuid

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.registry import register_implementation

from stepskip import Batch, SkipManager
from stepskip._storage import EntryState, EntryStore, LocalBackend, open_store

pytestmark = pytest.mark.heavy


class Loop:
    def __init__(self, rows: int):
        self.rows, self.calls = rows, 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict(tensors={"responses": torch.randn(self.rows, 256)},
                               non_tensors={"uid": prompts.non_tensor_batch["uid"]})


def run_steps(dump_dir: str, rows: int, steps=(1, 2), **skip) -> tuple[Loop, list[Batch]]:
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": list(steps), "dump_dir": dump_dir, **skip}}})
    loop, outs = Loop(rows), []
    for step in steps:
        SkipManager.set_step(step)
        outs.append(loop.generate_sequences(Batch.from_dict(non_tensors={"uid": [str(i) for i in range(rows)]})))
    SkipManager.flush()
    return loop, outs


def all_files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the fsspec fault test covers the same path")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("async_dump", [True, False])
def test_full_disk_keeps_training_and_leaves_nothing_partial(small_tmpfs, async_dump, caplog):
    loop, outs = run_steps(small_tmpfs, rows=1024, async_dump=async_dump)  # ~1 MiB per entry > 512 KiB
    assert loop.calls == 2 and all(o.batch["responses"].shape == (1024, 256) for o in outs)
    stats = SkipManager.stats()
    assert stats["skip/rollout/dump_failures"] == 2 and stats["skip/rollout/dumps"] == 0
    assert "No space left" in caplog.text or "ENOSPC" in caplog.text or "Errno 28" in caplog.text
    assert all_files(small_tmpfs) == []  # no data file, no temp dir content, no meta.json
    assert [d for _, dirs, _ in os.walk(small_tmpfs) for d in dirs if d.startswith(".tmp")] == []
    SkipManager.reset()
    small, _ = run_steps(small_tmpfs, rows=16, async_dump=async_dump)  # space is back: small entries fit
    assert small.calls == 2 and SkipManager.stats()["skip/rollout/dumps"] == 2


class QuotaMemoryFileSystem(MemoryFileSystem):
    """memory:// that refuses writes once a byte quota is used up, like a full bucket or disk."""

    protocol = "quotamem"
    quota = 200_000

    def pipe_file(self, path, value, *args, **kwargs):
        used = sum(len(f.getvalue()) for f in self.store.values() if hasattr(f, "getvalue"))
        if used + len(value) > self.quota:
            raise OSError(errno.ENOSPC, "No space left on device (quota)", path)
        return super().pipe_file(path, value, *args, **kwargs)


def test_full_object_store_keeps_training_and_leaves_nothing_named():
    register_implementation("quotamem", QuotaMemoryFileSystem, clobber=True)
    root = f"quotamem://bucket-{uuid.uuid4().hex[:8]}/dump"
    loop, _ = run_steps(root, rows=512)  # ~0.5 MiB per entry > quota
    assert loop.calls == 2 and SkipManager.stats()["skip/rollout/dump_failures"] == 2
    role = SkipManager.skip_instances["rollout"]
    assert role.available_steps() == []
    for step in (1, 2):
        assert role.store.probe(role.step_dump_dir(step)).state is EntryState.MISSING
        assert role.store.list_dir(role.step_dump_dir(step)) == []  # the failed writer cleaned up


def _write_same_entry(path: str, writer: int, start) -> None:
    start.wait()
    data = {"data.safetensors": bytes([writer]) * 200_000, "data.json": f'{{"writer": {writer}}}'.encode()}
    EntryStore(LocalBackend()).write_entry(path, data, {"global_steps": 1, "writer": writer})


def test_processes_writing_one_entry_leave_exactly_one_complete_entry(tmp_path):
    context = multiprocessing.get_context("fork")
    for round_ in range(5):
        path = str(tmp_path / f"round{round_}" / "1")
        start = context.Event()
        procs = [context.Process(target=_write_same_entry, args=(path, w, start)) for w in range(1, 6)]
        for p in procs:
            p.start()
        start.set()
        for p in procs:
            p.join(300)
        assert [p.exitcode for p in procs] == [0] * 5
        store = EntryStore(LocalBackend())
        probe = store.probe(path)
        assert probe.state is EntryState.PRESENT
        writer = probe.meta["writer"]
        data = store.read_files(path, probe.meta, ["data.safetensors", "data.json"], verify=True)
        assert data["data.safetensors"] == bytes([writer]) * 200_000
        assert sorted(os.listdir(os.path.dirname(path))) == ["1"]  # no temporaries or trash left


def test_open_store_rejects_an_unknown_protocol():
    from stepskip import SkipConfigError

    with pytest.raises(SkipConfigError, match="nosuch://"):
        open_store("nosuch://bucket/x")
