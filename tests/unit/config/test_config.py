"""Validation and parsing of the ``skip`` section (stepskip.config)."""

from __future__ import annotations

import dataclasses
import sys
import tracemalloc
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from omegaconf import DictConfig, OmegaConf

import stepskip.config
from stepskip import (
    AsyncRolloutSkipConfig,
    RolloutSkipConfig,
    RolloutTqSkipConfig,
    SkipConfigError,
    SkipManagerConfig,
)
from stepskip.config import SkipRoleConfig, StepSet, disable_legacy_flag, select
from stepskip._index import compress_steps

ROLE_CLASSES = [RolloutSkipConfig, RolloutTqSkipConfig, AsyncRolloutSkipConfig]
ROLE_NAMES = {RolloutSkipConfig: "rollout", RolloutTqSkipConfig: "rollout_tq", AsyncRolloutSkipConfig: "async_rollout"}
ALL_ACTIONS = ["cache", "repeat", "random", "replay", "record"]
BOOL_FIELDS = ["enable", "allow_pickle", "verify", "async_dump"]


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("cls", ROLE_CLASSES)
def test_role_defaults_match_the_seed(cls: type[SkipRoleConfig]) -> None:
    cfg = cls()
    assert cfg.enable is False
    assert cfg.dump_dir == "~/.verl/rollout_dump"
    assert cfg.steps == []
    assert cfg.action == "cache"
    assert cfg.format == "safe"
    assert cfg.allow_pickle is False
    assert cfg.verify is True
    assert cfg.async_dump is True
    assert cfg.compress == "auto"
    assert cfg.seed == 0
    assert cfg.rebind_keys == ["uid"]
    assert cfg.check_prompts == "warn"
    assert cfg.on_mismatch == "warn"
    assert cfg.fingerprint_keys == []
    assert not cfg.step_set
    assert 0 not in cfg.step_set


def test_mutable_defaults_are_not_shared() -> None:
    a, b = RolloutSkipConfig(), RolloutSkipConfig()
    a.rebind_keys.append("other")
    a.steps.append(1)
    assert b.rebind_keys == ["uid"]
    assert b.steps == []


def test_dump_dir_keeps_the_value_given() -> None:
    assert RolloutSkipConfig(dump_dir="~/x").dump_dir == "~/x"
    assert RolloutSkipConfig(dump_dir="s3://bucket/prefix").dump_dir == "s3://bucket/prefix"


# --------------------------------------------------------------------------- bool fields


@pytest.mark.parametrize("cls", ROLE_CLASSES)
@pytest.mark.parametrize("key", BOOL_FIELDS)
@pytest.mark.parametrize("bad", [1, 0, "true", "True", "false", None, 1.0])
def test_bool_fields_reject_non_bools(cls: type[SkipRoleConfig], key: str, bad: Any) -> None:
    with pytest.raises(SkipConfigError) as info:
        cls(**{key: bad})
    msg = str(info.value)
    assert f"skip.{ROLE_NAMES[cls]}.{key}" in msg
    assert repr(bad) in msg
    assert "allowed values" in msg
    assert "true" in msg and "false" in msg


@pytest.mark.parametrize("key", BOOL_FIELDS)
@pytest.mark.parametrize("good", [True, False])
def test_bool_fields_accept_bools(key: str, good: bool) -> None:
    kwargs: dict[str, Any] = {key: good}
    if key == "allow_pickle":
        kwargs["format"] = "safe"
    assert getattr(RolloutSkipConfig(**kwargs), key) is good


def test_skip_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        RolloutSkipConfig(enable="yes")


# --------------------------------------------------------------------------- dump_dir


@pytest.mark.parametrize("bad", ["", "   ", None, 3, ["/tmp"], b"/tmp"])
def test_dump_dir_must_be_a_non_empty_str(bad: Any) -> None:
    with pytest.raises(SkipConfigError) as info:
        RolloutSkipConfig(dump_dir=bad)
    assert "skip.rollout.dump_dir" in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("good", ["/tmp/x", "relative/dir", "~/.cache/x", "s3://bucket/prefix", "file:///tmp/x"])
def test_dump_dir_accepts_paths_and_urls(good: str) -> None:
    assert RolloutSkipConfig(dump_dir=good).dump_dir == good


# --------------------------------------------------------------------------- steps


@pytest.mark.parametrize(
    "steps",
    [[], [0], [1, 2, 3], [5, 5, 5], (1, 2), ["1-128"], ["10-100:10"], ["all"], "all", ["7"], [1, "3-5", "all"],
     [" 1 - 4 "], ["ALL"], 3, 0, "1-6,8,10", "1-5, 8, 10-20:2", ["1-3,7", 9]],
)
def test_steps_accepted(steps: Any) -> None:
    cfg = RolloutSkipConfig(steps=steps)
    assert cfg.steps == steps


@pytest.mark.parametrize(
    "bad",
    [[True], [False], [1, True], [-1], [1.0], [1.5], [None], [[1]], [{"a": 1}], True, -3, None, {"a": 1}, 2.0],
)
def test_steps_rejects_non_lists_bools_negatives_and_non_ints(bad: Any) -> None:
    with pytest.raises(SkipConfigError) as info:
        RolloutSkipConfig(steps=bad)
    msg = str(info.value)
    assert "skip.rollout.steps" in msg
    # the message names the offending item (or the whole value)
    offending = [x for x in bad if isinstance(x, bool) or not isinstance(x, int) or x < 0][0] \
        if isinstance(bad, list) else bad
    assert repr(offending) in msg


@pytest.mark.parametrize("bad", ["5-1", "1-5:0", "x", "1-", "-3", "1-5:", "1..5", "1-5:-1", "one-two", ""])
def test_malformed_range_strings_rejected_naming_the_key(bad: str) -> None:
    with pytest.raises(SkipConfigError) as info:
        RolloutSkipConfig(steps=[bad])
    msg = str(info.value)
    assert "skip.rollout.steps" in msg
    assert repr(bad) in msg


def test_bare_malformed_string_rejected() -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.steps"):
        RolloutSkipConfig(steps="5-1")


@pytest.mark.parametrize("bad", ["1,,2", "1-6,8,", ",3", "1-6,x", "1-6;8"])
def test_comma_strings_with_a_bad_piece_rejected_naming_it(bad: str) -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.steps contains '") as info:
        RolloutSkipConfig(steps=bad)
    assert "1-6,8,10" in str(info.value)  # the accepted forms are listed


@pytest.mark.parametrize(("steps", "members"), [
    ("1-6,8,10", {1, 2, 3, 4, 5, 6, 8, 10}),
    (3, {3}),
    ("2-10:4,all", set(range(12))),
    ("  7 ", {7}),
])
def test_string_and_single_int_steps_select_those_steps(steps: Any, members: set[int]) -> None:
    cfg = SkipManagerConfig.from_section({"rollout": {"enable": True, "steps": steps}}).rollout
    assert {s for s in range(12) if s in cfg.step_set} == members
    assert {s for s in range(12) if s in cfg.step_set.fast()} == members


@given(st.sets(st.integers(min_value=0, max_value=300), min_size=1, max_size=40))
def test_the_steps_stepskip_ls_prints_parse_back_to_the_same_steps(steps: set[int]) -> None:
    printed = compress_steps(steps)  # what `stepskip ls` shows, for pasting into skip.<role>.steps
    parsed = RolloutSkipConfig(steps=printed).step_set
    assert {s for s in range(302) if s in parsed} == steps


def test_hydra_string_override_of_steps() -> None:
    """verl's yaml gives ``steps: []``; a quoted string from the command line replaces it."""
    base = OmegaConf.create({"skip": {"rollout": {"enable": False, "steps": []}}})
    OmegaConf.set_struct(base, True)
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(["skip.rollout.enable=true", "skip.rollout.steps=1-6,8"]))
    cfg = SkipManagerConfig.from_section(merged.skip)
    assert 6 in cfg.rollout.step_set and 7 not in cfg.rollout.step_set and 8 in cfg.rollout.step_set


@pytest.mark.parametrize("cls", ROLE_CLASSES)
def test_steps_error_names_each_role(cls: type[SkipRoleConfig]) -> None:
    with pytest.raises(SkipConfigError, match=rf"skip\.{ROLE_NAMES[cls]}\.steps"):
        cls(steps=["5-1"])


# --------------------------------------------------------------------------- StepSet membership


def test_explicit_membership() -> None:
    s = RolloutSkipConfig(steps=[1, 3, 7]).step_set
    assert [i for i in range(10) if i in s] == [1, 3, 7]


def test_inclusive_range_membership() -> None:
    s = StepSet.parse(["1-128"])
    assert 1 in s and 64 in s and 128 in s
    assert 0 not in s and 129 not in s


def test_strided_range_membership() -> None:
    s = StepSet.parse(["10-100:10"])
    assert [i for i in range(0, 120) if i in s] == list(range(10, 101, 10))


def test_strided_range_end_not_on_stride() -> None:
    s = StepSet.parse(["1-10:4"])
    assert [i for i in range(0, 15) if i in s] == [1, 5, 9]


def test_single_point_range() -> None:
    s = StepSet.parse(["5-5"])
    assert [i for i in range(10) if i in s] == [5]


def test_mixed_membership() -> None:
    s = StepSet.parse([2, "10-12", "20-30:5"])
    assert [i for i in range(40) if i in s] == [2, 10, 11, 12, 20, 25, 30]


@pytest.mark.parametrize("spec", ["all", ["all"], [3, "all"], ["All"]])
def test_all_membership(spec: Any) -> None:
    s = StepSet.parse(spec)
    assert 0 in s and 1 in s and 10**12 in s
    assert -1 not in s


def test_empty_step_set_is_falsy_and_has_no_members() -> None:
    s = StepSet.parse([])
    assert not s
    assert all(i not in s for i in range(10))


def test_step_set_truthiness() -> None:
    assert StepSet.parse([0])
    assert StepSet.parse(["1-2"])
    assert StepSet.parse("all")


@pytest.mark.parametrize("spec", [[1, 2, 3], ["0-10"], ["0-10:2"], "all"])
@pytest.mark.parametrize("step", [-1, -2, -10**9])
def test_negative_steps_never_members(spec: Any, step: int) -> None:
    assert step not in StepSet.parse(spec)


@pytest.mark.parametrize("spec", [[1, 2, 3], ["0-10"], "all"])
@pytest.mark.parametrize("step", ["1", None, 2.5, "all", (1,), b"1"])
def test_non_int_values_never_members(spec: Any, step: Any) -> None:
    assert step not in StepSet.parse(spec)


@pytest.mark.parametrize("spec", [[1, 2, 3], ["0-10"], "all"])
def test_bools_are_not_members(spec: Any) -> None:
    s = StepSet.parse(spec)
    assert True not in s and False not in s


@pytest.mark.parametrize("spec", [[5], ["0-10"], ["1-9:2"], "all"])
def test_numpy_integers_are_members_like_ints(spec: Any) -> None:
    s = StepSet.parse(spec)
    assert np.int64(5) in s and np.int32(5) in s and np.uint8(5) in s
    assert (np.int64(-5) in s) is False


@pytest.mark.parametrize("spec", [[1, 2, 3], ["0-10"], "all"])
def test_integral_float_is_not_a_member(spec: Any) -> None:
    assert 1.0 not in StepSet.parse(spec)
    assert np.float64(2.0) not in StepSet.parse(spec)


def test_non_int_membership_does_not_scan_ranges() -> None:
    class CountingEq:
        calls = 0

        def __eq__(self, other: object) -> bool:
            CountingEq.calls += 1
            if CountingEq.calls > 1000:
                raise AssertionError("membership is iterating over the range")
            return False

        def __hash__(self) -> int:
            return 12345

    s = StepSet.parse(["0-1000000000"])
    assert CountingEq() not in s
    assert CountingEq.calls < 1000


def _python_lines_run_in(filename: str, fn: Any, limit: int) -> tuple[Any, int]:
    """Call ``fn()``, counting the Python lines it runs in ``filename``; fail once over ``limit``.

    An operation count instead of a stopwatch: it does not depend on how loaded the machine is.
    """
    count = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count > limit:
                raise AssertionError(f"more than {limit} Python lines run in {filename}: a loop over the steps?")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == filename else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        result = fn()
    finally:
        sys.settrace(previous)
    return result, count


def test_huge_range_membership_is_constant_work_and_small() -> None:
    tracemalloc.start()
    try:
        s = RolloutSkipConfig(steps=["0-1000000000", "5-2000000000:7"]).step_set
        probes = range(0, 10**9, 10**6)
        # ~10 lines per lookup whatever the range size; iterating a range would run billions
        hits, lines = _python_lines_run_in(stepskip.config.__file__, lambda: sum(1 for i in probes if i in s),
                                           limit=50 * len(probes))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert hits == 1000
    assert 0 < lines <= 50 * len(probes)
    assert 1_000_000_000 in s and 1_000_000_001 not in s
    assert 5 + 7 * 10**8 in s
    assert peak < 1_000_000  # no expansion of a billion-element range


def test_string_digit_step_is_an_int() -> None:
    s = StepSet.parse(["7", " 8 "])
    assert 7 in s and 8 in s and "7" not in s


# --------------------------------------------------------------------------- action


@pytest.mark.parametrize("cls", ROLE_CLASSES)
@pytest.mark.parametrize("action", ALL_ACTIONS)
def test_actions_accepted(cls: type[SkipRoleConfig], action: str) -> None:
    assert cls(action=action).action == action


@pytest.mark.parametrize("cls", ROLE_CLASSES)
@pytest.mark.parametrize("bad", ["empty", "CACHE", "Cache", "", "skip", None, 1, ["cache"]])
def test_other_actions_rejected_listing_the_allowed_values(cls: type[SkipRoleConfig], bad: Any) -> None:
    with pytest.raises(SkipConfigError) as info:
        cls(action=bad)
    msg = str(info.value)
    assert f"skip.{ROLE_NAMES[cls]}.action" in msg
    assert repr(bad) in msg
    assert "allowed values" in msg
    for action in ALL_ACTIONS:
        assert action in msg


# --------------------------------------------------------------------------- other choice fields


@pytest.mark.parametrize(
    ("key", "bad", "allowed"),
    [
        ("format", "pickle", ["safe", "verl"]),
        ("compress", "gzip", ["auto", "none", "zstd"]),
        ("check_prompts", "ignore", ["warn", "error", "off"]),
        ("on_mismatch", "skip", ["warn", "error", "regenerate"]),
    ],
)
def test_choice_fields_rejected_listing_allowed_values(key: str, bad: str, allowed: list[str]) -> None:
    with pytest.raises(SkipConfigError) as info:
        RolloutSkipConfig(**{key: bad})
    msg = str(info.value)
    assert f"skip.rollout.{key}" in msg and repr(bad) in msg and "allowed values" in msg
    for a in allowed:
        assert a in msg


@pytest.mark.parametrize("bad", [True, "0", 1.0, None])
def test_seed_must_be_an_int(bad: Any) -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.seed"):
        RolloutSkipConfig(seed=bad)


@pytest.mark.parametrize("key", ["rebind_keys", "fingerprint_keys"])
@pytest.mark.parametrize("bad", ["uid", [1], None, ["a", None]])
def test_string_list_fields(key: str, bad: Any) -> None:
    with pytest.raises(SkipConfigError, match=rf"skip\.rollout\.{key}"):
        RolloutSkipConfig(**{key: bad})


def test_format_verl_requires_allow_pickle() -> None:
    with pytest.raises(SkipConfigError) as info:
        RolloutSkipConfig(format="verl")
    assert "allow_pickle" in str(info.value)
    assert "skip.rollout" in str(info.value)
    cfg = RolloutSkipConfig(format="verl", allow_pickle=True)
    assert cfg.format == "verl" and cfg.allow_pickle is True


def test_format_verl_requires_allow_pickle_through_from_section() -> None:
    with pytest.raises(SkipConfigError, match="allow_pickle") as info:
        SkipManagerConfig.from_section({"async_rollout": {"format": "verl"}})
    assert "skip.async_rollout" in str(info.value)


# --------------------------------------------------------------------------- from_section


def test_from_section_none_and_empty_give_defaults() -> None:
    for section in (None, {}, OmegaConf.create({})):
        cfg = SkipManagerConfig.from_section(section)
        assert isinstance(cfg.rollout, RolloutSkipConfig)
        assert isinstance(cfg.rollout_tq, RolloutTqSkipConfig)
        assert isinstance(cfg.async_rollout, AsyncRolloutSkipConfig)
        assert cfg.rollout.enable is False and cfg.extra == {}


def test_from_section_plain_dict() -> None:
    cfg = SkipManagerConfig.from_section(
        {"rollout": {"enable": True, "steps": [1, "3-4"], "action": "repeat", "dump_dir": "/d"},
         "async_rollout": {"enable": True, "steps": "all"}}
    )
    assert cfg.rollout.enable is True
    assert cfg.rollout.action == "repeat"
    assert cfg.rollout.dump_dir == "/d"
    assert [i for i in range(6) if i in cfg.rollout.step_set] == [1, 3, 4]
    assert 99 in cfg.async_rollout.step_set
    assert cfg.rollout_tq.enable is False
    assert cfg.role("rollout") is cfg.rollout
    assert cfg.role("nope") is None


def test_from_section_hydra_cli_dotlist() -> None:
    root = OmegaConf.from_dotlist(
        ["skip.rollout.enable=True", "skip.rollout.steps=[1,2,3]", "skip.rollout.action=cache"]
    )
    assert isinstance(root.skip, DictConfig)
    cfg = SkipManagerConfig.from_section(root.skip)
    assert cfg.rollout.enable is True
    assert cfg.rollout.steps == [1, 2, 3]
    assert type(cfg.rollout.steps) is list
    assert cfg.rollout.action == "cache"
    assert [i for i in range(5) if i in cfg.rollout.step_set] == [1, 2, 3]


def test_from_section_hydra_cli_range_strings() -> None:
    root = OmegaConf.from_dotlist(["skip.rollout.enable=true", "skip.rollout.steps=[1-4,10-20:5]"])
    cfg = SkipManagerConfig.from_section(root.skip)
    assert [i for i in range(25) if i in cfg.rollout.step_set] == [1, 2, 3, 4, 10, 15, 20]


def test_from_section_hydra_cli_int_enable_rejected() -> None:
    root = OmegaConf.from_dotlist(["skip.rollout.enable=1"])
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.enable = 1 "):
        SkipManagerConfig.from_section(root.skip)


def test_from_section_dictconfig_resolves_interpolations() -> None:
    root = OmegaConf.create(
        {"trainer": {"dir": "/runs/x"}, "skip": {"rollout": {"enable": True, "dump_dir": "${trainer.dir}/dump"}}}
    )
    cfg = SkipManagerConfig.from_section(root.skip)
    assert cfg.rollout.dump_dir == "/runs/x/dump"


def test_from_section_read_only_and_struct_dictconfig() -> None:
    root = OmegaConf.create({"skip": {"rollout": {"enable": True, "steps": [2]}}})
    OmegaConf.set_readonly(root, True)
    OmegaConf.set_struct(root, True)
    cfg = SkipManagerConfig.from_section(root.skip)
    assert cfg.rollout.enable is True and 2 in cfg.rollout.step_set


def test_from_section_structured_role_node() -> None:
    node = OmegaConf.structured(RolloutSkipConfig(enable=True, steps=[4]))
    cfg = SkipManagerConfig.from_section({"rollout": node})
    assert cfg.rollout.enable is True and cfg.rollout.steps == [4]


def test_from_section_ignores_hydra_private_keys() -> None:
    cfg = SkipManagerConfig.from_section({"_target_": "x.y", "rollout": {"enable": True}})
    assert cfg.rollout.enable is True
    assert cfg.extra == {}


def test_from_section_dataclass_instances() -> None:
    @dataclass
    class SkipSection:
        rollout: RolloutSkipConfig = field(default_factory=lambda: RolloutSkipConfig(enable=True, steps=[5]))
        async_rollout: Any = field(default_factory=lambda: {"enable": True, "action": "random"})

    cfg = SkipManagerConfig.from_section(SkipSection())
    assert cfg.rollout.enable is True and 5 in cfg.rollout.step_set
    assert isinstance(cfg.async_rollout, AsyncRolloutSkipConfig)
    assert cfg.async_rollout.action == "random"


def test_from_section_role_dataclass_of_another_role_class() -> None:
    cfg = SkipManagerConfig.from_section({"async_rollout": RolloutSkipConfig(enable=True, steps=[1])})
    assert isinstance(cfg.async_rollout, AsyncRolloutSkipConfig)
    assert cfg.async_rollout.enable is True


def test_from_section_revalidates_mutated_dataclass() -> None:
    role = RolloutSkipConfig(enable=True)
    role.enable = 1  # type: ignore[assignment]
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.enable = 1"):
        SkipManagerConfig.from_section({"rollout": role})


def test_from_section_attribute_objects() -> None:
    section = SimpleNamespace(rollout=SimpleNamespace(enable=True, steps=[1, 2], action="replay"))
    cfg = SkipManagerConfig.from_section(section)
    assert cfg.rollout.enable is True
    assert cfg.rollout.action == "replay"
    assert 2 in cfg.rollout.step_set


def test_from_section_attribute_object_validated() -> None:
    section = SimpleNamespace(rollout_tq=SimpleNamespace(enable="on"))
    with pytest.raises(SkipConfigError, match=r"skip\.rollout_tq\.enable = 'on'"):
        SkipManagerConfig.from_section(section)


def test_from_section_returns_an_existing_manager_config() -> None:
    cfg = SkipManagerConfig.from_section({"rollout": {"enable": True}})
    assert SkipManagerConfig.from_section(cfg) is cfg


@pytest.mark.parametrize("role", ["rollout", "rollout_tq", "async_rollout"])
def test_errors_inside_from_section_name_the_role(role: str) -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({role: {"enable": True, "action": "bogus"}})
    assert f"skip.{role}.action = 'bogus'" in str(info.value)


@pytest.mark.parametrize("role", ["rollout", "rollout_tq", "async_rollout"])
def test_unknown_keys_in_role_rejected_listing_known_keys(role: str) -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({role: {"enable": True, "stpes": [1], "zzz": 1}})
    msg = str(info.value)
    assert f"skip.{role}" in msg
    assert "'stpes'" in msg and "'zzz'" in msg
    assert "known keys" in msg
    for f in dataclasses.fields(RolloutSkipConfig):
        assert f.name in msg


@pytest.mark.parametrize(("typo", "meant"), [("step", "steps"), ("dumpdir", "dump_dir"), ("actoin", "action"),
                                             ("check_prompt", "check_prompts"), ("enabled", "enable")])
def test_a_mistyped_key_gets_the_closest_known_one(typo: str, meant: str) -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({"rollout": {"enable": True, typo: 1}})
    assert f"'{typo}' (did you mean `{meant}`?)" in str(info.value)


def test_a_key_like_no_known_one_gets_no_suggestion() -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({"rollout": {"zzz": 1}})
    assert "did you mean" not in str(info.value)


def test_a_stage_role_suggests_its_own_keys() -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.reward has unknown key\(s\) 'rowwise' \(did you mean `row_wise`\?\)"):
        SkipManagerConfig.from_section({"reward": {"kind": "stage", "rowwise": True}})


def test_a_mistyped_role_gets_the_closest_known_one() -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.rolout is not a known skip role \(did you mean `rollout`\?\)"):
        SkipManagerConfig.from_section({"rolout": {"enable": True}})


def test_step_set_is_not_an_accepted_key() -> None:
    with pytest.raises(SkipConfigError, match="step_set"):
        SkipManagerConfig.from_section({"rollout": {"step_set": [1]}})


def test_unknown_role_rejected_listing_known_roles() -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({"rollot": {"enable": True}})
    msg = str(info.value)
    assert "skip.rollot" in msg
    for known in ("rollout", "rollout_tq", "async_rollout"):
        assert known in msg


def test_unknown_role_with_other_kind_rejected() -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.reward"):
        SkipManagerConfig.from_section({"reward": {"kind": "function", "enable": True}})


def test_non_mapping_section_rejected() -> None:
    with pytest.raises(SkipConfigError):
        SkipManagerConfig.from_section(["rollout"])
    with pytest.raises(SkipConfigError, match=r"skip\.rollout"):
        SkipManagerConfig.from_section({"rollout": ["enable"]})


# --------------------------------------------------------------------------- registered roles


@dataclass
class _LimitedConfig(SkipRoleConfig):
    section: ClassVar[str] = "skip.limited"
    allowed_actions: ClassVar[tuple[str, ...]] = ("cache", "repeat")


def test_registered_role_config_class() -> None:
    cfg = SkipManagerConfig.from_section({"limited": {"enable": True, "action": "repeat"}},
                                         config_classes={"limited": _LimitedConfig})
    assert isinstance(cfg.limited, _LimitedConfig)
    assert cfg.role("limited") is cfg.limited
    assert cfg.limited.action == "repeat"


def test_registered_role_restricts_actions() -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({"limited": {"action": "random"}}, config_classes={"limited": _LimitedConfig})
    msg = str(info.value)
    assert "skip.limited.action = 'random'" in msg
    assert "cache, repeat" in msg and "replay" not in msg


def test_unknown_role_error_lists_registered_roles() -> None:
    with pytest.raises(SkipConfigError, match="limited"):
        SkipManagerConfig.from_section({"other": {}}, config_classes={"limited": _LimitedConfig})


# --------------------------------------------------------------------------- kind: stage


def test_stage_section_is_an_extra_role() -> None:
    cfg = SkipManagerConfig.from_section(
        {"reward": {"kind": "stage", "enable": True, "steps": "all", "action": "repeat"},
         "rollout": {"enable": True}}
    )
    assert "reward" in cfg.extra
    assert cfg.reward is cfg.extra["reward"]
    assert cfg.role("reward") is cfg.reward
    assert isinstance(cfg.reward, SkipRoleConfig)
    assert cfg.reward.enable is True
    assert cfg.reward.action == "repeat"
    assert 17 in cfg.reward.step_set
    assert cfg.reward.kind == "stage"
    with pytest.raises(AttributeError):
        cfg.not_a_role  # noqa: B018


def test_stage_section_from_dictconfig() -> None:
    root = OmegaConf.from_dotlist(["skip.ref_logprob.kind=stage", "skip.ref_logprob.enable=True",
                                   "skip.ref_logprob.steps=[1,2]"])
    cfg = SkipManagerConfig.from_section(root.skip)
    assert cfg.ref_logprob.enable is True
    assert 2 in cfg.ref_logprob.step_set and 3 not in cfg.ref_logprob.step_set


def test_a_stage_role_learns_its_name_when_bound(tmp_path) -> None:
    from stepskip import SkipManager

    SkipManager.init({"skip": {"myname": {"kind": "stage", "enable": True, "dump_dir": str(tmp_path)}}})
    role = SkipManager.skip_instances["myname"]
    assert role.name == "myname"
    assert role.project_dump_dir.endswith("/GBS0_N0_in0_out0/myname")


def test_stage_section_validation_names_the_stage() -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({"reward": {"kind": "stage", "enable": 1}})
    assert "skip.reward.enable = 1" in str(info.value)


def test_stage_section_unknown_key_lists_known_keys() -> None:
    with pytest.raises(SkipConfigError) as info:
        SkipManagerConfig.from_section({"reward": {"kind": "stage", "bogus": 1}})
    msg = str(info.value)
    assert "skip.reward" in msg and "'bogus'" in msg and "known keys" in msg and "kind" in msg


# --------------------------------------------------------------------------- select


def test_select_on_dicts() -> None:
    cfg = {"a": {"b": {"c": 3}, "z": None, "zero": 0, "f": False}}
    assert select(cfg, "a.b.c") == 3
    assert select(cfg, "a.b") == {"c": 3}
    assert select(cfg, "a.x.c", "d") == "d"
    assert select(cfg, "a.z", "d") == "d"  # None counts as missing
    assert select(cfg, "a.zero", "d") == 0
    assert select(cfg, "a.f", "d") is False
    assert select(cfg, "a.b.c.d", "d") == "d"
    assert select(None, "a", "d") == "d"
    assert cfg == {"a": {"b": {"c": 3}, "z": None, "zero": 0, "f": False}}  # nothing created


def test_select_on_dictconfig() -> None:
    cfg = OmegaConf.create({"a": {"b": {"c": 3}, "m": "???", "n": None, "i": "${a.b.c}"}})
    OmegaConf.set_struct(cfg, True)
    assert select(cfg, "a.b.c") == 3
    assert select(cfg, "a.i") == 3
    assert select(cfg, "a.missing", "d") == "d"
    assert select(cfg, "a.m", "d") == "d"
    assert select(cfg, "a.n", "d") == "d"
    assert select(cfg, "a.b.zz.yy", 7) == 7
    assert "missing" not in cfg.a


def test_select_on_attribute_objects() -> None:
    cfg = SimpleNamespace(a=SimpleNamespace(b=SimpleNamespace(c=3), n=None))
    assert select(cfg, "a.b.c") == 3
    assert select(cfg, "a.b.x", "d") == "d"
    assert select(cfg, "a.n", "d") == "d"

    @dataclass
    class Inner:
        c: int = 4

    @dataclass
    class Outer:
        b: Inner = field(default_factory=Inner)

    assert select({"a": Outer()}, "a.b.c") == 4


# --------------------------------------------------------------------------- legacy flag


def _both_on(kind: str) -> Any:
    cfg: Any = {"skip": {"rollout": {"enable": True}},
                "actor_rollout_ref": {"rollout": {"skip": {"enable": True, "dump_dir": "/x"}}}}
    if kind == "dictconfig":
        cfg = OmegaConf.create(cfg)
    elif kind == "readonly":
        cfg = OmegaConf.create(cfg)
        OmegaConf.set_readonly(cfg, True)
    return cfg


@pytest.mark.parametrize("kind", ["dict", "dictconfig", "readonly"])
def test_legacy_flag_disabled_with_deprecation_warning(kind: str) -> None:
    cfg = _both_on(kind)
    skip = SkipManagerConfig.from_section(select(cfg, "skip"))
    with pytest.warns(DeprecationWarning, match="legacy"):
        disable_legacy_flag(cfg, skip)
    assert select(cfg, "actor_rollout_ref.rollout.skip.enable") is False
    assert select(cfg, "actor_rollout_ref.rollout.skip.dump_dir") == "/x"  # the rest untouched
    assert select(cfg, "skip.rollout.enable") is True
    if kind == "readonly":
        assert OmegaConf.is_readonly(cfg)  # flag restored after the write


def test_legacy_flag_on_attribute_config() -> None:
    legacy = SimpleNamespace(enable=True)
    cfg = SimpleNamespace(skip=SimpleNamespace(rollout=SimpleNamespace(enable=True)),
                          actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(skip=legacy)))
    with pytest.warns(DeprecationWarning):
        disable_legacy_flag(cfg, SkipManagerConfig.from_section(cfg.skip))
    assert legacy.enable is False


@pytest.mark.parametrize("kind", ["dict", "dictconfig", "readonly"])
@pytest.mark.parametrize(("new_on", "legacy_on"), [(False, True), (True, False), (False, False)])
def test_legacy_flag_untouched_unless_both_on(kind: str, new_on: bool, legacy_on: bool) -> None:
    cfg: Any = {"skip": {"rollout": {"enable": new_on}},
                "actor_rollout_ref": {"rollout": {"skip": {"enable": legacy_on}}}}
    if kind != "dict":
        cfg = OmegaConf.create(cfg)
        if kind == "readonly":
            OmegaConf.set_readonly(cfg, True)
    skip = SkipManagerConfig.from_section(select(cfg, "skip"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_legacy_flag(cfg, skip)
    assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert select(cfg, "actor_rollout_ref.rollout.skip.enable") is legacy_on


def test_legacy_flag_absent_section() -> None:
    cfg = {"skip": {"rollout": {"enable": True}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disable_legacy_flag(cfg, SkipManagerConfig.from_section(cfg["skip"]))
    assert not caught
    assert cfg == {"skip": {"rollout": {"enable": True}}}


def test_numpy_bool_enable_rejected() -> None:
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.enable"):
        RolloutSkipConfig(enable=np.bool_(True))


def test_a_plain_dict_config_does_not_import_omegaconf(tmp_path):
    """Only an imported omegaconf can have made a config node: ``init`` with plain dicts leaves it
    unimported (its import, with its grammar's parser, took 0.1-0.2 s of every start-up)."""
    import subprocess
    import sys

    code = ("import sys\nfrom stepskip import SkipManager\n"
            "SkipManager.init({'skip': {'rollout': {'enable': True, 'steps': 'all', 'dump_dir': sys.argv[1]}}})\n"
            "print('omegaconf' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
