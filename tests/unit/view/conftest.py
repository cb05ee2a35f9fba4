"""Fixtures of the view tests: the CLI tests' real caches (written by stepskip through SkipManager, the V1
harness and verl's own fixture), built once per session; tests that change a cache work on a copy."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))

from cli_caches import build_cache  # noqa: E402


@pytest.fixture(scope="session")
def view_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rollout (safe) + stage role reward, rollout (format verl), rollout_tq (V1) and verl's fixture cache."""
    return build_cache(tmp_path_factory.mktemp("view") / "dump")


@pytest.fixture
def copy_view_cache(view_cache: Path, tmp_path: Path) -> Callable[[], Path]:
    def copy() -> Path:
        return Path(shutil.copytree(view_cache, tmp_path / "dump"))

    return copy

