"""verl's V1 trainer over TransferQueue — the two-phase ``rollout_tq`` role.

Rollout is split across two methods that run at different times:

- *submit*: :meth:`V1Trainer._add_batch_to_generate`, decorated with
  ``SkipManager.annotate_tq(role="rollout_tq", phase="submit")``, is split into
  :meth:`~V1Trainer._next_train_batch` (dataloader + fresh uids) and
  :meth:`~V1Trainer._submit_batch_to_rollout` (prompt tags + dispatch to the agent loop). On a
  cached step the decorator calls ``_next_train_batch`` itself (the dataloader stays aligned) and
  injects the recorded trajectories into the queue instead of submitting;
- *sample*: :meth:`ReplayBuffer.sample`, decorated with ``phase="sample"``, waits until enough
  prompts are ``finished`` (dropping over-stale ones in the async modes) and hands their
  trajectory keys to the trainer; on a recorded step the decorator reads those keys back from
  the queue and saves them as ``{step}/{inner_idx}/``.

The agent loop (:class:`AgentLoopManagerTQ`, the inference server) runs on its own thread and
writes each trajectory into the queue under ``{uid}_{session}_{index}`` with tags; the trainer
clears the step's keys (``kv_clear``) at the end of the step. Modes (``trainer.v1.trainer_mode``):
``sync``; ``colocate_async`` (the rollout pauses while the actor trains, one warm-up batch in
flight); ``separate_async`` (the rollout keeps running, ``parameter_sync_step`` samples and
updates per step before its weights are synced). As in verl, no warm-up batch is submitted while
``skip.rollout_tq`` is enabled, so that cached steps line up with the dataloader.

The queue is :class:`stepskip.tq.InProcessTQClient` by default; ``trainer.v1.tq_backend=transfer_queue``
runs on the real ``transfer_queue`` (starting Ray and one storage unit when none is running).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip import SkipManager
from stepskip.pipelines.grpo import grpo_advantages
from stepskip.pipelines.policy import TinyPolicy
from stepskip.pipelines.runtime import RunResult, StepRecord, build_parts, derive_seed, timed_run
from stepskip.tq import InProcessTQClient, KVBatchMeta, TQClient

__all__ = ["AgentLoopManagerTQ", "KVQueue", "ReplayBuffer", "V1Trainer", "transfer_queue_session", "main"]

logger = logging.getLogger(__name__)

MODES = ("sync", "colocate_async", "separate_async")


class KVQueue(TQClient, Protocol):
    """The queue the reference trainer drives: what stepskip reads and writes, plus listing and clearing keys.

    Both the ``transfer_queue`` module and :class:`stepskip.tq.InProcessTQClient` satisfy it.
    """

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition: {key: tags}}`` of one partition (or of all)."""
        ...

    def kv_clear(self, keys: list[str] | str, partition_id: str) -> None:
        """Remove ``keys`` from ``partition_id``."""
        ...


def _strings(values: Sequence[str]) -> NonTensorStack:
    """One string per row, as the queue stores non-tensor fields (never a batch-wide NonTensorData)."""
    return NonTensorStack(*(NonTensorData(data=str(v), batch_size=[]) for v in values), batch_size=[len(values)])


def _dense(column: Any) -> torch.Tensor:
    """A queue column as a dense tensor: per-row tensors come back jagged; rows here have equal shapes."""
    if isinstance(column, torch.Tensor) and column.is_nested:
        return torch.stack(list(column.unbind()))
    return column


@dataclass
class _Job:
    prompts: TensorDict
    global_steps: int
    partition_id: str
    validate: bool


class AgentLoopManagerTQ:
    """The inference side: generates submitted prompts on a background thread, writing into the queue.

    Each prompt's ``n`` sessions become trajectory keys ``{uid}_{session}_0`` with fields
    ``prompts``, ``responses``, ``response_mask``, ``rollout_log_probs``, ``index`` and
    ``data_source`` and tags ``global_steps``/``min_global_steps``/``max_global_steps`` (the
    weights version that generated them), ``status`` and ``seq_len``; the prompt's own key goes
    ``pending`` → ``running`` → ``finished``.

    Args:
        tq: the TransferQueue client (the ``transfer_queue`` module or an object with its KV methods).
        policy: the rollout's own weights (synced by :meth:`update_weights`).
        n: sessions per prompt.
        num_workers: prompts of a job are generated in this many chunks.
        response_length: tokens per response.
        temperature: training temperature; ``val_temperature`` for validation jobs.
        seed: base seed; each chunk's sampler is seeded from it, the job's step and the chunk.
    """

    def __init__(self, tq: KVQueue, policy: TinyPolicy, n: int, num_workers: int, response_length: int,
                 temperature: float, val_temperature: float, seed: int) -> None:
        self.tq, self.policy, self.n = tq, policy, n
        self.num_workers, self.response_length = max(1, num_workers), response_length
        self.temperature, self.val_temperature, self.seed = temperature, val_temperature, seed
        self.version = 0
        #: ``(global_steps, validate)`` of every submitted job (the tests' "generation happened").
        self.calls: list[tuple[int, bool]] = []
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._awake = threading.Event()
        self._awake.set()
        self._busy = threading.Lock()  # held while a chunk generates: weights never change mid-chunk
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the generation thread (the inference server coming up)."""
        if self._thread is None or not self._thread.is_alive():
            self._error = None
            self._thread = threading.Thread(target=self._run, name="stepskip-agent-loop", daemon=True)
            self._thread.start()

    def generate_sequences(self, prompts: TensorDict, global_steps: int, partition_id: str = "train",
                           validate: bool = False) -> None:
        """Queue ``prompts`` for generation and return at once; results arrive in the queue."""
        self.check()
        self.calls.append((global_steps, validate))
        self._jobs.put(_Job(prompts, global_steps, partition_id, validate))

    def pause(self) -> None:
        """Stop after the chunk in progress (verl: abort and sleep the replicas while the actor trains)."""
        self._awake.clear()
        with self._busy:
            pass

    def resume(self) -> None:
        """Resume generation (verl: wake the replicas up)."""
        self._awake.set()

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Load the actor's weights between two chunks."""
        with self._busy:
            self.policy.load_state_dict(state)
            self.version = version

    def check(self) -> None:
        """Raise the error that stopped the generation thread, if any."""
        if self._error is not None:
            raise RuntimeError("the agent loop's generation thread failed") from self._error

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued jobs and stop the thread."""
        if self._thread is None:
            return
        self._awake.set()
        self._jobs.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._process(job)
            except BaseException as err:  # surfaced to the trainer by check()
                logger.exception("agent loop: generation of step %d failed", job.global_steps)
                self._error = err
                return

    def _process(self, job: _Job) -> None:
        uids = [str(u) for u in job.prompts["uid"]]
        input_ids = job.prompts["input_ids"]
        index = job.prompts["index"]
        sources = [str(s) for s in job.prompts["data_source"]]
        temperature = self.val_temperature if job.validate else self.temperature
        bounds = np.linspace(0, len(uids), self.num_workers + 1).round().astype(int)
        for chunk, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if lo == hi:
                continue
            self._awake.wait()
            chunk_uids = uids[lo:hi]
            self.tq.kv_batch_put(keys=chunk_uids, partition_id=job.partition_id,
                                 tags=[self._prompt_tag(job, "running") for _ in chunk_uids])
            rows = torch.arange(lo, hi).repeat_interleave(self.n)
            seed = derive_seed(self.seed, "val" if job.validate else "train", job.global_steps, chunk)
            with self._busy:
                out = self.policy.generate(input_ids[rows], self.response_length, temperature,
                                           torch.Generator().manual_seed(seed))
                version = self.version
            keys = [f"{uid}_{session}_0" for uid in chunk_uids for session in range(self.n)]
            fields = TensorDict({"prompts": input_ids[rows], "responses": out.responses,
                                 "response_mask": out.response_mask, "rollout_log_probs": out.log_probs,
                                 "index": index[rows]}, batch_size=[len(keys)])
            fields.set("data_source", _strings([sources[int(r)] for r in rows]))
            lengths = out.response_mask.sum(dim=1).tolist()
            tags = [{"global_steps": version, "min_global_steps": version, "max_global_steps": version,
                     "status": "finished", "seq_len": int(length)} for length in lengths]
            self.tq.kv_batch_put(keys=keys, partition_id=job.partition_id, fields=fields, tags=tags)
            self.tq.kv_batch_put(keys=chunk_uids, partition_id=job.partition_id,
                                 tags=[self._prompt_tag(job, "finished") for _ in chunk_uids])

    @staticmethod
    def _prompt_tag(job: _Job, status: str) -> dict[str, Any]:
        return {"is_prompt": True, "status": status, "global_steps": job.global_steps}


class ReplayBuffer:
    """Hands the trainer the trajectories of ``finished`` prompts, oldest first.

    Prompts are served in ``(global_steps, uid)`` order — uids are time-ordered — so a step's
    batch (and each ``parameter_sync_step`` share of it) is the same whether it was generated or
    injected from the cache. In the async modes a finished prompt whose trajectories would span
    more than ``max_off_policy_threshold`` model versions is dropped (its keys cleared) and
    ``refill_fn`` submits as many fresh prompts.

    Args:
        tq: the TransferQueue client.
        trainer_mode: ``sync``, ``colocate_async`` or ``separate_async``.
        max_off_policy_threshold: versions a trajectory may span.
        poll_interval: seconds between looks at the queue.
        timeout: seconds to wait for enough finished prompts before raising ``TimeoutError``.
        refill_fn: ``count -> None`` submitting fresh prompts after a drop.
        health_check: called at every poll (raises when the generation side died).
    """

    def __init__(self, tq: KVQueue, trainer_mode: str, max_off_policy_threshold: int, poll_interval: float = 0.002,
                 timeout: float = 300.0, refill_fn: Callable[[int], None] | None = None,
                 health_check: Callable[[], None] | None = None) -> None:
        self.tq, self.trainer_mode = tq, trainer_mode
        self.max_off_policy_threshold = max_off_policy_threshold
        self.poll_interval, self.timeout = poll_interval, timeout
        self.refill_fn, self.health_check = refill_fn, health_check
        self.dropped = 0

    @SkipManager.annotate_tq(role="rollout_tq", phase="sample")
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict[str, float]]:
        """Wait for ``batch_size`` finished prompts and return their trajectories' keys and tags.

        Returns:
            The batch meta (``keys`` ordered by prompt then session, ``tags``, ``partition_id``)
            and metrics (``dropped``: stale prompts evicted while waiting).
        """
        deadline = time.monotonic() + self.timeout
        dropped = 0
        while True:
            if self.health_check is not None:
                self.health_check()
            listing = self.tq.kv_list(partition_id=partition_id).get(partition_id, {}) or {}
            prompts = {k: t for k, t in listing.items() if t.get("is_prompt")}
            finished = [k for k, t in prompts.items() if t.get("status") == "finished"]
            stale = self._stale(global_steps, partition_id, finished, prompts)
            if stale:
                dropped += len(stale)
                traj = [k for k in listing if not listing[k].get("is_prompt") and k.split("_")[0] in stale]
                self.tq.kv_clear(keys=sorted(stale) + traj, partition_id=partition_id)
                logger.info("replay buffer: dropped %d prompts older than %d versions at step %d",
                            len(stale), self.max_off_policy_threshold, global_steps)
                if self.refill_fn is not None:
                    self.refill_fn(len(stale))
                continue
            if len(finished) >= batch_size:
                chosen = sorted(finished, key=lambda k: (prompts[k].get("global_steps", 0), k))[:batch_size]
                break
            if time.monotonic() > deadline:
                states = {s: sum(1 for t in prompts.values() if t.get("status") == s)
                          for s in ("pending", "running", "finished")}
                raise TimeoutError(f"replay buffer: {batch_size} finished prompts wanted in partition "
                                   f"{partition_id!r} at step {global_steps}; prompts by status: {states}")
            time.sleep(self.poll_interval)
        self.dropped += dropped
        self.tq.kv_clear(keys=chosen, partition_id=partition_id)
        by_uid: dict[str, list[str]] = {uid: [] for uid in chosen}
        for key in listing:
            uid = key.split("_")[0]
            if uid in by_uid and key != uid:
                by_uid[uid].append(key)
        keys = [k for uid in chosen for k in sorted(by_uid[uid], key=lambda k: tuple(int(p) for p in k.split("_")[1:]))]
        return KVBatchMeta(keys=keys, tags=[dict(listing[k]) for k in keys], partition_id=partition_id), \
            {"dropped": float(dropped)}

    def _stale(self, global_steps: int, partition_id: str, finished: list[str],
               prompts: dict[str, dict[str, Any]]) -> set[str]:
        if partition_id != "train" or self.trainer_mode == "sync":
            return set()
        return {k for k in finished
                if global_steps - int(prompts[k].get("global_steps", global_steps)) + 1 > self.max_off_policy_threshold}


@contextlib.contextmanager
def transfer_queue_session(num_cpus: int = 2) -> Iterator[Any]:
    """The real ``transfer_queue`` module, started when needed and stopped only if started here.

    Ray is started (``RAY_AUTH_MODE=disabled``, a temporary ``RAY_TMPDIR``) when it is not
    running; TransferQueue attaches to a running controller, else starts one with a single
    storage unit (two units would wait forever on a 2-CPU Ray cluster).
    """
    from omegaconf import OmegaConf

    from stepskip.pipelines.fully_async import ray_session

    with ray_session(num_cpus) as started_ray:
        import transfer_queue as tq

        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        try:
            yield tq
        finally:
            if started_ray:
                tq.close()


class V1Trainer:
    """GRPO on verl's V1 loop: submit → sample (``parameter_sync_step`` times) → update → sync → ``kv_clear``.

    Args:
        config: the composed ``v1`` config.
        tq_client: the TransferQueue client; default an in-process one (see ``trainer.v1.tq_backend``
            to run on the real queue through :func:`run`).

    Example:
        >>> from stepskip.pipelines.runtime import load_config
        >>> cfg = load_config("v1", ["trainer.total_training_steps=1", "data.max_response_length=8",
        ...                          "trainer.val_before_train=false", "trainer.test_freq=0"])
        >>> [r.mode for r in V1Trainer(cfg).fit().records]
        ['generated']
    """

    pipeline = "v1"

    def __init__(self, config: Any, tq_client: KVQueue | None = None) -> None:
        self.config = config
        v1 = config.trainer.v1
        self.trainer_mode = str(v1.trainer_mode)
        if self.trainer_mode not in MODES:
            raise ValueError(f"trainer.v1.trainer_mode = {self.trainer_mode!r}; allowed values: {', '.join(MODES)}")
        mode_config = v1.get(self.trainer_mode, {}) or {}
        self.parameter_sync_step = int(mode_config.get("parameter_sync_step", 1))
        self.num_warmup_batches = int(mode_config.get("num_warmup_batches", 0))
        self.train_batch_size = int(config.data.train_batch_size)
        if self.parameter_sync_step < 1 or self.train_batch_size % self.parameter_sync_step:
            raise ValueError(f"data.train_batch_size ({self.train_batch_size}) must be a multiple of "
                             f"trainer.v1.{self.trainer_mode}.parameter_sync_step ({self.parameter_sync_step})")
        self.tq: KVQueue = tq_client if tq_client is not None else InProcessTQClient()
        self.parts = parts = build_parts(config)
        rollout = config.actor_rollout_ref.rollout
        self.agent_loop_manager = AgentLoopManagerTQ(
            self.tq, parts.policy.clone(), parts.n, int(rollout.agent.num_workers), parts.response_length,
            parts.temperature, parts.val_temperature, parts.seed)
        sampler = v1.sampler
        self.replay_buffer = ReplayBuffer(self.tq, self.trainer_mode, int(sampler.max_off_policy_threshold),
                                          float(sampler.poll_interval), refill_fn=self._refill,
                                          health_check=self.agent_loop_manager.check)
        self.global_steps = 0
        self._uid_counter = itertools.count()
        self._loader_indices: list[int] = []

    # ------------------------------------------------------------------ the two phases

    @SkipManager.annotate_tq(role="rollout_tq", phase="submit")
    def _add_batch_to_generate(self) -> None:
        """Take a batch from the dataloader and dispatch it (replaced by the decorator on cached steps)."""
        batch = self._next_train_batch()
        self._submit_batch_to_rollout(batch)

    def _next_train_batch(self, num_prompts: int | None = None) -> TensorDict:
        """Advance the dataloader and return a batch with fresh uids (``uid`` column, one per prompt)."""
        indices = self.parts.train_loader.next_indices(num_prompts)
        self._loader_indices.extend(indices)
        prompts = self.parts.train_loader.dataset.collate(indices)
        batch = TensorDict({"input_ids": prompts.tensors["input_ids"],
                            "index": torch.tensor(indices, dtype=torch.long)}, batch_size=[len(indices)])
        batch.set("uid", _strings([self._new_uid() for _ in indices]))
        batch.set("data_source", _strings(list(prompts.non_tensor_batch["data_source"])))
        return batch

    def _submit_batch_to_rollout(self, batch: TensorDict, partition_id: str = "train", validate: bool = False) -> int:
        """Register the prompts in the queue (``pending``) and dispatch them to the agent loop."""
        uids = [str(u) for u in batch["uid"]]
        tags = [{"is_prompt": True, "status": "pending", "global_steps": self.global_steps} for _ in uids]
        if self.trainer_mode != "sync" and not validate:  # async: keep the prompt so it can be re-issued
            fields = TensorDict({"input_ids": batch["input_ids"], "index": batch["index"]}, batch_size=[len(uids)])
            self.tq.kv_batch_put(keys=uids, partition_id=partition_id, fields=fields, tags=tags)
        else:
            self.tq.kv_batch_put(keys=uids, partition_id=partition_id, tags=tags)
        self.agent_loop_manager.generate_sequences(batch, self.global_steps, partition_id, validate)
        return len(uids)

    def _refill(self, count: int) -> None:
        self._submit_batch_to_rollout(self._next_train_batch(count))

    def _new_uid(self) -> str:
        """A time-ordered uid (a counter, then random hex; no underscore): the replay buffer serves FIFO."""
        return f"{next(self._uid_counter):010x}{uuid.uuid4().hex[:22]}"

    # ------------------------------------------------------------------ the loop

    def fit(self) -> RunResult:
        """Train ``trainer.total_training_steps`` steps (verl's ``PPOTrainer.fit``)."""
        return timed_run(self.pipeline, self.config, self._fit)

    def _fit(self, result: RunResult) -> None:
        SkipManager.init(self.config, tq_client=self.tq)
        self.agent_loop_manager.start()
        try:
            trainer = self.config.trainer
            total, test_freq = int(trainer.total_training_steps), int(trainer.test_freq)
            if bool(trainer.val_before_train):
                result.validations.append(self._validate())
            self.global_steps = 1
            SkipManager.set_step(self.global_steps)
            self.on_train_begin()
            for step in range(1, total + 1):
                self.global_steps = step
                SkipManager.set_step(step)
                record, batches = self.step()
                self.on_step_end()
                for meta in batches:  # the trajectories of this step leave the queue
                    self.tq.kv_clear(keys=meta.keys, partition_id="train")
                result.records.append(record)
                if test_freq > 0 and (step % test_freq == 0 or step == total):
                    result.validations.append(self._validate())
            SkipManager.flush()
            result.skip_stats = SkipManager.stats()
        finally:
            self.agent_loop_manager.close()
            SkipManager.close()
        result.generation_calls = list(self.agent_loop_manager.calls)

    def step(self) -> tuple[StepRecord, list[KVBatchMeta]]:
        """Submit, then sample and update ``parameter_sync_step`` times."""
        t0 = time.perf_counter()
        calls_before = len(self.agent_loop_manager.calls)
        first_index = len(self._loader_indices)
        self._add_batch_to_generate()
        rollout_s = time.perf_counter() - t0
        generated = any(not validate for _, validate in self.agent_loop_manager.calls[calls_before:])
        batches, losses, scores, clipfracs = [], [], [], []
        sample_size = self.train_batch_size // self.parameter_sync_step
        for i in range(self.parameter_sync_step):
            t_sample = time.perf_counter()
            meta, _ = self.replay_buffer.sample(self.global_steps, "train", sample_size)
            if i == self.parameter_sync_step - 1:  # earlier shares train while the rest still generates
                self.on_sample_end()
            rollout_s += time.perf_counter() - t_sample
            batches.append(meta)
            data = self.tq.kv_batch_get(keys=meta.keys, partition_id="train")
            prompts, responses = _dense(data["prompts"]), _dense(data["responses"])
            mask, old_log_probs = _dense(data["response_mask"]), _dense(data["rollout_log_probs"])
            score = self.parts.task.score(prompts, responses, mask)
            uids = [k.split("_")[0] for k in meta.keys]
            advantages = grpo_advantages(score, uids, self.parts.norm_adv_by_std)
            update = self.parts.actor.update(prompts, responses, mask, old_log_probs, advantages)
            losses.append(update["loss"])
            clipfracs.append(update["clipfrac"])
            scores.append(score)
        all_scores = torch.cat(scores)
        record = StepRecord(
            step=self.global_steps, mode="generated" if generated else "replayed", rollout_s=rollout_s,
            step_s=time.perf_counter() - t0, reward=float(all_scores.mean()), loss=sum(losses) / len(losses),
            prompt_indices=self._loader_indices[first_index:first_index + self.train_batch_size],
            metrics={"clipfrac": sum(clipfracs) / len(clipfracs), "dropped": float(self.replay_buffer.dropped)},
        )
        return record, batches

    # ------------------------------------------------------------------ mode hooks (verl's on_* methods)

    def on_train_begin(self) -> None:
        """Async modes put warm-up batches in flight — not while stepskip replays (as verl does)."""
        if self.trainer_mode == "sync" or bool(self.config.skip.rollout_tq.enable):
            return
        for _ in range(self.num_warmup_batches):
            self._add_batch_to_generate()

    def on_sample_end(self) -> None:
        """colocate_async: the rollout shares the device with the actor, so it pauses while training."""
        if self.trainer_mode == "colocate_async":
            self.agent_loop_manager.pause()

    def on_step_end(self) -> None:
        """Sync the actor's weights to the rollout (and resume it)."""
        self.agent_loop_manager.update_weights(self.parts.policy.state_dict(), self.global_steps)
        self.agent_loop_manager.resume()

    def _validate(self) -> float:
        """Greedy rollout of the validation prompts through the ``val`` partition (never cached)."""
        prompts = self.parts.val_prompts
        batch = TensorDict({"input_ids": prompts.tensors["input_ids"],
                            "index": torch.tensor([int(i) for i in prompts.non_tensor_batch["index"]])},
                           batch_size=[len(prompts)])
        batch.set("uid", _strings([self._new_uid() for _ in range(len(prompts))]))
        batch.set("data_source", _strings(list(prompts.non_tensor_batch["data_source"])))
        self.agent_loop_manager.resume()
        self._submit_batch_to_rollout(batch, partition_id="val", validate=True)
        meta, _ = self.replay_buffer.sample(self.global_steps, "val", len(prompts))
        data = self.tq.kv_batch_get(keys=meta.keys, partition_id="val")
        score = float(self.parts.task.score(_dense(data["prompts"]), _dense(data["responses"]),
                                            _dense(data["response_mask"])).mean())
        self.tq.kv_clear(keys=meta.keys, partition_id="val")
        return score


def run(config: Any) -> RunResult:
    """Train with the queue ``trainer.v1.tq_backend`` names (``in_process`` or ``transfer_queue``)."""
    backend = str(config.trainer.v1.get("tq_backend", "in_process"))
    if backend == "in_process":
        return V1Trainer(config).fit()
    if backend == "transfer_queue":
        with transfer_queue_session(int(config.ray.num_cpus)) as tq:
            return V1Trainer(config, tq_client=tq).fit()
    raise ValueError(f"trainer.v1.tq_backend = {backend!r}; allowed values: in_process, transfer_queue")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m stepskip.pipelines.v1 [hydra overrides]``."""
    from stepskip.pipelines.report import run_module

    return run_module("v1", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
