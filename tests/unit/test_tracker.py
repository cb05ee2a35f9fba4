"""``stepskip._tracker``: each step's skip metrics for a tracker, the roles' sampled trajectories, and what the
backends get (TensorBoard and MLflow for real, when installed; W&B is read back in the integration tests)."""

from __future__ import annotations

import pytest
import torch
from skip_configs import training_config

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip.config import MAX_LOG_SAMPLES, RolloutSkipConfig
from stepskip._policies import LogMetrics
from stepskip._tracker import (
    SAMPLE_COLUMNS,
    StepMetrics,
    add_rewards,
    decoder,
    log_mlflow,
    samples_text,
    select_metrics,
    take_samples,
)

PROMPT, RESPONSE = 4, 3


def rollout(prompts: Batch) -> Batch:
    """A generation: left-padded prompts, right-padded responses, masks and per-token scores, as verl's."""
    rows = len(prompts.non_tensor_batch["uid"])
    ids = torch.arange(rows * PROMPT).reshape(rows, PROMPT) + 10
    responses = torch.arange(rows * RESPONSE).reshape(rows, RESPONSE) + 100
    attention = torch.ones(rows, PROMPT + RESPONSE, dtype=torch.long)
    attention[:, 0] = 0  # one pad token on the left of every prompt
    attention[:, -1] = 0  # one pad token on the right of every response
    scores = torch.zeros(rows, RESPONSE)
    scores[:, 1] = torch.arange(rows, dtype=torch.float32)
    return Batch.from_dict(tensors={"prompts": ids, "responses": responses, "attention_mask": attention,
                                    "rm_scores": scores}, non_tensors={"uid": prompts.non_tensor_batch["uid"]})


class Loop:
    calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        Loop.calls += 1
        return rollout(prompts)


def prompts(rows: int = 8) -> Batch:
    return Batch.from_dict(tensors={"input_ids": torch.zeros(rows, PROMPT, dtype=torch.long)},
                           non_tensors={"uid": [f"u{i}" for i in range(rows)]})


def init(tmp_path, **fields) -> None:
    section = {"action": "repeat", "steps": [1, 2, 3], **fields}
    SkipManager.init(training_config(tmp_path / "dump", **section))
    take_samples()  # nothing left over from another test


def step(loop: Loop, number: int) -> Batch:
    SkipManager.set_step(number)
    return loop.generate_sequences(prompts())


# ---------------------------------------------------------------------- configuration


@pytest.mark.parametrize("value", ["short", "full", "off", LogMetrics.FULL])
def test_log_metrics_takes_its_three_names(value):
    assert RolloutSkipConfig(log_metrics=value).log_metrics is LogMetrics(value)


@pytest.mark.parametrize("value", ["all", "", None, 1, True])
def test_log_metrics_refuses_other_values_naming_the_key_and_the_names(value):
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.log_metrics = .*allowed values: short, full, off"):
        RolloutSkipConfig(log_metrics=value)


@pytest.mark.parametrize("value", [-1, MAX_LOG_SAMPLES + 1, True, 2.0, "2", None])
def test_log_samples_refuses_anything_but_a_small_count(value):
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.log_samples = .* expected an int from 0"):
        RolloutSkipConfig(log_samples=value)


def test_both_options_are_read_from_a_role_section(tmp_path):
    init(tmp_path, log_metrics="full", log_samples=3)
    config = SkipManager.skip_instances["rollout"].config
    assert (config.log_metrics, config.log_samples) == (LogMetrics.FULL, 3)


# ---------------------------------------------------------------------- metrics


def test_each_step_gets_its_own_counts_not_run_totals(tmp_path):
    init(tmp_path)
    loop, metrics = Loop(), StepMetrics()
    sent = []
    for number in (1, 2, 3):
        step(loop, number)
        sent.append(metrics.collect(number))
    assert [m["skip/rollout/misses"] for m in sent] == [1, 0, 0]
    assert [m["skip/rollout/hits"] for m in sent] == [0, 1, 1]  # repeat: steps 2 and 3 replay step 1
    assert sent[0]["skip/rollout/saved_seconds"] == 0 and sent[1]["skip/rollout/saved_seconds"] > 0
    assert set(sent[0]) == {f"skip/rollout/{n}" for n in ("hits", "misses", "saved_seconds", "dump_failures",
                                                           "corrupt")}
    assert SkipManager.stats()["skip/rollout/hits"] == 2  # the totals are untouched


def test_a_second_line_of_the_same_step_sends_only_what_changed(tmp_path):
    init(tmp_path)
    loop, metrics = Loop(), StepMetrics()
    step(loop, 1)
    assert metrics.collect(1)["skip/rollout/misses"] == 1
    assert metrics.collect(1) == {}
    step(loop, 2)
    assert metrics.collect(2)["skip/rollout/hits"] == 1
    # a step with no call still gets its zeros: a tracker plots a line, not dots
    zeros = metrics.collect(3)
    assert "skip/rollout/hits" in zeros and set(zeros.values()) == {0.0}


def test_a_new_run_counts_from_zero(tmp_path):
    init(tmp_path)
    loop, metrics = Loop(), StepMetrics()
    step(loop, 1)
    metrics.collect(1)
    init(tmp_path)  # same dump dir: step 1 is now a hit of the new run
    step(loop, 1)
    assert metrics.collect(1)["skip/rollout/hits"] == 1


def test_full_and_off(tmp_path):
    init(tmp_path, log_metrics="full")
    step(Loop(), 1)
    full = StepMetrics().collect(1)
    assert set(full) == set(SkipManager.stats())
    assert full["skip/rollout/rows_generated"] == 8 and full["skip/rollout/dumps"] == 1
    init(tmp_path, log_metrics="off")
    step(Loop(), 1)
    assert StepMetrics().collect(1) == {}


def test_nothing_before_init_or_with_every_role_off():
    assert StepMetrics().collect(1) == {}
    SkipManager.init({"skip": {"rollout": {"enable": False}}})
    assert StepMetrics().collect(1) == {}


def test_comparison_figures_pass_through_counts_as_deltas_the_token_match_on_compared_steps(monkeypatch):
    """The figures of ``action: compare`` (``compared``, ``drifted`` counters, ``token_match`` the last
    compared step's level), as ``SkipManager.stats()`` reports them."""
    totals = {"skip/rollout/hits": 0.0, "skip/rollout/compared": 1.0, "skip/rollout/drifted": 0.0,
              "skip/rollout/token_match": 0.97}
    monkeypatch.setattr(SkipManager, "stats", classmethod(lambda cls: dict(totals)))
    metrics = StepMetrics()
    first = metrics.collect(1)
    assert first == {**totals}
    totals.update({"skip/rollout/compared": 2.0, "skip/rollout/drifted": 1.0, "skip/rollout/token_match": 0.5})
    assert metrics.collect(2) == {"skip/rollout/hits": 0.0, "skip/rollout/compared": 1.0,
                                  "skip/rollout/drifted": 1.0, "skip/rollout/token_match": 0.5}
    # a step that compared nothing: counts of zero, no stale token match
    assert metrics.collect(3) == {"skip/rollout/hits": 0.0, "skip/rollout/compared": 0.0,
                                  "skip/rollout/drifted": 0.0}


def test_select_metrics_keeps_per_role_choices():
    stats = {"skip/a/hits": 1.0, "skip/a/bytes_read": 2.0, "skip/b/hits": 3.0, "skip/b/bytes_read": 4.0,
             "skip/c/hits": 5.0, "other": 6.0}
    modes = {"a": LogMetrics.SHORT, "b": LogMetrics.FULL, "c": LogMetrics.OFF}
    assert select_metrics(stats, modes) == {"skip/a/hits": 1.0, "skip/b/hits": 3.0, "skip/b/bytes_read": 4.0}


# ---------------------------------------------------------------------- samples


def test_no_samples_unless_asked(tmp_path):
    init(tmp_path)
    step(Loop(), 1)
    assert take_samples() == []


def test_recorded_and_replayed_steps_offer_their_sampled_trajectories(tmp_path):
    init(tmp_path, log_samples=3)
    loop = Loop()
    for number in (1, 2):
        step(loop, number)
    generated, replayed = take_samples(2)
    assert (generated.step, generated.source_step, generated.origin) == (1, 1, "generated")
    assert (replayed.step, replayed.source_step, replayed.origin) == (2, 1, "replayed")
    assert len(generated.rows) == len(replayed.rows) == 3
    sample = generated.rows[0]
    row = sample.row
    # padding left out; the reward is the row's scores summed
    assert sample.prompt == list(range(10 + row * PROMPT + 1, 10 + (row + 1) * PROMPT))
    assert sample.response == list(range(100 + row * RESPONSE, 100 + row * RESPONSE + 2))
    assert sample.reward == float(row)
    assert take_samples() == []


def test_the_rows_come_from_the_seed_and_the_step(tmp_path):
    init(tmp_path, log_samples=2, action="record")
    loop = Loop()
    for number in (1, 2, 1):
        step(loop, number)
    first, second, again = take_samples()
    assert [s.row for s in first.rows] == [s.row for s in again.rows]
    assert [s.row for s in first.rows] != [s.row for s in second.rows]  # (this seed draws other rows)
    init(tmp_path, log_samples=2, action="record", seed=5)
    step(loop, 1)
    (other_seed,) = take_samples()
    assert [s.row for s in other_seed.rows] != [s.row for s in first.rows]


def test_samples_wait_only_for_a_few_steps(tmp_path):
    init(tmp_path, log_samples=1, action="record", steps="1-40")
    loop = Loop()
    for number in range(1, 41):
        step(loop, number)
    assert [s.step for s in take_samples(30)] == list(range(25, 31))  # the oldest were dropped
    assert [s.step for s in take_samples()] == list(range(31, 41))


def test_ids_rows_and_rewards_added_later(tmp_path):
    """Results that are rows of completion ids (TRL's calls) with their prompt rows; rewards come after."""
    from stepskip._tracker import offer_samples

    init(tmp_path, log_samples=2)
    role = SkipManager.skip_instances["rollout"]
    offer_samples(role, 1, 1, ([[7, 8], [9], [10, 11, 12]], None), [[1], [2], [3]], replayed=False)
    assert add_rewards("rollout", [0.5, float("nan"), 2.0])
    assert not add_rewards("rollout", [1.0, 1.0, 1.0])  # taken already
    (samples,) = take_samples()
    by_row = {s.row: s for s in samples.rows}
    assert len(by_row) == 2
    expected = {0: ([1], [7, 8], 0.5), 1: ([2], [9], None), 2: ([3], [10, 11, 12], 2.0)}
    for row, sample in by_row.items():
        assert (sample.prompt, sample.response, sample.reward) == expected[row]


def test_a_result_without_rows_offers_nothing_and_a_broken_one_never_raises(tmp_path, caplog):
    from stepskip._tracker import offer_samples

    init(tmp_path, log_samples=2)
    role = SkipManager.skip_instances["rollout"]
    offer_samples(role, 1, 1, {"not": "a batch"}, None, replayed=False)

    class Broken:
        batch = property(lambda self: (_ for _ in ()).throw(RuntimeError("unreadable")))
        non_tensor_batch: dict = {}
        meta_info: dict = {}

    offer_samples(role, 1, 1, Broken(), None, replayed=False)
    assert take_samples() == []
    assert "no samples of step 1" in caplog.text


# ---------------------------------------------------------------------- rendering and backends


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, "hello": 1, "world": 2, "<unk>": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>")


def test_decoder_uses_the_tokenizer_and_falls_back_to_ids():
    pytest.importorskip("transformers")
    decode = decoder(word_tokenizer())
    assert decode([1, 2]) == "hello world"
    assert decode("already text") == "already text"
    assert decode(None) == ""
    assert decoder(None)([1, 2]) == "[1, 2]"

    class Refuses:
        def decode(self, ids, **kwargs):
            raise ValueError("no such id")

    assert decoder(Refuses())([99]) == "[99]"


def test_text_is_plain_and_indented_for_tensorboard(tmp_path):
    init(tmp_path, log_samples=1)
    step(Loop(), 1)
    (samples,) = take_samples()
    text = samples_text(samples, decoder(), indent="    ")
    lines = text.splitlines()
    assert lines[0] == "    skip/rollout/samples: step 1, generated"
    assert all(line.startswith("    ") for line in lines)
    assert "prompt: [" in text and "reward" in text


def test_tensorboard_text_reads_back(tmp_path):
    from tracker_files import tensorboard_texts  # skips naming the fix where a backend is missing

    from torch.utils.tensorboard import SummaryWriter

    init(tmp_path, log_samples=2)
    step(Loop(), 1)
    (samples,) = take_samples()
    writer = SummaryWriter(str(tmp_path / "tb"))
    writer.add_text(samples.key, samples_text(samples, decoder(), indent="    "), 1)
    writer.close()
    ((at, text),) = tensorboard_texts(tmp_path / "tb")["skip/rollout/samples"]
    assert at == 1 and "step 1, generated" in text


def test_mlflow_table_reads_back(tmp_path, monkeypatch):
    from tracker_files import mlflow_run, mlflow_tables

    import mlflow

    init(tmp_path, log_samples=2)
    step(Loop(), 1)
    (samples,) = take_samples()
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("unit")
    with mlflow.start_run():
        path = log_mlflow(samples, decoder())
    assert path == "stepskip/samples/rollout/step_000001.json"
    client, run_id = mlflow_run(uri, "unit")
    (rows,) = mlflow_tables(client, run_id, "stepskip/samples/rollout", tmp_path / "down").values()
    assert [list(r) for r in rows] == [list(SAMPLE_COLUMNS)] * 2
    assert [r["row"] for r in rows] == [s.row for s in samples.rows]
    assert [r["reward"] for r in rows] == [s.reward for s in samples.rows]
