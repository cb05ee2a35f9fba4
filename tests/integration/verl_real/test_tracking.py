"""Skip metrics and rollout samples reach verl 0.9.1's real ``Tracking`` backends, per step, with no user code.

One run of verl's real ``RayPPOTrainer.fit()`` (``verl_side/ray_ppo.py``: the stand-ins are the agent-loop
worker handles, the actor worker group, the checkpoint and resource-pool managers, which need GPUs or
inference servers) with ``trainer.logger=[console,tensorboard,wandb,mlflow,file]``: TensorBoard event
files, W&B in offline mode, an MLflow file store and verl's JSONL file logger, all real, read back here
with each backend's own reader. stepskip is installed as the launcher installs it (``install()`` before
verl is imported); nothing else of the run knows about it.

The skip section records step 1 and replays it on steps 2 and 3 (``action: repeat``), so one run shows
a generated step and replayed ones: per-step hits ``[0, 1, 1]``, misses ``[1, 0, 0]``, seconds saved only
on the replayed steps, and the trajectories of each step (``log_samples: 8``, the whole batch of 4 prompts
x 2) with their origin and source step.
"""

from __future__ import annotations

import json

import pytest
from tracker_files import (
    mlflow_metric,
    mlflow_run,
    mlflow_tables,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_history,
    wandb_run_dir,
    wandb_table,
)
from verl_real_support import needs_verl_env, ok, run_scenario

pytestmark = [pytest.mark.heavy, needs_verl_env]

STEPS = [1, 2, 3]
ROWS = 8  # 4 prompts x n = 2
SHORT = {"hits", "misses", "saved_seconds", "dump_failures", "corrupt"}
HITS, MISSES = [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]
ORIGINS = [(1, "generated", 1), (2, "replayed", 1), (3, "replayed", 1)]  # (step, origin, source step)


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    work = tmp_path_factory.mktemp("tracked")
    env = {
        "TENSORBOARD_DIR": str(work / "tb"),
        "WANDB_MODE": "offline", "WANDB_DIR": str(work / "wb"), "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
        "MLFLOW_TRACKING_URI": (work / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
        "VERL_FILE_LOGGER_PATH": str(work / "metrics.jsonl"),
    }
    (work / "wb").mkdir()
    skip = {"enable": True, "dump_dir": str(work / "dump"), "steps": STEPS, "action": "repeat", "log_samples": ROWS}
    report = ok(run_scenario("ray_ppo", {
        "skip": skip, "logger": ["console", "tensorboard", "wandb", "mlflow", "file"], "env": env,
    }, work / "run"))
    assert report["impl"] == "stepskip" and report["generation_calls"] == 1
    return work, report


def per_step(series: list[tuple[int, float]]) -> list[float]:
    assert [step for step, _ in series] == STEPS, series
    return [value for _, value in series]


def test_tensorboard_events_carry_each_steps_skip_metrics_and_samples_text(tracked):
    work, _ = tracked
    scalars = tensorboard_scalars(work / "tb", "skip/")
    assert {tag.rsplit("/", 1)[1] for tag in scalars} == SHORT  # log_metrics: short, the default
    assert per_step(scalars["skip/rollout/hits"]) == HITS
    assert per_step(scalars["skip/rollout/misses"]) == MISSES
    saved = per_step(scalars["skip/rollout/saved_seconds"])
    assert saved[0] == 0.0 and saved[1] > 0 and saved[2] > 0
    assert per_step(scalars["skip/rollout/dump_failures"]) == per_step(scalars["skip/rollout/corrupt"]) == [0.0] * 3
    # verl's own metrics are still there, at the same steps
    assert [s for s, _ in tensorboard_scalars(work / "tb", "critic/score/mean")["critic/score/mean"]] == STEPS
    texts = dict(tensorboard_texts(work / "tb")["skip/rollout/samples"])
    assert sorted(texts) == STEPS
    assert "step 1, generated" in texts[1] and "step 2, replayed from step 1" in texts[2]
    # decoded with the trainer's tokenizer: its chat template's words, not token ids
    assert "assistant" in texts[3] and "prompt: user : w" in texts[3]


def test_wandb_offline_run_has_metrics_per_step_and_a_samples_table(tracked):
    work, _ = tracked
    run = wandb_run_dir(work / "wb")
    rows = {row["_step"]: row for row in wandb_history(run) if "skip/rollout/hits" in row}
    assert sorted(rows) == STEPS
    assert [rows[s]["skip/rollout/hits"] for s in STEPS] == HITS
    assert [rows[s]["skip/rollout/misses"] for s in STEPS] == MISSES
    assert all("skip/rollout/bytes_read" not in row for row in rows.values())
    tables = {row["_step"]: row["skip/rollout/samples"] for row in wandb_history(run) if "skip/rollout/samples" in row}
    assert sorted(tables) == STEPS
    for step, origin, source in ORIGINS:
        samples = wandb_table(run, tables[step])
        assert len(samples) == ROWS
        assert {(r["step"], r["origin"], r["source_step"]) for r in samples} == {(step, origin, source)}
        assert all(r["reward"] > 0 and r["response"] and r["prompt"].startswith("user :") for r in samples)


def test_mlflow_file_store_has_metrics_per_step_and_sample_tables(tracked):
    work, _ = tracked
    client, run_id = mlflow_run((work / "mlruns").as_uri(), "verl_real")
    assert per_step(mlflow_metric(client, run_id, "skip/rollout/hits")) == HITS
    assert per_step(mlflow_metric(client, run_id, "skip/rollout/misses")) == MISSES
    tables = mlflow_tables(client, run_id, "stepskip/samples/rollout", work / "mlflow-download")
    assert sorted(tables) == [f"step_{s:06d}.json" for s in STEPS]
    for step, origin, source in ORIGINS:
        samples = tables[f"step_{step:06d}.json"]
        assert [(r["origin"], r["source_step"]) for r in samples] == [(origin, source)] * ROWS


def test_file_logger_and_console_get_metrics_and_samples(tracked):
    work, report = tracked
    lines = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    metrics = [line for line in lines if "skip/rollout/hits" in line["data"]]
    assert [line["step"] for line in metrics] == STEPS
    assert [line["data"]["skip/rollout/hits"] for line in metrics] == HITS
    samples = [line for line in lines if "skip/rollout/samples" in line["data"]]
    assert [(line["step"], line["data"]["skip/rollout/samples"][0]["origin"]) for line in samples] == [
        (step, origin) for step, origin, _ in ORIGINS]
    # the console backend: the samples' text through stepskip's logger
    assert "skip/rollout/samples: step 3, replayed from step 1" in report["log"]


def test_replayed_samples_are_the_recorded_trajectories(tracked):
    """Steps 2 and 3 replay step 1's entry: their tables hold step 1's trajectories, row for row."""
    work, _ = tracked
    lines = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    tables = {line["step"]: line["data"]["skip/rollout/samples"] for line in lines
              if "skip/rollout/samples" in line["data"]}

    def trajectories(step: int) -> list[tuple]:
        return [(r["row"], r["prompt"], r["response"], r["reward"]) for r in tables[step]]

    assert [r["row"] for r in tables[1]] == list(range(ROWS))
    assert len({response for _, _, response, _ in trajectories(1)}) > 1  # random responses: rows differ
    assert trajectories(2) == trajectories(1) == trajectories(3)
