"""Text and rewards for entries that carry neither: the reference pipelines' character tokenizer decodes entries
whose fingerprint names the pipelines' model (and no other), and ``show`` takes a step's rewards from a stage
role of the same step that scores its rows, as the view does. Caches written by stepskip through SkipManager."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cli_caches import SAFE_RUN
from cli_run import stepskip
from tensordict import TensorDict

from stepskip import Batch, SkipManager
from stepskip.pipelines.tokenizer import ALPHABET, MODEL_NAME, CharTokenizer
from stepskip.view.data import ViewSource

RUN = "exp_text/GBS2_N2_in3_out4"
ROWS = 4


def rollout(step: int) -> Batch:
    """Prompts ``<s>`` + two symbols, responses of 1..4 symbols (then ``</s>`` and padding), no reward."""
    prompts = torch.tensor([[1, 3 + r, 4 + r] for r in range(ROWS)])
    responses = torch.zeros(ROWS, 4, dtype=torch.int64)
    mask = torch.zeros(ROWS, 4, dtype=torch.int64)
    for r in range(ROWS):
        n = r + 1
        responses[r, :n] = torch.arange(5 + r, 5 + r + n) if n < 4 else torch.tensor([5 + r, 6 + r, 7 + r, 2])
        mask[r, :n] = 1
    return Batch.from_dict({"prompts": prompts, "responses": responses, "response_mask": mask},
                           {"uid": [f"s{step}-{r // 2}" for r in range(ROWS)]}, meta_info={"global_steps": step})


class Loop:
    def __init__(self, reward_rows: int = ROWS) -> None:
        self.reward_rows = reward_rows

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return rollout(SkipManager.step)

    @SkipManager.annotate(role="reward")
    def compute_reward(self, batch: Batch) -> TensorDict:
        return TensorDict({"scores": torch.arange(self.reward_rows, dtype=torch.float32) / 4 + SkipManager.step},
                          batch_size=[self.reward_rows])


def record(dump: Path, model: str = MODEL_NAME, reward_rows: int = ROWS) -> Path:
    config = {
        "trainer": {"experiment_name": "exp", "project_name": "text"},
        "data": {"train_batch_size": 2, "max_prompt_length": 3, "max_response_length": 4},
        "actor_rollout_ref": {"rollout": {"n": 2}, "model": {"path": model}},
        "skip": {"rollout": {"enable": True, "dump_dir": str(dump), "steps": [1, 2], "async_dump": False},
                 "reward": {"kind": "stage", "enable": True, "dump_dir": str(dump), "steps": [1],
                            "async_dump": False}},
    }
    SkipManager.init(config)
    loop = Loop(reward_rows)
    for step in (1, 2):
        SkipManager.set_step(step)
        batch = loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "a", "b", "b"]}))
        loop.compute_reward(batch)
    SkipManager.close()
    SkipManager.reset()
    return dump / RUN


def test_the_character_tokenizer_round_trips_and_names_what_it_cannot_encode():
    tok = CharTokenizer()
    assert tok.decode([1, 3, 12, 18, 2, 0]) == "<s>09f</s><pad>"
    assert tok.decode([1, 3, 2, 0], skip_special_tokens=True) == "0"
    assert tok.encode("<s>09f</s><pad>") == [1, 3, 12, 18, 2, 0]
    assert tok.decode([19, -1]) == "<19><-1>"  # beyond the task's 16 symbols: shown, never an error
    assert CharTokenizer(num_symbols=len(ALPHABET)).decode([19]) == "g"
    with pytest.raises(ValueError, match=r"'z' \(position 3\) is not in the vocabulary"):
        tok.encode("<s>z")


def test_show_decodes_the_pipelines_entries_and_joins_the_stage_rewards(tmp_path):
    run = record(tmp_path)
    result = stepskip("show", run / "1", "--rows", "4", "--json")
    assert result.code == 0, result
    rows = result.json()["rows"]
    assert [r["prompt_decoded"] for r in rows] == ["<s>01", "<s>12", "<s>23", "<s>34"]
    assert [r["response_decoded"] for r in rows] == ["2", "34", "456", "567</s>"]  # padding left out
    assert [r["reward"] for r in rows] == [1.0, 1.25, 1.5, 1.75]  # the reward role's scores of step 1
    assert {r["extra"]["reward from"] for r in rows} == {"reward role (scores)"}

    text = stepskip("show", run, "--step", "1", "--rows", "1")  # the run directory named, the step by --step
    assert text.code == 0, text
    assert "reward 1 " in text.out and "'<s>01'" in text.out and "'2'" in text.out

    unscored = stepskip("show", run / "2", "--rows", "4", "--json")  # the reward role recorded step 1 only
    assert unscored.code == 0, unscored
    assert [r["reward"] for r in unscored.json()["rows"]] == [None] * 4

    page = ViewSource(str(tmp_path)).step_page(RUN, "rollout", 1)
    assert [r["prompt"] for r in page["rows"]] == ["<s>01", "<s>12", "<s>23", "<s>34"]
    assert [r["reward"] for r in page["rows"]] == [1.0, 1.25, 1.5, 1.75]


def test_no_tokenizer_is_guessed_and_no_reward_of_another_row_count_is_joined(tmp_path, pristine_cache):
    run = record(tmp_path, model="Qwen/Qwen2.5-0.5B", reward_rows=ROWS - 1)
    rows = stepskip("show", run / "1", "--rows", "4", "--json").json()["rows"]
    assert [r["prompt"] for r in rows] == [[1, 3, 4], [1, 4, 5], [1, 5, 6], [1, 6, 7]]
    assert all("prompt_decoded" not in r and r["reward"] is None for r in rows)
    assert [r["prompt"] for r in ViewSource(str(tmp_path)).step_page(RUN, "rollout", 1)["rows"]][0] == [1, 3, 4]
    other = stepskip("show", pristine_cache / SAFE_RUN / "1", "--rows", "1", "--json").json()["rows"][0]
    assert "prompt_decoded" not in other  # a cache of another model: token ids
