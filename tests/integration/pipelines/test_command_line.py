"""verl's skip command lines against the packaged Hydra configs, and ``stepskip demo``'s contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pipeline_helpers import SMALL, entry_dirs, project_dir

from stepskip.pipelines import demo
from stepskip.pipelines.runtime import load_config

SEED_COMMAND = ["skip.rollout.enable=True", "skip.rollout.steps=[1,2,3]", "skip.rollout.action=cache"]


def test_packaged_configs_hold_the_three_roles_defaults():
    for name in ("colocated", "v1", "fully_async"):
        skip = load_config(name).skip
        for role in ("rollout", "rollout_tq", "async_rollout"):
            assert dict(skip[role]) == {"enable": False, "dump_dir": "~/.verl/rollout_dump", "steps": [],
                                        "action": "cache"}
    assert load_config("colocated").skip.reward.kind == "stage"
    cfg = load_config("v1", ["trainer.v1.trainer_mode=separate_async",
                             "trainer.v1.separate_async.parameter_sync_step=4"])
    assert cfg.trainer.v1[cfg.trainer.v1.trainer_mode].parameter_sync_step == 4


@pytest.mark.heavy
def test_seed_command_line_works_literally(tmp_path):
    """``python -m stepskip.pipelines.colocated skip.rollout.enable=True skip.rollout.steps=[1,2,3] ...``, twice."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {**os.environ, "HOME": str(home)}  # the default dump_dir is ~/.verl/rollout_dump
    command = [sys.executable, "-m", "stepskip.pipelines.colocated", *SEED_COMMAND, *SMALL]
    outputs = []
    for _ in range(2):
        done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    modes = [[line.split("│")[3].strip() for line in out.splitlines() if line.startswith("│ run")] for out in outputs]
    assert modes == [["generated"] * 3, ["replayed"] * 3]  # the table's rows (the counters line names rows_generated)
    assert entry_dirs(project_dir(home / ".verl" / "rollout_dump", "colocated")) == ["1", "2", "3"]
    assert list(cwd.iterdir()) == []  # no Hydra output directory, nothing else


def test_demo_json(tmp_path):
    out = tmp_path / "demo.json"
    code = demo.main(["--steps", "2", "--replay-steps", "1", "--json", str(out), "data.max_response_length=8"])
    assert code == 0
    (item,) = json.loads(out.read_text())
    assert item["pipeline"] == "v1"  # verl's default trainer (rollout_tq, what main_ppo runs) leads the demo
    assert [(s["pass"], s["step"], s["mode"]) for s in item["steps"]] == [
        ("record", 1, "generated"), ("record", 2, "generated"), ("replay", 1, "replayed"), ("replay", 2, "generated")]
    assert all(set(s) == {"pass", "step", "mode", "rollout_s", "step_s", "reward", "loss"} for s in item["steps"])
    summary = item["summary"]
    assert summary["rollout_calls_avoided"] == 1 and summary["losses_equal"] is True
    assert isinstance(summary["time_saved_s"], float) and summary["step_time_ratio"] > 0
    losses = {(s["pass"], s["step"]): s["loss"] for s in item["steps"]}
    assert losses["record", 1] == losses["replay", 1] and losses["record", 2] == losses["replay", 2]


def test_demo_keeps_a_dump_dir_and_refuses_a_used_one(tmp_path, capsys):
    dump = tmp_path / "cache"
    assert demo.main(["--steps", "1", "--replay-steps", "1", "--dump-dir", str(dump),
                      "data.max_response_length=8", "trainer.val_before_train=false"]) == 0
    assert entry_dirs(dump)  # kept
    assert demo.main(["--steps", "1", "--replay-steps", "1", "--dump-dir", str(dump)]) == 2
    assert "not empty" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--replay-steps", "9"], ["--pipeline", "nope"]])
def test_demo_bad_arguments(argv):
    assert demo.main(argv) == 2
