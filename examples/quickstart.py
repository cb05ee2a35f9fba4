"""stepskip quickstart: a toy generate function recorded on run 1 and replayed on run 2.

Usage:
    python examples/quickstart.py                       # two runs in a fresh temp dump dir
    python examples/quickstart.py skip.rollout.steps=[1,2,3,10] skip.rollout.action=cache \\
        skip.rollout.dump_dir=/tmp/rollout_dump --runs 1  # Hydra-style dotted keys

Every command-line ``key=value`` is merged into the training config exactly as Hydra would
(``OmegaConf.from_dotlist``), so verl's ``skip.rollout.*`` overrides work as written.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time

import torch
from omegaconf import OmegaConf

from stepskip import Batch, SkipManager

BASE_CONFIG = {
    "trainer": {"experiment_name": "quickstart", "project_name": "stepskip", "total_training_steps": 5},
    "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 16},
    "actor_rollout_ref": {"rollout": {"n": 2}},
    "skip": {"rollout": {"enable": True, "steps": [1, 2, 3], "action": "cache", "dump_dir": None}},
}


class ToyAgentLoop:
    """Stands in for an inference engine: slow, random, and the single skip unit."""

    def __init__(self, seed: int) -> None:
        self.rng = torch.Generator().manual_seed(seed)
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        self.calls += 1
        time.sleep(0.2)  # "generation" is the expensive stage
        rows = len(prompts)
        responses = torch.randint(0, 64, (rows, 16), generator=self.rng)
        return Batch.from_dict(
            tensors={"prompts": prompts.batch["input_ids"], "responses": responses},
            non_tensors={"uid": prompts.non_tensor_batch["uid"]},
            meta_info={"timing": {"gen": 0.2}},
        )


def digest(batch: Batch) -> str:
    return hashlib.sha256(batch.batch["responses"].numpy().tobytes()).hexdigest()[:10]


def train(config: object, run: int) -> list[str]:
    """One training run: init stepskip, then a loop that calls the generator every step."""
    SkipManager.init(config)
    loop = ToyAgentLoop(seed=1000 + run)  # a different seed per run: replayed steps keep run 1's data
    digests = []
    for step in range(1, int(config.trainer.total_training_steps) + 1):
        SkipManager.set_step(step)
        rows = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        prompts = Batch.from_dict(
            tensors={"input_ids": torch.arange(rows * 8).reshape(rows, 8)},
            non_tensors={"uid": [f"run{run}-step{step}-{i}" for i in range(rows)]},
        )
        calls_before = loop.calls
        start = time.perf_counter()
        out = loop.generate_sequences(prompts)
        seconds = time.perf_counter() - start
        mode = "generated" if loop.calls > calls_before else "replayed"
        digests.append(digest(out))
        print(f"  step {step}: {mode:9s}  {seconds * 1000:7.1f} ms  responses {digests[-1]}  uid[0]={out['uid'][0]}")
    SkipManager.close()
    stats = SkipManager.stats()
    print(f"  hits {stats['skip/rollout/hits']:.0f}, misses {stats['skip/rollout/misses']:.0f}, "
          f"dumps {stats['skip/rollout/dumps']:.0f}, generation seconds saved {stats['skip/rollout/saved_seconds']:.2f}")
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="training runs to do one after another (default 2)")
    args, overrides = parser.parse_known_args()
    config = OmegaConf.merge(OmegaConf.create(BASE_CONFIG), OmegaConf.from_dotlist(overrides))
    with tempfile.TemporaryDirectory(prefix="stepskip-quickstart-") as tmp:
        if not config.skip.rollout.dump_dir:
            config.skip.rollout.dump_dir = tmp
        print(f"dump_dir: {config.skip.rollout.dump_dir}  steps: {list(config.skip.rollout.steps)}  "
              f"action: {config.skip.rollout.action}")
        runs = []
        for run in range(1, args.runs + 1):
            print(f"run {run}:")
            runs.append(train(config, run))
        if len(runs) > 1:
            same = [i + 1 for i, (a, b) in enumerate(zip(runs[0], runs[-1])) if a == b]
            print(f"steps whose responses run {len(runs)} replayed identically from run 1: {same}")
        SkipManager.reset()


if __name__ == "__main__":
    main()
