"""TRL with ``use_vllm=True``: a run the cache serves builds no vLLM engine and moves no weights to it.

The real TRL ``GRPOTrainer`` (through ``StepskipGRPOTrainer``) trains on CPU in a fresh process.
vLLM does not run on this machine: ``trl.trainer.grpo_trainer.VLLMGeneration``, the name
``GRPOTrainer.__init__`` builds its vLLM backend with (``vllm.LLM`` in colocate mode, a server
client in server mode), is replaced by a stand-in (``trl_run.StandInVLLMGeneration``) that counts
its constructions, its weight syncs and its generations, and generates random words.
"""

from __future__ import annotations

import pytest
from trl_support import copy_cache, logs_without_timings, run_trl, skip_section

STEPS = [1, 2, 3, 4]


def losses(result: dict) -> list[float]:
    return [entry["loss"] for entry in logs_without_timings(result) if "loss" in entry]


MODES = ["colocate", "server"]


@pytest.fixture(scope="module")
def vllm_recordings(tmp_path_factory):
    """``recording(mode)``: 4 steps recorded with vLLM (the stand-in) started in that vLLM mode, made on first
    use. Whether an engine starts for an uncached step does not depend on the mode, so the two tests of that
    ask for colocate alone: no server recording is made only for a test that is then skipped."""
    made: dict[str, tuple] = {}

    def recording(mode: str) -> tuple:
        if mode not in made:
            work = tmp_path_factory.mktemp(f"trl-vllm-{mode}")
            result, _ = run_trl(work, skip_section(work / "cache", steps=STEPS), name="record", vllm=mode,
                                stepskip_trainer=True)
            assert result["error"] is None, result["error"]
            made[mode] = (mode, work / "cache", result)
        return made[mode]

    return recording


@pytest.mark.parametrize("mode", MODES)
def test_vllm_recording_starts_the_engine_and_generates_every_step(vllm_recordings, mode):
    _, _, result = vllm_recordings(mode)
    assert result["vllm"] == {"constructed": 1, "weight_syncs": 4, "generations": 4}
    assert result["vllm_backend"] == "StandInVLLMGeneration" and result["generated_steps"] == STEPS


@pytest.mark.parametrize("mode", MODES)
def test_vllm_fully_cached_run_constructs_no_engine_and_moves_no_weights(vllm_recordings, mode, tmp_path):
    mode, cache, recorded = vllm_recordings(mode)
    result, _ = run_trl(tmp_path, skip_section(cache, steps=STEPS, action="replay"), name="replay", vllm=mode,
                        stepskip_trainer=True)
    assert result["error"] is None, result["error"]
    assert result["vllm"] == {"constructed": 0, "weight_syncs": 0, "generations": 0}
    assert result["vllm_backend"] == "NoVLLMGeneration"
    assert "all 4 planned steps (1-4) are served from the cache" in result["engine_plan"]
    assert result["generated_steps"] == []
    assert losses(result) == losses(recorded) and len(losses(result)) == 4


def test_vllm_one_uncached_step_starts_the_engine_and_syncs_weights_for_that_step_only(vllm_recordings, tmp_path):
    mode, cache, _ = vllm_recordings("colocate")
    result, _ = run_trl(tmp_path, skip_section(copy_cache(cache, tmp_path), steps=[*STEPS, 5]), name="partial",
                        vllm=mode, stepskip_trainer=True, args={"max_steps": 5})
    assert result["error"] is None, result["error"]
    # steps 1-4 replayed: no weight moved into vLLM for them; step 5 generated after one sync
    assert result["vllm"] == {"constructed": 1, "weight_syncs": 1, "generations": 1}
    assert result["generated_steps"] == [5]


def test_vllm_engines_skip_refuses_to_start_a_run_that_needs_generation(vllm_recordings, tmp_path):
    mode, cache, _ = vllm_recordings("colocate")
    result, _ = run_trl(tmp_path, skip_section(copy_cache(cache, tmp_path), steps=[*STEPS, 5], engines="skip"),
                        name="refused", vllm=mode, stepskip_trainer=True, args={"max_steps": 5})
    assert result.get("init_failed") and result["error"]["type"] == "SkipConfigError"
    assert "skip.trl_generate.engines = skip" in result["error"]["message"]
    assert "not served from the cache: 5" in result["error"]["message"]
    assert result["vllm"]["constructed"] == 0
