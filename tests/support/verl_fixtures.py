"""The caches verl 0.9.1 wrote (tests/fixtures/verl) and its summary script, shared by the compat tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
FIXTURE_RUN = FIXTURES / "cache" / "fx_verl" / "GBS4_N2_in8_out6"


def check_load_module() -> ModuleType:
    """``tests/fixtures/verl/check_load.py`` (its ``summarise`` needs no verl)."""
    spec = importlib.util.spec_from_file_location("verl_check_load", FIXTURES / "check_load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def comparable(summary: Any) -> Any:
    """A summary without what legitimately differs between verl's TensorDicts and ours."""
    summary = json.loads(json.dumps(summary))
    for td in (summary.get("batch"), summary.get("tensordict")):
        if td:
            td.pop("is_consolidated", None)
            td.pop("type", None)
    return summary


def expected_summary(name: str) -> Any:
    return json.loads((FIXTURES / "expected" / f"{name}.json").read_text())["summary"]
