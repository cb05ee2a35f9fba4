"""A call at a step whose background dump is still queued replays it instead of generating again."""

from __future__ import annotations

import threading

import torch

from stepskip import Batch, SkipManager
from stepskip.roles.rollout import RolloutSkip


class Loop:
    def __init__(self):
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict(tensors={"x": torch.full((2, 3), float(self.calls))})


def test_second_call_waits_for_the_queued_dump_and_replays_it(tmp_path, monkeypatch):
    release = threading.Event()
    original = RolloutSkip._write

    def held_write(self, *args):
        release.wait(10)  # the background worker is still busy with the first dump
        return original(self, *args)

    monkeypatch.setattr(RolloutSkip, "_write", held_write)
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(tmp_path)}}})
    SkipManager.set_step(1)
    loop = Loop()
    first = loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    threading.Timer(0.2, release.set).start()
    second = loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    assert loop.calls == 1
    assert torch.equal(first.batch["x"], second.batch["x"])
    stats = SkipManager.stats()
    assert (stats["skip/rollout/hits"], stats["skip/rollout/dumps"]) == (1, 1)


def test_a_failed_queued_dump_lets_the_next_call_generate(tmp_path, monkeypatch):
    def failing_write(self, path, step, frozen, meta):
        self.stats.add(dump_failures=1)

    monkeypatch.setattr(RolloutSkip, "_write", failing_write)
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(tmp_path)}}})
    SkipManager.set_step(1)
    loop = Loop()
    loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    assert loop.calls == 2 and SkipManager.stats()["skip/rollout/dump_failures"] == 2
