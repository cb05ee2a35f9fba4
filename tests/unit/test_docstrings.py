"""Every docstring example in the package runs, and shows what it says it shows (doctest).

The modules are found by walking ``src/stepskip`` (no list to keep up to date): any module whose
source holds a ``>>>`` example is collected, so a new module's examples are covered from the start.
Examples run with the working directory and :mod:`tempfile`'s default directory inside the test's
``tmp_path``, so one that writes files (``tempfile.mkdtemp()``) leaves nothing outside it.
"""

from __future__ import annotations

import doctest
import importlib
import tempfile
from pathlib import Path

import pytest

import stepskip

PACKAGE_DIR = Path(stepskip.__file__).resolve().parent
#: Optional dependencies (extras) a module may need; without them its examples are skipped, saying which.
OPTIONAL = {"transformers", "hydra", "ray", "transfer_queue", "s3fs", "trl"}


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.name == "__main__.py":  # importing it would run the command line
            continue
        if ">>>" not in path.read_text(encoding="utf-8"):
            continue
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_walk_finds_the_documented_modules():
    assert {"stepskip._manager", "stepskip.config", "stepskip.roles.rollout", "stepskip._batch"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        missing = (err.name or "").split(".")[0]
        if missing in OPTIONAL:
            pytest.skip(f"{name} needs the optional dependency {missing!r}, not installed here")
        raise
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module) if t.examples]
    assert tests, f"{name} has '>>>' in its source but doctest finds no example in it"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    for test in sorted(tests, key=lambda t: t.name):
        runner.run(test, out=report.append)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, "".join(report)  # a module whose examples are all +SKIP attempts none
