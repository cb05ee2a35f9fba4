"""Roles: the BaseSkip protocol, the registry, custom and generic stage roles, RolloutSkip's helpers."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from skip_configs import run_path, training_config
from tensordict import NonTensorData, TensorDict

from stepskip import (
    SKIP_REGISTRY,
    AsyncRolloutSkip,
    BaseSkip,
    Batch,
    RolloutSkip,
    RolloutSkipConfig,
    SkipAction,
    SkipConfigError,
    SkipManager,
    register_skip,
)


def make_config(dump_dir, role: str = "rollout", **fields) -> dict:
    return training_config(dump_dir, role, **{"steps": "all", **fields})


def project_dir(dump_dir) -> Path:
    return run_path(dump_dir)


def output(step: int) -> Batch:
    return Batch.from_dict(tensors={"responses": torch.full((2, 3), step)},
                           non_tensors={"uid": ["a", "b"], "step": [step, step]}, meta_info={"step": step})


CALLS: list[int] = []


@SkipManager.annotate(role="rollout")
def generate(self, prompts):
    CALLS.append(SkipManager.step)
    return output(SkipManager.step)
PROMPTS = Batch.from_dict(non_tensors={"uid": ["a", "b"]})


def record(dump_dir, steps) -> None:
    SkipManager.init(make_config(dump_dir))
    for step in steps:
        SkipManager.set_step(step)
        generate(None, PROMPTS)
    SkipManager.flush()
    for step in steps:
        assert (project_dir(dump_dir) / str(step) / "meta.json").is_file()


def role_for(dump_dir, action: str = "cache", **fields) -> RolloutSkip:
    SkipManager.init(make_config(dump_dir, action=action, **fields))
    role = SkipManager.skip_instances["rollout"]
    assert isinstance(role, RolloutSkip)
    return role


# --------------------------------------------------------------------------- BaseSkip and SkipAction


def test_skip_action_members():
    assert {a.name: a.value for a in SkipAction}.items() >= {
        "CACHE": "cache", "REPEAT": "repeat", "RANDOM": "random", "EMPTY": "empty", "REPLAY": "replay",
        "RECORD": "record",
    }.items()


class CacheOnlySkip(BaseSkip):
    support_actions = [SkipAction.CACHE]


def _local(action: str, **overrides) -> SimpleNamespace:
    fields = {"enable": True, "dump_dir": "/nonexistent", "steps": [1, 3], "action": action}
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("action", ["repeat", "record", "bogus"])
def test_base_skip_rejects_unsupported_action(action):
    with pytest.raises(ValueError, match="Unsupported action"):
        CacheOnlySkip(_local(action), {})


def test_base_skip_keeps_its_configuration():
    global_config = {"trainer": {}}
    skip = CacheOnlySkip(_local("cache"), global_config)
    assert skip.action is SkipAction.CACHE
    assert skip.is_enabled() is True
    assert skip.global_config is global_config
    assert 1 in skip.steps and 3 in skip.steps and 2 not in skip.steps
    assert CacheOnlySkip(_local("cache", enable=False), {}).is_enabled() is False
    assert BaseSkip.support_online_step is False


def test_builtin_roles_registered():
    assert SKIP_REGISTRY["rollout"] is RolloutSkip
    assert SKIP_REGISTRY["async_rollout"] is AsyncRolloutSkip
    assert AsyncRolloutSkip.support_online_step is True
    assert RolloutSkip.support_online_step is False
    for action in ("cache", "repeat", "random", "replay", "record"):
        assert SkipAction(action) in RolloutSkip.support_actions


# --------------------------------------------------------------------------- custom roles


@dataclass
class MemoSkipConfig(RolloutSkipConfig):
    section: ClassVar[str] = "skip.memo"

    note: str = "default note"


class MemoSkip(BaseSkip):
    """An in-memory role: the second call of a step returns the first call's result."""

    support_actions = [SkipAction.CACHE]
    config_class = MemoSkipConfig

    def __init__(self, local_config: Any, global_config: Any) -> None:
        super().__init__(local_config, global_config)
        self.memory: dict[int, Any] = {}

    def meet_precondition(self, step, func, *args, **kwargs):
        return step in self.memory

    def warp_function(self, step, func, *args, **kwargs):
        return self.memory[step]

    def prepare_data(self, step, result, *args, **kwargs):
        self.memory[step] = result


def test_register_skip_custom_role_with_config_class():
    registered = register_skip("memo")(MemoSkip)
    assert registered is MemoSkip
    assert SKIP_REGISTRY["memo"] is MemoSkip

    SkipManager.init({"skip": {"memo": {"enable": True, "steps": [1, 2], "note": "hello"}}})
    role = SkipManager.skip_instances["memo"]
    assert isinstance(role, MemoSkip)
    assert isinstance(role.local_config, MemoSkipConfig)
    assert role.local_config.note == "hello"

    calls = []

    @SkipManager.annotate(role="memo")
    def stage(self, batch):
        calls.append(SkipManager.step)
        return {"step": SkipManager.step, "n": len(calls)}

    for step in (1, 1, 2, 2, 3, 3):
        SkipManager.set_step(step)
        stage(None, None)
    assert calls == [1, 2, 3, 3]  # 3 is not a listed step
    SkipManager.set_step(1)
    assert stage(None, None) == {"step": 1, "n": 1}


def test_custom_role_section_is_validated_by_its_config_class():
    register_skip("memo")(MemoSkip)
    with pytest.raises(SkipConfigError, match="note"):
        SkipManager.init({"skip": {"memo": {"enable": True, "no_such_key": 1}}})
    with pytest.raises(SkipConfigError, match="enable"):
        SkipManager.init({"skip": {"memo": {"enable": "yes"}}})


def test_custom_role_without_section_gets_defaults_and_passes_through():
    register_skip("memo")(MemoSkip)
    SkipManager.init({"skip": {}})
    role = SkipManager.skip_instances["memo"]
    assert role.local_config.note == "default note"
    assert role.is_enabled() is False
    calls = []

    @SkipManager.annotate(role="memo")
    def stage(self, batch):
        calls.append(1)

    SkipManager.set_step(1)
    stage(None, None)
    stage(None, None)
    assert calls == [1, 1]


def test_registry_cleanup_between_tests():
    assert "memo" not in SKIP_REGISTRY
    assert "online" not in SKIP_REGISTRY


@dataclass
class PlainMemoConfig:
    """A plain config dataclass with verl's four fields, as verl's own role configs are written."""

    enable: bool = False
    dump_dir: str = "~/.verl/rollout_dump"
    steps: list[int] = field(default_factory=list)
    action: str = "cache"


def test_custom_role_with_plain_dataclass_config():
    @register_skip("memo")
    class PlainMemoSkip(MemoSkip):
        config_class = PlainMemoConfig

    SkipManager.init({"skip": {"memo": {"enable": True, "steps": [1]}}})
    role = SkipManager.skip_instances["memo"]
    assert isinstance(role, PlainMemoSkip) and role.is_enabled()


class OnlineSkip(MemoSkip):
    """Steps come from each call (keyword ``sample``), not from SkipManager.set_step."""

    support_online_step = True

    def extract_step(self, *args, **kwargs):
        return int(kwargs["sample"].split("-")[1])


def test_custom_role_with_online_step():
    register_skip("online")(OnlineSkip)
    SkipManager.init({"skip": {"online": {"enable": True, "steps": [1, 2]}}})
    calls = []

    @SkipManager.annotate(role="online")
    def stage(self, *, sample):
        calls.append(sample)
        return sample

    SkipManager.set_step(99)  # ignored by an online role
    for sample in ("s-1", "s-1", "s-2", "s-2", "s-5", "s-5"):
        SkipManager.set_step(1 if sample == "s-5" else 99)
        assert stage(None, sample=sample) == sample
    assert calls == ["s-1", "s-2", "s-5", "s-5"]


# --------------------------------------------------------------------------- generic stage roles


def _tensordict(step: int) -> TensorDict:
    return TensorDict(
        {
            "scores": torch.arange(4, dtype=torch.float32) + step,
            "sub": TensorDict({"token_level": torch.full((4, 3), step, dtype=torch.int32)}, batch_size=[4]),
            "source": NonTensorData(f"reward-model-{step}"),
            "jagged": torch.nested.nested_tensor([torch.arange(i + 1) + step for i in range(4)],
                                                 layout=torch.jagged),
        },
        batch_size=[4],
    )


RESULTS = {
    "dict_of_tensors": lambda step: {"scores": torch.arange(4.0) + step,
                                     "mask": torch.tensor([True, False, True, step % 2 == 0])},
    "tensordict": _tensordict,
    "tensor": lambda step: torch.linspace(0, 1, 7, dtype=torch.float64) * step,
}


def assert_value_equal(actual, expected, path="result") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        if expected.is_nested:
            assert actual.is_nested, path
            a, e = actual.unbind(), expected.unbind()
            assert len(a) == len(e) and all(torch.equal(x, y) for x, y in zip(a, e)), path
        else:
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), path
    elif isinstance(expected, TensorDict):
        assert isinstance(actual, TensorDict), path
        assert list(actual.batch_size) == list(expected.batch_size), path
        assert sorted(actual.keys()) == sorted(expected.keys()), path
        for key in expected.keys():
            e = expected.get(key)
            a = actual.get(key)
            if isinstance(e, NonTensorData):
                assert isinstance(a, NonTensorData) and a.data == e.data, f"{path}[{key}]"
            else:
                assert_value_equal(a, e, f"{path}[{key}]")
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), path
        for key in expected:
            assert_value_equal(actual[key], expected[key], f"{path}[{key}]")
    else:
        assert actual == expected, path


def _stage_config(dump_dir, *names) -> dict:
    cfg = make_config(dump_dir, enable=False)
    for name in names:
        cfg["skip"][name] = {"kind": "stage", "enable": True, "steps": [1, 2], "dump_dir": str(dump_dir),
                             "async_dump": False}
    return cfg


def _make_stage(name: str, kind: str):
    calls: list[int] = []

    @SkipManager.annotate(role=name)
    def compute(batch):
        calls.append(SkipManager.step)
        return RESULTS[kind](SkipManager.step)

    return compute, calls


@pytest.mark.parametrize("kind", sorted(RESULTS))
def test_stage_role_records_and_replays_exactly(tmp_path, kind):
    cfg = _stage_config(tmp_path, "reward")
    SkipManager.init(cfg)
    compute, calls = _make_stage("reward", kind)
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        assert_value_equal(compute(None), RESULTS[kind](step))
    assert calls == [1, 2, 3]
    assert SkipManager.stats()["skip/reward/dumps"] == 2

    SkipManager.init(cfg)
    compute, calls = _make_stage("reward", kind)
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        assert_value_equal(compute(None), RESULTS[kind](step))
    assert calls == [3]
    assert SkipManager.stats()["skip/reward/hits"] == 2


def test_stage_role_entries_live_under_its_name(tmp_path):
    SkipManager.init(_stage_config(tmp_path, "reward"))
    compute, _ = _make_stage("reward", "tensor")
    SkipManager.set_step(1)
    compute(None)
    entry = project_dir(tmp_path) / "reward" / "1"
    assert json.loads((entry / "meta.json").read_text())["global_steps"] == 1
    assert SkipManager.skip_instances["reward"].project_dump_dir == str(project_dir(tmp_path) / "reward")


def test_two_stage_roles_do_not_share_entries(tmp_path):
    cfg = _stage_config(tmp_path, "reward", "ref_logprob")
    SkipManager.init(cfg)

    @SkipManager.annotate(role="reward")
    def reward(batch):
        return torch.tensor([1.0, 2.0])

    @SkipManager.annotate(role="ref_logprob")
    def ref_logprob(batch):
        return torch.tensor([-3.0, -4.0, -5.0])

    SkipManager.set_step(1)
    reward(None)
    ref_logprob(None)
    SkipManager.init(cfg)
    SkipManager.set_step(1)
    assert torch.equal(reward(None), torch.tensor([1.0, 2.0]))
    assert torch.equal(ref_logprob(None), torch.tensor([-3.0, -4.0, -5.0]))


def test_stage_section_needs_kind_stage(tmp_path):
    with pytest.raises(SkipConfigError, match="reward"):
        SkipManager.init({"skip": {"reward": {"enable": True, "dump_dir": str(tmp_path)}}})


# --------------------------------------------------------------------------- RolloutSkip helpers


def test_project_and_step_dump_dir(tmp_path):
    role = role_for(tmp_path)
    assert role.project_dump_dir == str(project_dir(tmp_path))
    assert role.step_dump_dir(3) == str(project_dir(tmp_path) / "3")
    assert role.step_dump_dir(0) == str(project_dir(tmp_path) / "0")


def test_dump_dir_tilde_expanded_in_paths_not_in_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    role = role_for("~/dumps")
    assert SkipManager.config.rollout.dump_dir == "~/dumps"
    assert role.project_dump_dir == str(tmp_path / "dumps" / "exp_proj" / "GBS4_N2_in8_out6")


def test_unsafe_names_do_not_escape_dump_dir(tmp_path):
    cfg = make_config(tmp_path / "dump")
    cfg["trainer"] = {"experiment_name": "../../escape", "project_name": "a/../b"}
    SkipManager.init(cfg)
    role = SkipManager.skip_instances["rollout"]
    resolved = Path(os.path.realpath(role.step_dump_dir(1)))
    assert resolved.is_relative_to(os.path.realpath(tmp_path / "dump"))
    assert Path(role.project_dump_dir).parent.parent == tmp_path / "dump"
    SkipManager.set_step(1)
    generate(None, PROMPTS)
    assert [p.name for p in tmp_path.iterdir()] == ["dump"]


def test_available_steps_lists_only_valid_entries(tmp_path):
    record(tmp_path, [1, 3, 10, 5, 6])
    root = project_dir(tmp_path)
    (root / "5" / "meta.json").write_text("{garbage")                           # unreadable meta
    data = root / "6" / "data.safetensors"
    data.write_bytes(data.read_bytes()[:-7])                                   # truncated data file
    shutil.copytree(root / "1", root / ".tmp-4-0123456789ab")                  # a writer's leftover
    shutil.copytree(root / "1", root / ".trash-2-0123456789ab")                # an overwrite's leftover
    shutil.copytree(root / "1", root / "notes")
    shutil.copytree(root / "1", root / "7a")
    shutil.copytree(root / "1", root / "-8")
    (root / "9").write_bytes(b"a file, not an entry")
    (root / "11").mkdir()                                                      # no meta.json
    (root / "12").mkdir()
    (root / "12" / "data.safetensors").write_bytes(b"half a file")             # verl-style crash: no meta
    role = role_for(tmp_path)
    assert role.available_steps() == [1, 3, 10]

    # a cache run replaces every one of them with a valid entry
    CALLS.clear()
    for step in (1, 3, 5, 6, 9, 10, 11, 12):
        SkipManager.set_step(step)
        assert generate(None, PROMPTS).meta_info == {"step": step}
    assert CALLS == [5, 6, 9, 11, 12]
    assert role.available_steps() == [1, 3, 5, 6, 9, 10, 11, 12]
    assert (root / "9").is_dir()


def test_available_steps_empty_without_project_dir(tmp_path):
    assert role_for(tmp_path / "nothing_here").available_steps() == []


def test_available_steps_ignores_non_ascii_digit_names(tmp_path):
    record(tmp_path, [1])
    (project_dir(tmp_path) / "\u00b2").mkdir()
    assert role_for(tmp_path).available_steps() == [1]


@pytest.fixture
def entries_2_5_9(tmp_path):
    record(tmp_path, [2, 5, 9])
    return tmp_path


@pytest.mark.parametrize(("action", "expected"), [
    ("cache", {5: 5, 2: 2, 3: -1, 0: -1, 10: -1}),
    ("replay", {5: 5, 2: 2, 3: -1, 0: -1, 10: -1}),
    ("repeat", {5: 5, 3: 2, 6: 5, 8: 5, 0: 2, 1: 2, 10: 9, 100: 9}),
    ("record", {5: -1, 2: -1, 3: -1}),
])
def test_resolve_load_step_per_action(entries_2_5_9, action, expected):
    role = role_for(entries_2_5_9, action)
    assert {step: role.resolve_load_step(step) for step in expected} == expected


def test_resolve_load_step_random_is_seeded_and_available(entries_2_5_9):
    picks = {}
    for seed in range(10):
        role = role_for(entries_2_5_9, "random", seed=seed)
        picks[seed] = [role.resolve_load_step(step) for step in (1, 3, 5, 42)]
        assert set(picks[seed]) <= {2, 5, 9}
        again = role_for(entries_2_5_9, "random", seed=seed)
        assert [again.resolve_load_step(step) for step in (1, 3, 5, 42)] == picks[seed]
    assert len({tuple(p) for p in picks.values()}) > 1


def test_resolve_load_step_repeat_sees_changes_at_once(entries_2_5_9):
    role = role_for(entries_2_5_9, "repeat")
    root = project_dir(entries_2_5_9)
    assert role.resolve_load_step(4) == 2
    shutil.copytree(root / "2", root / "3")
    assert role.resolve_load_step(4) == 3
    shutil.rmtree(root / "2")
    shutil.rmtree(root / "3")
    shutil.rmtree(root / "5")
    assert role.resolve_load_step(4) == 9
    shutil.rmtree(root / "9")
    assert role.resolve_load_step(4) == -1
    assert role.available_steps() == []


def test_resolve_load_step_repeat_skips_damaged_entries(entries_2_5_9):
    root = project_dir(entries_2_5_9)
    (root / "5" / "meta.json").write_text("not json")
    role = role_for(entries_2_5_9, "repeat")
    assert role.available_steps() == [2, 9]
    assert role.resolve_load_step(5) == 2
    assert role.resolve_load_step(7) == 2


def test_repeat_replays_what_resolve_load_step_names(entries_2_5_9):
    role_for(entries_2_5_9, "repeat")
    CALLS.clear()
    SkipManager.set_step(7)
    out = generate(None, PROMPTS)
    assert CALLS == []
    assert out.meta_info == {"step": 5}
    assert np.array_equal(out.non_tensor_batch["step"], np.array([5, 5], dtype=object))
