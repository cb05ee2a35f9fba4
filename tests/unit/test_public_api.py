"""The public namespaces are a contract: code outside this repo imports these names."""

from __future__ import annotations

import inspect
from pathlib import Path

import stepskip

SPEC_NAMES = {
    "SkipManager", "SkipAction", "BaseSkip", "register_skip", "SKIP_REGISTRY", "SkipManagerConfig",
    "RolloutSkipConfig", "RolloutTqSkipConfig", "AsyncRolloutSkipConfig", "SkipConfigError",
    "CacheMissError", "CorruptEntryError", "RolloutSkip", "RolloutTqSkip", "AsyncRolloutSkip",
    "parse_async_rollout_sample_step", "Batch",
    # round 2
    "SkipRoleConfig", "RunIdentity", "UnreadableEntryError",
    # round 3
    "StepskipError",
}

CACHE_NAMES = {
    "CacheIndex", "EntryRecord", "EntryStatus", "Issue", "IssueKind", "RoleSummary", "RunDir", "StepDir", "StepKind",
    "NotACacheError", "CliError", "compress_steps", "open_cache",
    "verify", "verify_runs", "repair", "VerifyReport", "Problem", "RepairResult",
    "plan_prune", "apply_prune", "PrunePlan",
    "convert", "convert_cache", "plan_convert", "ConvertReport", "ConvertedEntry",
}


def test_every_spec_name_is_exported():
    missing = {name for name in SPEC_NAMES if not hasattr(stepskip, name)}
    assert not missing


def test_all_lists_exactly_the_public_names():
    assert set(stepskip.__all__) == SPEC_NAMES | {"__version__"}


def test_stepskip_cache_exports_exactly_its_names():
    import stepskip.cache

    assert set(stepskip.cache.__all__) == CACHE_NAMES
    missing = {name for name in CACHE_NAMES if not hasattr(stepskip.cache, name)}
    assert not missing


def test_error_hierarchy():
    from stepskip.cache import CliError, NotACacheError
    from stepskip.errors import (
        DecodeLimitError,
        DriftError,
        EngineNotStartedError,
        FingerprintMismatchError,
        PickleRefusedError,
        PromptMismatchError,
        ReplayMissError,
        TruncatedEntryError,
        UnstorableValueError,
    )

    assert issubclass(stepskip.CorruptEntryError, stepskip.CacheMissError)
    assert issubclass(stepskip.SkipConfigError, ValueError)
    assert issubclass(stepskip.CacheMissError, LookupError)
    for error in (stepskip.SkipConfigError, stepskip.CacheMissError, stepskip.CorruptEntryError,
                  stepskip.UnreadableEntryError, PickleRefusedError, ReplayMissError, TruncatedEntryError,
                  DecodeLimitError, DriftError, EngineNotStartedError, FingerprintMismatchError, PromptMismatchError, UnstorableValueError, CliError,
                  NotACacheError):
        assert issubclass(error, stepskip.StepskipError), error
    # damage and intact-but-unreadable entries are not configuration errors; a refused pickle is both
    for error in (stepskip.CorruptEntryError, TruncatedEntryError, DecodeLimitError, stepskip.UnreadableEntryError):
        assert not issubclass(error, stepskip.SkipConfigError), error
    assert issubclass(PickleRefusedError, stepskip.UnreadableEntryError)
    assert issubclass(PickleRefusedError, stepskip.SkipConfigError)


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


#: The modules code outside the package may import; every other module's name starts with ``_``.
PUBLIC_MODULES = {
    "stepskip", "stepskip.cache", "stepskip.config", "stepskip.errors", "stepskip.rerun", "stepskip.testing",
    "stepskip.roles", "stepskip.tq", "stepskip.integrations", "stepskip.integrations.verl",
    "stepskip.integrations.trl", "stepskip.pipelines", "stepskip.cli", "stepskip.view",
}


def test_implementation_modules_are_private():
    root = Path(stepskip.__file__).parent
    public = set()
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(["stepskip", *parts])
        if not any(part.startswith("_") for part in parts) and name.count(".") <= 2:
            public.add(name)
    # A public package's own submodules (the pipelines, the roles, the CLI commands) are part of it.
    stray = {name for name in public if name not in PUBLIC_MODULES
             and not any(name.startswith(package + ".") for package in PUBLIC_MODULES - {"stepskip"})}
    assert stray == set(), f"modules outside the public namespaces without a leading underscore: {sorted(stray)}"


def test_stepskip_cache_lists_and_verifies_without_loading_torch(tmp_path):
    """A script that lists or verifies a cache starts as fast as ``stepskip ls``: the codecs (and torch) load
    only when it converts."""
    import subprocess
    import sys

    script = ("import sys\nfrom stepskip.cache import open_cache, verify\n"
              f"verify(open_cache({str(tmp_path)!r}))\n"
              "print(sorted(m for m in ('torch', 'tensordict', 'safetensors') if m in sys.modules))\n"
              "from stepskip.cache import plan_convert\n"
              "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "True"]
