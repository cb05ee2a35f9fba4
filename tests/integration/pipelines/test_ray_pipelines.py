"""The pipelines that need Ray: fully async (role ``async_rollout``) and V1 on the real TransferQueue.

One Ray cluster and one TransferQueue (a single storage unit: two would wait forever on 2 CPUs)
serve the whole module; the pipelines reuse a running Ray instead of starting their own.
"""

from __future__ import annotations

import json
import shutil

import pytest
from pipeline_helpers import SMALL, entry_dirs, project_dir, skip_overrides

from stepskip.pipelines import demo
from stepskip.pipelines.fully_async import run as run_async
from stepskip.pipelines.runtime import load_config
from stepskip.pipelines.v1 import V1Trainer, transfer_queue_session

pytestmark = pytest.mark.heavy

BATCH = 4  # prompts per step = samples per trainer step on the fully async path


@pytest.fixture(scope="module")
def tq():
    """Ray (2 CPUs, no auth, temp RAY_TMPDIR) and the real TransferQueue, for the module."""
    pytest.importorskip("ray")
    pytest.importorskip("transfer_queue")
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already running in this process; this module starts its own")
    with transfer_queue_session(num_cpus=2) as module:
        yield module


def feed_indices(steps: list[int]) -> list[int]:
    return [i for s in steps for i in range((s - 1) * BATCH, s * BATCH)]


@pytest.fixture(scope="module")
def async_recording(tq, tmp_path_factory):
    """One fully async record run (the samples of steps 1 and 2 cached) for the tests that replay, compare
    or refuse against it: each run starts its own Ray actors, seconds a run."""
    where = tmp_path_factory.mktemp("async-recording")
    recorded = run_async(load_config("fully_async", [*SMALL, *skip_overrides("async_rollout", where,
                                                                             feed_indices([1, 2]))]))
    return where, recorded


def recording_in(tmp_path, async_recording):
    """A copy of the module's recording under ``tmp_path`` (the same layout); its run's result."""
    where, recorded = async_recording
    shutil.copytree(where, tmp_path, dirs_exist_ok=True)
    return recorded


def test_fully_async_record_then_replay(tq, tmp_path, async_recording):
    skip = skip_overrides("async_rollout", tmp_path, feed_indices([1, 2]))
    config = load_config("fully_async", [*SMALL, *skip])
    recorded = recording_in(tmp_path, async_recording)
    assert recorded.generated_train_steps == [1, 2, 3]
    assert entry_dirs(project_dir(tmp_path, "fully_async", gbs=1)) == sorted(str(i) for i in feed_indices([1, 2]))

    replayed = run_async(config)
    # no sample of a replayed step was generated; step 3's samples were
    assert replayed.generated_train_steps == [3]
    assert [r.mode for r in replayed.records] == ["replayed", "replayed", "generated"]
    assert replayed.skip_stats["skip/async_rollout/hits"] == 2 * BATCH
    assert [r.prompt_indices for r in replayed.records] == [r.prompt_indices for r in recorded.records]
    assert [s for s, validate in replayed.generation_calls if validate] == [0, 2, 3]
    # staleness_threshold 0: even the regenerated step 3 used the same weights version: all losses equal
    assert replayed.losses == recorded.losses


def test_fully_async_compare(tq, tmp_path, async_recording):
    """``action: compare`` on the Rollouter's per-sample calls (step 1's, of the module's recording): the
    same policy matches every sample's recording; another policy seed drifts. The records lie beside the
    entries (the role runs in the actor)."""
    recording_in(tmp_path, async_recording)
    compare = skip_overrides("async_rollout", tmp_path, feed_indices([1]), action="compare")
    same = run_async(load_config("fully_async", [*SMALL, *compare]))
    stats = same.skip_stats
    assert stats["skip/async_rollout/compared"] == BATCH and stats["skip/async_rollout/drifted"] == 0
    assert stats["skip/async_rollout/token_match"] == 1.0
    other = run_async(load_config("fully_async", [*SMALL, *compare, "actor_rollout_ref.model.init_seed=1"]))
    assert other.skip_stats["skip/async_rollout/drifted"] > 0
    records = project_dir(tmp_path, "fully_async", gbs=1) / ".stepskip-drift"
    written = [json.loads((records / f"{i}.json").read_text()) for i in feed_indices([1])]
    assert [r["step"] for r in written] == feed_indices([1]) and not all(r["passed"] for r in written)


def test_v1_on_the_real_transfer_queue(tq, tmp_path):
    skip = skip_overrides("rollout_tq", tmp_path, [1, 2])
    overrides = [*SMALL, "trainer.v1.trainer_mode=separate_async", *skip]
    recorded = V1Trainer(load_config("v1", overrides), tq_client=tq).fit()
    assert entry_dirs(project_dir(tmp_path, "v1")) == ["1/0", "1/1", "2/0", "2/1"]
    replayed = V1Trainer(load_config("v1", overrides), tq_client=tq).fit()
    assert replayed.generated_train_steps == [3]
    assert replayed.losses == recorded.losses
    assert not any(tq.kv_list().values())


def test_demo_all_json(tq, tmp_path):
    out = tmp_path / "demo.json"
    code = demo.main(["--all", "--steps", "2", "--replay-steps", "1", "--json", str(out),
                      "data.max_response_length=8", "trainer.val_before_train=false"])
    assert code == 0
    payload = json.loads(out.read_text())
    assert [p["pipeline"] for p in payload] == ["v1", "colocated", "fully_async"]  # the V1 trainer leads
    for item in payload:
        assert set(item) == {"pipeline", "steps", "summary"}
        assert set(item["summary"]) == {"rollout_calls_avoided", "time_saved_s", "step_time_ratio", "losses_equal"}
        assert item["summary"]["losses_equal"] is True
        assert [(s["pass"], s["step"], s["mode"]) for s in item["steps"]] == [
            ("record", 1, "generated"), ("record", 2, "generated"),
            ("replay", 1, "replayed"), ("replay", 2, "generated")]
        for step in item["steps"]:
            assert set(step) == {"pass", "step", "mode", "rollout_s", "step_s", "reward", "loss"}
    assert [p["summary"]["rollout_calls_avoided"] for p in payload] == [1, 1, BATCH]


def test_a_failing_rollouter_stops_the_run(tq, tmp_path, async_recording):
    """A replay refused by the Rollouter (prompts of another data order than the module's recording,
    check_prompts=error) fails fast."""
    recording_in(tmp_path, async_recording)
    skip = skip_overrides("async_rollout", tmp_path, feed_indices([1]))
    short = [*SMALL, "trainer.total_training_steps=1", "trainer.val_before_train=false"]
    with pytest.raises(Exception, match="PromptMismatchError|recorded for other prompts"):
        run_async(load_config("fully_async", [*short, *skip, "data.seed=1"]))
