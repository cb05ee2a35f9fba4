"""The README and the docs site's pages as the tests read them: their code blocks, and the build hook
that writes their generated sections."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def pages() -> list[Path]:
    """The README and every page of the docs site."""
    return [README, *sorted(DOCS.glob("*.md"))]


def blocks(path: Path, language: str) -> list[str]:
    """The fenced code blocks of ``path`` in ``language`` (``python``, ``yaml``, ``bash`` ...)."""
    return [body for lang, body in _FENCE.findall(path.read_text(encoding="utf-8")) if lang == language]


def block(path: Path, language: str, containing: str) -> str:
    """The one ``language`` block of ``path`` that holds ``containing``."""
    found = [b for b in blocks(path, language) if containing in b]
    assert len(found) == 1, f"{path.name}: {len(found)} {language} blocks hold {containing!r}"
    return found[0]


def reference_hook() -> ModuleType:
    """``docs/_hooks/reference.py``, the mkdocs hook that writes the generated sections."""
    name = "stepskip_docs_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, DOCS / "_hooks" / "reference.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
