"""verl-environment side of test_hydra.py: verl's own ``ppo_trainer`` config composed by Hydra, read by stepskip.

    PYTHONPATH=src .venv-verl/bin/python tests/integration/verl_real/hydra_side.py DUMP_DIR

Prints one JSON object: for each case, what ``SkipManager.init`` (stepskip's, imported under
verl's name after ``install()``) made of the composed config, or the error it raised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from stepskip.integrations.verl import GUARD_KEY, install

install()

import verl.trainer  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from verl.utils.skip import SkipManager  # noqa: E402

CONFIG_DIR = str(Path(verl.trainer.__file__).resolve().parent / "config")
PROBE_STEPS = [1, 2, 5, 125, 128, 129, 200, 201]


def case(overrides: list[str]) -> dict[str, Any]:
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            config = compose("ppo_trainer", overrides=overrides)
    except Exception as err:  # noqa: BLE001 - the test asserts on what Hydra raised
        return {"compose_error": f"{type(err).__name__}: {err}"}
    out: dict[str, Any] = {"rollout_tq_enable": config.skip.rollout_tq.enable}  # what trainer_base.py reads
    try:
        SkipManager.init(config)
    except Exception as err:  # noqa: BLE001
        out["init_error"] = {"type": type(err).__name__, "mro": [c.__name__ for c in type(err).__mro__],
                             "message": str(err)}
        return out
    rollout = SkipManager.skip_instances["rollout"]
    out.update({
        "enabled": rollout.is_enabled(),
        "format": rollout.format.name,
        "allow_pickle": rollout.allow_pickle,
        "in_steps": {str(step): step in rollout.step_set for step in PROBE_STEPS},
        "steps": list(rollout.steps),  # the configured list, as verl's roles expose it
        "roles": sorted(SkipManager.skip_instances),
    })
    SkipManager.reset()
    return out


def main() -> None:
    dump = sys.argv[1]
    base = ["skip.rollout.enable=true", f"skip.rollout.dump_dir={dump}"]
    cases = {
        "extensions": base + ["+skip.rollout.format=verl", "+skip.rollout.allow_pickle=true",
                              "skip.rollout.steps=[1-128:4,200]"],
        "guard_key": base + [f"+skip.{GUARD_KEY}=true", "skip.rollout.steps=[1,2]"],
        "unknown_key": base + ["+skip.rollout.bogus=1"],
        "extension_without_plus": base + ["skip.rollout.format=verl"],
        "defaults": [],
    }
    print(json.dumps({name: case(overrides) for name, overrides in cases.items()}))


if __name__ == "__main__":
    main()
