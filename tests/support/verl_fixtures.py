"""The caches verl 0.9.1 wrote (tests/fixtures/verl) and its summary script, shared by the compat tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from stepskip import SkipManager

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
#: The run directory of each fixture cache, relative to its dump dir.
RUN = Path("fx_verl") / "GBS4_N2_in8_out6"
FIXTURE_RUN = FIXTURES / "cache" / RUN


def copy_fixture(cache: str, dump_dir: Path) -> Path:
    """A private copy of the fixture cache ``cache`` (``cache``, ``cache_numpy``) as ``dump_dir``'s run."""
    shutil.copytree(FIXTURES / cache / RUN, dump_dir / RUN)
    return dump_dir


def fixture_config(dump_dir: Any, **skip: Any) -> dict[str, Any]:
    """A config naming the fixture's run (steps 1 and 2 listed, no key rebound); ``skip`` overrides the role."""
    return {
        "trainer": {"experiment_name": "fx", "project_name": "verl"},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout": {"enable": True, "steps": [1, 2], "dump_dir": str(dump_dir), "rebind_keys": [], **skip}},
    }


class EchoLoop:
    """A rollout that hands its prompts back, counting its calls (a replay must make none)."""

    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Any) -> Any:
        self.calls += 1
        return prompts


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
