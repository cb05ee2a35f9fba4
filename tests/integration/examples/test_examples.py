"""The runnable examples beside the quickstart, run as a user would run them.

``examples/trl_grpo.py`` trains with the real TRL twice in a fresh process; ``examples/verl_launcher.sh``
cannot run here (verl's trainer needs GPUs and an inference engine), so its command line is checked:
the script parses, and with ``DRY_RUN=1`` prints the launcher command whose ``skip`` overrides are a
valid configuration and whose other arguments reach verl as they were given.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import stepskip
from stepskip import SkipManagerConfig
from stepskip.integrations.verl.__main__ import build_overrides

ROOT = Path(__file__).resolve().parents[3]
SRC = str(Path(stepskip.__file__).resolve().parents[1])
ENV = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def test_trl_example_records_then_replays_every_step(tmp_path):
    pytest.importorskip("trl")
    cache = tmp_path / "cache"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--cache", str(cache)],
                          capture_output=True, text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = done.stdout.split("run 2 (replay):")
    assert len(runs) == 2, done.stdout
    first = dict(re.findall(r"step (\d+): (generated|replayed)", runs[0]))
    second = dict(re.findall(r"step (\d+): (generated|replayed)", runs[1]))
    assert first == dict.fromkeys("1234", "generated") and second == dict.fromkeys("1234", "replayed")
    losses = [re.findall(r"loss ([-+0-9.]+)", part) for part in runs]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    assert "run 2 replayed every step: yes; losses equal to run 1's: yes" in done.stdout
    assert sorted(p.parent.name for p in cache.glob("*/*/trl_generate/*/*/meta.json")) == ["c0-r0"] * 4


def _dry_run(*args: str) -> list[str]:
    env = {**ENV, "DRY_RUN": "1", "DUMP_DIR": "/data/rollout_dump", "MODEL": "/models/m"}
    done = subprocess.run(["bash", str(ROOT / "examples" / "verl_launcher.sh"), *args], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout)


def test_verl_launcher_script_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "examples" / "verl_launcher.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_verl_launcher_script_runs_main_ppo_through_the_launcher_with_a_valid_skip_section():
    argv = _dry_run("trainer.total_training_steps=3", "--cfg", "job")
    assert argv[:4] == ["python", "-m", "stepskip.integrations.verl", "verl.trainer.main_ppo"]
    overrides = argv[4:]
    assert overrides[-3:] == ["trainer.total_training_steps=3", "--cfg", "job"]  # the user's, passed on as given
    skip = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith("skip.")]
    section = OmegaConf.to_container(OmegaConf.from_dotlist(skip))["skip"]
    config = SkipManagerConfig.from_section(section)
    assert config.rollout_tq.enable and config.rollout_tq.dump_dir == "/data/rollout_dump"
    steps = config.rollout_tq.step_set
    assert 50 in steps and 100 in steps and 51 not in steps
    # keys verl's config does not declare carry the "+" Hydra's struct mode needs
    declared = {"enable", "dump_dir", "steps", "action"}
    for o in overrides:
        if o.lstrip("+").startswith("skip."):
            key = o.lstrip("+").split("=", 1)[0].rsplit(".", 1)[1]
            assert o.startswith("+") == (key not in declared), o
    assert "actor_rollout_ref.model.path=/models/m" in overrides
    # and what the launcher adds keeps every one of them
    assert set(overrides) <= set(build_overrides(overrides))
