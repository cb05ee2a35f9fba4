"""Fixtures of the crash tests: a clean class-level registry around every test."""

from __future__ import annotations

import pytest

from stepskip import SKIP_REGISTRY, SkipManager


@pytest.fixture(autouse=True)
def _reset_skip_manager():
    """SkipManager is process-wide state: every test starts and ends at the pre-init defaults."""
    registry = dict(SKIP_REGISTRY)
    SkipManager.reset()
    yield
    SkipManager.reset()
    SKIP_REGISTRY.clear()
    SKIP_REGISTRY.update(registry)
