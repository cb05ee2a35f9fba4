"""Fixtures of the CLI tests: real caches written by stepskip (and verl), copied per test that changes them."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_caches import build_cache

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def pristine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of cache (see ``cli_caches``), built once; tests that change it work on a copy."""
    return build_cache(tmp_path_factory.mktemp("pristine") / "dump")


@pytest.fixture
def copy_cache(pristine_cache: Path, tmp_path: Path) -> Callable[[str], Path]:
    """``copy_cache(name)``: a private copy of the pristine cache under ``tmp_path/name``."""

    def copy(name: str = "dump") -> Path:
        return Path(shutil.copytree(pristine_cache, tmp_path / name))

    return copy


def _load_exact() -> Callable[[Any, Any], None]:
    spec = importlib.util.spec_from_file_location("formats_exact", HERE.parent / "formats" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.assert_exact


@pytest.fixture(scope="session")
def exact() -> Callable[[Any, Any], None]:
    """The strict, bit-exact comparison of the format tests."""
    return _load_exact()


@pytest.fixture(autouse=True)
def _keep_logging_levels():
    """In-process ``main()`` calls quiet torch's logger (right for a CLI process); undo it for other tests."""
    loggers = [logging.getLogger(name) for name in ("torch", "torch.fx")]
    levels = [logger.level for logger in loggers]
    yield
    for logger, level in zip(loggers, levels):
        logger.setLevel(level)
