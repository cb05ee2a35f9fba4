"""What the three reference trainers share: config loading, torch set-up, the model/data parts, step records.

Configs are the packaged Hydra YAML files in ``stepskip/pipelines/configs``, composed with
Hydra's compose API (no output directory, nothing written to the working directory), so the
command lines of verl's skip guide work as written::

    python -m stepskip.pipelines.colocated skip.rollout.enable=True skip.rollout.steps=[1,2,3] skip.rollout.action=cache
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stepskip import Batch
from stepskip.pipelines.grpo import Actor, ActorConfig
from stepskip.pipelines.policy import ModelSpec, TinyPolicy
from stepskip.pipelines.task import CountTask, PromptDataset, PromptLoader

__all__ = [
    "CONFIG_DIR",
    "PIPELINES",
    "load_config",
    "configure_torch",
    "torch_settings",
    "quiet_torch_notices",
    "derive_seed",
    "Parts",
    "build_parts",
    "generate_batch",
    "repeat_rows",
    "StepRecord",
    "RunResult",
]

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
#: Pipeline name -> config name (the module of the same name runs it).
PIPELINES = ("colocated", "v1", "fully_async")


def load_config(name: str, overrides: Sequence[str] = ()) -> Any:
    """Compose the packaged config ``name`` with Hydra command-line ``overrides``.

    Args:
        name: ``colocated``, ``v1`` or ``fully_async``.
        overrides: Hydra override strings, e.g. ``["skip.rollout.enable=True", "skip.rollout.steps=[1,2]"]``.

    Returns:
        The composed ``DictConfig`` (struct mode off, so trainers may add runtime keys).

    Example:
        >>> cfg = load_config("colocated", ["skip.rollout.enable=True", "skip.rollout.steps=[1,2,3]"])
        >>> cfg.skip.rollout.enable, list(cfg.skip.rollout.steps)
        (True, [1, 2, 3])
    """
    try:
        from hydra import compose, initialize_config_dir
    except ImportError as err:  # pragma: no cover - hydra ships with the `pipelines` extra
        raise ImportError("the reference pipelines need hydra-core: pip install 'stepskip[pipelines]'") from err
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    if name not in PIPELINES:
        raise ValueError(f"unknown pipeline {name!r}; known pipelines: {', '.join(PIPELINES)}")
    outer = GlobalHydra.instance()
    backup = None
    if outer.is_initialized():  # called from inside a Hydra app: compose aside, then give its state back
        from hydra.initialize import get_gh_backup, restore_gh_from_backup

        backup = get_gh_backup()
        outer.clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None, job_name=f"stepskip_{name}"):
            config = compose(config_name=name, overrides=list(overrides))
    finally:
        if backup is not None:
            restore_gh_from_backup(backup)
    OmegaConf.set_struct(config, False)
    return config


def configure_torch(config: Any) -> None:
    """Apply ``trainer.torch_threads`` and ``trainer.deterministic`` to this process's torch (for good)."""
    threads = int(config.trainer.get("torch_threads", 0) or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if bool(config.trainer.get("deterministic", False)):
        torch.use_deterministic_algorithms(True)


@contextlib.contextmanager
def torch_settings(config: Any) -> Iterator[None]:
    """:func:`configure_torch` for the duration of a ``with`` block, then the caller's settings back."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    configure_torch(config)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def quiet_torch_notices() -> None:
    """Silence torch's one-off ``is_fx_tracing`` notice (jagged tensors built outside tracing trigger it)."""
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def derive_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts (step, chunk, sample id ...), stable across processes.

    Example:
        >>> derive_seed(0, "train", 3) == derive_seed(0, "train", 3) != derive_seed(0, "train", 4)
        True
    """
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Parts:
    """The model and data pieces every trainer builds from its config."""

    task: CountTask
    train_loader: PromptLoader
    val_prompts: Batch
    policy: TinyPolicy
    actor: Actor
    n: int
    response_length: int
    temperature: float
    val_temperature: float
    seed: int
    norm_adv_by_std: bool


def build_parts(config: Any) -> Parts:
    """Task, seeded loaders, the randomly initialised policy and its actor, from a pipeline config.

    Raises:
        ValueError: the model's vocabulary or the prompt length does not fit the task.
    """
    task = CountTask.from_config(config.task)
    spec = ModelSpec.from_config(config.actor_rollout_ref.model)
    if spec.vocab_size < task.vocab_size:
        raise ValueError(f"actor_rollout_ref.model.vocab_size = {spec.vocab_size} is too small for the task "
                         f"({task.vocab_size} tokens: pad, BOS, EOS and {task.num_symbols} symbols)")
    data = config.data
    if int(data.max_prompt_length) != task.prompt_length:
        raise ValueError(f"data.max_prompt_length = {data.max_prompt_length} must equal the task's prompt length "
                         f"{task.prompt_length} (BOS + task.prompt_tokens)")
    rollout = config.actor_rollout_ref.rollout
    seed = int(data.seed)
    train = PromptDataset(task, int(data.train_size), seed=seed)
    val = PromptDataset(task, int(data.val_size), seed=seed + 7919)
    policy = TinyPolicy(spec)
    n = int(rollout.n)
    actor = Actor(policy, ActorConfig.from_config(config.actor_rollout_ref.actor), n=n,
                  temperature=float(rollout.temperature))
    val_prompts = val.collate(list(range(min(int(data.val_batch_size), len(val)))))
    return Parts(
        task=task,
        train_loader=PromptLoader(train, int(data.train_batch_size), seed=seed, shuffle=bool(data.shuffle)),
        val_prompts=val_prompts,
        policy=policy,
        actor=actor,
        n=n,
        response_length=int(data.max_response_length),
        temperature=float(rollout.temperature),
        val_temperature=float(rollout.val_kwargs.temperature),
        seed=seed,
        norm_adv_by_std=bool(config.algorithm.norm_adv_by_std_in_grpo),
    )


def repeat_rows(batch: Batch, n: int) -> Batch:
    """Each row repeated ``n`` times, interleaved (verl's ``batch.repeat(n, interleave=True)``)."""
    return batch[np.repeat(np.arange(len(batch)), n)]


def generate_batch(policy: TinyPolicy, prompts: Batch, response_length: int, temperature: float, seed: int) -> Batch:
    """Roll out ``prompts`` with ``policy``: the verl-shaped output batch of one agent-loop worker.

    Returns:
        A Batch with ``prompts``, ``responses``, ``response_mask``, ``input_ids``,
        ``attention_mask`` and ``rollout_log_probs`` tensors; the prompts' non-tensor columns
        (``uid``, ``index``, ``data_source``) carried over.
    """
    input_ids = prompts.tensors["input_ids"]
    out = policy.generate(input_ids, response_length, temperature, torch.Generator().manual_seed(seed))
    full = torch.cat([input_ids, out.responses], dim=1)
    attention = torch.cat([torch.ones_like(input_ids), out.response_mask], dim=1)
    return Batch.from_dict(
        tensors={"prompts": input_ids, "responses": out.responses, "response_mask": out.response_mask,
                 "input_ids": full, "attention_mask": attention, "rollout_log_probs": out.log_probs},
        non_tensors={k: np.array(v, copy=True) for k, v in prompts.non_tensor_batch.items()},
        meta_info=dict(prompts.meta_info),
    )


@dataclass
class StepRecord:
    """One training step as the demo and the tests see it.

    Attributes:
        step: the trainer's ``global_steps``.
        mode: ``generated`` when the rollout ran, ``replayed`` when it came from the cache.
        rollout_s: seconds spent obtaining the step's rollout (generation or replay).
        step_s: seconds of the whole training step (validation excluded).
        reward: mean score of the step's responses.
        loss: mean policy loss of the step's update.
        prompt_indices: dataset indices of the step's prompts, in order (dataloader alignment).
        metrics: anything else (clip fraction, gradient norm, staleness ...).
    """

    step: int
    mode: str
    rollout_s: float
    step_s: float
    reward: float
    loss: float
    prompt_indices: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    """The outcome of one ``fit()``.

    Attributes:
        pipeline: ``colocated``, ``v1`` or ``fully_async``.
        records: one per training step.
        generation_calls: ``(step, validate)`` for every call that really generated.
        validations: mean validation score per validation run (validation always generates).
        skip_stats: ``SkipManager.stats()`` at the end of the run.
        seconds: wall time of ``fit()``.
    """

    pipeline: str
    records: list[StepRecord] = field(default_factory=list)
    generation_calls: list[tuple[int, bool]] = field(default_factory=list)
    validations: list[float] = field(default_factory=list)
    skip_stats: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def losses(self) -> list[float]:
        return [r.loss for r in self.records]

    @property
    def generated_train_steps(self) -> list[int]:
        """Steps on which training generation really ran."""
        return sorted({step for step, validate in self.generation_calls if not validate})


def timed_run(pipeline: str, config: Any, body: Any) -> RunResult:
    """Run ``body(result)`` under the config's torch settings and time it: the frame of every ``fit()``."""
    result = RunResult(pipeline=pipeline)
    start = time.perf_counter()
    with torch_settings(config):
        body(result)
    result.seconds = time.perf_counter() - start
    return result


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds``."""

    def __enter__(self) -> Stopwatch:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self.start
