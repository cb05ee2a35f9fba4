"""Small background dumps committed in batches: the worker's groups, and the async role's entries.

The worker is held on an event the test controls while dumps queue up behind it, so which dumps
form a batch is fixed by the test, not by thread timing.
"""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np
import torch
from async_samples import rollouter, sample_prompts
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip._dumping.worker import DumpWorker, default_worker

WAIT_S = 60  # only reached when the behaviour under test is broken (a hang guard, not a timing)


def _held(worker: DumpWorker) -> threading.Event:
    """Occupy ``worker`` with a job that waits for the returned event."""
    release, running = threading.Event(), threading.Event()

    def blocker() -> None:
        running.set()
        assert release.wait(WAIT_S), "the test never released the worker"

    worker.submit(blocker)
    assert running.wait(WAIT_S)
    return release


def test_consecutive_jobs_of_a_group_run_as_one_batch_in_order():
    worker, batches, ran = DumpWorker(max_pending=8), [], []
    release = _held(worker)

    def group(jobs):
        batches.append(list(jobs))
        for job in jobs:
            job()

    jobs = [lambda i=i: ran.append(i) for i in range(5)]
    for job in jobs[:3]:
        worker.submit(job, nbytes=10, group=group)
    worker.submit(jobs[3])  # no group: ends the batch and runs alone
    worker.submit(jobs[4], nbytes=10, group=group)
    release.set()
    assert worker.flush(WAIT_S)
    assert ran == [0, 1, 2, 3, 4]
    assert batches == [jobs[:3]]  # the last one was alone after the ungrouped job: run as job()
    assert worker.pending == 0


def test_small_jobs_queue_beyond_the_job_bound_within_the_budget():
    worker = DumpWorker(max_pending=1, small_budget=100)
    release = _held(worker)
    for _ in range(4):  # 4 x 25 bytes: within the budget, so none of these blocks
        worker.submit(lambda: None, nbytes=25)
    blocked = threading.Event()
    submitted = threading.Event()

    def over_budget() -> None:
        blocked.set()
        worker.submit(lambda: None, nbytes=25)
        submitted.set()

    thread = threading.Thread(target=over_budget)
    thread.start()
    assert blocked.wait(WAIT_S)
    _waiting(worker, 1)  # the sixth is inside submit, waiting (budget spent, queue not empty)
    assert worker.pending == 5 and not submitted.is_set()
    release.set()
    thread.join(WAIT_S)
    assert submitted.is_set() and worker.flush(WAIT_S)


def test_a_failing_group_keeps_the_worker_alive():
    worker, ran = DumpWorker(max_pending=8), []
    release = _held(worker)

    def broken(jobs):
        raise RuntimeError("boom")

    worker.submit(lambda: None, nbytes=1, group=broken)
    worker.submit(lambda: None, nbytes=1, group=broken)
    worker.submit(lambda: ran.append(1))
    release.set()
    assert worker.flush(WAIT_S) and ran == [1]


def _output(index: int) -> Batch:
    return Batch.from_dict(tensors={"responses": torch.arange(6).reshape(1, 6) + 100 * index,
                                    "mask": torch.tensor([[1, 1, 1, 0, 0, 0]])},
                           non_tensors={"uid": [f"uid_sample_0_{index}"], "feed": [index]})


def _config(tmp_path, **fields):
    return training_config(tmp_path, "async_rollout", gbs=1, n=1, steps="all", async_dump=True, **fields)


def _record(tmp_path, count: int, monkeypatch, fail: int | None = None, broken_after: int | None = None):
    SkipManager.init(_config(tmp_path))
    skip = SkipManager.skip_instances["async_rollout"]
    store, batches = skip.store, []
    original = store.write_entries

    def spied(entries):
        if broken_after is not None:  # the store publishes the first entries, then fails as a whole
            taken = list(itertools.islice(entries, broken_after))
            batches.append([path for path, _, _ in taken])
            original(taken)
            raise RuntimeError("the store failed mid-batch")
        entries = list(entries)
        batches.append([path for path, _, _ in entries])
        return original(entries)

    monkeypatch.setattr(store, "write_entries", spied)
    if fail is not None:  # one entry's encoding fails (a stand-in for a value the format refuses late)
        fmt = skip.format
        encode = fmt.encode

        def failing(frozen):
            files = encode(frozen)
            feed = json.loads(files["data.json"])["root"]["non_tensor_batch"].get("feed", {}).get("v")
            if feed == [fail]:
                raise ValueError(f"cannot encode sample {fail}")
            return files

        monkeypatch.setattr(fmt, "encode", failing)
    release = _held(default_worker())  # every dump below queues behind the held worker
    generate = rollouter(_output)
    try:
        for i in range(count):
            generate(sample_prompts(i))
    finally:
        release.set()
    assert SkipManager.flush(WAIT_S)
    return skip, batches


def test_queued_small_dumps_are_written_as_one_batch_and_each_replays(tmp_path, monkeypatch):
    count = 12
    skip, batches = _record(tmp_path, count, monkeypatch)
    assert [len(b) for b in batches] == [count]  # one batch, every entry in it
    stats = SkipManager.stats()
    assert stats["skip/async_rollout/dumps"] == count and stats["skip/async_rollout/dump_failures"] == 0
    run = run_path(tmp_path, gbs=1, n=1)
    assert sorted(p.name for p in run.iterdir()) == sorted(str(i) for i in range(count))  # no temporaries
    SkipManager.reset()
    SkipManager.init(_config(tmp_path, action="replay"))
    generate = rollouter(_output)
    for i in range(count):
        got = generate(sample_prompts(i))
        assert torch.equal(got.batch["responses"], _output(i).batch["responses"])
        assert got.non_tensor_batch["feed"].tolist() == [i]
    assert SkipManager.stats()["skip/async_rollout/hits"] == count


def test_a_failure_in_a_batch_is_counted_alone(tmp_path, monkeypatch):
    skip, batches = _record(tmp_path, 6, monkeypatch, fail=3)
    stats = SkipManager.stats()
    assert stats["skip/async_rollout/dumps"] == 5 and stats["skip/async_rollout/dump_failures"] == 1
    assert len(batches) == 1 and len(batches[0]) == 5  # the failed one never reached the store
    run = run_path(tmp_path, gbs=1, n=1)
    assert sorted(p.name for p in run.iterdir()) == ["0", "1", "2", "4", "5"]
    assert not skip.dumper.pending  # every queued dump was finished, the failed one too
    assert np.array_equal(skip.load_entry(4)[0].batch["responses"].numpy(), _output(4).batch["responses"].numpy())


def test_a_batch_that_fails_as_a_whole_counts_each_dump_once(tmp_path, monkeypatch):
    """The store reports failures per entry; should it still raise, no dump is counted twice or lost
    from the counters (all count as failed: what it published stays, whole, on disk)."""
    skip, batches = _record(tmp_path, 5, monkeypatch, broken_after=2)
    stats = SkipManager.stats()
    assert len(batches) == 1 and len(batches[0]) == 2
    assert stats["skip/async_rollout/dumps"] == 0 and stats["skip/async_rollout/dump_failures"] == 5
    assert sorted(p.name for p in run_path(tmp_path, gbs=1, n=1).iterdir()) == ["0", "1"]
    assert not skip.dumper.pending


def test_an_unexpected_error_publishing_one_entry_costs_that_entry_alone(tmp_path, monkeypatch):
    from stepskip._storage import EntryStore, LocalBackend, _localfs

    store = EntryStore(LocalBackend(str(tmp_path)))
    publish = _localfs.publish_rename

    def failing(parent_fd, tmp, name, path, overwrite):
        if name == "1":
            raise RuntimeError("not an OSError")
        return publish(parent_fd, tmp, name, path, overwrite)

    monkeypatch.setattr(_localfs, "publish_rename", failing)
    results = store.write_entries([(f"{tmp_path}/run/{i}", {"data.json": b"{}"}, {"global_steps": i})
                                   for i in range(3)])
    assert isinstance(results[1], RuntimeError) and all(isinstance(results[i], int) for i in (0, 2))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["0", "2"]  # nothing partial of 1


def test_the_non_tensor_part_of_a_snapshot_counts_toward_its_small_size():
    """Text, message lists and numpy images ride in the snapshot tree, not its tensors: they are
    sized too, so 1024 queued one-sample snapshots cannot hold gigabytes beyond the budget."""
    from stepskip._formats.safe import SafeFormat
    from stepskip._dumping.dumper import SMALL_DUMP_BYTES, small_size as _small_size

    fmt = SafeFormat()

    def size(**non_tensors):
        value = Batch.from_dict(tensors={"x": torch.ones(1, 4)}, non_tensors=non_tensors)
        return _small_size(fmt.freeze(value, copy=True))

    tiny = size(uid=["a"])
    assert tiny is not None and tiny < 8192
    text = size(uid=["a"], response=["x" * 200_000])
    assert text is not None and text >= 200_000 + 16
    assert size(uid=["a"], response=["x" * SMALL_DUMP_BYTES]) is None
    messages = [[{"role": "user", "content": "y" * 100_000} for _ in range(12)]]
    assert size(uid=["a"], messages=messages) is None  # 1.2 MB of message text
    images = [{"pixels": np.zeros((1024, 1024, 3), dtype=np.uint8)}]
    assert size(uid=["a"], images=images) is None  # a 3 MB image array inside a dict
    many = [list(range(10_000))]
    assert size(uid=["a"], ids=many) is None  # too many objects to size cheaply: a large dump


def _waiting(worker: DumpWorker, count: int) -> None:
    with worker._cond:
        assert worker._cond.wait_for(lambda: worker.waiting == count, timeout=WAIT_S)


def test_small_jobs_do_not_overtake_a_waiting_large_job():
    worker, ran = DumpWorker(max_pending=2), []
    release = _held(worker)
    for name in ("small-1", "small-2"):
        worker.submit(lambda name=name: ran.append(name), nbytes=10)  # the job bound is reached
    large = threading.Thread(target=worker.submit, args=(lambda: ran.append("large"),))
    large.start()
    _waiting(worker, 1)  # the large job waits for the job bound
    late = threading.Thread(target=worker.submit, args=(lambda: ran.append("small-3"),), kwargs={"nbytes": 10})
    late.start()
    _waiting(worker, 2)  # within the small budget, yet behind the large job
    assert worker.pending == 3  # the held job and the two small ones
    release.set()
    large.join(WAIT_S)
    late.join(WAIT_S)
    assert worker.flush(WAIT_S)
    assert ran == ["small-1", "small-2", "large", "small-3"]


def test_plain_values_held_by_the_tree_count_toward_the_small_size_too():
    """A string the snapshot keeps as itself (not copied: immutable) is sized with the snapshots."""
    from tensordict import NonTensorData, TensorDict

    from stepskip._formats.safe import SafeFormat
    from stepskip._dumping.dumper import SMALL_DUMP_BYTES, small_size as _small_size

    fmt = SafeFormat()
    td = TensorDict({"x": torch.ones(1, 4)}, batch_size=[1])
    td.set("note", NonTensorData(data="z" * 300_000, batch_size=[1]))
    frozen = fmt.freeze(td, copy=True)
    assert frozen.leaves and any(leaf == "z" * 300_000 for leaf in frozen.leaves if isinstance(leaf, str))
    size = _small_size(frozen)
    assert size is not None and size >= 300_000
    td.set("note", NonTensorData(data="z" * SMALL_DUMP_BYTES, batch_size=[1]))
    assert _small_size(fmt.freeze(td, copy=True)) is None
    fmt.encode(frozen)
    assert frozen.leaves is None  # encoded: the snapshots are no longer held twice
