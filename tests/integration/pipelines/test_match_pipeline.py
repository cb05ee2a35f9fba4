"""``action: match`` on the colocated reference pipeline: another batch size still replays every prompt."""

from __future__ import annotations

from pipeline_helpers import SMALL, skip_overrides

from stepskip.pipelines.colocated import ColocatedTrainer
from stepskip.pipelines.runtime import load_config


def fit(overrides: list[str]):
    trainer = ColocatedTrainer(load_config("colocated", [*SMALL, *overrides]))
    return trainer, trainer.fit()


def test_a_run_whose_prompts_were_all_recorded_never_generates(tmp_path):
    skip = skip_overrides("rollout", tmp_path, [1, 2, 3], action="match")[:-1]  # prompt digests differ by design
    _, recorded = fit(skip)
    assert recorded.generated_train_steps == [1, 2, 3]
    # half the batch size for twice the steps: the same 12 prompts in the same order, in other batches
    halved = [*skip, "data.train_batch_size=2", "trainer.total_training_steps=6", "skip.rollout.steps=[1-6]"]
    _, replayed = fit(halved)
    assert replayed.generated_train_steps == []
    assert [i for r in replayed.records for i in r.prompt_indices] == [i for r in recorded.records
                                                                      for i in r.prompt_indices]
    assert replayed.skip_stats["skip/rollout/rows_generated"] == 0
    assert replayed.skip_stats["skip/rollout/rows_replayed"] == 12 * 4  # 12 prompts x n = 4
    # every prompt got its recorded responses: two halved steps score what their recorded step scored
    for k, whole in enumerate(recorded.records):
        halves = replayed.records[2 * k: 2 * k + 2]
        assert abs(sum(h.reward for h in halves) / 2 - whole.reward) < 1e-6
