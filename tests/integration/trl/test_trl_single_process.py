"""stepskip inside the real TRL ``GRPOTrainer`` on one process: exact replay, the random state, step
mapping, fidelity reports and failing dumps. Each run is a fresh process (``trl_run.py``)."""

from __future__ import annotations

import pytest
from trl_support import copy_cache, entries, logs_without_timings, run_trl, skip_section

pytestmark = pytest.mark.heavy


def test_recording_stores_listed_training_steps_only_never_evaluation(recording):
    cache, recorded = recording
    assert recorded["error"] is None
    training, evaluation = recorded["generated_steps"][:4], recorded["generated_steps"][4:]
    assert training == [1, 2, 3, 4]
    assert evaluation and set(evaluation) == {5}  # the evaluation after step 4 generated
    assert entries(cache) == {1: ["c0-r0"], 2: ["c0-r0"], 3: ["c0-r0"]}
    assert [(c["step"], c["name"], c["eligible"], c["hit"]) for c in recorded["calls"]] == [
        (1, "c0", True, False), (2, "c0", True, False), (3, "c0", True, False), (4, "c0", False, False)]


def test_replay_in_a_fresh_process_is_exact_including_the_regenerated_step(recording, tmp_path):
    cache, recorded = recording
    replayed, _ = run_trl(tmp_path, skip_section(copy_cache(cache, tmp_path)), evaluate=True, name="replay")
    assert replayed["error"] is None
    # step 4 is not listed; the evaluation (at 5) generates as it did when recording, never cached
    assert replayed["generated_steps"] == recorded["generated_steps"][3:]
    assert logs_without_timings(replayed) == logs_without_timings(recorded)  # bit for bit, eval metrics too
    assert [c["hit"] for c in replayed["calls"]] == [True, True, True, False]
    assert replayed["stats"]["skip/trl_generate/hits"] == 3
    assert replayed["stats"]["skip/trl_generate/dumps"] == 0
    # the callback put the counters into what TRL's reporters receive
    train_logs = [log for log in replayed["seen_logs"] if "loss" in log]
    assert [log["skip/trl_generate/hits"] for log in train_logs] == [1, 2, 3, 3]


def test_without_restore_rng_the_replay_drifts_and_the_next_generated_step_differs(recording, tmp_path):
    """Why ``restore_rng`` exists: TRL shuffles the generated batch with the global torch generator
    right after generating; a replay that skips the sampling leaves the generator elsewhere."""
    cache, recorded = recording
    replayed, _ = run_trl(tmp_path, skip_section(copy_cache(cache, tmp_path), restore_rng=False), name="drift")
    assert replayed["generated_steps"] == [4]
    ours, theirs = logs_without_timings(replayed), logs_without_timings(recorded)[:len(logs_without_timings(replayed))]
    assert ours[:3] != theirs[:3]  # the same completions, shuffled otherwise: the losses drift
    for key in ("completions/mean_length", "reward"):  # the completions themselves are the recorded ones
        assert [log[key] for log in ours[:3]] == [log[key] for log in theirs[:3]]
    assert ours[3] != theirs[3]  # the first regenerated step sees another random stream


def test_strict_replay_of_a_missing_step_raises_cache_miss(tmp_path):
    result, _ = run_trl(tmp_path, skip_section(tmp_path / "empty", steps=[1], action="replay"),
                        args={"max_steps": 1}, name="strict")
    assert result["error"] is not None
    assert "CacheMissError" in result["error"]["mro"]
    assert "no usable entry of step 1" in result["error"]["message"]
    assert result["generated_steps"] == []


def test_steps_per_generation_2_stores_generating_steps_and_warns_about_the_others(tmp_path):
    result, stderr = run_trl(tmp_path, skip_section(tmp_path / "cache", steps=[1, 2, 3, 4]),
                             args={"steps_per_generation": 2}, name="spg2")
    assert result["error"] is None
    assert result["generated_steps"] == [1, 3]
    assert entries(tmp_path / "cache") == {1: ["c0-r0"], 3: ["c0-r0"]}
    assert "listed step(s) 2, 4 never generate" in stderr


def test_gradient_accumulation_caches_every_call_of_a_step_and_replays_them(tmp_path):
    args = {"gradient_accumulation_steps": 2, "steps_per_generation": 1, "max_steps": 2}
    section = skip_section(tmp_path / "cache", steps=[1, 2])
    recorded, _ = run_trl(tmp_path, section, args=args, name="ga-record")
    assert recorded["generated_steps"] == [1, 1, 2, 2]
    assert entries(tmp_path / "cache") == {1: ["c0-r0", "c1-r0"], 2: ["c0-r0", "c1-r0"]}
    replayed, _ = run_trl(tmp_path, section, args=args, name="ga-replay")
    assert replayed["generated_steps"] == []
    assert logs_without_timings(replayed) == logs_without_timings(recorded)


def test_a_changed_temperature_and_data_seed_are_reported(recording, tmp_path):
    cache, _ = recording
    result, stderr = run_trl(tmp_path, skip_section(copy_cache(cache, tmp_path), steps=[1]),
                             args={"max_steps": 1, "temperature": 0.9, "seed": 8}, name="changed")
    assert result["error"] is None
    assert "recorded with other rollout settings" in stderr
    assert "trl.temperature: recorded 1.0, now 0.9" in stderr
    assert "trl.seed: recorded 7, now 8" in stderr
    assert "was recorded for other prompts" in stderr  # another seed: another data order


def test_a_dump_dir_that_cannot_be_written_counts_failures_and_training_goes_on(tmp_path):
    """The dump dir itself is fine at startup; below it, a file sits where the run's directory must
    go (root ignores read-only modes, so this is how the test makes every write fail)."""
    dump_dir = tmp_path / "cache"
    dump_dir.mkdir()
    (dump_dir / "grpo_model").write_text("a file where the run's directory should go")
    result, stderr = run_trl(tmp_path, skip_section(dump_dir, steps=[1, 2]), args={"max_steps": 2},
                             name="unwritable")
    assert result["error"] is None
    assert result["generated_steps"] == [1, 2]
    assert len(result["log_history"]) == 3  # two steps and the summary
    assert result["stats"]["skip/trl_generate/dump_failures"] == 2
    assert "dump failed" in stderr
