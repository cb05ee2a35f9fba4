"""stepskip inside TRL's ``GRPOTrainer``: record the generation of chosen steps once, replay it on later runs.

Two lines in an existing GRPO script::

    from stepskip.integrations.trl import enable_stepskip
    trainer = GRPOTrainer(model=..., args=..., train_dataset=..., reward_funcs=...)
    enable_stepskip(trainer, skip={"enable": True, "dump_dir": "/tmp/cache", "steps": "1-50"})

or ``StepskipGRPOTrainer(..., skip={...})`` in place of ``GRPOTrainer``. The skip unit is the
per-process generation call, ``GRPOTrainer._generate_single_turn``; rewards, advantages,
log-probs and the update always run live. Evaluation generation always runs and is never stored.

Entries are keyed by the optimizer step being computed (``state.global_step + 1``), the index of
the call within that step (``c0``, ``c1`` ... with gradient accumulation; ``c0t0`` ... for the
turns of a tool loop) and the rank: ``{run}/trl_generate/{step}/c{call}-r{rank}/``. With several
processes the world size is part of the run directory (``..._W2``), and before every call the
ranks agree on hit or miss with one ``all_reduce`` (gloo): one rank's missing or damaged entry
makes every rank regenerate the call.

Requires ``pip install "stepskip[trl]"``.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from transformers import TrainerCallback
from trl import GRPOTrainer

from stepskip._reading.classify import EntryStatus
from stepskip._reading.reader import seconds_of
from stepskip._content import ContentSources
from stepskip._storage.layered import origin_of
from stepskip.errors import CacheMissError, CorruptEntryError, ReplayMissError, SkipConfigError, StoreUnavailableError
from stepskip._identity import RunIdentity
from stepskip.integrations._trl_config import TrlGenerateConfig
from stepskip._manager import SkipManager
from stepskip._policies import SkipAction
from stepskip.roles.base import RunContext, register_skip
from stepskip.roles.cached import CachedRole
from stepskip._tracker import (
    StepSamples,
    add_rewards,
    decoder,
    log_mlflow,
    log_wandb,
    offer_samples,
    samples_text,
    select_metrics,
    take_samples,
)

__all__ = ["NoVLLMGeneration", "StepskipGRPOTrainer", "TrlGenerateConfig", "enable_stepskip"]

logger = logging.getLogger(__name__)

ROLE = "trl_generate"

_HIT, _MISS, _ERROR = 0, 1, 2  # ordered: the all_reduce MAX of the ranks' outcomes is the agreed one


@dataclass
class CallRecord:
    """One generation call of the trainer, as the caller sees it afterwards (``trainer.stepskip._calls``).

    Args:
        step: the optimizer step being computed (``state.global_step + 1``).
        name: the call within the step: ``c0``, ``c1`` ..., tool-loop turns ``c0t0``, ``c0t1`` ...
        rank: the process's rank.
        eligible: the step is listed and the call could be cached.
        hit: the call was served from the cache (the generator did not run).
        path: the entry it was served from or written to (None when not eligible).
    """

    step: int
    name: str
    rank: int = 0
    eligible: bool = False
    hit: bool = False
    path: str | None = None
    turn: int | None = None
    round_replayed: bool = field(default=False, repr=False)  # a tool turn's: its round's first call was a hit


#: The call the role is serving (set around the decorated call; the role's hooks keep verl's signatures).
_CALL: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar("stepskip_trl_call", default=None)
_IN_TOOL_LOOP: contextvars.ContextVar[bool] = contextvars.ContextVar("stepskip_trl_tool_loop", default=False)


@dataclass
class _Loaded:
    value: Any
    meta: dict[str, Any]
    seconds: float
    nbytes: int
    rng: Any
    source: int = -1  # the step whose entry it is


@dataclass
class _Attempt:
    status: int
    load_step: int = -1
    loaded: _Loaded | None = None
    error: BaseException | None = None


def _prompts_of_call(*args: Any, **kwargs: Any) -> Any:
    """The call's ``prompt_ids`` (``list[list[int]]``): the prompt digest hashes such rows packed, row
    boundaries included (:func:`stepskip._fidelity.prompt_digest`)."""
    return kwargs.get("prompt_ids", args[1] if len(args) > 1 else None)


def _never(*args: Any, **kwargs: Any) -> bool:
    return False  # evaluation and uncacheable calls never reach the decorated function


# ---------------------------------------------------------------------- stored form of a call's result
#
# A call's ``(completion_ids, logprobs)`` is stored as it is: ``format: safe`` packs ragged number
# rows into tensors itself (:mod:`stepskip._formats.values`). Entries written before it did hold the
# integration's own packing, a dict tagged ``_PACKED``; they are still read.

_PACKED = "stepskip.trl.generation/1"  # the tag of the integration's own packing (older entries)


def _unpack_rows(packed: Any, path: str, what: str, holes: bool) -> list[list[Any]]:
    import torch

    from stepskip.errors import UnreadableEntryError

    def refuse(why: str) -> UnreadableEntryError:
        return UnreadableEntryError(f"the entry at {path} holds {what} this stepskip cannot unpack ({why}); it was "
                                    "left untouched: re-record the step with action: record")

    if not isinstance(packed, dict):
        raise refuse("not a mapping")
    values, offsets = packed.get("values"), packed.get("offsets")
    if not isinstance(values, torch.Tensor) or not isinstance(offsets, torch.Tensor):
        raise refuse("values or offsets missing")
    if values.dim() != 1 or offsets.dim() != 1 or offsets.dtype != torch.int64 or offsets.numel() < 1:
        raise refuse("tensors of the wrong shape or type")
    bounds = offsets.tolist()
    if bounds[0] != 0 or bounds[-1] != values.numel() or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise refuse("row offsets out of order or out of bounds")
    flat = values.tolist()
    if holes:
        missing = packed.get("missing")
        if not isinstance(missing, torch.Tensor) or missing.dtype != torch.bool or missing.shape != values.shape:
            raise refuse("a missing-value mask of the wrong shape or type")
        flat = [None if gone else item for item, gone in zip(flat, missing.tolist())]
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def _unpack_generation(value: Any, path: str) -> Any:
    """The call's ``(completion_ids, logprobs)``: ``value`` itself, or unpacked from the integration's own
    packing (entries written before ``format: safe`` packed rows; any other value is returned as it is).

    Raises:
        UnreadableEntryError: a packed value whose tensors do not describe rows (checksums held).
    """
    if not (isinstance(value, dict) and value.get("kind") == _PACKED):
        return value
    ids = _unpack_rows(value.get("completion_ids"), path, "completion ids", holes=False)
    logprobs = value.get("logprobs")
    return ids, None if logprobs is None else _unpack_rows(logprobs, path, "log-probs", holes=True)


@register_skip(ROLE)
class TrlGenerateSkip(CachedRole):
    """Caches one process's ``GRPOTrainer._generate_single_turn`` calls: ``(completion_ids, logprobs)``,
    stored as returned (``format: safe`` packs the ragged rows into tensors).

    Runtime objects (``SkipManager.init(..., rank=, world_size=, group=)``, passed by
    :func:`enable_stepskip`): the process's rank, the number of processes and the gloo process
    group the ranks agree on hit or miss through (None: the default group).
    """

    config_class: ClassVar[type[Any]] = TrlGenerateConfig

    def __init__(self, local_config: Any, global_config: Any) -> None:
        super().__init__(local_config, global_config)
        self.rank = 0
        self.world_size = 1
        self._group: Any = None
        self._loaded: dict[str, _Loaded] = {}  # entry path -> what meet_precondition read for warp_function

    def bind(self, context: RunContext) -> None:
        self.rank = int(context.runtime.get("rank", 0))
        self.world_size = int(context.runtime.get("world_size", 1))
        self._group = context.runtime.get("group")
        super().bind(context)

    # ------------------------------------------------------------------ addressing

    def entry_dir(self, step: int, name: str, rank: int | None = None) -> str:
        """The entry of call ``name`` of ``step`` on ``rank`` (default: this process's)."""
        return self.layout.call_dir(step, name, self.rank if rank is None else rank)

    def step_dump_dir(self, step: int) -> str:
        """The entry of the call being served at ``step`` (the step's directory outside a call)."""
        call = _CALL.get()
        return self.layout.step_dir(step) if call is None else self.entry_dir(step, call.name)

    def _call_names(self, step: int) -> list[str]:
        """The calls of ``step`` this rank recorded (``c0``, ``c1`` ...; tool-loop turns left out)."""
        suffix = f"-r{self.rank}"
        calls = [n[: -len(suffix)] for n in self.store.list_dir(self.layout.step_dir(step), dirs_only=True)
                 if n.endswith(suffix) and n[:1] == "c" and n[1:-len(suffix)].isdigit()]
        return sorted(calls, key=lambda n: int(n[1:]))

    def would_replay(self, step: int) -> bool:
        """True when every call this rank recorded for ``step`` (at least its first) would be served."""
        for name in self._call_names(step) or ["c0"]:
            token = _CALL.set(CallRecord(step=step, name=name, rank=self.rank))
            try:
                if not super().would_replay(step):
                    return False
            finally:
                _CALL.reset(token)
        return True

    # ------------------------------------------------------------------ the role protocol

    def meet_precondition(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> bool:
        """Read this rank's entry, then agree with every rank: True only when all of them can replay.

        Raises:
            ReplayMissError: under ``replay``, when any rank has no usable entry (raised on every rank).
            UnreadableEntryError: this rank's entry is intact but cannot be used here (every other
                rank raises a :class:`SkipConfigError` naming this one).
        """
        call = _CALL.get()
        path = self.step_dump_dir(step)
        if self.withheld:
            self.withheld.forget(path)
        if self.action is SkipAction.RECORD:
            self.stats.add(misses=1)  # every call generates: each is a miss
            return False  # every rank has the same action: no need to ask
        if call is not None and call.turn is not None:
            return self._tool_turn_cached(step, call, path, args, kwargs)
        attempt = self._attempt(step, path, args, kwargs)
        status, load_step = self._agree(attempt)
        if status == _ERROR:
            if attempt.error is not None:
                raise attempt.error
            raise SkipConfigError(f"{self.name}: another rank cannot use its entry of step {step} "
                                  f"({os.path.basename(path)}); see that rank's error for the entry and the fix")
        if status == _MISS:
            if attempt.status == _HIT:
                logger.info("%s: step %d %s: another rank has no usable entry; every rank regenerates it",
                            self.name, step, os.path.basename(path))
            if self.action is SkipAction.REPLAY:
                raise ReplayMissError(f"{self.name}: no usable entry of step {step} call {os.path.basename(path)} "
                                      f"on every rank under {self.project_dump_dir} (action 'replay'); record it "
                                      "first with action 'cache' or 'record', or check dump_dir and the run shape")
            self.stats.add(misses=1)
            logger.info("%s miss: step %d has no usable entry at %s on every rank; generating and dumping it",
                        self.name, step, path)
            return False
        assert attempt.loaded is not None and load_step == attempt.load_step
        self._loaded[path] = attempt.loaded
        return True

    def _attempt(self, step: int, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Attempt:
        """This rank's outcome, never raising: whatever goes wrong must still reach the collective."""
        try:
            probe = self.reader.probe_settled(path)
            if probe.state.kept:
                raise self.reader.unreadable(probe.reason)
            if probe.state is EntryStatus.DAMAGED:
                self.reader.report_corrupt(step, path, probe.reason)
            elif probe.state is EntryStatus.UNAVAILABLE:
                if self.action is SkipAction.REPLAY:  # read with the reader's retries: raises if it stays down
                    return _Attempt(_HIT, step, self._load(step, step, args, kwargs))
                self.entry_unavailable(step, path, probe.reason)  # a miss, its result not written over the entry
            load_step = self.resolve_load_step(step)
            if load_step == -1:
                return _Attempt(_MISS)
            return _Attempt(_HIT, load_step, self._load(step, load_step, args, kwargs))
        except StoreUnavailableError as err:  # retried first under replay, where it fails the call on every rank
            self.entry_unavailable(step, path, str(err.__cause__ or err))
            return _Attempt(_ERROR, error=err) if self.action is SkipAction.REPLAY else _Attempt(_MISS)
        except CacheMissError:  # damaged (counted by the reader), vanished, or a fingerprint to regenerate
            return _Attempt(_MISS)
        except Exception as err:  # raised after the collective, on every rank
            return _Attempt(_ERROR, error=err)

    def _load(self, step: int, load_step: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Loaded:
        from stepskip._calls import call_prompts

        path = self.step_dump_dir(load_step)
        prompts = call_prompts(args, kwargs)
        value, meta, seconds, nbytes = self.load_entry(load_step, step, prompts=prompts)
        return _Loaded(_unpack_generation(value, path), meta, seconds, nbytes, self._recorded_rng(meta, step, path),
                       load_step)

    def _recorded_rng(self, meta: dict[str, Any], step: int, path: str) -> Any:
        if not self.config.restore_rng:
            return None
        recorded = meta.get("rng_state")
        if recorded is None:
            self.restore_rng(meta, step, path)  # warns once; sets nothing
            return None
        from stepskip._rng import parse_rng_state

        try:
            return parse_rng_state(recorded, path)
        except CorruptEntryError as err:
            self.reader.report_corrupt(step, path, str(err))
            raise

    def _agree(self, attempt: _Attempt) -> tuple[int, int]:
        """``(status, load step)`` agreed by every rank in one ``all_reduce``; a hit only when every rank
        has one, from the same step."""
        if self.world_size <= 1:
            return attempt.status, attempt.load_step
        status, highest, negated_lowest = _highest_of_ranks(
            [attempt.status, attempt.load_step, -attempt.load_step], self._group)
        lowest = -negated_lowest
        if status == _HIT and highest != lowest:
            status = _MISS  # the ranks would replay different steps: regenerate instead
        return status, highest

    def _tool_turn_cached(self, step: int, call: CallRecord, path: str, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> bool:
        """A tool-loop turn: ranks run different numbers of turns, so no collective. It replays when its
        round's first call did and this rank's entry is usable; otherwise it runs (and is recorded)."""
        if not call.round_replayed:
            return False
        try:
            loaded = self._load(step, step, args, kwargs)
        except CacheMissError:
            if self.action is SkipAction.REPLAY:
                raise
            self.stats.add(misses=1)
            logger.warning("%s: step %d replayed but its tool turn %s has no usable entry at %s; generating it "
                           "on this rank", self.name, step, call.name, path)
            return False
        self._loaded[path] = loaded
        return True

    def warp_function(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """The value ``meet_precondition`` read, with the random state its call left (``restore_rng``)."""
        path = self.step_dump_dir(step)
        loaded = self._loaded.pop(path, None)
        if loaded is None:
            return _unpack_generation(super().warp_function(step, func, *args, **kwargs), path)
        if loaded.rng is not None:
            for reason in loaded.rng.apply():
                logger.warning("%s: step %d replayed without part of its random state: %s", self.name, step, reason)
        self.stats.add(hits=1, load_seconds=loaded.seconds, bytes_read=loaded.nbytes,
                       saved_seconds=seconds_of(loaded.meta.get("generation_seconds")),
                       rows_replayed=_completion_rows(loaded.value))
        origin = origin_of(loaded.meta) if self.layered else None  # read from a layered cache (sources, replay_from)
        if origin is not None:
            self.stats.add(**{origin.counter: 1})
        offer_samples(self, step, loaded.source if loaded.source >= 0 else step, loaded.value,
                      _prompts_of_call(*args, **kwargs), replayed=True)
        call = _CALL.get()
        if call is not None:
            call.hit = True
        logger.info("%s hit: step %d replayed from %s (%d bytes, %.3fs)", self.name, step,
                    path if origin is None else origin.describe(), loaded.nbytes, loaded.seconds)
        return loaded.value

    def prepare_data(self, step: int, result: Any, *args: Any, **kwargs: Any) -> None:
        """Record a generated call (:meth:`CachedRole.prepare_data`), its rows counted in ``rows_generated``."""
        self.stats.add(rows_generated=_completion_rows(result))
        super().prepare_data(step, result, *args, **kwargs)


def _completion_rows(value: Any) -> int:
    """The number of completions in a call's ``(completion_ids, logprobs)``; 0 for anything else."""
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], (list, tuple)):
        return len(value[0])
    return 0


# ---------------------------------------------------------------------- the trainer side


def generating_steps(args: Any, steps: int) -> list[int]:
    """The optimizer steps ``1..steps`` on which ``GRPOTrainer`` generates (the others reuse its buffer).

    Generation runs on micro-steps ``m`` with ``m % (steps_per_generation * num_iterations) == 0``;
    optimizer step ``k`` covers micro-steps ``(k-1)*GA`` to ``k*GA - 1``.

    Example:
        >>> from types import SimpleNamespace
        >>> generating_steps(SimpleNamespace(steps_per_generation=2, num_iterations=1,
        ...                                  gradient_accumulation_steps=1), 5)
        [1, 3, 5]
    """
    every = max(1, int(args.steps_per_generation or 1) * int(getattr(args, "num_iterations", 1) or 1))
    accumulation = max(1, int(args.gradient_accumulation_steps or 1))
    out = []
    for step in range(1, steps + 1):
        first, last = (step - 1) * accumulation, step * accumulation - 1
        if (last // every) * every >= first:
            out.append(step)
    return out


def identity_of(trainer: Any) -> RunIdentity:
    """The run identity of a ``GRPOTrainer``: its shape and every setting that decides what it generates.

    ``{experiment}_{project}`` is ``grpo_{model name}``; the run directory is
    ``GBS{prompts per generation}_N{num_generations}_in0_out{max_completion_length}`` (``_W{n}`` for
    ``n`` processes). The dataset's own ``_fingerprint`` is a fingerprint value; the content digests
    cover ``processing_class`` (its chat template and tokenizer files), the model's config (and
    weight files with ``fingerprint_weights``) and the code revision.
    """
    args = trainer.args
    model = getattr(trainer.model, "name_or_path", None) or getattr(getattr(trainer.model, "config", None),
                                                                       "_name_or_path", "")
    world_size = int(trainer.accelerator.num_processes)
    num_generations = int(args.num_generations or 1)
    dataset = getattr(trainer, "train_dataset", None)
    fingerprint = {
        "trl.model": str(model),
        "trl.world_size": world_size,
        "trl.train_dataset": getattr(dataset, "_fingerprint", None),
        "trl.use_vllm": bool(getattr(args, "use_vllm", False)),
        "trl.vllm_mode": getattr(args, "vllm_mode", None) if getattr(args, "use_vllm", False) else None,
    }
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "generation_kwargs",
                "num_generations", "max_completion_length", "generation_batch_size", "per_device_train_batch_size",
                "gradient_accumulation_steps", "steps_per_generation", "seed", "data_seed", "shuffle_dataset"):
        fingerprint[f"trl.{key}"] = getattr(args, key, None)
    name = os.path.basename(str(model).rstrip("/")) or "model"
    return RunIdentity(
        experiment_name="grpo",
        project_name=name,
        gbs=int(args.generation_batch_size or 0) // num_generations,
        n=num_generations,
        prompt_len=int(getattr(args, "max_prompt_length", 0) or 0),
        response_len=int(args.max_completion_length or 0),
        fingerprint={k: v for k, v in fingerprint.items() if v is not None},
        world_size=world_size,
        # what the values above do not show: the template and tokenizer files, the model's config
        content=ContentSources(tokenizer=getattr(trainer, "processing_class", None), model=trainer.model),
    )


class StepskipCallback(TrainerCallback):
    """Puts stepskip into what TRL's reporters (``report_to``) receive, and flushes pending dumps at the end.

    Every log line gets the enabled roles' ``skip/{role}/{name}`` counters, run totals, as each role's
    ``log_metrics`` chooses (``short`` by default: hits, misses, saved_seconds, dump_failures,
    corrupt). With ``log_samples``, the main process sends the sampled trajectories of the steps
    logged: a table to W&B and MLflow, text to TensorBoard, the ``stepskip`` logger when none of them
    reports.

    Args:
        trainer: the trainer whose TensorBoard writer takes the samples' text (held weakly).
    """

    def __init__(self, trainer: Any = None) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._failed = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs is not None:
            logs.update(select_metrics(SkipManager.stats()))
        samples = take_samples(state.global_step)
        if samples and state.is_world_process_zero:
            try:
                self._send(samples, args, kwargs.get("processing_class"))
            except Exception as err:  # a tracker that refuses the samples never stops training
                if not self._failed:
                    self._failed = True
                    logger.warning("stepskip: could not send rollout samples to the trackers: %s: %s",
                                   type(err).__name__, err)

    def _send(self, samples: list[StepSamples], args: Any, processing_class: Any) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        decode = decoder(processing_class if processing_class is not None
                         else getattr(trainer, "processing_class", None))
        report_to = set(getattr(args, "report_to", None) or [])
        sent = False
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                for each in samples:  # joins the line TRL's W&B callback commits next
                    log_wandb(wandb, each, decode, commit=False)
                sent = True
        if "mlflow" in report_to:
            import mlflow

            if mlflow.active_run() is not None:
                for each in samples:
                    log_mlflow(each, decode)
                sent = True
        writer = _tensorboard_writer(trainer) if "tensorboard" in report_to else None
        if writer is not None:
            for each in samples:
                writer.add_text(each.key, samples_text(each, decode, indent="    "), each.step)
            sent = True
        if not sent:
            for each in samples:
                logger.info("%s", samples_text(each, decode))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not SkipManager.flush(timeout=600):
            logger.warning("stepskip: background dumps still running at the end of training")


def _tensorboard_writer(trainer: Any) -> Any:
    """The ``SummaryWriter`` of the trainer's TensorBoard reporting callback, once it made one."""
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        writer = getattr(callback, "tb_writer", None)
        if writer is not None and hasattr(writer, "add_text"):
            return writer
    return None


def _wrap_rewards(trainer: Any) -> None:
    """Give the sampled trajectories of each step their rewards: GRPOTrainer computes them after the call."""
    calculate = getattr(trainer, "_calculate_rewards", None)
    if calculate is None:
        return

    @functools.wraps(calculate)
    def calculate_rewards(*args: Any, **kwargs: Any) -> Any:
        per_function = calculate(*args, **kwargs)
        prompts = kwargs.get("prompts", args[1] if len(args) > 1 else None)
        try:
            model = trainer.model
            if prompts is not None and model is not None and model.training:  # evaluation is never sampled
                add_rewards(ROLE, _local_rewards(trainer, per_function, len(prompts)))
        except Exception as err:  # the samples go without rewards; training goes on
            logger.debug("stepskip: no rewards for the samples: %s: %s", type(err).__name__, err)
        return per_function

    trainer._calculate_rewards = calculate_rewards


def _local_rewards(trainer: Any, per_function: Any, rows: int) -> list[float]:
    """This process's rows of the gathered ``(rows, functions)`` rewards, weighted and summed as TRL does
    (NaN where no function scored the row)."""
    import torch

    start = int(trainer.accelerator.process_index) * rows
    local = per_function[start:start + rows].detach().float().cpu()
    weights = trainer.reward_weights.detach().float().cpu()
    total = (local * weights.unsqueeze(0)).nansum(dim=1)
    total[torch.isnan(local).all(dim=1)] = float("nan")
    return [float(value) for value in total.tolist()]


@dataclass
class TrainerSkipState:
    """What :func:`enable_stepskip` attaches to a trainer as ``trainer.stepskip``.

    Args:
        role: the ``trl_generate`` role serving the trainer's calls.
        calls: the latest calls (at most 10 000), oldest first.
        engine_plan: whether vLLM was started and why (:class:`StepskipGRPOTrainer` with ``use_vllm``).
    """

    role: TrlGenerateSkip
    original: Callable[..., Any]
    calls: deque[CallRecord] = field(default_factory=lambda: deque(maxlen=10_000))
    engine_plan: Any = None  # the EnginePlan StepskipGRPOTrainer decided vLLM by (None: not asked)
    _step: int = -1
    _main: int = -1
    _turn: int = -1
    round_replayed: bool = False
    _said: set[str] = field(default_factory=set)

    @property
    def last(self) -> CallRecord | None:
        """The latest generation call, or None before the first."""
        return self.calls[-1] if self.calls else None

    def next_call(self, step: int, in_tool_loop: bool) -> CallRecord:
        if step != self._step:
            self._step, self._main, self._turn = step, -1, -1
        if in_tool_loop and self._main >= 0:
            self._turn += 1
            name, turn = f"c{self._main}t{self._turn}", self._turn
        else:
            self._main += 1
            self._turn = -1
            name, turn = f"c{self._main}", None
        return CallRecord(step=step, name=name, rank=self.role.rank, turn=turn,
                          round_replayed=self.round_replayed and turn is not None)

    def say_once(self, reason: str) -> None:
        if reason not in self._said:
            self._said.add(reason)
            logger.info("stepskip: %s; such generation calls run untouched and are not cached", reason)


def _uncacheable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why a ``_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, ...)`` call
    cannot be cached, or None."""
    images = kwargs.get("images", args[1] if len(args) > 1 else None)
    fields = kwargs.get("multimodal_fields", args[2] if len(args) > 2 else None)
    if images is not None and any(item is not None for item in images):
        return "the prompts carry images"
    if fields:
        return f"the prompts carry multimodal fields ({', '.join(map(str, fields))})"
    if kwargs.get("has_tool_images") or (len(args) > 4 and args[4]):
        return "a tool returned images"
    return None


def enable_stepskip(trainer: GRPOTrainer, skip: Any, *, identity: RunIdentity | None = None) -> TrainerSkipState:
    """Turn stepskip on for an existing ``GRPOTrainer`` (or subclass) instance.

    Call it on every process, after constructing the trainer and before ``train()``. It starts a
    stepskip run (``SkipManager.init``: one per process), wraps the trainer's generation call and
    adds a :class:`StepskipCallback`.

    Args:
        trainer: the trainer.
        skip: the role's section (``enable``, ``dump_dir``, ``steps``, ``action`` ...): a dict, an
            OmegaConf node or a dataclass (:class:`TrlGenerateConfig` keeps TRL's defaults).
        identity: override the run identity read from ``trainer.args`` (:func:`identity_of`).

    Returns:
        ``trainer.stepskip``: the role and the latest calls (``trainer.stepskip.last.hit``).

    Raises:
        TypeError: ``trainer`` is not a ``GRPOTrainer``.
        SkipConfigError: a bad value in ``skip``.

    Example:
        >>> enable_stepskip(trainer, skip={"enable": True, "dump_dir": "/tmp/c", "steps": [1, 2]})  # doctest: +SKIP
    """
    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"enable_stepskip needs a trl.GRPOTrainer, got {type(trainer).__qualname__}")
    previous = getattr(trainer, "stepskip", None)
    original = previous.original if isinstance(previous, TrainerSkipState) else trainer._generate_single_turn
    world_size = int(trainer.accelerator.num_processes)
    rank = int(trainer.accelerator.process_index)
    group = _gloo_group(trainer) if world_size > 1 else None
    SkipManager.init({"skip": {ROLE: skip}}, identity=identity or identity_of(trainer), rank=rank,
                     world_size=world_size, group=group)
    role = SkipManager.skip_instances[ROLE]
    assert isinstance(role, TrlGenerateSkip)
    state = TrainerSkipState(role=role, original=original)
    trainer.stepskip = state  # type: ignore[attr-defined]

    @SkipManager.annotate(role=ROLE, bypass=_never, prompts=_prompts_of_call)
    def cached(owner: Any, *args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    @functools.wraps(original)
    def generate_single_turn(*args: Any, **kwargs: Any) -> Any:
        model = trainer.model
        if model is None or not model.training:
            return original(*args, **kwargs)  # evaluation: always generated, never stored
        call = state.next_call(trainer.state.global_step + 1, _IN_TOOL_LOOP.get())
        state.calls.append(call)
        reason = _uncacheable(args, kwargs)
        if reason is not None or not role.enable:
            if reason is not None:
                state.say_once(reason)
            return original(*args, **kwargs)
        call.eligible = call.step in role.step_set
        call.path = role.entry_dir(call.step, call.name) if call.eligible else None
        SkipManager.set_step(call.step)
        token = _CALL.set(call)
        try:
            result = cached(trainer, *args, **kwargs)
        finally:
            _CALL.reset(token)
        if call.turn is None:
            state.round_replayed = call.hit
        return result

    # on the instance, not the class: other trainers in the process stay untouched
    trainer._generate_single_turn = generate_single_turn  # type: ignore[method-assign]
    if not isinstance(previous, TrainerSkipState):
        _wrap_tool_loop(trainer)
        trainer.callback_handler.callbacks.insert(0, StepskipCallback(trainer))  # before the reporters: they see skip/*
    if role.config.log_samples and not getattr(trainer, "_stepskip_rewards_wrapped", False):
        _wrap_rewards(trainer)
        trainer._stepskip_rewards_wrapped = True  # type: ignore[attr-defined]
    if getattr(trainer, "rollout_func", None) is not None:
        state.say_once("the trainer has a custom rollout_func (it generates without _generate_single_turn)")
    _warn_idle_steps(trainer, role)
    return state


def _wrap_tool_loop(trainer: Any) -> None:
    loop = getattr(trainer, "_tool_call_loop", None)
    if loop is None:
        return

    @functools.wraps(loop)
    def tool_call_loop(*args: Any, **kwargs: Any) -> Any:
        token = _IN_TOOL_LOOP.set(True)
        try:
            return loop(*args, **kwargs)
        finally:
            _IN_TOOL_LOOP.reset(token)

    trainer._tool_call_loop = tool_call_loop


#: trainer -> the gloo group its ranks vote through, when the default group is not gloo (made once per trainer:
#: the vLLM decision in ``__init__`` and every later vote share it).
_GLOO_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _gloo_group(trainer: Any) -> Any:
    """The process group the ranks of ``trainer`` vote through: the default one when it is gloo, else a gloo
    group made for the trainer (on every rank, outside any generation call, once) — votes are tiny CPU
    tensors, which NCCL would not take."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise SkipConfigError("stepskip: the trainer runs several processes but torch.distributed is not "
                              "initialised; launch with torchrun or accelerate launch")
    if dist.get_backend() == "gloo":
        return None
    group = _GLOO_GROUPS.get(trainer)
    if group is None:
        group = _GLOO_GROUPS[trainer] = dist.new_group(backend="gloo")
    return group


def _highest_of_ranks(values: list[int], group: Any) -> list[int]:
    """Each of ``values`` as the highest any rank holds: one ``all_reduce`` (MAX) through ``group``."""
    import torch
    import torch.distributed as dist

    votes = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in votes.tolist()]


def _warn_idle_steps(trainer: Any, role: TrlGenerateSkip) -> None:
    """Warn about listed steps that never generate (TRL reuses its generation buffer on them)."""
    if not role.enable:
        return
    max_steps = int(getattr(trainer.args, "max_steps", -1) or -1)
    horizon = max_steps if max_steps > 0 else 10_000
    generating = set(generating_steps(trainer.args, horizon))
    idle = [s for s in range(1, horizon + 1) if s in role.step_set and s not in generating]
    if idle:
        shown = ", ".join(map(str, idle[:10])) + (" ..." if len(idle) > 10 else "")
        logger.warning(
            "stepskip: listed step(s) %s never generate (steps_per_generation=%s, num_iterations=%s, "
            "gradient_accumulation_steps=%s: TRL reuses its buffered generation there); nothing is cached for them",
            shown, trainer.args.steps_per_generation, getattr(trainer.args, "num_iterations", 1),
            trainer.args.gradient_accumulation_steps)


# ---------------------------------------------------------------------- vLLM: started only when the run needs it


class NoVLLMGeneration:
    """What ``trainer.vllm_generation`` is when the run starts no vLLM (``engines``: every step replays).

    No ``vllm.LLM`` is built and no server client connects. Generating, or syncing weights before
    generating, raises :class:`~stepskip.errors.EngineNotStartedError` naming the step. In server mode
    the trainer's start-up check of the server's ``logprobs_mode`` (importance-sampling correction)
    has no server to ask: it is told ``processed_logprobs``, the mode it wants, since no sample of
    this run comes from a server.
    """

    def __init__(self, plan: Any, mode: str | None, step: Callable[[], int | None]) -> None:
        self.plan, self.mode, self._step = plan, mode, step
        self.vllm_client = _NoServer() if mode == "server" else None

    def sync_weights(self) -> None:
        raise self.plan.not_started(self._step(), "a weight sync before a vLLM generation (a cache miss)")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise self.plan.not_started(self._step(), "a vLLM generation (a cache miss, or evaluation)")

    @property
    def llm(self) -> Any:
        raise self.plan.not_started(self._step(), "the colocated vLLM engine")


class _NoServer:
    def get_server_info(self) -> dict[str, Any]:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


def engine_steps(args: Any) -> list[int] | None:
    """The optimizer steps of a run that generate, or None when ``max_steps`` does not say how many."""
    max_steps = int(getattr(args, "max_steps", -1) or -1)
    return generating_steps(args, max_steps) if max_steps > 0 else None


def evaluation_need(trainer: Any) -> str | None:
    """Whether the trainer's evaluation will generate during training, and how to turn it off."""
    strategy = str(getattr(getattr(trainer.args, "eval_strategy", "no"), "value",
                           getattr(trainer.args, "eval_strategy", "no")))
    if strategy == "no" or getattr(trainer, "eval_dataset", None) is None:
        return None
    return (f"evaluation generates during training (eval_strategy={strategy!r}); it is never skipped, turn it off "
            "with eval_strategy='no'")


class _VLLMGate:
    """Decides, where ``GRPOTrainer.__init__`` builds its vLLM backend, whether the run needs it."""

    def __init__(self, trainer: Any, skip: Any, identity: RunIdentity | None) -> None:
        self.trainer, self.skip, self.identity = trainer, skip, identity
        self.plan: Any = None

    def build(self, real: Callable[..., Any], **kwargs: Any) -> Any:
        trainer = self.trainer
        identity = self.identity or identity_of(trainer)
        try:
            plan = SkipManager.engine_plan(ROLE, engine_steps(trainer.args), validation=evaluation_need(trainer),
                                           config={"skip": {ROLE: self.skip}}, identity=identity,
                                           runtime={"rank": int(trainer.accelerator.process_index),
                                                    "world_size": int(trainer.accelerator.num_processes)})
            error: SkipConfigError | None = None
            vote = 1 if plan.start else 0
        except SkipConfigError as err:
            plan, error, vote = None, err, 2
        vote = _agree_on_engines(trainer, vote)
        if vote == 2:
            raise error or SkipConfigError(f"skip.{ROLE}.engines: another rank cannot run without vLLM; see its error")
        if vote == 1 and plan is not None and not plan.start:
            logger.info("stepskip: another rank needs vLLM (its cache does not serve every step): starting it here too")
        self.plan = plan
        if vote == 1:
            logger.info("stepskip: starting vLLM (%s)", plan.reason if plan is not None else "another rank needs it")
            return real(**kwargs)
        assert plan is not None  # a vote of 0 is every rank's plan, this one's included
        logger.info("stepskip: vLLM is not started (%s)", plan.reason)
        return NoVLLMGeneration(plan, kwargs.get("mode"), lambda: trainer.state.global_step + 1)


def _agree_on_engines(trainer: Any, vote: int) -> int:
    """The highest vote of every rank (0 no engine, 1 start it, 2 an error)."""
    if int(trainer.accelerator.num_processes) <= 1:
        return vote
    return _highest_of_ranks([vote], _gloo_group(trainer))[0]


class StepskipGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` with stepskip on: ``StepskipGRPOTrainer(*grpo_args, skip={...}, **grpo_kwargs)``.

    With ``use_vllm=True`` (colocate or server mode) it decides, where ``GRPOTrainer`` builds its vLLM
    backend, whether the run needs one (the role's ``engines`` option, see
    :meth:`stepskip.SkipManager.engine_plan`): when the cache serves every step the run will take
    (``max_steps`` must be set for it to know them) and evaluation does not generate during
    training, no ``vllm.LLM`` is built and no server client connects
    (``trainer.vllm_generation`` is a :class:`NoVLLMGeneration`). Replayed steps never move weights
    to vLLM either way. Several ranks agree: vLLM starts on all of them or on none.

    Args:
        skip: the ``trl_generate`` role's section (see :func:`enable_stepskip`).
        identity: override the run identity read from the trainer's args.

    Example:
        >>> trainer = StepskipGRPOTrainer(model=model, args=args, reward_funcs=reward, train_dataset=ds,
        ...     skip={"enable": True, "dump_dir": "/tmp/c", "steps": "1-10"})  # doctest: +SKIP
    """

    def __init__(self, *args: Any, skip: Any, identity: RunIdentity | None = None, **kwargs: Any) -> None:
        import trl.trainer.grpo_trainer as grpo_module

        gate = _VLLMGate(self, skip, identity)
        real = grpo_module.VLLMGeneration
        grpo_module.VLLMGeneration = functools.partial(gate.build, real)  # type: ignore[misc,assignment]
        try:
            super().__init__(*args, **kwargs)
        finally:
            grpo_module.VLLMGeneration = real  # type: ignore[misc]
        state = enable_stepskip(self, skip=skip, identity=identity)
        state.engine_plan = gate.plan
