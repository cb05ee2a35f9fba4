"""``restore_rng``: a replayed call leaves torch's global generator where the recorded call left it."""

from __future__ import annotations

import json

import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip.config import RolloutSkipConfig
from stepskip.errors import CorruptEntryError


class Sampler:
    """Draws from the global generator inside the call, as sampling does."""

    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict(tensors={"x": torch.rand(2, 3)}, non_tensors={"uid": ["a", "b"]})


PROMPTS = Batch.from_dict(non_tensors={"uid": ["a", "b"]})


def run_step(tmp_path, sampler: Sampler, **fields) -> tuple[torch.Tensor, torch.Tensor]:
    """One step 1 with seed 0: (the call's result, a draw right after the call)."""
    SkipManager.init(training_config(tmp_path, steps=[1], **fields))
    SkipManager.set_step(1)
    torch.manual_seed(0)
    out = sampler.generate_sequences(PROMPTS)
    after = torch.rand(4)
    SkipManager.reset()
    return out.batch["x"], after


def test_replay_restores_the_generator_the_recorded_call_left(tmp_path):
    sampler = Sampler()
    recorded, after_recorded = run_step(tmp_path, sampler, restore_rng=True)
    replayed, after_replayed = run_step(tmp_path, sampler, restore_rng=True)
    assert sampler.calls == 1
    assert torch.equal(recorded, replayed)
    assert torch.equal(after_recorded, after_replayed)


def test_without_the_option_the_draw_after_a_replay_differs(tmp_path):
    """Why the option exists: the skipped sampling no longer advances the generator."""
    sampler = Sampler()
    _, after_recorded = run_step(tmp_path, sampler)
    _, after_replayed = run_step(tmp_path, sampler)
    assert sampler.calls == 1
    assert not torch.equal(after_recorded, after_replayed)


def test_an_entry_recorded_without_the_state_replays_with_a_warning(tmp_path, caplog):
    sampler = Sampler()
    run_step(tmp_path, sampler)
    run_step(tmp_path, sampler, restore_rng=True)
    assert sampler.calls == 1
    assert "recorded without restore_rng" in caplog.text


def _damage_rng_state(tmp_path) -> None:
    meta_path = run_path(tmp_path) / "1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["rng_state"]["cpu"] = meta["rng_state"]["cpu"][:-8]  # still base64, the wrong size
    meta_path.write_text(json.dumps(meta))


def test_a_damaged_state_is_a_damaged_entry_and_the_step_is_regenerated(tmp_path):
    sampler = Sampler()
    run_step(tmp_path, sampler, restore_rng=True)
    _damage_rng_state(tmp_path)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    SkipManager.init(training_config(tmp_path, steps=[1], restore_rng=True))
    SkipManager.set_step(1)
    torch.set_rng_state(before)
    sampler.generate_sequences(PROMPTS)
    assert sampler.calls == 2
    assert SkipManager.stats()["skip/rollout/corrupt"] == 1


def test_a_damaged_state_under_replay_raises_and_leaves_the_generator_alone(tmp_path):
    sampler = Sampler()
    run_step(tmp_path, sampler, restore_rng=True)
    _damage_rng_state(tmp_path)
    SkipManager.init(training_config(tmp_path, steps=[1], restore_rng=True, action="replay"))
    SkipManager.set_step(1)
    before = torch.get_rng_state()
    with pytest.raises(CorruptEntryError):
        sampler.generate_sequences(PROMPTS)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_option_is_validated():
    with pytest.raises(SkipConfigError, match="restore_rng"):
        RolloutSkipConfig(restore_rng="yes")
