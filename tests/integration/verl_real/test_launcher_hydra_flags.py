"""The launcher in front of verl's own ``verl.trainer.main_ppo``, with Hydra's flags where users put
them: ``--cfg job`` after the overrides prints verl's composed config (with the launcher's keys in it)
and starts nothing, as ``python -m verl.trainer.main_ppo ... --cfg job`` does."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VERL_PYTHON),
                       reason="verl 0.9.1 environment not built (run `make verl-env`)"),
]


def test_cfg_job_after_the_overrides_prints_verls_config(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("STEPSKIP_VERL", None)
    cmd = [VERL_PYTHON, "-W", "ignore", "-m", "stepskip.integrations.verl", "verl.trainer.main_ppo",
           "skip.rollout.enable=true", 'skip.rollout.steps="1-6,8,10"', "--cfg", "job"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    config = yaml.safe_load(done.stdout)
    assert config["skip"]["rollout"]["enable"] is True
    assert config["skip"]["rollout"]["steps"] == "1-6,8,10"  # `stepskip ls`'s form reaches stepskip as given
    assert config["skip"]["_stepskip_install_required"] is True
    assert config["ray_kwargs"]["ray_init"]["runtime_env"]["worker_process_setup_hook"] == \
        "stepskip.integrations.verl.setup_hook"
    assert "trainer" in config and "actor_rollout_ref" in config  # verl's ppo_trainer config, composed
