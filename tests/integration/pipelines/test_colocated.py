"""The colocated pipeline (role ``rollout``, and ``reward`` as a generic stage role) recorded, then replayed."""

from __future__ import annotations

import pytest
from pipeline_helpers import SMALL, entry_dirs, project_dir, skip_overrides

from stepskip import CacheMissError
from stepskip.pipelines.colocated import ColocatedTrainer
from stepskip.pipelines.runtime import load_config


def fit(overrides: list[str]) -> tuple[ColocatedTrainer, object]:
    trainer = ColocatedTrainer(load_config("colocated", [*SMALL, *overrides]))
    return trainer, trainer.fit()


def test_record_then_replay(tmp_path):
    skip = skip_overrides("rollout", tmp_path, [1, 2])
    _, recorded = fit(skip)
    assert recorded.generated_train_steps == [1, 2, 3]
    assert [r.mode for r in recorded.records] == ["generated"] * 3
    assert entry_dirs(project_dir(tmp_path, "colocated")) == ["1", "2"]

    _, replayed = fit(skip)
    # generation never ran on a replayed step; the unlisted step 3 generated again
    assert replayed.generated_train_steps == [3]
    assert [r.mode for r in replayed.records] == ["replayed", "replayed", "generated"]
    assert replayed.skip_stats["skip/rollout/hits"] == 2
    # the dataloader stayed aligned: same prompts at every step (check_prompts=error enforces the digest too)
    assert [r.prompt_indices for r in replayed.records] == [r.prompt_indices for r in recorded.records]
    # validation (before training, at step 2 and at the last step) always generated
    validations = [step for step, validate in replayed.generation_calls if validate]
    assert validations == [0, 2, 3]
    assert replayed.validations == recorded.validations
    # deterministic mode: every step's loss, replayed or regenerated, equals the recorded one exactly
    assert replayed.losses == recorded.losses
    assert [r.reward for r in replayed.records] == [r.reward for r in recorded.records]


def test_strict_replay_never_generates(tmp_path):
    fit(skip_overrides("rollout", tmp_path, [1, 2, 3]))
    trainer, replayed = fit(skip_overrides("rollout", tmp_path, [1, 2, 3], action="replay"))
    assert replayed.generated_train_steps == []
    assert all(validate for _, validate in trainer.agent_loop.calls)


def test_strict_replay_of_a_missing_step_raises(tmp_path):
    with pytest.raises(CacheMissError):
        fit(skip_overrides("rollout", tmp_path, [1], action="replay"))


def test_reward_stage_role(tmp_path):
    """``skip.reward: {kind: stage}`` caches RewardManager.compute_reward; validation scoring always runs."""
    skip = ["skip.reward.enable=true", f"skip.reward.dump_dir={tmp_path}", "skip.reward.steps=[1,2]"]
    first, recorded = fit(skip)
    assert entry_dirs(project_dir(tmp_path, "colocated") / "reward") == ["1", "2"]
    second, replayed = fit(skip)
    train_calls = [step for step, validate in second.reward_manager.calls if not validate]
    assert train_calls == [3]
    assert [step for step, validate in second.reward_manager.calls if validate] == [0, 2, 3]
    assert replayed.skip_stats["skip/reward/hits"] == 2
    assert replayed.generated_train_steps == [1, 2, 3]  # the rollout role is off: generation still runs
    assert replayed.losses == recorded.losses


def test_reward_improves_under_grpo():
    """The task is learnable: a short run on bigger batches raises the mean reward clearly."""
    trainer = ColocatedTrainer(load_config("colocated", [
        "trainer.total_training_steps=24", "trainer.test_freq=0", "trainer.val_before_train=false",
        "data.max_response_length=16", "data.train_batch_size=8", "actor_rollout_ref.actor.lr=3e-3"]))
    rewards = [r.reward for r in trainer.fit().records]
    assert sum(rewards[-4:]) / 4 > 2 * sum(rewards[:4]) / 4 + 0.05, rewards
