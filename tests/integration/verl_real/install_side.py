"""verl-environment side of test_install.py: one scenario per run, one JSON object on stdout.

    PYTHONPATH=src .venv-verl/bin/python tests/integration/verl_real/install_side.py SCENARIO DUMP_DIR

Scenarios: ``install_first`` (install(), then verl's trainer modules import), ``verl_first`` (verl's
trainer modules and its own skip package import, then install()), ``not_installed`` (verl alone),
``boot`` (nothing called: STEPSKIP_VERL and the boot path are set by the test; ``boot_off``
only reports whether that installed), ``hook`` (Ray's
setup hook called as Ray calls it, with a next hook to chain).

In every scenario but ``not_installed``, verl's real ``AgentLoopManager.generate_sequences``
(``@auto_await`` over ``annotate("rollout")``) is called at step 1 over a cache verl 0.9.1 wrote
(``tests/fixtures/verl/cache``, copied to DUMP_DIR): a hit must come back without the method's
body running. The ``self`` it gets is a bare stand-in (the agent-loop workers cannot run here);
a hit never touches it, and a call that reached the body would fail on it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

VERL_MODULES = (
    "verl.trainer.ppo.ray_trainer",
    "verl.experimental.agent_loop.agent_loop",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.trainer.ppo.v1.replay_buffer",
    "verl.experimental.fully_async_policy.fully_async_rollouter",
)
# The five methods verl 0.9.1 decorates, and the manager each one's wrapper consults.
DECORATED = (
    ("verl.experimental.agent_loop.agent_loop", "AgentLoopManager", "generate_sequences"),
    ("verl.experimental.fully_async_policy.fully_async_rollouter", "FullyAsyncAgentLoopManager",
     "generate_sequences_single"),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer", "_add_batch_to_generate"),
    ("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer", "sample"),
    ("verl.trainer.ppo.v1.replay_buffer", "ReplayBufferAsync", "sample"),
)


def import_verl() -> None:
    for name in VERL_MODULES:
        importlib.import_module(name)


def managers_of(fn: Any) -> list[str]:
    """``module.qualname`` of every ``cls`` a layer of ``fn``'s decorator chain closes over."""
    found = []
    while fn is not None:
        cells = dict(zip(getattr(fn, "__code__", None).co_freevars, fn.__closure__ or ())) \
            if getattr(fn, "__code__", None) else {}
        if "cls" in cells:
            owner = cells["cls"].cell_contents
            found.append(f"{owner.__module__}.{owner.__qualname__}")
        fn = getattr(fn, "__wrapped__", None)
    return found


def training_config(dump_dir: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "trainer": {"experiment_name": "fx", "project_name": "verl", "v1": {"trainer_mode": "sync", "sync": {}}},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout": {"enable": True, "steps": [1], "action": "cache", "dump_dir": dump_dir,
                             "allow_pickle": True, "async_dump": False}},
    })


class BareManager:
    """Stands in for an AgentLoopManager: verl's method body would fail on it (no workers)."""


def replay_through_verl(dump_dir: str) -> dict[str, Any]:
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.protocol import DataProto
    from verl.utils.skip import SkipManager

    cached = DataProto.load_from_disk(str(Path(dump_dir) / "fx_verl" / "GBS4_N2_in8_out6" / "1" / "gen_batch.dp"))
    prompts = DataProto.from_dict(non_tensors={"uid": cached.non_tensor_batch["uid"]})
    SkipManager.init(training_config(dump_dir))
    SkipManager.set_step(1)
    out = AgentLoopManager.generate_sequences(BareManager(), prompts)
    stats = SkipManager.stats()
    SkipManager.close()
    return {
        "type": f"{type(out).__module__}.{type(out).__qualname__}",
        "responses_equal": bool((out.batch["responses"] == cached.batch["responses"]).all()),
        "hits": stats.get("skip/rollout/hits"),
        "misses": stats.get("skip/rollout/misses"),
    }


def report(dump_dir: str | None) -> dict[str, Any]:
    import stepskip
    from stepskip.integrations import verl as integration

    served = {name: bool(getattr(importlib.import_module(name), "__stepskip_serves__", False))
              for name in integration.SERVED_MODULES}
    wrappers = {}
    for modname, cls_name, attr in DECORATED:
        owner = getattr(sys.modules[modname], cls_name)
        wrappers[f"{cls_name}.{attr}"] = managers_of(vars(owner)[attr])
    import verl.trainer.ppo.ray_trainer as ray_trainer

    out: dict[str, Any] = {
        "pid": os.getpid(),
        "served": served,
        "wrappers": wrappers,
        "ray_trainer_manager_is_stepskip": ray_trainer.SkipManager is stepskip.SkipManager,
        "problems": integration.check(),
    }
    if dump_dir is not None and not out["problems"]:
        out["replay"] = replay_through_verl(dump_dir)
    return out


def main() -> None:
    scenario, dump_dir = sys.argv[1], sys.argv[2]
    from stepskip.integrations import verl as integration

    out: dict[str, Any] = {"scenario": scenario}
    if scenario == "install_first":
        integration.configure_logging()
        integration.install()
        integration.install()
        import_verl()
        integration.install()
    elif scenario == "verl_first":
        import_verl()
        out["problems_before"] = integration.check()
        integration.configure_logging()
        integration.install()
        integration.install()
    elif scenario == "not_installed":
        import_verl()
        try:
            integration.check(raise_error=True)
            out["raised"] = None
        except integration.VerlSkipNotServedError as err:
            out["raised"] = str(err)
        out["guard"] = own_init_with_guard()
    elif scenario == "boot":
        out["installed_at_start"] = integration.is_installed()
        import_verl()
    elif scenario == "boot_off":
        print(json.dumps({"scenario": scenario, "installed_at_start": integration.is_installed()}))
        return
    elif scenario == "hook":
        integration.setup_hook()
        out["next_hook_ran"] = os.environ.get("NEXT_HOOK_MARK") == "ran"
        import_verl()
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    out.update(report(None if scenario == "not_installed" else dump_dir))
    print(json.dumps(out))


def own_init_with_guard() -> str:
    """verl's own SkipManager.init over a config carrying the launcher's guard key."""
    from omegaconf import OmegaConf
    from verl.utils.skip import SkipManager

    from stepskip.integrations.verl import GUARD_KEY

    config = OmegaConf.create({"skip": {GUARD_KEY: True, "rollout": {"enable": True}}})
    try:
        SkipManager.init(config)
    except Exception as err:  # noqa: BLE001 - the test asserts on what verl raised
        return f"{type(err).__name__}: {err}"
    return "accepted"


def mark_next_hook() -> None:
    """The hook of the user's own that ``hook`` chains through STEPSKIP_VERL_NEXT_HOOK."""
    os.environ["NEXT_HOOK_MARK"] = "ran"


if __name__ == "__main__":
    main()
