"""What stepskip sends to a trainer's experiment tracker: each step's skip metrics and sampled trajectories.

The integrations use it with no code of yours (verl's ``Tracking``, TRL's ``report_to``); a loop of
your own can send the same metrics with :class:`StepMetrics`::

    from stepskip._tracker import StepMetrics

    skip_metrics = StepMetrics()
    for step in range(1, steps + 1):
        SkipManager.set_step(step)
        ...
        tracker.log({**metrics, **skip_metrics.collect(step)}, step=step)

Samples (``log_samples: K`` in a role's section) are picked by the role as it records or replays a
step (:func:`offer_samples`) and wait here until the integration logs that step (:func:`take_samples`).
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepskip._policies import LogMetrics

__all__ = [
    "SHORT_NAMES", "SAMPLE_COLUMNS", "Sample", "StepSamples", "StepMetrics", "select_metrics", "offer_samples",
    "take_samples", "add_rewards", "decoder", "samples_text", "log_wandb", "log_mlflow",
]

logger = logging.getLogger(__name__)

#: The counters of ``log_metrics: short``: what a run's dashboard needs to see skipping at work.
#: ``compared``, ``drifted`` and ``token_match`` exist only for roles under ``action: compare``.
SHORT_NAMES = ("hits", "misses", "saved_seconds", "dump_failures", "corrupt", "compared", "drifted", "token_match")
#: Figures that are a level, not a running count: sent as they are, on the steps that set them.
_LEVELS = {"token_match": "compared"}
#: The columns of a samples table, in order.
SAMPLE_COLUMNS = ("step", "source_step", "origin", "row", "prompt", "response", "reward")
# Steps of samples kept for an integration that has not logged them yet (a run logging nothing keeps no more).
_PENDING_STEPS = 16


def _split(key: str) -> tuple[str, str] | None:
    """``("rollout", "hits")`` for ``"skip/rollout/hits"``; None for a key of another shape."""
    if not key.startswith("skip/"):
        return None
    role, _, name = key[len("skip/"):].rpartition("/")
    return (role, name) if role and name else None


def _role_modes() -> dict[str, LogMetrics]:
    from stepskip._manager import SkipManager

    modes = {}
    for name, skip in SkipManager.skip_instances.items():
        value = getattr(getattr(skip, "config", None), "log_metrics", LogMetrics.SHORT)
        modes[name] = value if isinstance(value, LogMetrics) else LogMetrics.SHORT
    return modes


def select_metrics(stats: Mapping[str, float], modes: Mapping[str, LogMetrics] | None = None) -> dict[str, float]:
    """The part of ``stats`` (``SkipManager.stats()``) that each role's ``log_metrics`` sends.

    Args:
        stats: ``{"skip/{role}/{name}": value}``.
        modes: ``log_metrics`` per role; default: read from the roles of the current run.

    Returns:
        The kept items, in their order in ``stats``.

    Example:
        >>> select_metrics({"skip/rollout/hits": 2.0, "skip/rollout/bytes_read": 9.0}, {"rollout": LogMetrics.SHORT})
        {'skip/rollout/hits': 2.0}
    """
    modes = _role_modes() if modes is None else modes
    out: dict[str, float] = {}
    for key, value in stats.items():
        parts = _split(key)
        if parts is None:
            continue
        mode = modes.get(parts[0], LogMetrics.SHORT)
        if mode is LogMetrics.FULL or (mode is LogMetrics.SHORT and parts[1] in SHORT_NAMES):
            out[key] = value
    return out


class StepMetrics:
    """Each step's skip metrics for a tracker: what ``SkipManager.stats()`` counted since the last step sent.

    Counters become per-step deltas (hits of that step, seconds saved on that step ...); a level
    (``token_match``, the last compared step's figure) is sent on the steps that compared something.
    Which counters: each role's ``log_metrics``. A new run (``SkipManager.init``) starts from zero.
    A dump that fails in the background is counted on the step during which it failed.

    Example:
        >>> metrics = StepMetrics()
        >>> metrics.collect(1)  # {} before SkipManager.init, or with every role off
        {}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._run: str | None = None
        self._last: dict[str, float] = {}
        self._step: int | None = None

    def collect(self, step: int | None = None) -> dict[str, float]:
        """The metrics to send with the tracker's line for ``step``.

        Args:
            step: the step being logged. A second call for the same step returns only what changed
                since the first (an empty dict when nothing did), so that a trainer logging several
                lines per step sends each count once.

        Returns:
            ``{"skip/{role}/{name}": value}``; empty when no role is enabled.
        """
        from stepskip._manager import SkipManager

        stats = SkipManager.stats()
        if not stats:
            return {}
        with self._lock:
            if SkipManager.run_id != self._run:
                self._run, self._last, self._step = SkipManager.run_id, {}, None
            last = self._last
            changed = any(value != last.get(key, 0.0) for key, value in stats.items()
                          if (_split(key) or ("", ""))[1] not in _LEVELS)
            if step is not None and step == self._step and not changed:
                return {}
            self._step = step
            out: dict[str, float] = {}
            for key, value in select_metrics(stats).items():
                role, name = _split(key) or ("", "")
                counter = _LEVELS.get(name)
                if counter is None:
                    out[key] = value - last.get(key, 0.0)
                elif stats.get(f"skip/{role}/{counter}", 0.0) > last.get(f"skip/{role}/{counter}", 0.0):
                    out[key] = value
            self._last = dict(stats)
        return out


# ---------------------------------------------------------------------- samples


@dataclass
class Sample:
    """One trajectory of a step as the tracker shows it.

    Args:
        row: its row in the step's batch.
        prompt: the prompt's token ids (padding left out), or its text.
        response: the response's token ids (padding left out), or its text.
        reward: its reward, when the batch carries one (verl's ``rm_scores`` summed) or the trainer
            computes one (TRL's weighted reward functions); else None.
    """

    row: int
    prompt: Any
    response: Any
    reward: float | None = None


@dataclass
class StepSamples:
    """The sampled trajectories of one recorded or replayed call.

    Args:
        role: the role's name.
        step: the step that called.
        source_step: the step whose entry it replayed (``step`` itself when generated).
        replayed: served from the cache (else generated, and recorded).
        rows: the trajectories, in row order.
    """

    role: str
    step: int
    source_step: int
    replayed: bool
    rows: list[Sample] = field(default_factory=list)
    rewarded: bool = field(default=False, repr=False)  # rewards came from the trainer (add_rewards)

    @property
    def origin(self) -> str:
        return "replayed" if self.replayed else "generated"

    @property
    def key(self) -> str:
        """The tracker key: ``skip/{role}/samples``."""
        return f"skip/{self.role}/samples"

    def table(self, decode: Callable[[Any], str]) -> list[list[Any]]:
        """One list per trajectory, in :data:`SAMPLE_COLUMNS` order, texts decoded."""
        return [[self.step, self.source_step, self.origin, sample.row, decode(sample.prompt), decode(sample.response),
                 sample.reward] for sample in self.rows]

    def records(self, decode: Callable[[Any], str]) -> list[dict[str, Any]]:
        """One mapping per trajectory, keyed by :data:`SAMPLE_COLUMNS`."""
        return [dict(zip(SAMPLE_COLUMNS, row)) for row in self.table(decode)]


_pending: deque[StepSamples] = deque(maxlen=_PENDING_STEPS)
_pending_lock = threading.Lock()


def offer_samples(role: Any, step: int, source_step: int, value: Any, prompts: Any, replayed: bool) -> None:
    """Keep ``log_samples`` trajectories of a call's result for the tracker; a role calls it on each
    recorded or replayed call. Does nothing when the role's ``log_samples`` is 0; never raises.

    The rows are drawn reproducibly from the role's ``seed`` and ``step``, so that a step's
    recording and its replay show the same trajectories.

    Args:
        role: the role (its ``name`` and ``config.log_samples``, ``config.seed`` are read).
        step: the step that called.
        source_step: the step whose entry served it (``step`` when generated).
        value: the call's result: a DataProto-like batch (``prompts``, ``responses`` and masks;
            ``rm_scores`` when present) or ``(completion_ids, ...)`` rows of token ids.
        prompts: the call's prompts (the rows of prompt ids when ``value`` holds only completions).
        replayed: whether the cache served it.
    """
    config = getattr(role, "config", None)
    count = getattr(config, "log_samples", 0)
    if not isinstance(count, int) or count <= 0:
        return
    try:
        rows = _sample_rows(value, prompts, count, random.Random(int(getattr(config, "seed", 0)) * 1_000_003 + step))
    except Exception as err:  # samples are a view of the run: never a reason for it to fail
        logger.warning("stepskip: no samples of step %d for the tracker: %s: %s", step, type(err).__name__, err)
        return
    if rows:
        with _pending_lock:
            _pending.append(StepSamples(str(getattr(role, "name", "")), int(step), int(source_step), replayed, rows))


def take_samples(step: int | None = None) -> list[StepSamples]:
    """The samples waiting for the tracker (those of steps up to ``step``, or all), removed from the queue.

    Example:
        >>> take_samples(3)
        []
    """
    with _pending_lock:
        taken = [s for s in _pending if step is None or s.step <= step]
        kept = [s for s in _pending if not (step is None or s.step <= step)]
        _pending.clear()
        _pending.extend(kept)
    return taken


def add_rewards(role: str, rewards: Sequence[float]) -> bool:
    """Give the newest samples of ``role`` still without rewards the reward of their rows.

    For trainers that compute rewards after the cached call (TRL). ``rewards`` holds one value per row
    of that call's result; NaN (no reward function scored the row) is kept as None.

    Returns:
        True when samples took them.
    """
    with _pending_lock:
        for samples in reversed(_pending):
            if samples.role != role or samples.rewarded or any(s.reward is not None for s in samples.rows):
                continue
            if any(s.row >= len(rewards) for s in samples.rows):
                return False
            for sample in samples.rows:
                value = float(rewards[sample.row])
                sample.reward = None if math.isnan(value) else value
            samples.rewarded = True
            return True
    return False


def _sample_rows(value: Any, prompts: Any, count: int, rng: random.Random) -> list[Sample]:
    from stepskip._calls import is_dataproto_like

    if is_dataproto_like(value):
        return _batch_rows(value, count, rng)
    if isinstance(value, (tuple, list)) and value and _is_id_rows(value[0]):
        completions = list(value[0])
        prompt_rows = list(prompts) if _is_id_rows(prompts) and len(prompts) == len(completions) else None
        picked = _pick(len(completions), count, rng)
        return [Sample(i, list(prompt_rows[i]) if prompt_rows is not None else None, list(completions[i]))
                for i in picked]
    return []


def _is_id_rows(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(row, (list, tuple)) for row in value[:4])


def _pick(rows: int, count: int, rng: random.Random) -> list[int]:
    return sorted(rng.sample(range(rows), min(count, rows)))


def _batch_rows(value: Any, count: int, rng: random.Random) -> list[Sample]:
    """Rows of a verl-style batch: left-padded ``prompts``, right-padded ``responses``, their masks."""
    tensors = value.batch
    if tensors is None:
        return []
    keys = set(tensors.keys())
    if not {"prompts", "responses"} <= keys:
        return []
    prompts, responses = tensors["prompts"], tensors["responses"]
    rows = int(prompts.shape[0])
    width = int(prompts.shape[-1])
    attention = tensors["attention_mask"] if "attention_mask" in keys else None
    response_mask = tensors["response_mask"] if "response_mask" in keys else None
    scores = tensors["rm_scores"] if "rm_scores" in keys else None
    out = []
    for i in _pick(rows, count, rng):
        prompt = prompts[i]
        response = responses[i]
        if attention is not None:
            prompt = prompt[attention[i, :width].bool()]
            response = response[attention[i, width:width + response.shape[-1]].bool()]
        elif response_mask is not None:
            response = response[response_mask[i].bool()]
        reward = float(scores[i].sum()) if scores is not None else None
        out.append(Sample(i, prompt.tolist(), response.tolist(), reward))
    return out


# ---------------------------------------------------------------------- rendering and backends


def decoder(tokenizer: Any = None) -> Callable[[Any], str]:
    """How samples become text: ``tokenizer.decode`` on token ids when a tokenizer is given (its
    ``tokenizer`` when it is a processor), else the ids themselves; text stays text.

    Example:
        >>> decoder()([5, 6])
        '[5, 6]'
    """
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    decode = getattr(tokenizer, "decode", None)

    def text(ids: Any) -> str:
        if ids is None:
            return ""
        if isinstance(ids, str):
            return ids
        if decode is not None:
            try:
                return str(decode(list(ids), skip_special_tokens=False))
            except Exception:  # a tokenizer that cannot read these ids: show the ids
                pass
        return str(list(ids))

    return text


def samples_text(samples: StepSamples, decode: Callable[[Any], str], indent: str = "") -> str:
    """Plain text of one call's samples (TensorBoard's text panel takes it indented by four spaces:
    shown as written, never read as Markdown)."""
    head = (f"{samples.key}: step {samples.step}, replayed from step {samples.source_step}" if samples.replayed
            else f"{samples.key}: step {samples.step}, generated")
    lines = [head]
    for row in samples.table(decode):
        _, _, _, index, prompt, response, reward = row
        lines.append(f"row {index}" + (f", reward {reward:g}" if reward is not None else ""))
        lines.append(f"  prompt: {prompt}")
        lines.append(f"  response: {response}")
    return "\n".join(indent + line for line in lines)


def log_wandb(wandb: Any, samples: StepSamples, decode: Callable[[Any], str], step: int | None = None,
              commit: bool | None = None) -> None:
    """Log the samples as a ``wandb.Table`` under ``skip/{role}/samples`` (``wandb`` is the module or a
    module of the same API).

    Args:
        step: the tracker step to log at (None: W&B's current one).
        commit: passed to ``wandb.log`` (False: joins the line the trainer commits next).
    """
    table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=samples.table(decode))
    kwargs: dict[str, Any] = {}
    if step is not None:
        kwargs["step"] = step
    if commit is not None:
        kwargs["commit"] = commit
    wandb.log({samples.key: table}, **kwargs)


def log_mlflow(samples: StepSamples, decode: Callable[[Any], str]) -> str:
    """Log the samples as an MLflow table artifact of the active run; returns the artifact's path,
    ``stepskip/samples/{role}/step_{step:06d}.json``."""
    import mlflow

    path = f"stepskip/samples/{samples.role}/step_{samples.step:06d}.json"
    columns: dict[str, list[Any]] = {name: [] for name in SAMPLE_COLUMNS}
    for row in samples.table(decode):
        for name, item in zip(SAMPLE_COLUMNS, row):
            columns[name].append(item)
    mlflow.log_table(data=columns, artifact_file=path)
    return path
