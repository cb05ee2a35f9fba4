"""Shared test setup: every test starts and ends with a pristine SkipManager."""

from __future__ import annotations

import pytest

from stepskip import SkipManager


@pytest.fixture(autouse=True)
def _reset_skip_manager():
    SkipManager.reset()
    yield
    SkipManager.reset()
