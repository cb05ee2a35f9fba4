"""Reference RL pipelines: stepskip wired into verl's three training paths, for real, on CPU.

- :mod:`stepskip.pipelines.colocated` — colocated GRPO (verl's ``RayPPOTrainer``), role ``rollout``,
  plus a generic stage role on the reward (``skip.reward``);
- :mod:`stepskip.pipelines.v1` — verl's V1 trainer over TransferQueue, role ``rollout_tq``
  (modes ``sync``, ``colocate_async``, ``separate_async``);
- :mod:`stepskip.pipelines.fully_async` — a Rollouter and a Trainer as Ray actors, role ``async_rollout``;
- :mod:`stepskip.pipelines.demo` — ``stepskip demo``: each pipeline recorded, then replayed.

Shared pieces: :mod:`~stepskip.pipelines.policy` (a tiny random-init causal LM from a
``transformers`` config), :mod:`~stepskip.pipelines.task` (a verifiable counting task and a seeded
loader), :mod:`~stepskip.pipelines.grpo` (advantages and the clipped update),
:mod:`~stepskip.pipelines.runtime` (Hydra configs packaged in ``configs/*.yaml``, step records),
:mod:`~stepskip.pipelines.tokenizer` (one character per token: their caches read as text).
Needs the ``pipelines`` extra (transformers, hydra-core, ray).
"""

from stepskip.pipelines.runtime import PIPELINES, RunResult, StepRecord, load_config

__all__ = ["PIPELINES", "RunResult", "StepRecord", "load_config"]
