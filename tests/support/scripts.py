"""Import a script of the repository (``benchmarks/*.py``) as a module, for tests of its helpers."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def script_module(relative: str, name: str) -> Iterator[ModuleType]:
    """The script at ``ROOT/relative`` run as module ``name``, listed in ``sys.modules`` while the block runs
    (dataclasses and pickling look a module up by its name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None and spec.loader is not None, relative
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
