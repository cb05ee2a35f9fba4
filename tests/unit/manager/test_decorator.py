"""``SkipManager.annotate`` on sync functions: the decision path, actions, storage failures, stats.

Everything goes through the public API (``import stepskip``); the on-disk layout is checked
against the exact paths verl's layout gives.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from skip_configs import run_path, training_config

from stepskip import Batch, CacheMissError, CorruptEntryError, SkipConfigError, SkipManager
from stepskip._dumping.worker import DumpWorker
from stepskip.errors import PromptMismatchError

STAT_NAMES = (
    "hits", "misses", "dumps", "dump_failures", "corrupt",
    "load_seconds", "dump_seconds", "bytes_read", "bytes_written", "saved_seconds",
    "rows_replayed", "rows_generated", "unavailable",
)


# --------------------------------------------------------------------------- helpers


def make_config(dump_dir, role: str = "rollout", **fields) -> dict:
    """A whole training config whose run shape gives ``exp_proj/GBS4_N2_in8_out6``."""
    return training_config(dump_dir, role, **fields)


def run_dir(dump_dir) -> Path:
    return run_path(dump_dir)


def step_dir(dump_dir, step: int) -> Path:
    return run_dir(dump_dir) / str(step)


def make_prompts(uids, validate: bool | None = None) -> Batch:
    meta = {} if validate is None else {"validate": validate}
    rows = len(uids)
    return Batch.from_dict(tensors={"input_ids": torch.arange(rows * 8).reshape(rows, 8)},
                           non_tensors={"uid": list(uids)}, meta_info=meta)


PROMPTS = ["p0", "p1", "p2", "p3"]


def make_output(step: int, uids=PROMPTS, version: int = 0) -> Batch:
    """The deterministic 'rollout' of a step: every column depends on the step (and ``version``)."""
    rows = len(uids)
    gen = torch.Generator().manual_seed(step * 1000 + version)
    return Batch.from_dict(
        tensors={
            "responses": torch.arange(rows * 6).reshape(rows, 6) + 1000 * step + 100_000 * version,
            "log_probs": torch.randn(rows, 6, generator=gen),
            "attention_mask": torch.rand(rows, 6, generator=gen) > 0.3,
        },
        non_tensors={
            "uid": list(uids),
            "text": [f"s{step}v{version}r{i}" for i in range(rows)],
            "reward_info": [{"score": step + i / 10 + version, "tags": ["t", step, i]} for i in range(rows)],
        },
        meta_info={"step": step, "version": version, "timing": {"gen": 0.5 * step}},
    )


def assert_batch_equal(actual, expected) -> None:
    assert isinstance(actual, Batch), type(actual)
    assert (actual.batch is None) == (expected.batch is None)
    if expected.batch is not None:
        assert sorted(actual.batch.keys()) == sorted(expected.batch.keys())
        assert list(actual.batch.batch_size) == list(expected.batch.batch_size)
        for key in expected.batch.keys():
            a, e = actual.batch[key], expected.batch[key]
            assert a.dtype == e.dtype, key
            assert torch.equal(a, e), key
    assert sorted(actual.non_tensor_batch) == sorted(expected.non_tensor_batch)
    for key, e in expected.non_tensor_batch.items():
        a = actual.non_tensor_batch[key]
        assert isinstance(a, np.ndarray), key
        assert a.dtype == e.dtype and a.shape == e.shape, key
        assert a.tolist() == e.tolist(), key
    assert actual.meta_info == expected.meta_info


def stat(name: str, role: str = "rollout") -> float:
    return SkipManager.stats()[f"skip/{role}/{name}"]


class Loop:
    """Stands for verl's AgentLoopManager: ``generate_sequences(self, prompts)`` is the skip unit."""

    def __init__(self, version: int = 0) -> None:
        self.calls: list[int] = []
        self.version = version
        self.seconds: list[float] = []  # how long each call ran, measured inside the function

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        """Generate one batch of rollouts."""
        start = time.perf_counter()
        self.calls.append(SkipManager.step)
        uids = list(prompts.non_tensor_batch["uid"]) if isinstance(prompts, Batch) else PROMPTS
        out = make_output(SkipManager.step, uids, self.version)
        self.seconds.append(time.perf_counter() - start)
        return out


def record_steps(dump_dir, steps, **fields) -> dict[int, Batch]:
    """One recording run (action cache) over ``steps``; returns what each call returned."""
    SkipManager.init(make_config(dump_dir, steps=list(steps), **fields))
    loop = Loop()
    out = {}
    for step in steps:
        SkipManager.set_step(step)
        out[step] = loop.generate_sequences(make_prompts(PROMPTS))
    SkipManager.flush()
    assert loop.calls == list(steps)
    for step in steps:
        assert (step_dir(dump_dir, step) / "meta.json").is_file()
    return out


def tree_snapshot(root) -> dict[str, bytes]:
    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


WAIT_S = 60  # only reached when the behaviour under test is broken (a hang guard, not a timing)


def hold(monkeypatch, role: str, method: str, part: str = "store") -> threading.Event:
    """Make one method of ``role``'s store (or format) wait until the returned event is set.

    The test decides when a background job may go on, so what it sees before setting the event
    does not depend on how fast the worker thread happens to be scheduled.
    """
    store = getattr(SkipManager.skip_instances[role], part)
    original = getattr(store, method)
    release = threading.Event()

    def held(*args, **kwargs):
        if not release.wait(WAIT_S):
            raise AssertionError(f"{method} was held for {WAIT_S}s and never released by the test")
        return original(*args, **kwargs)

    monkeypatch.setattr(store, method, held)
    return release


# --------------------------------------------------------------------------- before init


def test_defaults_before_init():
    assert SkipManager.config is None
    assert SkipManager.step == -1
    assert SkipManager.skip_instances == {}


async def test_decorators_pass_through_before_init(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    @SkipManager.annotate(role="rollout")
    def sync_fn(self, prompts):
        calls.append("sync")
        return prompts

    @SkipManager.annotate(role="async_rollout")
    async def async_fn(self, prompts):
        calls.append("async")
        return prompts

    prompts = make_prompts(PROMPTS)
    SkipManager.set_step(1)
    assert sync_fn(None, prompts) is prompts
    assert sync_fn(None, prompts) is prompts
    assert await async_fn(None, prompts) is prompts
    assert calls == ["sync", "sync", "async"]
    assert list(tmp_path.iterdir()) == []
    assert SkipManager.skip_instances == {}


async def test_wrappers_keep_metadata_and_kind():
    def sync_fn(self, prompts: Batch) -> Batch:
        """Sync docstring."""
        return prompts

    async def async_fn(self, prompts: Batch) -> Batch:
        """Async docstring."""
        return prompts

    sync_fn.custom_attr = "kept"
    wrapped_sync = SkipManager.annotate(role="rollout")(sync_fn)
    wrapped_async = SkipManager.annotate(role="async_rollout")(async_fn)

    for wrapped, original in ((wrapped_sync, sync_fn), (wrapped_async, async_fn)):
        assert wrapped is not original
        assert wrapped.__name__ == original.__name__
        assert wrapped.__qualname__ == original.__qualname__
        assert wrapped.__doc__ == original.__doc__
        assert wrapped.__module__ == original.__module__
        assert wrapped.__wrapped__ is original
        assert inspect.signature(wrapped) == inspect.signature(original)
    assert wrapped_sync.custom_attr == "kept"
    assert not inspect.iscoroutinefunction(wrapped_sync)
    assert inspect.iscoroutinefunction(wrapped_async)
    assert await wrapped_async(None, 5) == 5
    assert Loop.generate_sequences.__name__ == "generate_sequences"
    assert Loop.generate_sequences.__doc__ == "Generate one batch of rollouts."


# --------------------------------------------------------------------------- verl's debugging workflow


def test_record_then_replay_then_partial_cache(tmp_path):
    cfg = make_config(tmp_path, steps=[1, 2, 3])
    prompts = make_prompts(PROMPTS)

    # run 1: nothing on disk, every step generates and dumps
    SkipManager.init(cfg)
    loop = Loop()
    recorded = {}
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        recorded[step] = copy.deepcopy(loop.generate_sequences(prompts))
        assert_batch_equal(recorded[step], make_output(step))
    assert loop.calls == [1, 2, 3]
    for step in (1, 2, 3):
        meta_path = tmp_path / "exp_proj" / "GBS4_N2_in8_out6" / str(step) / "meta.json"
        assert meta_path.is_file()
        assert json.loads(meta_path.read_text())["global_steps"] == step
    assert sorted(os.listdir(run_dir(tmp_path))) == ["1", "2", "3"]
    assert stat("misses") == 3 and stat("dumps") == 3 and stat("hits") == 0

    # run 2: same config, every step replays without calling the function
    SkipManager.init(cfg)
    loop = Loop()
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(prompts), recorded[step])
    assert loop.calls == []
    assert stat("hits") == 3 and stat("misses") == 0 and stat("dumps") == 0

    # run 3: step 2's entry is gone: only step 2 regenerates
    shutil.rmtree(step_dir(tmp_path, 2))
    SkipManager.init(cfg)
    loop = Loop()
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(prompts), recorded[step])
    assert loop.calls == [2]
    assert stat("hits") == 2 and stat("misses") == 1 and stat("dumps") == 1
    assert (step_dir(tmp_path, 2) / "meta.json").is_file()


def test_run_dir_uses_gen_batch_size_when_set(tmp_path):
    cfg = make_config(tmp_path, steps=[1])
    cfg["data"]["gen_batch_size"] = 16
    SkipManager.init(cfg)
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    assert (tmp_path / "exp_proj" / "GBS16_N2_in8_out6" / "1" / "meta.json").is_file()


def test_run_dir_defaults_without_trainer_metadata(tmp_path):
    SkipManager.init({"skip": {"rollout": {"enable": True, "dump_dir": str(tmp_path), "steps": [1],
                                           "async_dump": False}}})
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    assert (tmp_path / "default_experiment_name_default_project_name" / "GBS0_N0_in0_out0" / "1"
            / "meta.json").is_file()


def test_steps_not_listed_always_run(tmp_path):
    record_steps(tmp_path, [1, 2, 3])
    SkipManager.init(make_config(tmp_path, steps=[1, 2, 3]))
    loop = Loop()
    for step in (4, 0, 4):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(step))
    assert loop.calls == [4, 0, 4]
    assert sorted(os.listdir(run_dir(tmp_path))) == ["1", "2", "3"]
    assert stat("hits") == 0 and stat("misses") == 0 and stat("dumps") == 0


def test_step_never_set_runs(tmp_path):
    record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1]))
    loop = Loop()
    loop.generate_sequences(make_prompts(PROMPTS))
    assert loop.calls == [-1]


@pytest.mark.parametrize("section", ["disabled", "absent", "other_role"])
def test_disabled_or_missing_role_always_runs(tmp_path, section):
    record_steps(tmp_path, [1, 2])
    if section == "disabled":
        cfg = make_config(tmp_path, steps=[1, 2], enable=False)
    elif section == "absent":
        cfg = make_config(tmp_path, steps=[1, 2])
        del cfg["skip"]
    else:  # only another role is configured
        cfg = make_config(tmp_path, role="async_rollout", steps=[1, 2])
    before = tree_snapshot(tmp_path)
    SkipManager.init(cfg)
    loop = Loop()
    for step in (1, 2, 1):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(step))
    assert loop.calls == [1, 2, 1]
    assert tree_snapshot(tmp_path) == before
    assert SkipManager.will_replay("rollout", [1, 2]) is False


def test_unknown_role_in_annotate_passes_through(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1]))
    calls = []

    @SkipManager.annotate(role="no_such_role")
    def fn(self, prompts):
        calls.append(1)
        return 7

    SkipManager.set_step(1)
    assert fn(None, make_prompts(PROMPTS)) == 7
    assert fn(None, make_prompts(PROMPTS)) == 7
    assert calls == [1, 1]


# --------------------------------------------------------------------------- validation bypass


def _validation_calls():
    validate = make_prompts(PROMPTS, validate=True)
    tensordict_style = SimpleNamespace(non_tensor_data={"validate": True})
    return {
        "positional": lambda loop: loop.generate_sequences(validate),
        "keyword": lambda loop: loop.generate_sequences(prompts=validate),
        "tensordict_style": lambda loop: loop.generate_sequences(tensordict_style),
        "lone_first_arg": lambda loop: lone_generate(validate),
    }


LONE_CALLS: list[int] = []


@SkipManager.annotate(role="rollout")
def lone_generate(prompts):
    """A free function whose only argument is the prompts."""
    LONE_CALLS.append(SkipManager.step)
    return make_output(SkipManager.step, list(prompts.non_tensor_batch["uid"]))


@pytest.mark.parametrize("how", ["positional", "keyword", "tensordict_style", "lone_first_arg"])
def test_validation_calls_always_run_and_dump_nothing(tmp_path, how):
    record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1, 2]))
    before = tree_snapshot(tmp_path)
    LONE_CALLS.clear()
    loop = Loop()
    call = _validation_calls()[how]
    for step in (1, 2):  # 1 has an entry (would be a hit), 2 has none (would be dumped)
        SkipManager.set_step(step)
        assert_batch_equal(call(loop), make_output(step))
    assert loop.calls + LONE_CALLS == [1, 2]
    SkipManager.flush()
    assert tree_snapshot(tmp_path) == before
    assert not step_dir(tmp_path, 2).exists()
    assert stat("hits") == 0 and stat("misses") == 0 and stat("dumps") == 0


@pytest.mark.parametrize("flag", [False, None])
def test_non_validation_prompts_are_not_bypassed(tmp_path, flag):
    record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1]))
    loop = Loop()
    SkipManager.set_step(1)
    loop.generate_sequences(make_prompts(PROMPTS, validate=flag))
    loop.generate_sequences(SimpleNamespace(non_tensor_data={"validate": False}))
    LONE_CALLS.clear()
    lone_generate(make_prompts(PROMPTS, validate=flag))
    assert loop.calls == [] and LONE_CALLS == []
    assert stat("hits") == 3


# --------------------------------------------------------------------------- rebind of identity columns


def test_hit_rebinds_uid_to_current_prompts(tmp_path):
    recorded = record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    live = ["new0", "new1", "new2", "new3"]
    out = Loop().generate_sequences(make_prompts(live))
    assert out.non_tensor_batch["uid"].tolist() == live
    expected = copy.deepcopy(recorded[1])
    expected.non_tensor_batch["uid"] = out.non_tensor_batch["uid"]
    assert_batch_equal(out, expected)  # every other column is the recorded one
    assert out.non_tensor_batch["text"].tolist() == recorded[1].non_tensor_batch["text"].tolist()


def test_rebind_skipped_when_row_counts_differ(tmp_path):
    recorded = record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    out = Loop().generate_sequences(make_prompts(["x0", "x1", "x2"]))
    assert_batch_equal(out, recorded[1])


def test_rebind_keys_empty_keeps_recorded_uids(tmp_path):
    recorded = record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1], rebind_keys=[]))
    SkipManager.set_step(1)
    out = Loop().generate_sequences(make_prompts(["new0", "new1", "new2", "new3"]))
    assert out.non_tensor_batch["uid"].tolist() == PROMPTS
    assert_batch_equal(out, recorded[1])


# --------------------------------------------------------------------------- actions


def test_repeat_resolves_exact_then_smaller_then_larger_on_every_call(tmp_path):
    recorded = record_steps(tmp_path, [1, 2, 5])
    backup = tmp_path / "backup_step2"
    shutil.move(str(step_dir(tmp_path, 2)), str(backup))

    SkipManager.init(make_config(tmp_path, steps="all", action="repeat"))
    loop = Loop()
    prompts = make_prompts(PROMPTS)

    def replayed(step):
        SkipManager.set_step(step)
        return loop.generate_sequences(prompts)

    assert_batch_equal(replayed(5), recorded[5])  # exact
    assert_batch_equal(replayed(3), recorded[1])  # largest smaller (2 is gone)
    assert_batch_equal(replayed(0), recorded[1])  # smallest larger
    assert_batch_equal(replayed(9), recorded[5])  # largest smaller
    shutil.move(str(backup), str(step_dir(tmp_path, 2)))
    assert_batch_equal(replayed(3), recorded[2])  # re-resolved: the new entry is seen at once
    assert_batch_equal(replayed(2), recorded[2])
    assert loop.calls == []
    assert stat("hits") == 6


def test_repeat_without_any_entry_generates_and_dumps(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1, 2], action="repeat"))
    loop = Loop()
    SkipManager.set_step(2)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(2))
    assert loop.calls == [2]
    assert (step_dir(tmp_path, 2) / "meta.json").is_file()
    SkipManager.set_step(1)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(2))  # repeats step 2
    assert loop.calls == [2]


def _random_choice(tmp_path, seed: int, step: int) -> int:
    SkipManager.init(make_config(tmp_path, steps=[3, 4, 10], action="random", seed=seed))
    loop = Loop()
    SkipManager.set_step(step)
    out = loop.generate_sequences(make_prompts(PROMPTS))
    assert loop.calls == []
    chosen = out.meta_info["step"]
    assert_batch_equal(out, make_output(chosen))
    return chosen


def test_random_is_reproducible_and_picks_available_steps(tmp_path):
    record_steps(tmp_path, [1, 2, 5, 7])
    available = {1, 2, 5, 7}
    choices = {}
    for seed in range(12):
        first = _random_choice(tmp_path, seed, 3)
        second = _random_choice(tmp_path, seed, 3)
        assert first == second, f"seed {seed}: {first} then {second}"
        assert first in available
        choices[seed] = first
    assert len(set(choices.values())) > 1, choices
    for step in (4, 10):
        assert _random_choice(tmp_path, 0, step) in available


def test_replay_hits_exact_step(tmp_path):
    recorded = record_steps(tmp_path, [1, 2])
    SkipManager.init(make_config(tmp_path, steps=[1, 2, 3], action="replay"))
    loop = Loop()
    for step in (2, 1):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), recorded[step])
    assert loop.calls == []


def test_replay_missing_step_raises_cache_miss_without_calling(tmp_path):
    record_steps(tmp_path, [1, 2])
    SkipManager.init(make_config(tmp_path, steps=[1, 2, 3], action="replay"))
    loop = Loop()
    SkipManager.set_step(3)
    with pytest.raises(CacheMissError) as excinfo:
        loop.generate_sequences(make_prompts(PROMPTS))
    assert not isinstance(excinfo.value, CorruptEntryError)
    assert loop.calls == []
    assert not step_dir(tmp_path, 3).exists()


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage_meta(entry: Path) -> None:
    (entry / "meta.json").write_bytes(b"\x00{not json at all")


DAMAGE = {
    "flipped_byte": lambda entry: _flip_byte(entry / "data.safetensors"),
    "truncated_file": lambda entry: _truncate(entry / "data.safetensors"),
    "garbage_meta": _garbage_meta,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_replay_damaged_entry_raises_corrupt_entry_error(tmp_path, damage):
    assert issubclass(CorruptEntryError, CacheMissError)
    record_steps(tmp_path, [1, 2])
    DAMAGE[damage](step_dir(tmp_path, 2))
    before = tree_snapshot(tmp_path)
    SkipManager.init(make_config(tmp_path, steps=[1, 2], action="replay"))
    loop = Loop()
    SkipManager.set_step(2)
    with pytest.raises(CorruptEntryError):
        loop.generate_sequences(make_prompts(PROMPTS))
    assert loop.calls == []
    assert stat("corrupt") >= 1
    assert tree_snapshot(tmp_path) == before  # replay never regenerates


def test_record_always_calls_and_overwrites(tmp_path):
    record_steps(tmp_path, [1, 2])
    SkipManager.init(make_config(tmp_path, steps=[1, 2], action="record"))
    record_run = SkipManager.run_id
    loop = Loop(version=1)
    for step in (1, 2, 1):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(step, version=1))
    assert loop.calls == [1, 2, 1]
    assert stat("dumps") == 3 and stat("hits") == 0
    assert sorted(os.listdir(run_dir(tmp_path))) == ["1", "2"]  # no temporaries or trash left
    for step in (1, 2):
        assert json.loads((step_dir(tmp_path, step) / "meta.json").read_text())["run_id"] == record_run

    SkipManager.init(make_config(tmp_path, steps=[1, 2], action="replay"))
    loop = Loop()
    for step in (1, 2):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(step, version=1))
    assert loop.calls == []


# --------------------------------------------------------------------------- corrupt entries under cache


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_cache_regenerates_corrupt_entry(tmp_path, damage, caplog):
    record_steps(tmp_path, [1, 2])
    DAMAGE[damage](step_dir(tmp_path, 2))
    caplog.set_level(logging.INFO, logger="stepskip")
    SkipManager.init(make_config(tmp_path, steps=[1, 2]))
    loop = Loop(version=3)
    SkipManager.set_step(2)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(2, version=3))
    assert loop.calls == [2]
    assert stat("corrupt") == 1
    assert stat("dumps") == 1
    warnings_logged = [r for r in caplog.records
                       if r.name.startswith("stepskip") and r.levelno == logging.WARNING]
    assert warnings_logged, [r.getMessage() for r in caplog.records]
    assert any(str(step_dir(tmp_path, 2)) in r.getMessage() for r in warnings_logged)
    assert sorted(os.listdir(run_dir(tmp_path))) == ["1", "2"]

    # the overwritten entry is valid and holds the new result
    SkipManager.init(make_config(tmp_path, steps=[1, 2], action="replay"))
    loop = Loop()
    SkipManager.set_step(2)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(2, version=3))
    assert loop.calls == []
    assert stat("corrupt") == 0


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_corrupt_entry_counts_as_a_miss(tmp_path, damage):
    record_steps(tmp_path, [1])
    DAMAGE[damage](step_dir(tmp_path, 1))
    SkipManager.init(make_config(tmp_path, steps=[1]))
    loop = Loop()
    SkipManager.set_step(1)
    loop.generate_sequences(make_prompts(PROMPTS))
    assert loop.calls == [1]
    assert (stat("hits"), stat("misses"), stat("corrupt"), stat("dumps")) == (0, 1, 1, 1)


def test_function_error_propagates_and_dumps_nothing(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=True))

    @SkipManager.annotate(role="rollout")
    def generate(self, prompts):
        raise RuntimeError("engine crashed")

    SkipManager.set_step(1)
    with pytest.raises(RuntimeError, match="engine crashed"):
        generate(None, make_prompts(PROMPTS))
    assert SkipManager.flush(timeout=300)
    assert not step_dir(tmp_path, 1).exists()
    assert stat("dumps") == 0 and stat("dump_failures") == 0


# --------------------------------------------------------------------------- pickle entries


def _record_verl(tmp_path, steps) -> dict[int, Batch]:
    return record_steps(tmp_path, steps, format="verl", allow_pickle=True)


def test_verl_format_round_trips_with_allow_pickle(tmp_path):
    recorded = _record_verl(tmp_path, [1, 2])
    entry = step_dir(tmp_path, 1)
    assert (entry / "gen_batch.dp").is_file()
    assert json.loads((entry / "meta.json").read_text())["format"] == "verl"
    SkipManager.init(make_config(tmp_path, steps=[1, 2], format="verl", allow_pickle=True))
    loop = Loop()
    for step in (1, 2):
        SkipManager.set_step(step)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), recorded[step])
    assert loop.calls == []


@pytest.mark.parametrize("action", ["cache", "repeat", "replay"])
def test_pickle_entry_refused_without_allow_pickle(tmp_path, action):
    _record_verl(tmp_path, [1])
    before = tree_snapshot(tmp_path)
    SkipManager.init(make_config(tmp_path, steps=[1], action=action))
    loop = Loop()
    SkipManager.set_step(1)
    with pytest.raises(SkipConfigError) as excinfo:
        loop.generate_sequences(make_prompts(PROMPTS))
    message = str(excinfo.value)
    assert "allow_pickle" in message
    assert "stepskip convert" in message
    assert loop.calls == []
    SkipManager.flush()
    assert tree_snapshot(tmp_path) == before  # never regenerated over


def test_pickle_entry_overwritten_by_record(tmp_path):
    _record_verl(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1], action="record"))
    loop = Loop(version=2)
    SkipManager.set_step(1)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(1, version=2))
    assert loop.calls == [1]
    entry = step_dir(tmp_path, 1)
    assert json.loads((entry / "meta.json").read_text())["format"] == "safe"
    assert not (entry / "gen_batch.dp").exists()


# --------------------------------------------------------------------------- dump failures


@pytest.mark.parametrize("async_dump", [False, True])
def test_dump_into_unwritable_location_returns_result(tmp_path, async_dump, caplog):
    blocker = tmp_path / "blocker"
    caplog.set_level(logging.INFO, logger="stepskip")
    SkipManager.init(make_config(blocker / "dump", steps=[1], async_dump=async_dump))
    blocker.write_bytes(b"a regular file where a directory should be")  # after startup's check
    loop = Loop()
    SkipManager.set_step(1)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(1))
    assert SkipManager.flush(timeout=300)
    assert loop.calls == [1]
    assert stat("dump_failures") == 1
    assert stat("dumps") == 0
    assert any(r.name.startswith("stepskip") and r.levelno >= logging.ERROR for r in caplog.records)
    assert [p.name for p in tmp_path.iterdir()] == ["blocker"]
    assert blocker.read_bytes() == b"a regular file where a directory should be"


def test_an_unusable_dump_dir_is_a_startup_error(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"file")
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.dump_dir = .*blocker is a file"):
        SkipManager.init(make_config(blocker / "dump", steps=[1]))
    assert blocker.read_bytes() == b"file"


def test_unwritable_location_is_a_miss_not_a_corrupt_entry(tmp_path, caplog):
    blocker = tmp_path / "blocker"
    caplog.set_level(logging.INFO, logger="stepskip")
    SkipManager.init(make_config(blocker / "dump", steps=[1]))
    blocker.write_bytes(b"file")
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    assert stat("misses") == 1
    assert stat("corrupt") == 0


class Opaque:
    """Something format 'safe' cannot store."""


@pytest.mark.parametrize("async_dump", [False, True])
def test_unstorable_result_is_returned_and_counted(tmp_path, async_dump, caplog):
    caplog.set_level(logging.INFO, logger="stepskip")
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=async_dump))
    marker = Opaque()
    result = Batch.from_dict(tensors={"x": torch.ones(2, 2)},
                             non_tensors={"uid": ["a", "b"], "opaque_field": [marker, marker]})

    @SkipManager.annotate(role="rollout")
    def generate(self, prompts):
        return result

    SkipManager.set_step(1)
    assert generate(None, make_prompts(["a", "b"])) is result
    assert SkipManager.flush(timeout=300)
    assert stat("dump_failures") == 1
    assert stat("dumps") == 0
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("stepskip") and r.levelno >= logging.ERROR]
    assert any("opaque_field" in m for m in errors), errors
    assert not step_dir(tmp_path, 1).exists()
    leftovers = os.listdir(run_dir(tmp_path)) if run_dir(tmp_path).exists() else []
    assert leftovers == []


def test_verl_format_refuses_objects_its_reader_cannot_load(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="stepskip")
    SkipManager.init(make_config(tmp_path, steps=[1], format="verl", allow_pickle=True))
    result = Batch.from_dict(tensors={"x": torch.ones(2, 2)},
                             non_tensors={"uid": ["a", "b"], "opaque_field": [Opaque(), Opaque()]})

    @SkipManager.annotate(role="rollout")
    def generate(self, prompts):
        return result

    SkipManager.set_step(1)
    assert generate(None, make_prompts(["a", "b"])) is result
    assert stat("dump_failures") == 1
    assert not step_dir(tmp_path, 1).exists()
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("stepskip") and r.levelno >= logging.ERROR]
    assert any("opaque_field" in m for m in errors), errors


# --------------------------------------------------------------------------- snapshot semantics


@pytest.mark.parametrize("fmt", ["safe", "verl"])
def test_async_dump_snapshots_result_at_return_time(tmp_path, monkeypatch, fmt):
    fields = {"format": fmt, "allow_pickle": fmt == "verl"}
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=True, **fields))
    # the background job starts encoding only after the mutations below
    release = hold(monkeypatch, "rollout", "encode", part="format")
    SkipManager.set_step(1)
    out = Loop().generate_sequences(make_prompts(PROMPTS))
    assert not step_dir(tmp_path, 1).exists()
    out.batch["responses"].add_(777)
    out.batch["log_probs"].zero_()
    out.batch["attention_mask"].fill_(False)
    out.non_tensor_batch["text"][0] = "mutated"
    out.non_tensor_batch["reward_info"][0]["score"] = -1.0
    out.non_tensor_batch["reward_info"][1]["tags"].append("mutated")
    out.non_tensor_batch["uid"][2] = "mutated"
    out.meta_info["timing"]["gen"] = -5.0
    out.meta_info["added"] = True
    release.set()
    assert SkipManager.flush(timeout=300)
    assert stat("dumps") == 1

    SkipManager.init(make_config(tmp_path, steps=[1], action="replay", **fields))
    loop = Loop()
    SkipManager.set_step(1)
    assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(1))
    assert loop.calls == []


def test_sync_dump_writes_before_returning(tmp_path, monkeypatch):
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=False))
    store = SkipManager.skip_instances["rollout"].store
    original, writes = store.write_entry, []

    def recorded_write(*args, **kwargs):
        result = original(*args, **kwargs)
        writes.append(threading.get_ident())
        return result

    monkeypatch.setattr(store, "write_entry", recorded_write)
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    assert writes == [threading.get_ident()]  # written by the caller's thread, before the call returned
    assert (step_dir(tmp_path, 1) / "meta.json").is_file()
    assert stat("dumps") == 1


def test_close_flushes_pending_dumps(tmp_path, monkeypatch):
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=True))
    release = hold(monkeypatch, "rollout", "write_entry")
    original_flush = DumpWorker.flush

    def flush_releasing_the_write(self, timeout=None):
        release.set()  # the held write goes on only once close() waits for the worker
        return original_flush(self, timeout)

    monkeypatch.setattr(DumpWorker, "flush", flush_releasing_the_write)
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    assert not step_dir(tmp_path, 1).exists()
    SkipManager.close()
    assert (step_dir(tmp_path, 1) / "meta.json").is_file()


def test_flush_timeout_reports_pending_dumps(tmp_path, monkeypatch):
    SkipManager.init(make_config(tmp_path, steps=[1], async_dump=True))
    release = hold(monkeypatch, "rollout", "write_entry")
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    assert SkipManager.flush(timeout=0.01) is False  # the write is held: flush cannot finish in time
    assert not step_dir(tmp_path, 1).exists()
    release.set()
    assert SkipManager.flush(timeout=300) is True
    assert (step_dir(tmp_path, 1) / "meta.json").is_file()


# --------------------------------------------------------------------------- stats


def test_stats_keys_for_every_enabled_role(tmp_path):
    cfg = make_config(tmp_path, steps=[1])
    cfg["skip"]["reward"] = {"kind": "stage", "enable": True, "steps": [1], "dump_dir": str(tmp_path)}
    SkipManager.init(cfg)
    stats = SkipManager.stats()
    assert {"rollout", "async_rollout", "reward"} <= set(SkipManager.skip_instances)
    assert set(stats) == {f"skip/{role}/{name}" for role in ("rollout", "reward") for name in STAT_NAMES}
    assert all(isinstance(v, float) and v == 0.0 for v in stats.values())


def test_stats_empty_before_init():
    assert SkipManager.stats() == {}


def test_stats_count_and_saved_seconds_equal_recorded_generation_time(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    recording = Loop()
    recording.generate_sequences(make_prompts(PROMPTS))
    assert stat("misses") == 1 and stat("dumps") == 1
    assert stat("bytes_written") > 0 and stat("dump_seconds") > 0
    assert stat("saved_seconds") == 0
    recorded_seconds = json.loads((step_dir(tmp_path, 1) / "meta.json").read_text())["generation_seconds"]
    # the wrapper's measurement encloses the function's own: no threshold that a loaded machine could miss
    assert len(recording.seconds) == 1 and recorded_seconds >= recording.seconds[0] > 0

    SkipManager.init(make_config(tmp_path, steps=[1]))
    loop = Loop()
    SkipManager.set_step(1)
    loop.generate_sequences(make_prompts(PROMPTS))
    assert loop.calls == []
    assert stat("hits") == 1 and stat("misses") == 0
    assert stat("bytes_read") > 0 and stat("load_seconds") > 0
    assert stat("saved_seconds") == pytest.approx(recorded_seconds)
    loop.generate_sequences(make_prompts(PROMPTS))
    assert stat("saved_seconds") == pytest.approx(2 * recorded_seconds)


# --------------------------------------------------------------------------- will_replay


@pytest.mark.parametrize(
    ("action", "steps", "expected"),
    [
        ("cache", [1, 2], True),
        ("cache", [1, 2, 3], False),
        ("cache", [3], False),
        ("replay", [1, 2], True),
        ("replay", [2, 3], False),
        ("repeat", [3], True),
        ("repeat", [1, 2, 3], True),
        ("random", [3], True),
        ("record", [1], False),
        ("record", [1, 2], False),
        ("cache", [1, 4], False),  # 4 is not in skip.rollout.steps
        ("repeat", [4], False),
    ],
)
def test_will_replay_per_action(tmp_path, action, steps, expected):
    record_steps(tmp_path, [1, 2])
    SkipManager.init(make_config(tmp_path, steps=[1, 2, 3], action=action))
    assert SkipManager.will_replay("rollout", steps) is expected


def test_will_replay_false_without_entries_disabled_or_unknown(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1], action="repeat"))
    assert SkipManager.will_replay("rollout", [1]) is False
    record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1], action="repeat"))
    assert SkipManager.will_replay("rollout", [1]) is True
    SkipManager.init(make_config(tmp_path, steps=[1], enable=False))
    assert SkipManager.will_replay("rollout", [1]) is False
    assert SkipManager.will_replay("no_such_role", [1]) is False
    SkipManager.reset()
    assert SkipManager.will_replay("rollout", [1]) is False


# --------------------------------------------------------------------------- replay fidelity


def _with_rollout_settings(cfg: dict, temperature: float, model: str) -> dict:
    cfg["actor_rollout_ref"]["rollout"]["temperature"] = temperature
    cfg["actor_rollout_ref"]["model"] = {"path": model}
    cfg["trainer"]["run_name_with_time"] = f"run-{time.time()}"  # never part of the fingerprint
    return cfg


def test_same_settings_replay_without_mismatch_warning(tmp_path, caplog):
    SkipManager.init(_with_rollout_settings(make_config(tmp_path, steps=[1]), 0.7, "/models/a"))
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    caplog.set_level(logging.WARNING, logger="stepskip")
    SkipManager.init(_with_rollout_settings(make_config(tmp_path, steps=[1]), 0.7, "/models/a"))
    loop = Loop()
    SkipManager.set_step(1)
    loop.generate_sequences(make_prompts(["other0", "other1", "other2", "other3"]))  # only uids differ
    assert loop.calls == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("on_mismatch", ["warn", "error", "regenerate"])
def test_fingerprint_mismatch_policy(tmp_path, caplog, on_mismatch):
    SkipManager.init(_with_rollout_settings(make_config(tmp_path, steps=[1]), 0.7, "/models/a"))
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    caplog.set_level(logging.WARNING, logger="stepskip")

    cfg = _with_rollout_settings(make_config(tmp_path, steps=[1], on_mismatch=on_mismatch), 1.0, "/models/b")
    SkipManager.init(cfg)
    loop = Loop(version=4)
    SkipManager.set_step(1)
    if on_mismatch == "error":
        with pytest.raises(SkipConfigError) as excinfo:
            loop.generate_sequences(make_prompts(PROMPTS))
        message = str(excinfo.value)
        assert loop.calls == []
    else:
        out = loop.generate_sequences(make_prompts(PROMPTS))
        message = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        if on_mismatch == "warn":
            assert loop.calls == []
            assert_batch_equal(out, make_output(1))
        else:
            assert loop.calls == [1]
            assert_batch_equal(out, make_output(1, version=4))
            SkipManager.init(cfg)  # the regenerated entry carries this run's fingerprint
            loop = Loop()
            SkipManager.set_step(1)
            assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), make_output(1, version=4))
            assert loop.calls == []
    for needle in ("actor_rollout_ref.rollout.temperature", "0.7", "1.0",
                   "actor_rollout_ref.model.path", "/models/a", "/models/b"):
        assert needle in message, (needle, message)
    assert "run_name_with_time" not in message


def _other_prompts():
    """The prompts of ``PROMPTS`` with other tokens and the same uids: a call a recorded entry's
    prompt digest does not match."""
    other = make_prompts(PROMPTS)
    other.batch["input_ids"] += 1
    return other


@pytest.mark.parametrize("check_prompts", ["warn", "error", "off"])
def test_prompt_digest_policy(tmp_path, caplog, check_prompts):
    record_steps(tmp_path, [1, 2])
    caplog.set_level(logging.WARNING, logger="stepskip")
    SkipManager.init(make_config(tmp_path, steps=[1, 2], check_prompts=check_prompts))
    other = _other_prompts()
    loop = Loop()
    SkipManager.set_step(1)
    if check_prompts == "error":
        with pytest.raises(SkipConfigError, match="prompts"):
            loop.generate_sequences(other)
        assert loop.calls == []
        return
    assert_batch_equal(loop.generate_sequences(other), make_output(1))
    assert loop.calls == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bool(warned) is (check_prompts == "warn"), warned
    if warned:
        assert str(step_dir(tmp_path, 1)) in warned[0]


def test_prompt_digest_not_compared_for_another_steps_entry(tmp_path, caplog):
    record_steps(tmp_path, [1])
    caplog.set_level(logging.WARNING, logger="stepskip")
    SkipManager.init(make_config(tmp_path, steps=[1, 2], action="repeat", check_prompts="error"))
    other = _other_prompts()
    loop = Loop()
    SkipManager.set_step(2)  # repeat serves step 1's entry: other prompts are expected
    assert_batch_equal(loop.generate_sequences(other), make_output(1))
    assert loop.calls == []


@pytest.mark.parametrize("check_prompts", ["warn", "error"])
def test_prompt_mismatch_on_a_damaged_entry(tmp_path, caplog, check_prompts):
    """An entry whose damage only its checksum tells (a flipped byte) and whose prompts differ from
    the call's: under ``check_prompts=error`` the mismatch is what the call raises (the check runs
    before any data is read: nothing generated, the entry kept); under ``warn`` the mismatch is
    logged, the damage found by the read, and the step regenerated."""
    record_steps(tmp_path, [1])
    entry = step_dir(tmp_path, 1)
    _flip_byte(entry / "data.safetensors")
    damaged = {f.name: f.read_bytes() for f in entry.iterdir()}
    caplog.set_level(logging.WARNING, logger="stepskip")
    SkipManager.init(make_config(tmp_path, steps=[1], check_prompts=check_prompts))
    other = _other_prompts()
    loop = Loop()
    SkipManager.set_step(1)
    if check_prompts == "error":
        with pytest.raises(PromptMismatchError, match="other prompts"):
            loop.generate_sequences(other)
        assert loop.calls == []
        assert {f.name: f.read_bytes() for f in entry.iterdir()} == damaged  # left as it was found
        return
    assert_batch_equal(loop.generate_sequences(other), make_output(1))
    assert loop.calls == [1]
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "other prompts" in warned and "corrupt" in warned, warned


def test_will_replay_false_when_mismatch_would_regenerate(tmp_path):
    SkipManager.init(_with_rollout_settings(make_config(tmp_path, steps=[1]), 0.7, "/models/a"))
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    SkipManager.init(_with_rollout_settings(make_config(tmp_path, steps=[1], on_mismatch="regenerate"),
                                            1.0, "/models/a"))
    assert SkipManager.will_replay("rollout", [1]) is False


# --------------------------------------------------------------------------- init


def _legacy_config(tmp_path, rollout_enable: bool = True) -> dict:
    cfg = make_config(tmp_path, steps=[1], enable=rollout_enable)
    cfg["actor_rollout_ref"]["rollout"]["skip"] = {"enable": True}
    return cfg


@pytest.mark.parametrize("kind", ["dict", "dictconfig", "readonly_dictconfig"])
def test_legacy_flag_is_warned_and_disabled(tmp_path, kind):
    cfg = _legacy_config(tmp_path)
    if kind != "dict":
        cfg = OmegaConf.create(cfg)
        if kind == "readonly_dictconfig":
            OmegaConf.set_readonly(cfg, True)
    with pytest.warns(DeprecationWarning, match="actor_rollout_ref.rollout.skip.enable"):
        SkipManager.init(cfg)
    assert cfg["actor_rollout_ref"]["rollout"]["skip"]["enable"] is False
    assert SkipManager.skip_instances["rollout"].is_enabled()


def test_legacy_flag_untouched_when_skip_rollout_disabled(tmp_path):
    cfg = _legacy_config(tmp_path, rollout_enable=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SkipManager.init(cfg)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)
                and "skip" in str(w.message)]
    assert cfg["actor_rollout_ref"]["rollout"]["skip"]["enable"] is True


def test_init_rejects_unknown_role_listing_known_roles(tmp_path):
    with pytest.raises(SkipConfigError) as excinfo:
        SkipManager.init({"skip": {"rollot": {"enable": True, "dump_dir": str(tmp_path)}}})
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert "rollot" in message
    for known in ("rollout", "rollout_tq", "async_rollout"):
        assert known in message
    assert SkipManager.skip_instances == {}


def test_init_accepts_attribute_objects_and_dictconfig(tmp_path):
    recorded = record_steps(tmp_path, [1])
    for cfg in (OmegaConf.create(make_config(tmp_path, steps=[1])),
                json.loads(json.dumps(make_config(tmp_path, steps=[1])),
                           object_hook=lambda d: SimpleNamespace(**d))):
        SkipManager.init(cfg)
        loop = Loop()
        SkipManager.set_step(1)
        assert_batch_equal(loop.generate_sequences(make_prompts(PROMPTS)), recorded[1])
        assert loop.calls == []


def test_reinit_replaces_state(tmp_path):
    SkipManager.init(make_config(tmp_path / "a", steps=[1]))
    first_run, first_role = SkipManager.run_id, SkipManager.skip_instances["rollout"]
    SkipManager.set_step(7)
    SkipManager.init(make_config(tmp_path / "b", steps=[1]))
    assert SkipManager.run_id and SkipManager.run_id != first_run
    assert SkipManager.step == -1
    role = SkipManager.skip_instances["rollout"]
    assert role is not first_role
    assert role.project_dump_dir == str(run_dir(tmp_path / "b"))
    SkipManager.set_step(1)
    Loop().generate_sequences(make_prompts(PROMPTS))
    meta = json.loads((step_dir(tmp_path / "b", 1) / "meta.json").read_text())
    assert meta["run_id"] == SkipManager.run_id
    assert not (tmp_path / "a").exists()


def test_reset_restores_defaults_and_pass_through(tmp_path):
    record_steps(tmp_path, [1])
    SkipManager.init(make_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    SkipManager.reset()
    assert SkipManager.config is None
    assert SkipManager.step == -1
    assert SkipManager.skip_instances == {}
    loop = Loop()
    SkipManager.set_step(1)
    loop.generate_sequences(make_prompts(PROMPTS))
    assert loop.calls == [1]

