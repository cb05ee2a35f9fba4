"""verl's real ``FullyAsyncAgentLoopManager.generate_sequences_single``, fed as the Rollouter feeds it.

Runs in .venv-verl.

Real: verl's Hydra config, ``RLHFDataset`` and a ``StatefulDataLoader`` of one prompt at a time,
``prepare_single_generation_data`` (the prompt repeated ``rollout.n`` times), the
``uid_sample_{epoch}_{feed index}`` ids the Rollouter embeds, ``SkipManager.init(config)`` as the
Rollouter actor runs it, the manager's decorated ``generate_sequences_single`` (verl's
``annotate("async_rollout")``) and ``addition_process`` on its result. Stand-in: the agent-loop
worker handle (see ``common``). The Rollouter itself is a Ray actor needing GPUs and a message
queue; its feeding loop is reproduced here in a few lines.

Spec keys: work, report, impl, samples, skip (the ``skip.async_rollout`` section), outputs (where
to save the responses of every sample); or work, report, impl and runs, a list of those with a name,
run one after another in this process (see ``common.run_each``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import common


def run(spec: dict[str, Any], report: dict[str, Any]) -> None:
    common.run_each(spec, report, fit)


def fit(spec: dict[str, Any], work: Path, report: dict[str, Any]) -> None:
    """Feed the samples of ``spec`` in ``work`` through verl's manager; ``report`` gets what it did."""
    import numpy as np
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.experimental.fully_async_policy.detach_utils import addition_process, prepare_single_generation_data
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncAgentLoopManager
    from verl.protocol import DataProto
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.utils.skip import SkipManager

    samples = int(spec.get("samples", 3))
    n = 2
    data = common.write_dataset(work / "data" / "train.parquet", rows=samples)
    overrides = common.base_overrides(work, data, steps=samples, batch=1, n=n)
    overrides += common.skip_overrides("async_rollout", spec.get("skip", {}))
    config = common.compose_config("ppo_trainer", overrides)
    report["impl"] = common.skip_impl_in_use()

    tokenizer = common.make_tokenizer()
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None)
    loader = StatefulDataLoader(dataset=dataset, batch_size=1, shuffle=False, collate_fn=collate_fn)
    worker = common.StandInAgentLoopWorker(tokenizer)
    manager = FullyAsyncAgentLoopManager(config, llm_client=None, reward_loop_worker_handles=["reward-loop-worker"])
    manager.agent_loop_workers = [worker]
    SkipManager.init(config)

    async def feed() -> list[Any]:
        results = []
        for index, batch_dict in enumerate(loader, start=1):  # the Rollouter's global_steps start at 1
            full_batch = prepare_single_generation_data(batch_dict, config)
            sample_id = f"sample_0_{index}"
            full_batch.non_tensor_batch["uid"] = np.array([f"uid_{sample_id}"] * len(full_batch), dtype=object)
            results.append(await manager.generate_sequences_single(full_batch))
        return results

    results = asyncio.run(feed())
    report["result_types"] = [f"{type(r).__module__}.{type(r).__qualname__}" for r in results]
    report["is_verl_dataproto"] = [type(r) is DataProto for r in results]
    processed = [addition_process(r) for r in results]  # what the Rollouter does next with each result
    report["processing_times"] = [list(map(float, p.non_tensor_batch["processing_times"])) for p in processed]
    report.update({
        "generation_calls": worker.calls,
        "stats": common.skip_stats(),
        "dump_files": common.tree_listing(Path(spec["skip"]["dump_dir"])) if spec.get("skip") else [],
    })
    if spec.get("outputs"):
        torch.save([{"responses": r.batch["responses"].clone(), "rm_scores": r.batch["rm_scores"].clone()}
                    for r in results], spec["outputs"])


if __name__ == "__main__":
    common.main(run)
