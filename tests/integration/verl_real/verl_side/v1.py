"""verl's real V1 ``PPOTrainerSync.fit()`` over the real TransferQueue, on CPU (run in .venv-verl).

Real: Ray (2 CPUs), ``transfer_queue`` 0.1.11 with one storage unit (its default of two plus a
controller would not fit 2 CPUs), verl's Hydra config, ``RLHFDataset`` and dataloader,
``PPOTrainerSync`` itself (``fit``/``step``/``_step_once``, ``_add_batch_to_generate`` and the
real ``ReplayBuffer.sample``, both decorated by verl with ``annotate_tq``), batch balancing,
``_compute_old_log_prob``, ``_compute_advantage`` and metrics, all through the queue.

Stand-ins (no GPUs, no inference servers): the agent-loop manager (``StandInAgentLoopManagerTQ``
writes each trajectory to the queue with the keys, fields and tags verl's ``AgentLoopWorkerTQ``
writes), the actor worker group (reads ``input_ids`` from the queue and writes log-probs back;
``update_actor`` records responses, advantages and old log-probs), the reward-loop manager (only
its ``reward_loop_worker_handles``, not None, so rewards come from the agent loop as with
streaming reward workers), the checkpoint and resource-pool managers.

Spec keys: work, report, impl, steps, skip (the ``skip.rollout_tq`` section), actor_inputs, logger and
env (as ``ray_ppo``'s). Or, for several runs in this one process (one import of verl, one Ray and one
TransferQueue; the queue emptied and the ``SkipManager`` reset between runs, as ``engines`` does):
work, report, impl, runs: a list of ``{name, steps, skip, actor_inputs, logger, env}``, each run in
``work/<name>``; the report then has one entry per run (with its own ``error`` when it failed).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import common

BATCH, N = 4, 2  # prompts per step, responses per prompt


class StandInAgentLoopManagerTQ:
    """Stands in for verl's ``AgentLoopManagerTQ`` + ``AgentLoopWorkerTQ`` (no inference server on CPU).

    ``generate_sequences(batch)`` writes, for every prompt, ``n`` trajectories under
    ``{uid}_{session}_0`` with the fields and tags verl's worker writes, then marks the prompt
    ``finished`` — synchronously, where verl's workers do it in background tasks.
    """

    def __init__(self, tokenizer: Any, n: int) -> None:
        self.tokenizer = tokenizer
        self.n = n
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self.calls = 0
        self.trajectories = 0

    def generate_sequences(self, batch: Any) -> None:
        self.calls += 1
        self.trajectories += write_trajectories(batch, self.tokenizer, self.n, self.rng)


def write_trajectories(batch: Any, tokenizer: Any, n: int, rng: random.Random, partition_id: str = "train",
                       flat_first: bool = False) -> int:
    """What verl's ``AgentLoopWorkerTQ`` puts in the queue for ``batch``: for every prompt, ``n``
    trajectories under ``{uid}_{session}_0`` with its fields and tags, then the prompt marked finished.
    With ``flat_first`` every session of the batch's first prompt gets one response (a group whose
    rewards do not vary: the DAPO filter evicts it).

    Returns:
        The number of trajectories written.
    """
    import torch
    import transfer_queue as tq
    from tensordict import NonTensorData, NonTensorStack
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    written = 0
    word_ids = tokenizer.convert_tokens_to_ids(common.WORDS)
    eos = tokenizer.eos_token_id
    for i in range(len(batch)):
        prompt: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                prompt[key] = value[i]
            elif isinstance(value, NonTensorStack):
                prompt[key] = value[i].data
            elif isinstance(value, NonTensorData):
                prompt[key] = value.data
        prompt.pop("validate", None)
        prompt.setdefault("agent_name", "single_turn_agent")
        uid = prompt["uid"]
        tq.kv_put(key=uid, partition_id=partition_id, tag={"status": "running"})
        ids = tokenizer.apply_chat_template(list(prompt["raw_prompt"]), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        prompt_ids = list(ids)[-common.PROMPT_LEN:]
        truth_id = tokenizer.convert_tokens_to_ids(prompt["reward_model"]["ground_truth"])
        keys, fields, tags = [], [], []
        first: list[int] = []
        for session in range(n):
            length = rng.randint(1, common.RESPONSE_LEN - 1)
            response = [rng.choice(word_ids) for _ in range(length)] + [eos]
            if flat_first and i == 0:
                first = first or response
                response = first
            score = len(response) / common.RESPONSE_LEN + sum(t == truth_id for t in response)
            prompts = torch.tensor(prompt_ids, dtype=torch.int64)
            responses = torch.tensor(response, dtype=torch.int64)
            rm_scores = torch.zeros(len(response), dtype=torch.float32)
            rm_scores[-1] = score
            input_ids = torch.cat([prompts, responses])
            step = prompt["global_steps"]
            field = {
                "prompts": prompts, "responses": responses,
                "response_mask": torch.ones(len(response), dtype=torch.int64), "rm_scores": rm_scores,
                # the inference server's log-probs (rollout.calculate_log_probs is on in verl's config)
                "rollout_log_probs": common.fake_log_probs(responses),
                "num_turns": 2,
                "metrics": {"generate_sequences": 0.01, "tool_calls": 0.0, "compute_score": 0.0,
                            "num_preempted": 0},
                "extra_fields": {"min_global_steps": step, "max_global_steps": step},
                **prompt, "session_id": session,
            }
            field["loss_mask"] = field["response_mask"]
            field["input_ids"] = input_ids
            field["position_ids"] = torch.arange(len(input_ids), dtype=torch.int64)
            field["multi_modal_inputs"] = {}
            keys.append(f"{uid}_{session}_0")
            fields.append(field)
            tags.append({"status": "success", "prompt_len": len(prompt_ids), "response_len": len(response),
                         "seq_len": len(prompt_ids) + len(response), "global_steps": step,
                         "min_global_steps": step, "max_global_steps": step})
        tq.kv_batch_put(keys=keys, fields=list_of_dict_to_tensordict(fields), tags=tags, partition_id=partition_id)
        written += len(keys)
        tq.kv_put(key=uid, partition_id=partition_id, tag={"status": "finished"})
    return written


class StandInV1ActorWorkerGroup:
    """Stands in for verl's actor worker group in V1 (no FSDP engine on CPU): reads and writes the queue."""

    def __init__(self) -> None:
        self._dispatch_info: dict[str, list[int]] = {}
        self.updates: list[dict[str, Any]] = []

    def _query_dispatch_info(self, role: str) -> list[int]:
        return [0]

    def compute_log_prob(self, batch: Any) -> Any:
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        got = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["input_ids"])
        ids = got["input_ids"]
        values = common.fake_log_probs(ids.values())
        log_probs = torch.nested.nested_tensor_from_jagged(values, offsets=ids.offsets())
        entropy = torch.nested.nested_tensor_from_jagged(torch.ones_like(values), offsets=ids.offsets())
        tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                        fields=TensorDict({"log_probs": log_probs, "entropy": entropy}, batch_size=len(batch)))
        return batch

    def update_actor(self, batch: Any) -> dict[str, Any]:
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=["responses", "advantages", "old_log_probs"])
        record: dict[str, Any] = {}
        for key in ("responses", "advantages", "old_log_probs"):
            value = data[key]
            record[key] = [row.clone() for row in value.unbind(0)]
        record["keys"] = list(batch.keys)
        self.updates.append(record)
        return {"metrics": {"pg_loss": 0.0, "mfu": 0.0}}


class StandInRewardLoopManager:
    """Only what ``_step_once`` asks: worker handles exist, so rewards are the agent loop's ``rm_scores``."""

    reward_loop_worker_handles = ["streaming-reward-worker"]


def start_ray_and_tq(config: Any) -> str:
    """Ray on 2 CPUs, then TransferQueue; returns Ray's temp dir (short: its socket paths must fit 107 bytes)."""
    import tempfile

    import ray
    import transfer_queue as tq

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    temp_dir = tempfile.mkdtemp(prefix="vr-ray-")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    tq.init(config.transfer_queue)
    return temp_dir


def stop_ray_and_tq(temp_dir: str) -> None:
    import shutil

    import ray
    import transfer_queue as tq

    try:
        tq.close()
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def compose(work: Path, spec: dict[str, Any]) -> Any:
    """verl's config for one run of ``spec`` in ``work`` (its dataset written there)."""
    steps = int(spec.get("steps", 3))
    data = common.write_dataset(work / "data" / "train.parquet", rows=BATCH * steps)
    overrides = common.base_overrides(work, data, steps=steps, batch=BATCH, n=N)
    overrides += ["transfer_queue.enable=True", "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
                  "transfer_queue.backend.SimpleStorage.total_storage_size=1000"]
    overrides += common.skip_overrides("rollout_tq", spec.get("skip", {}))
    overrides = common.tracking_overrides(overrides, spec)
    return common.compose_config("ppo_trainer", overrides)


def fit(spec: dict[str, Any], config: Any, report: dict[str, Any]) -> None:
    """``PPOTrainerSync.fit`` once, Ray and TransferQueue running; ``report`` gets what it did."""
    import torch
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = PPOTrainerSync(config=config)  # builds verl's real ReplayBuffer
    # PPOTrainer._setup without its GPU parts: the real dataloaders (over a locally built tokenizer,
    # where _init_tokenizer would load the model's), stand-ins for the workers and managers
    trainer.tokenizer, trainer.processor = common.make_tokenizer(), None
    trainer._init_dataloader()
    trainer._init_dump_executor()
    trainer.resource_pool_manager = common.StandInResourcePoolManager()
    trainer.ref_in_actor = False
    trainer.actor_rollout_wg = StandInV1ActorWorkerGroup()
    trainer.reward_loop_manager = StandInRewardLoopManager()
    trainer.teacher_model_manager, trainer.distillation_config = None, None
    checkpoints = common.StandInCheckpointManager()
    trainer.checkpoint_manager = checkpoints
    trainer._load_checkpoint()
    trainer.on_init_end()
    manager = StandInAgentLoopManagerTQ(trainer.tokenizer, n=N)
    try:
        trainer.fit(manager)
    finally:
        report.update({
            "generation_calls": manager.calls,
            "generated_trajectories": manager.trajectories,
            "actor_updates": len(trainer.actor_rollout_wg.updates),
            "weight_updates": checkpoints.updates,
            "stats": common.skip_stats(),
            "dump_files": common.tree_listing(Path(spec["skip"]["dump_dir"])) if spec.get("skip") else [],
        })
        if spec.get("actor_inputs"):
            torch.save(trainer.actor_rollout_wg.updates, spec["actor_inputs"])


def empty_queue() -> None:
    """Clear what an earlier run of this process left in the queue."""
    import transfer_queue as tq

    for partition in ("train", "val"):
        left = list((tq.kv_list(partition) or {}).get(partition, {}))
        if left:
            tq.kv_clear(keys=left, partition_id=partition)


def run(spec: dict[str, Any], report: dict[str, Any]) -> None:
    """One run, or each of ``spec["runs"]`` (see :func:`common.run_each`) on one Ray and TransferQueue,
    the queue emptied before each."""
    impl = report["impl"] = common.skip_impl_in_use()
    ray_dirs: list[Any] = []

    def fit_one(one: dict[str, Any], work: Path, entry: dict[str, Any]) -> None:
        entry["impl"] = impl
        config = compose(work, one)
        if not ray_dirs:
            ray_dirs.append(start_ray_and_tq(config))
        empty_queue()
        fit(one, config, entry)

    try:
        common.run_each(spec, report, fit_one)
    finally:
        if ray_dirs:
            stop_ray_and_tq(ray_dirs[0])


if __name__ == "__main__":
    common.main(run)
