"""Shared test setup: every test starts and ends with a pristine SkipManager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

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
    SKIP_REGISTRY.clear()
    SKIP_REGISTRY.update(registry)
