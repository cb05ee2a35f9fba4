"""pytest plugin for the unit suite's tensordict-0.10 leg: run it in verl's environment as if verl were absent.

The unit suite is written for an environment without verl (where ``format: verl`` decodes to
stepskip's own ``Batch``); verl's environment is the one place with verl's tensordict pin, so this
leg hides the ``verl`` package (importing it raises ``ImportError``, as where it is not installed)
and runs the suite there: ``python -m pytest -p hide_verl tests/unit`` with this folder on
``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.abc
import sys


class _HideVerl(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's signature
        if fullname == "verl" or fullname.startswith("verl."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (hidden for the tensordict-0.10 unit leg)",
                                      name=fullname)
        return None


if "verl" in sys.modules:  # pragma: no cover - a plugin runs before the suite imports anything
    raise RuntimeError("verl was imported before the hide_verl plugin loaded")
sys.meta_path.insert(0, _HideVerl())
