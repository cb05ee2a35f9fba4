"""Per-step views of GRPO training signal: groups whose rewards are all equal (zero advantage), one
trajectory's per-token log-probs, and text decoded by the local tokenizer a run's fingerprint names."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_caches import SAFE_RUN

from stepskip import Batch, SkipManager
from stepskip.view.data import ViewSource
from stepskip.view.groups import equal_reward_groups, sum_equal_groups
from stepskip.view.server import handle_api

RUN = "exp_grpo/GBS3_N4_in4_out5"
#: Rewards of each step's 12 rows (3 prompts, 4 samples): step 1 has one all-1 and one all-0 group.
REWARDS = {1: [1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1], 2: [1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1]}
RESPONSE_LENS = [5, 3, 1, 4, 5, 2, 5, 1, 3, 3, 4, 5]


def grpo_batch(step: int, uid: bool = True) -> Batch:
    rows = 12
    responses = torch.zeros(rows, 5, dtype=torch.int64)
    mask = torch.zeros(rows, 5, dtype=torch.int64)
    scores = torch.zeros(rows, 5)
    log_probs = torch.zeros(rows, 5)
    for r, n in enumerate(RESPONSE_LENS):
        responses[r, :n] = torch.arange(n) + 10 * r + 1
        mask[r, :n] = 1
        scores[r, n - 1] = REWARDS[step][r]
        log_probs[r, :n] = -torch.arange(1, n + 1, dtype=torch.float32) / (r + 1)
    prompts = torch.arange(rows * 4).reshape(rows, 4) % 7 + 200
    non_tensors = {"uid": np.array([f"q{step}-{r // 4}" for r in range(rows)], dtype=object)} if uid else {}
    return Batch.from_dict({"prompts": prompts, "responses": responses, "response_mask": mask,
                            "attention_mask": torch.cat([torch.ones(rows, 4, dtype=torch.int64), mask], 1),
                            "token_level_scores": scores, "rollout_log_probs": log_probs,
                            "old_log_probs": log_probs * 2}, non_tensors)


class Loop:
    uid = True

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return grpo_batch(SkipManager.step, self.uid)


def record(dump: Path, model: str = "Qwen/Qwen2.5-0.5B", project: str = "grpo", uid: bool = True) -> Path:
    SkipManager.init({
        "trainer": {"experiment_name": "exp", "project_name": project},
        "data": {"train_batch_size": 3, "max_prompt_length": 4, "max_response_length": 5},
        "actor_rollout_ref": {"rollout": {"n": 4}, "model": {"path": model}},
        "skip": {"rollout": {"enable": True, "dump_dir": str(dump), "steps": [1, 2], "async_dump": False}}})
    loop = Loop()
    loop.uid = uid
    for step in (1, 2):
        SkipManager.set_step(step)
        loop.generate_sequences(Batch.from_dict(non_tensors={"uid": [f"p{i}" for i in range(3)]}))
    SkipManager.close()
    SkipManager.reset()
    return dump


@pytest.fixture(scope="module")
def grpo(tmp_path_factory) -> ViewSource:
    dump = record(tmp_path_factory.mktemp("grpo"))
    record(dump, project="nouid", uid=False)
    return ViewSource(str(dump))


# ------------------------------------------------------------------ equal-reward groups


def test_equal_reward_groups_of_each_step_and_across_steps(grpo):
    first = grpo.step_stats(RUN, "rollout", 1)["groups"]
    assert first["groups"] == 3 and first["equal"] == 2 and first["by_value"] == {"0": 1, "1": 1}
    assert first["grouped_by"] == "group" and math.isclose(first["fraction"], 2 / 3)
    assert grpo.step_stats(RUN, "rollout", 2)["groups"]["by_value"] == {"1": 1}
    trend = grpo.trend(RUN, "rollout")
    assert [s["groups"]["equal"] for s in trend["steps"]] == [2, 1]
    assert trend["groups"] == {"steps": 2, "groups": 6, "equal": 3, "fraction": 0.5}


def test_rows_without_uid_are_grouped_by_the_runs_n(grpo):
    groups = grpo.step_stats("exp_nouid/GBS3_N4_in4_out5", "rollout", 1)["groups"]
    assert groups["grouped_by"].startswith("consecutive rows (4") and groups["equal"] == 2


def test_a_cache_without_equal_groups_counts_none(view_cache):
    stats = ViewSource(str(view_cache)).step_stats(SAFE_RUN, "rollout", 1)["groups"]
    assert stats["groups"] == 4 and stats["equal"] == 0 and stats["by_value"] == {}  # rewards alternate 0, 1


@pytest.mark.parametrize("rows, expected", [
    ([], None),
    ([{"i": 0, "group": "a"}, {"i": 1, "group": "a"}], None),  # no reward anywhere
    ([{"i": 0, "reward": 1.0}, {"i": 1, "reward": 1.0}], None),  # no group and no n
    ([{"i": 0, "group": "a", "reward": float("nan")}, {"i": 1, "group": "a", "reward": 1.0},
      {"i": 2, "group": "<b>", "reward": True}, {"i": 3, "group": "<b>", "reward": 0.5},
      {"i": 4, "group": "c", "reward": 2.0}],
     {"groups": 0, "equal": 0, "fraction": None, "by_value": {}, "unscored": 2, "single": 1, "grouped_by": "group"}),
])
def test_odd_rows_never_count_as_equal(rows, expected):
    assert equal_reward_groups(rows) == expected


def test_many_distinct_rewards_stay_a_short_list():
    rows = [{"i": i, "group": str(i // 2), "reward": float(i // 2) / 7} for i in range(200)]
    counts = equal_reward_groups(rows)
    assert counts["equal"] == 100 and len(counts["by_value"]) == 8
    assert sum_equal_groups([None, None]) is None


# ------------------------------------------------------------------ per-token strips


def test_a_trajectorys_log_probs_token_by_token(grpo):
    page = grpo.step_page(RUN, "rollout", 1)
    assert page["strip_columns"] == ["rollout_log_probs", "old_log_probs"]
    strip = grpo.token_strip(RUN, "rollout", 1, 3)
    assert strip["column"] == "rollout_log_probs" and strip["count"] == RESPONSE_LENS[3] and not strip["truncated"]
    assert [t["t"] for t in strip["tokens"]] == ["31", "32", "33", "34"]  # ids: no tokenizer for a Hub name
    assert [t["v"] for t in strip["tokens"]] == pytest.approx([-1 / 4, -2 / 4, -3 / 4, -4 / 4])
    assert strip["min"] == pytest.approx(-1.0) and strip["max"] == pytest.approx(-0.25)
    old = grpo.token_strip(RUN, "rollout", 1, 3, "old_log_probs")
    assert [t["v"] for t in old["tokens"]] == pytest.approx([-0.5, -1.0, -1.5, -2.0])


@pytest.mark.parametrize("params, status", [
    ({"row": ["99"]}, 404), ({"row": ["-1"]}, 404), ({"row": ["x"]}, 404),
    ({"row": ["1"], "column": ["<script>"]}, 404),
    ({"row": ["1"], "column": ["prompts"]}, 404), ({}, 400),
])
def test_strip_requests_for_what_is_not_there_are_refused(grpo, params, status):
    code, body = handle_api(grpo, "/api/tokens", {"run": [RUN], "role": ["rollout"], "step": ["1"], **params})
    assert code == status and "error" in body


def test_a_step_without_per_token_columns_has_no_strip(view_cache):
    source = ViewSource(str(view_cache))
    assert source.step_page(SAFE_RUN, "rollout", 1)["strip_columns"] == []
    query = {"run": [SAFE_RUN], "role": ["rollout"], "step": ["1"], "row": ["0"]}
    code, body = handle_api(source, "/api/tokens", query)
    assert code == 404 and "per-token" in body["error"]


# ------------------------------------------------------------------ the tokenizer the fingerprint names


def word_tokenizer(where: Path) -> Path:
    """A real Hugging Face tokenizer saved to a directory: ids 0-299 are the words w0-w299."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(300)} | {"[UNK]": 300}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(where))
    return where


def test_text_is_decoded_with_the_local_tokenizer_the_fingerprint_names(tmp_path):
    tokenizer = word_tokenizer(tmp_path / "models" / "tiny")
    source = ViewSource(str(record(tmp_path / "dump", model=str(tokenizer))))
    page = source.step_page(RUN, "rollout", 1, limit=2)
    assert page["rows"][1]["response"] == "w11 w12 w13" and page["rows"][0]["prompt"] == "w200 w201 w202 w203"
    assert str(tokenizer) in page["tokenizer"] and "fingerprint" in page["tokenizer"]
    assert [t["t"] for t in source.token_strip(RUN, "rollout", 1, 1)["tokens"]] == ["w11", "w12", "w13"]


def test_a_named_tokenizer_that_is_no_safe_local_directory_leaves_the_ids(tmp_path):
    """A Hub name, a relative path, a FIFO where tokenizer.json would be, and a directory whose tokenizer is
    remote code: ids are shown, nothing hangs, and no code from the directory runs."""
    fifo = tmp_path / "fifo-model"
    fifo.mkdir()
    os.mkfifo(fifo / "tokenizer.json")
    beside = word_tokenizer(tmp_path / "fifo-beside")
    os.mkfifo(beside / "vocab.json")  # a loader may open any of its files
    remote = word_tokenizer(tmp_path / "remote-model")
    marker = tmp_path / "code-ran"
    (remote / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((remote / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="Evil", auto_map={"AutoTokenizer": [None, "tokenization_evil.Evil"]})
    (remote / "tokenizer_config.json").write_text(json.dumps(config))
    named = ["Qwen/Qwen2.5-0.5B", "models/tiny", str(fifo), str(beside), str(remote), str(tmp_path / "none")]
    for i, model in enumerate(named):
        source = ViewSource(str(record(tmp_path / f"dump{i}", model=model)))
        row = source.step_page(RUN, "rollout", 1, limit=1)["rows"][0]
        assert row["response"] == [1, 2, 3, 4, 5], model
        assert source.step_page(RUN, "rollout", 1)["tokenizer"] is None
    assert not marker.exists()
