"""Small async dumps written by the helper processes (stepskip._dumping.helper), with real child processes.

The dump worker is held on an event while the dumps queue behind it, so the batch is fixed by the
test; the helpers are waited for (``wait_ready``) before anything is recorded, so every entry of
the batch goes to them, not to the worker's thread. No assertion depends on timing.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
import pytest
import torch
from async_samples import rollouter, sample_prompts
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip._dumping import helper as helpers_module
from stepskip._dumping.helper import (
    ENV,
    _pack_tensor,
    _unpack_tensor,
    close_default,
    default_helpers,
    write_with_helpers,
)
from stepskip._dumping.worker import default_worker
from stepskip._formats import get_format

WAIT_S = 120  # only reached when the behaviour under test is broken (a hang guard, not a timing)
COUNT = 16  # two shares of MIN_SHARE: both helpers take part


@pytest.fixture(scope="module", autouse=True)
def _no_helpers_after_this_module():
    """The helpers a test left running serve the next test of this module (starting them costs seconds
    a pair); none outlives the module."""
    close_default()
    yield
    close_default()


@pytest.fixture
def helpers(monkeypatch):
    """The process's helpers, on and ready: the ones an earlier test left ready, or fresh ones where it
    killed or closed them (or never started any)."""
    monkeypatch.setenv(ENV, "1")
    ready = default_helpers()
    if any(h.state == "broken" for h in ready):
        close_default()
        ready = default_helpers()
    assert all(h.wait_ready(WAIT_S) for h in ready), [h.state for h in ready]
    yield ready


def _held() -> threading.Event:
    release, running = threading.Event(), threading.Event()

    def blocker() -> None:
        running.set()
        assert release.wait(WAIT_S)

    default_worker().submit(blocker)
    assert running.wait(WAIT_S)
    return release


def _output(index: int) -> Batch:
    return Batch.from_dict(tensors={"responses": torch.arange(6).reshape(1, 6) + 100 * index,
                                    "mask": torch.tensor([[1, 1, 1, 0, 0, 0]]),
                                    "logp": torch.linspace(-1, 0, 6, dtype=torch.bfloat16).reshape(1, 6)},
                           non_tensors={"uid": [f"uid_sample_0_{index}"], "messages": [[{"role": "user",
                                                                                        "content": f"q{index}"}]]})


def _record(dump_dir, monkeypatch, **fields) -> list[int]:
    """Record COUNT entries as one batch; the sizes of the batches the worker's thread wrote itself."""
    here: list[int] = []
    write_small = helpers_module.write_small_entries

    def spied(store, codec, items):
        items = list(items)
        here.append(len(items))
        return write_small(store, codec, items)

    monkeypatch.setattr(helpers_module, "write_small_entries", spied)  # the parent's calls alone
    SkipManager.init(training_config(dump_dir, "async_rollout", gbs=1, n=1, steps="all", async_dump=True, **fields))
    release = _held()
    try:
        for i in range(COUNT):
            rollouter(_output)(sample_prompts(i))
    finally:
        release.set()
    assert SkipManager.flush(WAIT_S)
    return [n for n in here if n]


def _entry_files(dump_dir, step: int) -> dict[str, bytes]:
    entry = run_path(dump_dir, gbs=1, n=1) / str(step)
    return {p.name: p.read_bytes() for p in entry.iterdir()}


def test_the_helpers_write_the_entries_a_worker_thread_would_and_each_replays(tmp_path, monkeypatch, helpers):
    here = _record(tmp_path / "helper", monkeypatch)
    assert here == []  # every entry went to the helpers
    assert all(h.state == "ready" for h in helpers)
    stats = SkipManager.stats()
    assert stats["skip/async_rollout/dumps"] == COUNT and stats["skip/async_rollout/dump_failures"] == 0
    SkipManager.reset()
    monkeypatch.setenv(ENV, "0")
    assert _record(tmp_path / "thread", monkeypatch) == [COUNT]  # the same batch, on the worker's thread
    for step in range(COUNT):
        a, b = _entry_files(tmp_path / "helper", step), _entry_files(tmp_path / "thread", step)
        assert sorted(a) == sorted(b) == ["data.json", "data.safetensors", "meta.json"]
        assert a["data.json"] == b["data.json"] and a["data.safetensors"] == b["data.safetensors"]
        meta_a, meta_b = json.loads(a["meta.json"]), json.loads(b["meta.json"])
        assert meta_a["files"] == meta_b["files"] and meta_a["global_steps"] == step
    assert sorted(p.name for p in run_path(tmp_path / "helper", gbs=1, n=1).iterdir()) == \
        sorted(str(i) for i in range(COUNT))  # no temporaries left
    SkipManager.reset()
    SkipManager.init(training_config(tmp_path / "helper", "async_rollout", gbs=1, n=1, steps="all",
                                     action="replay"))
    for i in range(COUNT):
        got = rollouter(_output)(sample_prompts(i))
        want = _output(i)
        for key in ("responses", "mask", "logp"):
            assert torch.equal(got.batch[key], want.batch[key])
        assert got.non_tensor_batch["messages"].tolist() == want.non_tensor_batch["messages"].tolist()


def test_an_entry_the_helper_cannot_write_fails_alone(tmp_path, helpers):
    """An entry whose directory cannot be made (a file stands where it goes) fails in the helper's
    store: that entry's error comes back (its type kept), the others are written."""
    codec = get_format("safe", compress="auto")
    root = tmp_path / "root"
    root.mkdir()
    items = [(str(root / "run" / str(i)), codec.freeze(_output(i), copy=True), {"global_steps": i})
             for i in range(16)]
    (root / "a-file").write_bytes(b"not a directory")
    items[5] = (str(root / "a-file" / "5"), items[5][1], items[5][2])
    results = write_with_helpers(str(root), "safe", "auto", items)
    assert all(isinstance(r, int) and r > 0 for i, r in enumerate(results) if i != 5)
    assert isinstance(results[5], OSError) and (root / "a-file").read_bytes() == b"not a directory"
    assert sorted(p.name for p in (root / "run").iterdir()) == sorted(str(i) for i in range(16) if i != 5)


def test_an_entry_that_cannot_be_sent_is_left_to_the_caller(tmp_path, helpers):
    """A snapshot that does not pickle (a stand-in: a lambda put into its tree) comes back as None,
    for the caller to write itself; the rest of the batch is written by the helpers."""
    codec = get_format("safe", compress="auto")
    root = tmp_path / "root"
    items = [(str(root / "run" / str(i)), codec.freeze(_output(i), copy=True), {"global_steps": i})
             for i in range(16)]
    items[3][1].tree["unpicklable"] = lambda: None
    results = write_with_helpers(str(root), "safe", "auto", items)
    assert results[3] is None
    assert all(isinstance(r, int) and r > 0 for i, r in enumerate(results) if i != 3)
    assert sorted(p.name for p in (root / "run").iterdir()) == sorted(str(i) for i in range(16) if i != 3)
    assert all(h.state == "ready" for h in helpers)  # the stream stayed in step


def test_killed_helpers_cost_no_entry(tmp_path, monkeypatch, helpers, caplog):
    for helper in helpers:
        os.kill(helper.pid, signal.SIGKILL)
        helper._proc.wait(WAIT_S)
    here = _record(tmp_path, monkeypatch)
    assert sum(here) == COUNT  # written by the worker's thread instead
    assert all(h.state == "broken" for h in helpers)
    assert "not used any more" in caplog.text
    stats = SkipManager.stats()
    assert stats["skip/async_rollout/dumps"] == COUNT and stats["skip/async_rollout/dump_failures"] == 0
    assert sorted(p.name for p in run_path(tmp_path, gbs=1, n=1).iterdir()) == sorted(str(i) for i in range(COUNT))


def test_helpers_still_starting_leave_the_batch_to_the_worker_thread(tmp_path, monkeypatch):
    """Until a helper reports ready (held here: its ready message is never read), batches are written
    on the worker's thread; closing kills a helper that is still starting."""
    close_default()
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(helpers_module.DumpHelper, "_poll_ready", lambda self, timeout: None)
    assert _record(tmp_path, monkeypatch) == [COUNT]
    started = default_helpers()
    assert all(h.state == "starting" for h in started)
    procs = [h._proc for h in started]
    close_default()
    assert all(p.wait(WAIT_S) == -signal.SIGKILL for p in procs)
    assert SkipManager.stats()["skip/async_rollout/dumps"] == COUNT


def test_the_helpers_are_off_by_environment_or_by_config(tmp_path, monkeypatch):
    close_default()
    monkeypatch.setenv(ENV, "0")
    assert _record(tmp_path / "env", monkeypatch) == [COUNT]
    assert all(h.state == "new" for h in default_helpers())  # never started
    SkipManager.reset()
    monkeypatch.setenv(ENV, "1")
    assert _record(tmp_path / "config", monkeypatch, dump_process=False) == [COUNT]
    assert all(h.state == "new" for h in default_helpers())
    close_default()


def test_a_config_that_is_not_a_bool_is_refused(tmp_path):
    from stepskip.errors import SkipConfigError

    with pytest.raises(SkipConfigError, match="dump_process"):
        SkipManager.init(training_config(tmp_path, "async_rollout", dump_process="yes"))


def test_a_closed_helper_exits(helpers):
    procs = [h._proc for h in helpers]
    close_default()
    assert [p.wait(WAIT_S) for p in procs] == [0] * len(procs)


@pytest.mark.parametrize("tensor", [
    torch.arange(12, dtype=torch.int64).reshape(3, 4),
    torch.linspace(-2, 2, 10, dtype=torch.bfloat16),  # no numpy dtype: raw bytes
    torch.arange(20, dtype=torch.float32).reshape(4, 5)[:, 1:3],  # not contiguous
    torch.zeros(0, 7, dtype=torch.int32),
    torch.tensor(3.5, dtype=torch.float64),
    torch.tensor([True, False]),
])
def test_a_tensor_travels_bit_exactly(tensor):
    buffers: list = []
    spec = _pack_tensor(tensor, buffers)
    back = _unpack_tensor(spec, [bytearray(memoryview(b).tobytes()) for b in buffers])
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert np.array_equal(back.reshape(-1).view(torch.uint8).numpy() if back.numel() else np.array([]),
                          tensor.contiguous().reshape(-1).view(torch.uint8).numpy() if tensor.numel() else np.array([]))
