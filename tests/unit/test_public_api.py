"""The public namespace is a contract (SPEC §1): code outside this repo imports these names."""

from __future__ import annotations

import inspect

import stepskip

SPEC_NAMES = {
    "SkipManager", "SkipAction", "BaseSkip", "register_skip", "SKIP_REGISTRY", "SkipManagerConfig",
    "RolloutSkipConfig", "RolloutTqSkipConfig", "AsyncRolloutSkipConfig", "SkipConfigError",
    "CacheMissError", "CorruptEntryError", "RolloutSkip", "RolloutTqSkip", "AsyncRolloutSkip",
    "parse_async_rollout_sample_step", "Batch",
    # round 2 (SPEC §6)
    "SkipRoleConfig", "RunIdentity", "UnreadableEntryError",
}


def test_every_spec_name_is_exported():
    missing = {name for name in SPEC_NAMES if not hasattr(stepskip, name)}
    assert not missing


def test_all_lists_exactly_the_public_names():
    assert set(stepskip.__all__) == SPEC_NAMES | {"__version__"}


def test_error_hierarchy():
    assert issubclass(stepskip.CorruptEntryError, stepskip.CacheMissError)
    assert issubclass(stepskip.SkipConfigError, ValueError)


def test_skip_actions():
    names = {a.name for a in stepskip.SkipAction}
    assert {"CACHE", "REPEAT", "RANDOM", "EMPTY", "REPLAY", "RECORD"} <= names
    assert stepskip.SkipAction("cache") is stepskip.SkipAction.CACHE


def test_builtin_roles_are_registered():
    assert stepskip.SKIP_REGISTRY["rollout"] is stepskip.RolloutSkip
    assert stepskip.SKIP_REGISTRY["async_rollout"] is stepskip.AsyncRolloutSkip
    assert stepskip.SKIP_REGISTRY["rollout_tq"] is stepskip.RolloutTqSkip


def test_manager_defaults_before_init():
    assert stepskip.SkipManager.config is None
    assert stepskip.SkipManager.step == -1
    assert stepskip.SkipManager.skip_instances == {}


def test_manager_api_is_classmethods():
    for name in ("init", "set_step", "annotate", "annotate_tq", "flush", "close", "reset", "stats", "will_replay"):
        assert inspect.ismethod(getattr(stepskip.SkipManager, name)), name
    assert stepskip.SkipManager.annotate.__doc__
