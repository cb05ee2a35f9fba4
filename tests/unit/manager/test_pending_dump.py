"""A call at a step whose background dump is still queued replays it instead of generating again.

The background write is held on an event the test controls, so the order of the two calls and
the dump is fixed: no timer or sleep decides whether the second call found the dump pending.
"""

from __future__ import annotations

import threading

import torch

from stepskip import Batch, SkipManager
from stepskip._dumping.dumper import Dumper

WAIT_S = 300  # only reached when the behaviour under test is broken (a hang guard, not a timing)


class Loop:
    def __init__(self):
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict(tensors={"x": torch.full((2, 3), float(self.calls))})


def _prompts() -> Batch:
    return Batch.from_dict(non_tensors={"uid": ["a", "b"]})


def test_second_call_waits_for_the_queued_dump_and_replays_it(tmp_path, monkeypatch):
    release = threading.Event()  # set by the test: the background write may go on
    waiting = threading.Event()  # set when the second call is waiting for the pending dump
    original_write, original_await = Dumper.write, Dumper.await_pending

    def held_write(self, *args):
        assert release.wait(WAIT_S), "the test never released the background write"
        return original_write(self, *args)

    def observed_await(self, path):
        if self.pending.get(path) is not None:
            waiting.set()
        return original_await(self, path)

    monkeypatch.setattr(Dumper, "write", held_write)
    monkeypatch.setattr(Dumper, "await_pending", observed_await)
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(tmp_path)}}})
    SkipManager.set_step(1)
    loop = Loop()
    first = loop.generate_sequences(_prompts())
    outcome: dict = {}

    def second_call():
        try:
            outcome["value"] = loop.generate_sequences(_prompts())
        except BaseException as err:  # noqa: BLE001 - reported by the test
            outcome["error"] = err

    caller = threading.Thread(target=second_call)
    caller.start()
    try:
        assert waiting.wait(WAIT_S), "the second call did not wait for the queued dump of its step"
        # the first dump is still held: nothing is on disk, nothing generated a second time
        assert SkipManager.stats()["skip/rollout/dumps"] == 0 and loop.calls == 1
    finally:
        release.set()
        caller.join(WAIT_S)
    assert not caller.is_alive() and "error" not in outcome, outcome
    assert SkipManager.flush(timeout=WAIT_S)
    assert loop.calls == 1
    assert torch.equal(first.batch["x"], outcome["value"].batch["x"])
    stats = SkipManager.stats()
    assert (stats["skip/rollout/hits"], stats["skip/rollout/dumps"]) == (1, 1)


def test_a_failed_queued_dump_lets_the_next_call_generate(tmp_path, monkeypatch):
    def failing_write(self, path, step, frozen, meta):
        self.owner.stats.add(dump_failures=1)

    monkeypatch.setattr(Dumper, "write", failing_write)
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(tmp_path)}}})
    SkipManager.set_step(1)
    loop = Loop()
    loop.generate_sequences(_prompts())
    loop.generate_sequences(_prompts())
    assert SkipManager.flush(timeout=WAIT_S)  # the second call's dump runs in the background too
    assert loop.calls == 2 and SkipManager.stats()["skip/rollout/dump_failures"] == 2
