"""A verl entry point for test_install.py's launcher test: verl's own config, verl's own ``run_ppo``.

    PYTHONPATH=src .venv-verl/bin/python -m stepskip.integrations.verl launch_probe +probe_out=OUT.json ...

It is ``verl.trainer.main_ppo`` with the TaskRunner swapped for a probe: Hydra composes verl's
``ppo_trainer`` config with the command line, and verl's real ``run_ppo`` merges
``ray_kwargs.ray_init.runtime_env`` into its defaults, starts Ray and the runner actor exactly as it
would start verl's TaskRunner. The probe (standing in for the TaskRunner, whose real work needs GPU
workers) imports verl's trainer modules inside the actor, runs ``SkipManager.init(config)`` as
``RayPPOTrainer.fit`` does, and writes what it saw to ``probe_out``.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import hydra
import ray
import verl.trainer

CONFIG_DIR = str(Path(verl.trainer.__file__).resolve().parent / "config")
VERL_MODULES = (
    "verl.trainer.ppo.ray_trainer",
    "verl.experimental.agent_loop.agent_loop",
    "verl.trainer.ppo.v1.trainer_base",
    "verl.experimental.fully_async_policy.fully_async_rollouter",
)


@ray.remote(num_cpus=1)
class ProbeRunner:
    def run(self, config) -> None:
        for name in VERL_MODULES:
            importlib.import_module(name)
        from verl.utils.skip import SkipManager

        from stepskip.integrations import verl as integration

        SkipManager.init(config)
        out = {
            "pid": os.getpid(),
            "problems": integration.check(),
            "manager": f"{SkipManager.__module__}.{SkipManager.__qualname__}",
            "roles": {name: type(role).__module__ for name, role in SkipManager.skip_instances.items()},
            "rollout_enabled": SkipManager.skip_instances["rollout"].is_enabled(),
        }
        SkipManager.close()
        Path(config.probe_out).write_text(json.dumps(out))


@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(config) -> None:
    from verl.trainer.main_ppo import run_ppo

    from stepskip.integrations import verl as integration

    Path(config.probe_out + ".driver").write_text(json.dumps({
        "pid": os.getpid(),
        "installed": integration.is_installed(),
        "runtime_env": dict(config.ray_kwargs.ray_init.runtime_env),
        "guard": config.skip.get(integration.GUARD_KEY),
    }))
    try:
        run_ppo(config, task_runner_class=ProbeRunner)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
