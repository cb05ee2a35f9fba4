"""``SkipManager.annotate`` on coroutine functions: record/replay, event-loop friendliness, async_rollout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import AsyncRolloutSkip, Batch, SkipManager, parse_async_rollout_sample_step


def make_config(dump_dir, role: str = "rollout", **fields) -> dict:
    return training_config(dump_dir, role, gbs=1, n=1, **fields)


def step_dir(dump_dir, step: int) -> Path:
    return run_path(dump_dir, gbs=1, n=1) / str(step)


def make_prompts(uids) -> Batch:
    rows = len(uids)
    return Batch.from_dict(tensors={"input_ids": torch.arange(rows * 8).reshape(rows, 8)},
                           non_tensors={"uid": list(uids)})


def make_output(key: int, uids) -> Batch:
    """Deterministic output whose every column encodes ``key`` (the step or the feed index)."""
    rows = len(uids)
    gen = torch.Generator().manual_seed(key)
    return Batch.from_dict(
        tensors={"responses": torch.arange(rows * 6).reshape(rows, 6) + 1000 * key,
                 "log_probs": torch.randn(rows, 6, generator=gen),
                 "key": torch.full((rows,), key)},
        non_tensors={"uid": list(uids), "feed": [key] * rows, "info": [{"key": key, "i": i} for i in range(rows)]},
        meta_info={"key": key},
    )


def assert_batch_equal(actual, expected) -> None:
    assert isinstance(actual, Batch), type(actual)
    assert sorted(actual.batch.keys()) == sorted(expected.batch.keys())
    for key in expected.batch.keys():
        assert actual.batch[key].dtype == expected.batch[key].dtype, key
        assert torch.equal(actual.batch[key], expected.batch[key]), key
    assert sorted(actual.non_tensor_batch) == sorted(expected.non_tensor_batch)
    for key, e in expected.non_tensor_batch.items():
        a = actual.non_tensor_batch[key]
        assert isinstance(a, np.ndarray) and a.dtype == e.dtype and a.tolist() == e.tolist(), key
    assert actual.meta_info == expected.meta_info


def stat(name: str, role: str = "rollout") -> float:
    return SkipManager.stats()[f"skip/{role}/{name}"]


class AsyncLoop:
    """An async ``generate_sequences`` under the ``rollout`` role (step from set_step)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    @SkipManager.annotate(role="rollout")
    async def generate_sequences(self, prompts):
        step = SkipManager.step
        self.calls.append(step)
        await asyncio.sleep(0)
        return make_output(step, list(prompts.non_tensor_batch["uid"]))


class Rollouter:
    """Stands for verl's FullyAsyncAgentLoopManager: one streamed sample per call."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self._rng = random.Random(0)

    @SkipManager.annotate(role="async_rollout")
    async def generate_sequences_single(self, prompts):
        uid = str(prompts.non_tensor_batch["uid"][0])
        index = int(uid.rsplit("_", 1)[1])
        self.calls.append(index)
        for _ in range(self._rng.randrange(8)):  # completion order differs from feed order (no clock involved)
            await asyncio.sleep(0)
        return make_output(index, [uid])


# --------------------------------------------------------------------------- record / replay


@pytest.mark.parametrize("async_dump", [False, True])
async def test_async_record_then_replay(tmp_path, async_dump):
    cfg = make_config(tmp_path, steps=[1, 2, 3], async_dump=async_dump)
    prompts = make_prompts(["a"])

    SkipManager.init(cfg)
    loop = AsyncLoop()
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        assert_batch_equal(await loop.generate_sequences(prompts), make_output(step, ["a"]))
    assert loop.calls == [1, 2, 3]
    assert SkipManager.flush(timeout=300)
    for step in (1, 2, 3):
        assert json.loads((step_dir(tmp_path, step) / "meta.json").read_text())["global_steps"] == step

    shutil.rmtree(step_dir(tmp_path, 2))

    SkipManager.init(cfg)
    loop = AsyncLoop()
    for step in (1, 2, 3, 4):
        SkipManager.set_step(step)
        assert_batch_equal(await loop.generate_sequences(prompts), make_output(step, ["a"]))
    assert loop.calls == [2, 4]  # 2 was missing, 4 is not a listed step
    assert stat("hits") == 2 and stat("misses") == 1
    assert SkipManager.flush(timeout=300)
    assert (step_dir(tmp_path, 2) / "meta.json").is_file()
    assert not step_dir(tmp_path, 4).exists()


async def test_async_validation_call_runs_and_dumps_nothing(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1]))
    loop = AsyncLoop()
    prompts = make_prompts(["a"])
    prompts.meta_info["validate"] = True
    SkipManager.set_step(1)
    await loop.generate_sequences(prompts)
    await loop.generate_sequences(prompts=prompts)
    assert loop.calls == [1, 1]
    assert not step_dir(tmp_path, 1).exists()


@pytest.mark.parametrize("async_dump", [False, True])
async def test_async_saved_seconds_from_recorded_generation_time(tmp_path, async_dump):
    cfg = make_config(tmp_path, steps=[1], async_dump=async_dump)

    inside: list[float] = []  # how long the function itself ran, as seen from inside it

    class TimedLoop(AsyncLoop):
        @SkipManager.annotate(role="rollout")
        async def generate_sequences(self, prompts):
            start = time.perf_counter()
            self.calls.append(SkipManager.step)
            await asyncio.sleep(0)
            out = make_output(SkipManager.step, list(prompts.non_tensor_batch["uid"]))
            inside.append(time.perf_counter() - start)
            return out

    SkipManager.init(cfg)
    SkipManager.set_step(1)
    await TimedLoop().generate_sequences(make_prompts(["a"]))
    assert SkipManager.flush(timeout=300)
    recorded = json.loads((step_dir(tmp_path, 1) / "meta.json").read_text())["generation_seconds"]
    # the wrapper's measurement encloses the function's own: no threshold that a loaded machine could miss
    assert len(inside) == 1 and recorded >= inside[0] > 0

    SkipManager.init(cfg)
    loop = TimedLoop()
    SkipManager.set_step(1)
    await loop.generate_sequences(make_prompts(["a"]))
    assert loop.calls == [] and len(inside) == 1
    assert stat("saved_seconds") == pytest.approx(recorded)


# --------------------------------------------------------------------------- the event loop keeps running


WAIT_S = 60  # only reached when the event loop is blocked (a hang guard, not a timing)


async def _other_task() -> str:
    for _ in range(3):
        await asyncio.sleep(0)
    return "ran"


def _hold_until_loop_runs_a_task(monkeypatch, method: str) -> dict[str, object]:
    """Make the rollout store's ``method`` first run another coroutine to completion on the event loop.

    That coroutine can only finish while ``method`` is in progress if the storage call runs off
    the loop thread *and* the loop is free meanwhile (not blocked waiting for it). Returns what the
    held call saw: ``{"off_loop": bool, "other_task": "ran" | "blocked"}``.
    """
    store = SkipManager.skip_instances["rollout"].store
    original = getattr(store, method)
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    seen: dict[str, object] = {}

    def held(*args, **kwargs):
        seen["off_loop"] = threading.get_ident() != loop_thread
        if seen["off_loop"]:  # on the loop thread the task could never run: do not wait for it
            try:
                seen["other_task"] = asyncio.run_coroutine_threadsafe(_other_task(), loop).result(WAIT_S)
            except concurrent.futures.TimeoutError:
                seen["other_task"] = "blocked"
        return original(*args, **kwargs)

    monkeypatch.setattr(store, method, held)
    return seen


async def test_load_does_not_block_event_loop(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, steps=[1])
    SkipManager.init(cfg)
    SkipManager.set_step(1)
    await AsyncLoop().generate_sequences(make_prompts(["a"]))

    SkipManager.init(cfg)
    seen = _hold_until_loop_runs_a_task(monkeypatch, "read_entry")
    loop = AsyncLoop()
    SkipManager.set_step(1)
    result = await loop.generate_sequences(make_prompts(["a"]))
    assert loop.calls == []
    assert_batch_equal(result, make_output(1, ["a"]))
    assert seen == {"off_loop": True, "other_task": "ran"}, "the event loop was blocked while loading"


async def test_dump_does_not_block_event_loop(tmp_path, monkeypatch):
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=False))
    seen = _hold_until_loop_runs_a_task(monkeypatch, "write_entry")
    loop = AsyncLoop()
    SkipManager.set_step(1)
    result = await loop.generate_sequences(make_prompts(["a"]))
    assert loop.calls == [1]
    assert_batch_equal(result, make_output(1, ["a"]))
    assert (step_dir(tmp_path, 1) / "meta.json").is_file()  # async_dump false: written before returning
    assert seen == {"off_loop": True, "other_task": "ran"}, "the event loop was blocked while dumping"


# --------------------------------------------------------------------------- async_rollout


async def _feed(rollouter: Rollouter, order: list[int], keyword: bool = False) -> dict[int, Batch]:
    async def one(i):
        prompts = make_prompts([f"uid_sample_0_{i}"])
        if keyword:
            return i, await rollouter.generate_sequences_single(prompts=prompts)
        return i, await rollouter.generate_sequences_single(prompts)

    return dict(await asyncio.gather(*(one(i) for i in order)))


@pytest.mark.parametrize("async_dump", [True, False])
async def test_async_rollout_64_concurrent_samples_replay_their_own_data(tmp_path, async_dump):
    cfg = make_config(tmp_path, role="async_rollout", steps=["0-63"], async_dump=async_dump)
    order = list(range(64))
    random.Random(1).shuffle(order)

    SkipManager.init(cfg)
    rollouter = Rollouter()
    recorded = await _feed(rollouter, order)
    assert sorted(rollouter.calls) == list(range(64))
    assert SkipManager.flush(timeout=300)
    assert stat("dumps", "async_rollout") == 64
    for i in range(64):
        meta = json.loads((step_dir(tmp_path, i) / "meta.json").read_text())
        assert meta["global_steps"] == i
    for i, out in recorded.items():
        assert_batch_equal(out, make_output(i, [f"uid_sample_0_{i}"]))

    SkipManager.init(cfg)
    rollouter = Rollouter()
    random.Random(2).shuffle(order)
    replayed = await _feed(rollouter, order, keyword=True)
    assert rollouter.calls == []
    assert stat("hits", "async_rollout") == 64
    for i in range(64):
        assert_batch_equal(replayed[i], make_output(i, [f"uid_sample_0_{i}"]))


async def test_async_rollout_step_outside_steps_runs(tmp_path):
    SkipManager.init(make_config(tmp_path, role="async_rollout", steps=["0-3"]))
    rollouter = Rollouter()
    await _feed(rollouter, [5, 70])
    assert sorted(rollouter.calls) == [5, 70]
    assert not step_dir(tmp_path, 5).exists() and not step_dir(tmp_path, 70).exists()


async def test_async_rollout_step_ignores_set_step(tmp_path):
    SkipManager.init(make_config(tmp_path, role="async_rollout", steps=[7]))
    SkipManager.set_step(3)
    await _feed(Rollouter(), [7])
    assert (step_dir(tmp_path, 7) / "meta.json").is_file()
    assert not step_dir(tmp_path, 3).exists()


@pytest.mark.parametrize("prompts", [
    Batch.from_dict(tensors={"input_ids": torch.zeros(1, 2)}),
    Batch.from_dict(non_tensors={"other": ["x"]}),
    Batch.from_dict(non_tensors={"uid": []}),
    None,
], ids=["no_non_tensor", "no_uid_column", "empty_uid", "no_prompts"])
async def test_async_rollout_extract_step_requires_uid(tmp_path, prompts):
    SkipManager.init(make_config(tmp_path, role="async_rollout", steps="all"))
    role = SkipManager.skip_instances["async_rollout"]
    assert isinstance(role, AsyncRolloutSkip)
    with pytest.raises(ValueError, match="uid"):
        role.extract_step(None, prompts)
    rollouter = Rollouter()
    with pytest.raises(ValueError, match="uid"):
        await rollouter.generate_sequences_single(prompts)
    assert rollouter.calls == []


async def test_async_rollout_extract_step_reads_keyword_and_positional(tmp_path):
    SkipManager.init(make_config(tmp_path, role="async_rollout", steps="all"))
    role = SkipManager.skip_instances["async_rollout"]
    prompts = make_prompts(["uid_sample_2_17", "uid_sample_2_99"])
    assert role.extract_step(None, prompts) == 17
    assert role.extract_step(None, prompts=prompts) == 17
    with pytest.raises(ValueError, match="Invalid async rollout sample_id"):
        role.extract_step(None, make_prompts(["foo"]))


async def test_async_rollout_disabled_passes_through_without_uid(tmp_path):
    SkipManager.init(make_config(tmp_path, role="async_rollout", steps="all", enable=False))

    @SkipManager.annotate(role="async_rollout")
    async def generate(self, prompts):
        return "ran"

    assert await generate(None, Batch.from_dict(non_tensors={"other": ["x"]})) == "ran"


@pytest.mark.parametrize(("sample_id", "index"), [
    ("sample_0_42", 42),
    ("uid_sample_3_7", 7),
    ("sample_12_0", 0),
    ("uid_sample_0_1000000", 1_000_000),
])
def test_parse_async_rollout_sample_step_accepts(sample_id, index):
    assert parse_async_rollout_sample_step(sample_id) == index


@pytest.mark.parametrize("sample_id", [
    "foo", "sample_1", "sample_0_x", "uid_sample_0", "", "sample_0_", "sample_0_1_2", "samples_0_1",
    "uid_uid_sample_0_1", "sample_0_-1", "sample_0_1.5",
    "sample_0_\u00b2",
])
def test_parse_async_rollout_sample_step_rejects(sample_id):
    with pytest.raises(ValueError, match="Invalid async rollout sample_id"):
        parse_async_rollout_sample_step(sample_id)
