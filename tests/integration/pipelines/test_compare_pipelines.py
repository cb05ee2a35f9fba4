"""``action: compare`` and ``stepskip rerun`` in the reference pipelines: record on one run ("the good
commit"), compare on another. The same policy seed matches its recording exactly; another policy seed
or learning rate drifts, and the report says where."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
from pipeline_helpers import SMALL, skip_overrides

from stepskip import SkipManager
from stepskip.pipelines.colocated import ColocatedTrainer
from stepskip.pipelines.runtime import load_config
from stepskip.pipelines.v1 import V1Trainer
from stepskip.tq import InProcessTQClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "cli"))
from cli_run import stepskip  # noqa: E402


def colocated(overrides: list[str]) -> object:
    return ColocatedTrainer(load_config("colocated", [*SMALL, *overrides])).fit()


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    """Steps 1-3 of the colocated pipeline recorded ("the good commit")."""
    dump = tmp_path_factory.mktemp("good")
    result = colocated(skip_overrides("rollout", dump, [1, 2, 3]))
    SkipManager.reset()
    return dump, result


def compare_run(dump, *extra: str) -> tuple[object, list[dict]]:
    result = colocated([*skip_overrides("rollout", dump, [1, 2, 3], action="compare"), *extra])
    return result, SkipManager.drift("rollout")


def test_the_same_policy_matches_its_recording(recording):
    dump, recorded = recording
    result, drift = compare_run(dump)
    assert [(r["step"], r["token_match"], r["passed"], r["prompts_equal"]) for r in drift] == [
        (1, 1.0, True, True), (2, 1.0, True, True), (3, 1.0, True, True)]
    assert result.generated_train_steps == [1, 2, 3]  # compared live at every step
    assert result.skip_stats["skip/rollout/compared"] == 3 and result.skip_stats["skip/rollout/drifted"] == 0
    assert result.losses == recorded.losses


def test_another_policy_seed_drifts_at_every_step_and_trains_on_the_recording(recording):
    dump, recorded = recording
    result, drift = compare_run(dump, "actor_rollout_ref.model.init_seed=1")
    assert [r["passed"] for r in drift] == [False, False, False]
    assert all(r["token_match"] < 0.9 and r["worst_field"] for r in drift)
    assert result.skip_stats["skip/rollout/drifted"] == 3
    # train_on: recorded: the rewards are the recorded rollouts' (the policy being trained differs)
    assert [r.reward for r in result.records] == [r.reward for r in recorded.records]


def test_another_learning_rate_drifts_once_the_weights_moved(recording):
    dump, _ = recording
    _, drift = compare_run(dump, "actor_rollout_ref.actor.lr=1e-2")
    assert drift[0]["passed"] and drift[0]["token_match"] == 1.0  # step 1 samples with the initial weights
    assert not drift[1]["passed"] and not drift[2]["passed"]


def test_train_on_live_follows_the_live_rollouts(recording):
    dump, recorded = recording
    result, drift = compare_run(dump, "actor_rollout_ref.model.init_seed=1", "+skip.rollout.train_on=live")
    assert [r["train_on"] for r in drift] == ["live"] * 3
    assert [r.reward for r in result.records] != [r.reward for r in recorded.records]


def test_the_v1_pipeline_compares_per_trajectory(tmp_path):
    def v1(*extra: str) -> object:
        trainer = V1Trainer(load_config("v1", [*SMALL, "trainer.v1.trainer_mode=sync", *extra]),
                            tq_client=InProcessTQClient())
        return trainer.fit()

    recorded = v1(*skip_overrides("rollout_tq", tmp_path, [1, 2]))
    same = v1(*skip_overrides("rollout_tq", tmp_path, [1, 2], action="compare"))
    assert [(r["step"], r["token_match"], r["passed"]) for r in SkipManager.drift("rollout_tq")] == [
        (1, 1.0, True), (2, 1.0, True)]
    assert same.losses == recorded.losses
    other = v1(*skip_overrides("rollout_tq", tmp_path, [1, 2], action="compare"), "actor_rollout_ref.model.init_seed=3")
    assert [r["passed"] for r in SkipManager.drift("rollout_tq")] == [False, False]
    # train_on: recorded: the trainer read the recorded trajectories, so it saw the recorded rewards
    assert [r.reward for r in other.records[:2]] == [r.reward for r in recorded.records[:2]]


def test_rerun_the_demos_reward_stage(tmp_path):
    """``stepskip demo`` records the colocated pipeline's reward stage with its inputs; ``stepskip rerun``
    re-scores it with the pipeline's reward function (passes) and with a changed one (fails)."""
    from stepskip.pipelines import demo

    root = tmp_path / "dump"
    code = demo.main(["--pipeline", "colocated", "--steps", "2", "--replay-steps", "1-2", "--dump-dir", str(root),
                      "data.max_response_length=8", "skip.reward.enable=true", "skip.reward.steps=[1,2]",
                      "skip.reward.record_inputs=true"])
    assert code == 0
    cache = root  # the demo records into its dump dir itself
    same = stepskip("rerun", cache, "--stage", "reward", "--fn", "stepskip.pipelines.colocated:score_rollout")
    assert same.code == 0, same
    assert [line.split()[:3] for line in same.out.splitlines()[:2]] == [["step", "1", "pass"], ["step", "2", "pass"]]
    (tmp_path / "lenient.py").write_text(textwrap.dedent("""
        from stepskip.pipelines.colocated import score_rollout
        from stepskip.pipelines.task import CountTask

        def score(batch):
            out = score_rollout(batch, CountTask())
            out.batch["scores"] = out.batch["scores"] + 0.1 * (out.batch["scores"] == 0)  # partial credit
            return out
    """))
    changed = stepskip("rerun", cache, "--stage", "reward", "--fn", f"{tmp_path}/lenient.py:score")
    assert changed.code == 1, changed
    assert "first divergence: step 1, row" in changed.out and "field 'scores'" in changed.out
