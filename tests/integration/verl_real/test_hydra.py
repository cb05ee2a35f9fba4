"""verl 0.9.1's own ``ppo_trainer`` config, composed by Hydra with stepskip's keys, read by stepskip (verl env).

hydra_side.py composes the config from verl's installed config directory with Hydra's compose API
(exactly what ``@hydra.main`` in ``verl.trainer.main_ppo`` does with the command line) and hands it
to ``SkipManager.init`` imported under verl's name after ``install()``. No stand-ins.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VERL_PYTHON),
                       reason="verl 0.9.1 environment not built (run `make verl-env`)"),
]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hydra") / "dump"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("STEPSKIP_VERL", None)
    done = subprocess.run([VERL_PYTHON, "-W", "ignore", str(HERE / "hydra_side.py"), str(dump)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_stepskip_keys_and_step_ranges_compose_with_verls_config(cases):
    got = cases["extensions"]
    assert "init_error" not in got, got
    assert got["enabled"] and got["format"] == "verl" and got["allow_pickle"]
    # [1-128:4,200]: 1, 5, ..., 125 and 200
    assert got["in_steps"] == {"1": True, "2": False, "5": True, "125": True, "128": False, "129": False,
                               "200": True, "201": False}
    assert got["steps"] == ["1-128:4", 200]
    assert got["roles"] == ["async_rollout", "rollout", "rollout_tq"]
    assert got["rollout_tq_enable"] is False  # trainer_base.py reads config.skip.rollout_tq.enable


def test_unknown_key_is_a_config_error_naming_it(cases):
    err = cases["unknown_key"]["init_error"]
    assert err["type"] == "SkipConfigError" and "ValueError" in err["mro"]
    assert "'bogus'" in err["message"] and "known keys" in err["message"]


def test_the_launchers_guard_key_is_ignored_by_stepskip(cases):
    got = cases["guard_key"]
    assert "init_error" not in got, got
    assert got["in_steps"]["1"] and got["in_steps"]["2"] and not got["in_steps"]["5"]


def test_keys_verl_does_not_declare_need_a_plus(cases):
    assert "+skip.rollout.format=verl" in cases["extension_without_plus"]["compose_error"]


def test_verls_defaults_leave_every_role_off(cases):
    got = cases["defaults"]
    assert not got["enabled"] and got["format"] == "safe"
    assert not any(got["in_steps"].values())
