"""What a role does while its own dumps are still in flight, or could not be queued at all:
``repeat`` sees a queued dump as it would a written one, a damaged exact step is reported and
regenerated under ``repeat`` as under ``cache``, a dump the worker refused never strands a call, hits
in flight at once each keep the probe they took, and a forked child does not wait for its parent's
queue. Background writes are held by events, never by timing."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip._dumping.worker import DumpWorker
from stepskip._reading.reader import EntryReader

WAIT_S = 300  # a hang guard, reached only when the behaviour under test is broken
HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]


class Loop:
    def __init__(self) -> None:
        self.generated: list[int] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.generated.append(SkipManager.step)
        return Batch.from_dict(tensors={"x": torch.full((2, 2), float(SkipManager.step))},
                               non_tensors={"uid": ["p0", "p1"]})


PROMPTS = Batch.from_dict(non_tensors={"uid": ["p0", "p1"]})


def stats() -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in SkipManager.stats().items() if k.startswith("skip/rollout/")}


def hold_writes(monkeypatch) -> threading.Event:
    """Background writes of the rollout role wait for the returned event."""
    store = SkipManager.skip_instances["rollout"].store
    release = threading.Event()
    for name in ("write_entry", "write_entries"):
        original = getattr(store, name)

        def held(*args, _original=original, **kwargs):
            assert release.wait(WAIT_S), "the test never released the held write"
            return _original(*args, **kwargs)

        monkeypatch.setattr(store, name, held)
    return release


def test_repeat_replays_a_step_whose_background_dump_is_still_queued(tmp_path, monkeypatch):
    """Step 1's dump is held in the queue when step 2 is called: step 2 waits for it and replays it,
    as it would had the dump been synchronous, instead of generating again."""
    SkipManager.init(training_config(tmp_path, steps=[1, 2], action="repeat", async_dump=True))
    release = hold_writes(monkeypatch)
    loop = Loop()
    SkipManager.set_step(1)
    loop.generate_sequences(PROMPTS)
    assert not (run_path(tmp_path) / "1" / "meta.json").exists()  # still queued
    assert SkipManager.skip_instances["rollout"].listed_steps() == [1]
    role = SkipManager.skip_instances["rollout"]
    step_1 = role.step_dump_dir(1)
    original_wait = role.dumper.await_pending

    def wait_releasing(path):  # the held write goes on only once step 2 waits for step 1's dump
        if path == step_1:
            release.set()
        original_wait(path)

    monkeypatch.setattr(role.dumper, "await_pending", wait_releasing)
    SkipManager.set_step(2)
    out = loop.generate_sequences(PROMPTS)
    release.set()  # (already set when step 2 waited, as it should)
    assert SkipManager.flush(timeout=WAIT_S)
    assert loop.generated == [1]
    assert out.batch["x"].flatten().tolist() == [1.0] * 4
    assert stats()["hits"] == 1 and stats()["dumps"] == 1 and stats()["misses"] == 1


def test_repeat_reports_and_regenerates_a_damaged_exact_step(tmp_path, caplog):
    """A damaged entry at the step itself is counted and logged, then generated and overwritten, as
    under cache; repeat falls back to another step only for a step with no entry at all."""
    SkipManager.init(training_config(tmp_path, steps=[1, 2, 3], action="record"))
    loop = Loop()
    for step in (1, 2):
        SkipManager.set_step(step)
        loop.generate_sequences(PROMPTS)
    SkipManager.reset()
    meta = run_path(tmp_path) / "2" / "meta.json"
    meta.write_text(meta.read_text()[:20])  # truncated
    SkipManager.init(training_config(tmp_path, steps=[1, 2, 3], action="repeat"))
    loop = Loop()
    SkipManager.set_step(2)
    with caplog.at_level("WARNING", logger="stepskip"):
        out = loop.generate_sequences(PROMPTS)
    assert loop.generated == [2] and out.batch["x"][0, 0].item() == 2.0
    assert stats()["corrupt"] == 1 and stats()["misses"] == 1 and stats()["dumps"] == 1
    assert "corrupt entry for step 2" in caplog.text
    assert SkipManager.skip_instances["rollout"].available_steps() == [1, 2]  # overwritten whole
    SkipManager.set_step(3)  # no entry at all: the nearest earlier step, as before
    assert loop.generate_sequences(PROMPTS).batch["x"][0, 0].item() == 2.0 and loop.generated == [2]


def test_a_dump_the_worker_refuses_is_a_counted_failure_and_strands_no_call(tmp_path, monkeypatch):
    """The worker cannot take the dump (here: its thread cannot start): the call still returns its
    result, the failure is counted, and a later call at that step neither waits for the dump that
    never was nor fails; flush has nothing to wait for."""
    SkipManager.init(training_config(tmp_path, steps=[1], async_dump=True))
    original = DumpWorker.submit
    refused = []

    def refuse_once(self, job, nbytes=None, group=None):
        if not refused:
            refused.append(job)
            raise RuntimeError("can't start new thread")
        return original(self, job, nbytes, group)

    monkeypatch.setattr(DumpWorker, "submit", refuse_once)
    loop = Loop()
    SkipManager.set_step(1)
    assert loop.generate_sequences(PROMPTS).batch["x"][0, 0].item() == 1.0
    assert stats()["dump_failures"] == 1
    assert SkipManager.skip_instances["rollout"].dumper.pending == {}
    done = threading.Event()
    threading.Thread(target=lambda: (loop.generate_sequences(PROMPTS), done.set()), daemon=True).start()
    assert done.wait(WAIT_S), "a call at the refused step waits for a dump that was never queued"
    assert SkipManager.flush(timeout=WAIT_S)
    assert loop.generated == [1, 1] and stats()["dumps"] == 1


class AsyncRollouter:
    @SkipManager.annotate(role="async_rollout")
    async def generate_sequences_single(self, prompts):
        await asyncio.sleep(0)
        uids = list(prompts.non_tensor_batch["uid"])
        return Batch.from_dict(tensors={"x": torch.ones(1, 3)}, non_tensors={"uid": uids})


def test_hits_in_flight_at_once_each_read_with_the_probe_they_took(tmp_path, monkeypatch):
    """64 async hits at once: each read gets the probe its own precondition took (one slot on the
    instance lost all of them to each other)."""
    config = training_config(tmp_path, "async_rollout", gbs=1, n=1, steps=["0-63"])
    rollouter = AsyncRollouter()

    async def feed():
        await asyncio.gather(*(rollouter.generate_sequences_single(
            Batch.from_dict(tensors={"i": torch.zeros(1, 2)}, non_tensors={"uid": [f"uid_sample_0_{i}"]}))
            for i in range(64)))

    SkipManager.init(config)
    asyncio.run(feed())
    SkipManager.reset()
    taken = []
    original = EntryReader.take_probe

    def take(self, path):
        probe = original(self, path)
        taken.append(probe is not None)
        return probe

    monkeypatch.setattr(EntryReader, "take_probe", take)
    SkipManager.init(config)
    asyncio.run(feed())
    assert SkipManager.stats()["skip/async_rollout/hits"] == 64
    assert taken == [True] * 64


def test_a_child_forked_while_a_dump_is_queued_neither_waits_for_it_nor_hangs_at_exit(tmp_path):
    """The child inherits the parent's queue but not its thread: its probe of the queued step reads
    the disk and its exit does not wait for the parent's jobs (run in a fresh interpreter, as forking
    pytest would be)."""
    script = textwrap.dedent(f"""
        import os, sys, threading
        import torch
        sys.path.insert(0, {str(ROOT / "tests" / "support")!r})
        from skip_configs import training_config
        from stepskip import Batch, SkipManager

        SkipManager.init(training_config({str(tmp_path)!r}, steps=[1], async_dump=True))
        store = SkipManager.skip_instances["rollout"].store
        release = threading.Event()
        for name in ("write_entry", "write_entries"):
            original = getattr(store, name)
            setattr(store, name, lambda *a, _original=original, **k: (release.wait(), _original(*a, **k))[1])

        class Loop:
            @SkipManager.annotate(role="rollout")
            def generate_sequences(self, prompts):
                return Batch.from_dict(tensors={{"x": torch.ones(2, 2)}}, non_tensors={{"uid": ["a", "b"]}})

        SkipManager.set_step(1)
        Loop().generate_sequences(Batch.from_dict(non_tensors={{"uid": ["a", "b"]}}))
        pid = os.fork()
        if pid == 0:
            role = SkipManager.skip_instances["rollout"]
            print("child sees step 1:", role.resolve_load_step(1), flush=True)
            sys.exit(0)  # atexit hooks run: they must not wait for the parent's queue
        assert SkipManager.flush(timeout=0.01) is False  # the parent's dump is still held
        _, status = os.waitpid(pid, 0)
        release.set()
        assert SkipManager.flush(timeout=300)
        print("child status", status, flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "support")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "child sees step 1: -1" in done.stdout and "child status 0" in done.stdout, done.stdout


def test_flush_waits_for_a_submit_still_waiting_for_room():
    """A submit blocked for room in the queue is pending work: flush does not report done before it."""
    worker = DumpWorker(max_pending=0)  # nothing is admitted until the test makes room
    ran = threading.Event()
    submitter = threading.Thread(target=worker.submit, args=(ran.set,), daemon=True)
    submitter.start()
    with worker._cond:
        assert worker._cond.wait_for(lambda: worker.waiting == 1, timeout=WAIT_S)
    assert worker.flush(timeout=0.01) is False
    with worker._cond:
        worker._max_pending = 1
        worker._cond.notify_all()
    assert worker.flush(timeout=WAIT_S) and ran.is_set()
    submitter.join(WAIT_S)
