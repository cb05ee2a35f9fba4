"""A recorder of ``action: match`` SIGKILLed while writing never leaves the prompt index pointing at
a missing or different entry: a later run replays exactly the groups whose entries are complete,
each with its own prompt's responses, and generates the rest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _match_writer import N, Rollout, config, prompt_ids, prompts, response

from stepskip import SkipManager

HERE = Path(__file__).parent
ROOT = HERE.parents[2]

pytestmark = pytest.mark.heavy


def committed_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name) for p in run_dir.glob("*/meta.json") if p.parent.name.isdigit())


@pytest.mark.parametrize("kill_after", [3, 8])
def test_a_killed_match_recorder_leaves_a_consistent_index(tmp_path, tmp_path_factory, kill_after):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(HERE)])}
    log = tmp_path_factory.mktemp("writer-log") / "stderr"  # a file, not a pipe: a chatty child never blocks
    with open(log, "wb") as err:
        child = subprocess.Popen([sys.executable, str(HERE / "_match_writer.py"), str(tmp_path)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=err)
    run_dir = tmp_path / "default_experiment_name_default_project_name" / "GBS4_N0_in2_out128"
    deadline = time.monotonic() + 300  # a bound on waiting for the event, not an assertion on time
    try:
        while len(committed_steps(run_dir)) < kill_after:
            assert child.poll() is None, log.read_text(errors="replace")[-2000:]
            assert time.monotonic() < deadline, "the recorder committed nothing"
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    recorded = committed_steps(run_dir)
    asked = list(range(1, max(recorded) + 3))  # every committed step, and some never written
    SkipManager.init(config(str(tmp_path)))
    rollout = Rollout()
    for step in asked:
        SkipManager.set_step(1000 + step)
        ids = prompt_ids(step)
        out = rollout.generate_sequences(prompts(ids, "r"))
        # every row, replayed or generated, holds its own prompt's responses
        assert out.batch["responses"].tolist() == [response(i) for i in ids for _ in range(N)]
    SkipManager.flush()
    generated_steps = sorted({i // 100 for i in rollout.seen})
    assert generated_steps == [s for s in asked if s not in recorded]
