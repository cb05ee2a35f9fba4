"""`stepskip.integrations.verl` inside verl 0.9.1's own environment (.venv-verl, tensordict 0.10.0).

Each scenario runs install_side.py (or the launcher over launch_probe.py) in a fresh verl-env
interpreter: verl's real trainer modules are imported and their five decorated methods inspected,
and verl's real ``AgentLoopManager.generate_sequences`` replays step 1 from a cache verl wrote.
The one stand-in is the ``self`` that method gets (its agent-loop workers cannot run on CPU); a
hit never touches it. The launcher test runs verl's real ``run_ppo`` and Ray, with a probe actor in
place of verl's TaskRunner (whose work needs GPU workers).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")
FIXTURE_CACHE = ROOT / "tests" / "fixtures" / "verl" / "cache"
SERVING = "stepskip is serving verl's skip roles"
FIVE = ["AgentLoopManager.generate_sequences", "FullyAsyncAgentLoopManager.generate_sequences_single",
        "PPOTrainer._add_batch_to_generate", "ReplayBuffer.sample", "ReplayBufferAsync.sample"]

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VERL_PYTHON),
                       reason="verl 0.9.1 environment not built (run `make verl-env`)"),
]


def run_side(scenario: str, tmp_path: Path, **env: str) -> tuple[dict, str]:
    cache = tmp_path / "cache"
    shutil.copytree(FIXTURE_CACHE, cache)
    full_env = {key: value for key, value in os.environ.items() if key != "STEPSKIP_VERL"}
    full_env.update({"PYTHONPATH": str(ROOT / "src"), **env})
    done = subprocess.run([VERL_PYTHON, "-W", "ignore", str(HERE / "install_side.py"), scenario, str(cache)],
                          capture_output=True, text=True, env=full_env, timeout=600, cwd=str(HERE))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def assert_served(out: dict) -> None:
    assert out["problems"] == []
    assert all(out["served"].values()), out["served"]
    assert set(out["wrappers"]) == set(FIVE)
    for method, managers in out["wrappers"].items():
        assert managers == ["stepskip._manager.SkipManager"], (method, managers)
    assert out["ray_trainer_manager_is_stepskip"]
    replay = out["replay"]
    assert replay == {"type": "verl.protocol.DataProto", "responses_equal": True, "hits": 1.0, "misses": 0.0}


def serving_lines(stderr: str, pid: int) -> list[str]:
    return [line for line in stderr.splitlines() if SERVING in line and f"pid {pid}," in line]


def test_install_before_verl_serves_every_skip_module_and_decorated_method(tmp_path):
    out, stderr = run_side("install_first", tmp_path)
    assert_served(out)
    assert len(serving_lines(stderr, out["pid"])) == 1, stderr[-3000:]  # install() ran three times


def test_install_after_verl_rewraps_its_decorated_methods(tmp_path):
    out, stderr = run_side("verl_first", tmp_path)
    before = " | ".join(out["problems_before"])
    for method in FIVE:
        assert f"{method} is decorated by verl's own SkipManager" in before
    assert_served(out)
    lines = serving_lines(stderr, out["pid"])
    assert len(lines) == 1 and "re-wrapped 5 decorated methods" in lines[0], stderr[-3000:]


def test_verl_without_install_is_detected(tmp_path):
    out, stderr = run_side("not_installed", tmp_path)
    assert out["raised"] and "install() has not run" in out["raised"]
    assert "verl.utils.skip in sys.modules is verl's own module" in out["raised"]
    for method, managers in out["wrappers"].items():
        assert managers == ["verl.utils.skip.skip_manager.SkipManager"], (method, managers)
    assert not any(out["served"].values())
    # what the launcher adds to the config makes verl's own SkipManager.init refuse to run
    assert out["guard"].startswith("ConfigKeyError") and "_stepskip_install_required" in out["guard"]
    assert SERVING not in stderr


def test_environment_variable_installs_at_interpreter_start(tmp_path):
    boot = subprocess.run([VERL_PYTHON, "-c", "from stepskip.integrations.verl import boot_path; print(boot_path())"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
                          check=True).stdout.strip()
    out, stderr = run_side("boot", tmp_path, STEPSKIP_VERL="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), boot]))
    assert out["installed_at_start"]
    assert_served(out)
    assert len(serving_lines(stderr, out["pid"])) == 1


def test_boot_path_does_nothing_without_the_variable(tmp_path):
    boot = str(ROOT / "src" / "stepskip" / "integrations" / "verl" / "_boot")
    on = os.pathsep.join([str(ROOT / "src"), boot])
    assert run_side("boot_off", tmp_path / "a", STEPSKIP_VERL="1", PYTHONPATH=on)[0]["installed_at_start"]
    for value in ("0", ""):
        out, _ = run_side("boot_off", tmp_path / f"v{value}", STEPSKIP_VERL=value, PYTHONPATH=on)
        assert not out["installed_at_start"], value


def test_setup_hook_installs_and_runs_the_next_hook(tmp_path):
    out, stderr = run_side("hook", tmp_path, STEPSKIP_VERL_NEXT_HOOK="install_side.mark_next_hook")
    assert out["next_hook_ran"]
    assert_served(out)


def test_launcher_reaches_verls_ray_actors(tmp_path):
    """verl's run_ppo starts Ray with the launcher's runtime_env; the actor it starts serves stepskip."""
    probe_out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE)])}
    env.pop("STEPSKIP_VERL", None)
    cmd = [VERL_PYTHON, "-W", "ignore", "-m", "stepskip.integrations.verl", "launch_probe", f"+probe_out={probe_out}",
           "ray_kwargs.ray_init.num_cpus=2", "skip.rollout.enable=true", f"skip.rollout.dump_dir={tmp_path / 'dump'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    driver = json.loads(Path(f"{probe_out}.driver").read_text())
    actor = json.loads(probe_out.read_text())
    assert driver["installed"] and driver["guard"] is True
    assert driver["runtime_env"]["worker_process_setup_hook"] == "stepskip.integrations.verl.setup_hook"
    assert actor["pid"] != driver["pid"]
    assert actor["problems"] == []
    assert actor["manager"] == "stepskip._manager.SkipManager"
    assert set(actor["roles"].values()) <= {"stepskip.roles.rollout", "stepskip.roles.rollout_tq"}
    assert actor["rollout_enabled"]
    for pid in (driver["pid"], actor["pid"]):
        assert re.search(rf"{re.escape(SERVING)} \(stepskip [^,]+, pid {pid},", output), f"no line from pid {pid}"
