"""Writer side of the match-index crash test: records prompt groups with ``action: match`` forever
(until SIGKILLed), one step after another, each step's prompts new."""

from __future__ import annotations

import sys

import torch

from stepskip import Batch, SkipManager

N = 2  # samples per prompt
PROMPTS_PER_STEP = 4


def prompt_ids(step: int) -> list[int]:
    return [step * 100 + k for k in range(PROMPTS_PER_STEP)]


def prompts(ids: list[int], tag: str) -> Batch:
    rows = [i for i in ids for _ in range(N)]
    return Batch.from_dict(tensors={"input_ids": torch.tensor([[i, i + 1] for i in rows])},
                           non_tensors={"uid": [f"{tag}-{i}" for i in rows]})


def response(prompt_id: int) -> list[int]:
    """What generation answers to a prompt: a pure function of it, so a reader can check every row."""
    return [prompt_id * 7 % 1009, prompt_id % 13] * 64


def config(dump_dir: str) -> dict:
    return {"data": {"train_batch_size": PROMPTS_PER_STEP, "max_prompt_length": 2, "max_response_length": 128},
            "skip": {"rollout": {"enable": True, "dump_dir": dump_dir, "steps": "all", "action": "match"}}}


class Rollout:
    def __init__(self) -> None:
        self.seen: list[int] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        ids = prompts.batch["input_ids"][:, 0].tolist()
        self.seen.extend(ids[::N])
        return Batch.from_dict(tensors={"responses": torch.tensor([response(i) for i in ids])},
                               non_tensors={"uid": list(prompts.non_tensor_batch["uid"])})


def main(dump_dir: str) -> None:
    SkipManager.init(config(dump_dir))
    rollout = Rollout()
    step = 0
    while True:  # until killed
        step += 1
        SkipManager.set_step(step)
        rollout.generate_sequences(prompts(prompt_ids(step), "w"))


if __name__ == "__main__":
    main(sys.argv[1])
