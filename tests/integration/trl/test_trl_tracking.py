"""stepskip in what TRL's own reporters send (``report_to``): the short metrics set on every log line by
default, the full set and rollout samples when asked, read back from the real backends' files
(TensorBoard event files, a W&B offline run, an MLflow file store). Each run is a fresh process
(``trl_run.py``) of the real ``GRPOTrainer`` on a tiny model built locally."""

from __future__ import annotations

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
from trl_support import copy_cache, run_trl, skip_section

pytestmark = pytest.mark.heavy

ROLE = "skip/trl_generate"
SHORT = {"hits", "misses", "saved_seconds", "dump_failures", "corrupt"}
ROWS = 4  # completions of one call: per_device_train_batch_size in trl_run.py
SPECIAL = {"<eos>", "<pad>", "<unk>"}
# hits at each step's log line: run totals (TRL's end-of-training summary line repeats step 4's)
TOTALS = {1: 1.0, 2: 2.0, 3: 3.0, 4: 3.0}


def test_log_lines_carry_the_short_set_and_rows_are_counted(recording):
    _, recorded = recording
    logged = {key for log in recorded["seen_logs"] for key in log if key.startswith("skip/")}
    assert logged == {f"{ROLE}/{name}" for name in SHORT}
    # steps 1-3 were recorded: each call generated its completions
    assert recorded["stats"][f"{ROLE}/rows_generated"] == 3 * ROWS
    assert recorded["stats"][f"{ROLE}/rows_replayed"] == 0


def test_log_metrics_off_leaves_the_log_lines_alone(recording, tmp_path):
    cache, _ = recording
    result, _ = run_trl(tmp_path, skip_section(copy_cache(cache, tmp_path), log_metrics="off"),
                        args={"max_steps": 1}, name="off")
    assert result["error"] is None
    assert not [key for log in result["seen_logs"] for key in log if key.startswith("skip/")]


@pytest.fixture(scope="module")
def tracked(recording, tmp_path_factory):
    """The recording (steps 1-3) replayed with step 4 listed too (generated and recorded), report_to=[tensorboard,
    wandb, mlflow], log_metrics: full, log_samples: 2."""
    cache, _ = recording
    work = tmp_path_factory.mktemp("trl-tracked")
    (work / "wb").mkdir()
    env = {
        "TENSORBOARD_LOGGING_DIR": str(work / "tb"),
        "WANDB_MODE": "offline", "WANDB_DIR": str(work / "wb"), "WANDB_SILENT": "true", "WANDB_PROJECT": "trl",
        "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
        "MLFLOW_TRACKING_URI": (work / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
        "MLFLOW_EXPERIMENT_NAME": "trl",
    }
    skip = skip_section(copy_cache(cache, work), steps=[1, 2, 3, 4], log_metrics="full", log_samples=2)
    result, _ = run_trl(work, skip, args={"report_to": ["tensorboard", "wandb", "mlflow"]}, env=env, name="tracked")
    assert result["error"] is None
    assert [(c["hit"], c["eligible"]) for c in result["calls"]] == [(True, True)] * 3 + [(False, True)]
    return work, result


def reward_of(text: str) -> float:
    """trl_run.py's reward, ``count_blue``, of a decoded completion (special tokens are not words to it)."""
    words = [w for w in text.split() if w not in SPECIAL]
    return words.count("blue") + 0.1 * len(words)


def check_samples(rows: list[dict], step: int) -> None:
    assert len(rows) == 2
    origin = "generated" if step == 4 else "replayed"
    assert {(r["step"], r["origin"], r["source_step"]) for r in rows} == {(step, origin, step)}
    for row in rows:
        assert row["prompt"] and not row["prompt"].startswith("[")  # decoded by the trainer's tokenizer
        assert row["reward"] == pytest.approx(reward_of(row["response"]))


def test_tensorboard_gets_the_full_set_and_the_samples_as_text(tracked):
    work, _ = tracked
    scalars = tensorboard_scalars(work / "tb", f"train/{ROLE}/")
    assert dict(scalars[f"train/{ROLE}/hits"]) == TOTALS
    assert dict(scalars[f"train/{ROLE}/rows_replayed"])[4] == 3.0 * ROWS
    assert dict(scalars[f"train/{ROLE}/rows_generated"]) == {1: 0.0, 2: 0.0, 3: 0.0, 4: 1.0 * ROWS}
    assert f"train/{ROLE}/bytes_read" in scalars  # log_metrics: full
    texts = dict(tensorboard_texts(work / "tb")[f"{ROLE}/samples"])
    assert sorted(texts) == [1, 2, 3, 4]
    assert all(f"step {s}, replayed from step {s}" in texts[s] and "reward" in texts[s] for s in (1, 2, 3))
    assert "step 4, generated" in texts[4]


def test_wandb_run_gets_the_metrics_and_a_samples_table_per_step(tracked):
    work, _ = tracked
    run = wandb_run_dir(work / "wb")
    history = wandb_history(run)
    hits = [(row["train/global_step"], row[f"train/{ROLE}/hits"]) for row in history if f"train/{ROLE}/hits" in row]
    assert dict(hits) == TOTALS
    tables = [row for row in history if f"{ROLE}/samples" in row]
    # the table joined the line TRL's W&B callback logged for that step
    assert [row["train/global_step"] for row in tables] == [1, 2, 3, 4]
    for row in tables:
        check_samples(wandb_table(run, row[f"{ROLE}/samples"]), row["train/global_step"])


def test_mlflow_run_gets_the_metrics_and_sample_tables(tracked):
    work, _ = tracked
    client, run_id = mlflow_run((work / "mlruns").as_uri(), "trl")
    assert dict(mlflow_metric(client, run_id, f"{ROLE}/hits")) == TOTALS
    tables = mlflow_tables(client, run_id, "stepskip/samples/trl_generate", work / "mlflow-download")
    assert sorted(tables) == [f"step_{s:06d}.json" for s in (1, 2, 3, 4)]
    for step in (1, 2, 3, 4):
        check_samples(tables[f"step_{step:06d}.json"], step)
