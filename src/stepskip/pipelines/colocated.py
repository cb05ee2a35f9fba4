"""Colocated GRPO — verl's ``RayPPOTrainer`` path and the ``rollout`` role.

Wiring (as verl's colocated trainer does):

- :meth:`ColocatedTrainer.fit` calls ``SkipManager.init(config)`` once and
  ``SkipManager.set_step(global_steps)`` at every step;
- :meth:`AgentLoopManager.generate_sequences` is the single skip unit: prompts in (each prompt
  repeated ``n`` times, with its ``uid``), the full rollout batch out. It chunks the batch across
  its agent-loop workers, concatenates their outputs and records timings in ``meta_info``;
- validation passes ``meta_info["validate"] = True`` and is never skipped;
- :meth:`RewardManager.compute_reward` shows a generic stage role (``skip.reward: {kind: stage}``).

Run it::

    python -m stepskip.pipelines.colocated skip.rollout.enable=True skip.rollout.steps=[1,2,3] skip.rollout.action=cache
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from stepskip import Batch, SkipManager
from stepskip.pipelines.grpo import grpo_advantages
from stepskip.pipelines.policy import TinyPolicy
from stepskip.pipelines.runtime import (
    RunResult,
    StepRecord,
    build_parts,
    derive_seed,
    generate_batch,
    repeat_rows,
    timed_run,
)
from stepskip.pipelines.task import CountTask

__all__ = ["AgentLoopWorker", "AgentLoopManager", "RewardManager", "ColocatedTrainer", "main", "score_rollout"]

logger = logging.getLogger(__name__)


class AgentLoopWorker:
    """Rolls out one chunk of the batch (in verl: a Ray actor driving an inference server)."""

    def __init__(self, policy: TinyPolicy, worker_id: int) -> None:
        self.policy, self.worker_id = policy, worker_id

    def generate(self, chunk: Batch, response_length: int, temperature: float, seed: int) -> Batch:
        start = time.perf_counter()
        out = generate_batch(self.policy, chunk, response_length, temperature, seed)
        out.meta_info["worker_seconds"] = time.perf_counter() - start
        return out


class AgentLoopManager:
    """Drives the agent-loop workers; ``generate_sequences`` is the ``rollout`` skip unit.

    Args:
        policy: the colocated policy (the actor's own weights: nothing to sync).
        num_workers: agent-loop workers the batch is chunked across.
        response_length: tokens generated per response.
        temperature: training sampling temperature.
        val_temperature: validation temperature (0: greedy).
        seed: base seed; each chunk's sampler is seeded from it, the step and the chunk.
    """

    def __init__(self, policy: TinyPolicy, num_workers: int, response_length: int, temperature: float,
                 val_temperature: float, seed: int) -> None:
        self.workers = [AgentLoopWorker(policy, i) for i in range(max(1, num_workers))]
        self.response_length, self.temperature, self.val_temperature = response_length, temperature, val_temperature
        self.seed = seed
        #: ``(global_steps, validate)`` of every call whose body ran (the tests' "generation happened").
        self.calls: list[tuple[int, bool]] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        """Generate ``n`` responses per prompt: chunk across workers, roll out, concatenate.

        Args:
            prompts: prompt rows (each prompt repeated ``n`` times, interleaved), ``uid`` column,
                ``meta_info["global_steps"]`` and optionally ``meta_info["validate"]``.

        Returns:
            The rollout batch (see :func:`stepskip.pipelines.runtime.generate_batch`), with
            ``meta_info["timing"]`` holding the call's and each worker's seconds.
        """
        start = time.perf_counter()
        step = int(prompts.meta_info.get("global_steps", 0))
        validate = bool(prompts.meta_info.get("validate", False))
        self.calls.append((step, validate))
        temperature = self.val_temperature if validate else self.temperature
        chunks = prompts.chunk(len(self.workers))
        outputs = [worker.generate(chunk, self.response_length, temperature,
                                   derive_seed(self.seed, "val" if validate else "train", step, i))
                   for i, (worker, chunk) in enumerate(zip(self.workers, chunks, strict=True)) if len(chunk)]
        out = Batch.concat(outputs)
        out.meta_info = {k: v for k, v in prompts.meta_info.items()}
        out.meta_info["timing"] = {"generate_sequences": time.perf_counter() - start,
                                   "workers": [o.meta_info["worker_seconds"] for o in outputs]}
        return out


class RewardManager:
    """Scores rollouts with the task's verifier; ``compute_reward`` is a generic stage role (``reward``)."""

    def __init__(self, task: CountTask) -> None:
        self.task = task
        self.calls: list[tuple[int, bool]] = []

    @SkipManager.annotate(role="reward")
    def compute_reward(self, batch: Batch) -> Batch:
        """Per-response scores and token-level scores (the score on the last response token).

        Returns:
            A Batch with ``scores`` ``[rows]`` and ``token_level_scores`` ``[rows, T]``.
        """
        self.calls.append((int(batch.meta_info.get("global_steps", 0)), bool(batch.meta_info.get("validate"))))
        return score_rollout(batch, self.task)


def score_rollout(batch: Batch, task: CountTask | None = None) -> Batch:
    """The reward stage's computation on its own: what ``RewardManager.compute_reward`` returns for ``batch``.

    With ``skip.reward.record_inputs: true`` a recorded reward stage can be re-run offline with it:
    ``stepskip rerun DUMP_DIR --stage reward --fn stepskip.pipelines.colocated:score_rollout``.

    Args:
        batch: a rollout batch (``prompts``, ``responses``, ``response_mask``).
        task: the task scoring it (default: the pipelines' counting task, ``CountTask()``).

    Returns:
        A Batch with ``scores`` ``[rows]`` and ``token_level_scores`` ``[rows, T]``.
    """
    task = task or CountTask()
    tensors = batch.tensors
    scores = task.score(tensors["prompts"], tensors["responses"], tensors["response_mask"])
    token_level = torch.zeros(tensors["responses"].shape, dtype=torch.float32)
    last = (tensors["response_mask"].sum(dim=1) - 1).clamp_min(0)
    token_level[torch.arange(len(scores)), last] = scores
    return Batch.from_dict(tensors={"scores": scores, "token_level_scores": token_level})


class ColocatedTrainer:
    """GRPO with the rollout colocated with the actor (one set of weights, one process).

    Args:
        config: the composed ``colocated`` config (see :func:`stepskip.pipelines.runtime.load_config`).

    Example:
        >>> from stepskip.pipelines.runtime import load_config
        >>> trainer = ColocatedTrainer(load_config("colocated", ["trainer.total_training_steps=1",
        ...     "data.max_response_length=8", "trainer.val_before_train=false", "trainer.test_freq=0"]))
        >>> [r.mode for r in trainer.fit().records]
        ['generated']
    """

    pipeline = "colocated"

    def __init__(self, config: Any) -> None:
        self.config = config
        parts = build_parts(config)
        self.parts = parts
        rollout = config.actor_rollout_ref.rollout
        self.agent_loop = AgentLoopManager(parts.policy, int(rollout.agent.num_workers), parts.response_length,
                                           parts.temperature, parts.val_temperature, parts.seed)
        self.reward_manager = RewardManager(parts.task)
        self.global_steps = 0

    # ------------------------------------------------------------------ the loop

    def fit(self) -> RunResult:
        """Train ``trainer.total_training_steps`` steps; validation per ``trainer.test_freq``."""
        return timed_run(self.pipeline, self.config, self._fit)

    def _fit(self, result: RunResult) -> None:
        SkipManager.init(self.config)
        try:
            trainer = self.config.trainer
            total, test_freq = int(trainer.total_training_steps), int(trainer.test_freq)
            if bool(trainer.val_before_train):
                result.validations.append(self._validate())
            for step in range(1, total + 1):
                self.global_steps = step
                SkipManager.set_step(step)
                result.records.append(self.step())
                if test_freq > 0 and (step % test_freq == 0 or step == total):
                    result.validations.append(self._validate())
            SkipManager.flush()
            result.skip_stats = SkipManager.stats()
        finally:
            SkipManager.close()
        result.generation_calls = list(self.agent_loop.calls)

    def step(self) -> StepRecord:
        """One GRPO step: prompts, rollout (the skip unit), reward, advantages, clipped update."""
        t0 = time.perf_counter()
        prompts = self.parts.train_loader.next_batch()
        prompts.non_tensor_batch["uid"] = np.array([uuid.uuid4().hex for _ in range(len(prompts))], dtype=object)
        gen_batch = repeat_rows(prompts, self.parts.n)
        gen_batch.meta_info = {"global_steps": self.global_steps}

        calls_before = len(self.agent_loop.calls)
        t_gen = time.perf_counter()
        batch = self.agent_loop.generate_sequences(gen_batch)
        rollout_s = time.perf_counter() - t_gen
        generated = len(self.agent_loop.calls) > calls_before

        batch.meta_info["global_steps"] = self.global_steps
        rewards = self.reward_manager.compute_reward(batch)
        scores = rewards.tensors["scores"]
        advantages = grpo_advantages(scores, list(batch.non_tensor_batch["uid"]), self.parts.norm_adv_by_std)
        tensors = batch.tensors
        update = self.parts.actor.update(tensors["prompts"], tensors["responses"], tensors["response_mask"],
                                         tensors["rollout_log_probs"], advantages)
        return StepRecord(
            step=self.global_steps, mode="generated" if generated else "replayed", rollout_s=rollout_s,
            step_s=time.perf_counter() - t0, reward=float(scores.mean()), loss=update["loss"],
            prompt_indices=[int(i) for i in prompts.non_tensor_batch["index"]],
            metrics={"clipfrac": update["clipfrac"], "grad_norm": update["grad_norm"],
                     "response_length": float(tensors["response_mask"].sum(1).float().mean())},
        )

    def _validate(self) -> float:
        """Greedy rollout of the validation prompts, ``meta_info["validate"] = True``: never skipped."""
        val = self.parts.val_prompts
        prompts = Batch(batch=val.batch, non_tensor_batch=dict(val.non_tensor_batch),
                        meta_info={"validate": True, "global_steps": self.global_steps})
        prompts.non_tensor_batch["uid"] = np.array([f"val{i}" for i in range(len(prompts))], dtype=object)
        out = self.agent_loop.generate_sequences(prompts)
        out.meta_info["validate"] = True
        score = float(self.reward_manager.compute_reward(out).tensors["scores"].mean())
        logger.info("validation at step %d: score %.3f", self.global_steps, score)
        return score


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stepskip.pipelines.colocated [hydra overrides]``."""
    from stepskip.pipelines.report import run_module

    return run_module("colocated", ColocatedTrainer, argv)


if __name__ == "__main__":
    raise SystemExit(main())
