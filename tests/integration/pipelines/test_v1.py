"""The V1 pipeline (role ``rollout_tq``) on the in-process queue, in its three modes, recorded then replayed."""

from __future__ import annotations

import pytest
from pipeline_helpers import SMALL, entry_dirs, project_dir, skip_overrides

from stepskip.pipelines.runtime import load_config
from stepskip.pipelines.v1 import V1Trainer
from stepskip.tq import InProcessTQClient

MODES = {"sync": 1, "colocate_async": 1, "separate_async": 2}


def fit(mode: str, overrides: list[str]) -> tuple[V1Trainer, object]:
    trainer = V1Trainer(load_config("v1", [*SMALL, f"trainer.v1.trainer_mode={mode}", *overrides]),
                        tq_client=InProcessTQClient())
    return trainer, trainer.fit()


@pytest.mark.parametrize("mode", list(MODES))
def test_record_then_replay(tmp_path, mode):
    skip = skip_overrides("rollout_tq", tmp_path, [1, 2])
    _, recorded = fit(mode, skip)
    assert recorded.generated_train_steps == [1, 2, 3]
    inner = [str(i) for i in range(MODES[mode])]
    assert entry_dirs(project_dir(tmp_path, "v1")) == [f"{s}/{i}" for s in ("1", "2") for i in inner]

    trainer, replayed = fit(mode, skip)
    assert replayed.generated_train_steps == [3]  # the submit phase injected steps 1 and 2
    assert [r.mode for r in replayed.records] == ["replayed", "replayed", "generated"]
    assert replayed.skip_stats["skip/rollout_tq/hits"] == 2
    assert [r.prompt_indices for r in replayed.records] == [r.prompt_indices for r in recorded.records]
    assert [s for s, validate in replayed.generation_calls if validate] == [0, 2, 3]
    assert replayed.losses == recorded.losses
    # kv_clear at every step end (and the sampled prompts' keys): the queue ends empty
    assert not any(trainer.tq.kv_list().values())


def test_modes_train_alike_when_nothing_is_stale(tmp_path):
    """With skip on (no warm-up batches) every mode trains on the same batches with the same weights."""
    losses = {mode: fit(mode, skip_overrides("rollout_tq", tmp_path / mode, [1]))[1].losses for mode in MODES}
    assert losses["sync"] == losses["colocate_async"] == losses["separate_async"]


def test_async_mode_drops_over_stale_prompts():
    """Skip off: warm-up batches run ahead; prompts older than the threshold are dropped and refilled."""
    trainer, result = fit("colocate_async", ["trainer.v1.colocate_async.num_warmup_batches=2",
                                             "trainer.v1.sampler.max_off_policy_threshold=1"])
    assert len(result.records) == 3
    assert trainer.replay_buffer.dropped > 0
    assert all(r.mode == "generated" for r in result.records)
