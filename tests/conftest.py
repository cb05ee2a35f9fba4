"""Shared test setup: every test starts and ends with a pristine SkipManager."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests draw the same examples on every run and never fail for being slow: a loaded
# machine must not turn them red (deadline, too_slow), and a failure must reproduce on the next run.
settings.register_profile("stepskip", deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("stepskip")

# Small async dumps go to helper processes once those are ready (stepskip._dumping.helper): whether a batch
# went there would depend on how fast they started, and tests that patch a store or a format in this
# process would not reach them. Off here (children started by tests inherit it); the helper's own
# tests turn it on.
os.environ.setdefault("STEPSKIP_DUMP_PROCESS", "0")

# Shared test helpers (e.g. the V1 trainer harness) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent / "support"))

from stepskip import SKIP_REGISTRY, SkipManager


@pytest.fixture(autouse=True)
def _reset_skip_manager():
    """SkipManager is process-wide state: every test starts and ends at the pre-init defaults,
    with the role registry as it was (tests may register roles of their own)."""
    registry = dict(SKIP_REGISTRY)
    SkipManager.reset()
    yield
    SkipManager.reset()
    # A role a stepskip module registers when first imported stays: the import will not run again
    # for a later test (the TRL integration's ``trl_generate``, imported by whichever test came first).
    imported = {name: cls for name, cls in SKIP_REGISTRY.items() if cls.__module__.startswith("stepskip.integrations.")}
    SKIP_REGISTRY.clear()
    SKIP_REGISTRY.update(registry)
    for name, cls in imported.items():
        SKIP_REGISTRY.setdefault(name, cls)
