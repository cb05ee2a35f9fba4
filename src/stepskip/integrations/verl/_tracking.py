"""stepskip in verl's experiment tracking: ``verl.utils.tracking.Tracking.log`` also sends the step's skip data.

verl's trainers send each step's metrics through ``Tracking.log(data, step)``, which fans them out to
every backend of ``trainer.logger`` (console, wandb, mlflow, tensorboard, file, ...). Wrapped by
:func:`install`, each call also carries the step's skip metrics (:class:`stepskip._tracker.StepMetrics`:
per-step deltas of ``SkipManager.stats()``, as each role's ``log_metrics`` chooses), so every backend
receives them with no code of the user's. After the call, the sampled trajectories of the steps
logged (``log_samples``) go to the backends that take them: a table to W&B and MLflow, text to
TensorBoard, the console and the file logger.

The class is patched when ``verl.utils.tracking`` is first imported (through the finder
:func:`stepskip.integrations.verl.install` puts on ``sys.meta_path``, which applies every patch of
:func:`~stepskip.integrations.verl._served.after_import_patches`; nothing of verl is imported here),
or at once by ``install()`` when it already was. Skip counters are per process: the
metrics are those of the process that logs, where verl's ``RayPPOTrainer`` and the V1 trainer
run their rollout calls; the fully async Rollouter counts in its own actor (its summary line).
"""

from __future__ import annotations

import functools
import logging
import operator
import sys
import weakref
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from stepskip import _tracker as tracker

logger = logging.getLogger(__name__)

MODULE = "verl.utils.tracking"
# Marks verl's Tracking.log once wrapped (so that install() twice, or a reload, wraps once).
MARKER = "__stepskip_tracking__"

_feeds: weakref.WeakKeyDictionary[Any, tracker.StepMetrics] = weakref.WeakKeyDictionary()
_said: set[str] = set()


def patch(module: ModuleType) -> bool:
    """Wrap ``module.Tracking.log``; False when the module has no such class (another verl)."""
    cls = getattr(module, "Tracking", None)
    log = getattr(cls, "log", None)
    if cls is None or not callable(log):
        logger.warning("stepskip: %s has no Tracking.log; skip metrics are not sent to verl's trackers", MODULE)
        return False
    if getattr(log, MARKER, False):
        return True
    cls.log = _wrap(log)
    return True


def _wrap(log: Any) -> Any:
    @functools.wraps(log)
    def tracking_log(self: Any, data: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
        number = _step_number(step)
        extra = _metrics(self, number)
        result = log(self, {**data, **extra} if extra and isinstance(data, dict) else data, step, *args, **kwargs)
        if number is not None:
            _send_samples(self, number, kwargs.get("backend", args[0] if args else None), sys._getframe(1))
        return result

    setattr(tracking_log, MARKER, True)
    return tracking_log


def _step_number(step: Any) -> int | None:
    """The step as an int (numpy integers too); None for a step that is not an integer."""
    try:
        return operator.index(step)
    except TypeError:
        return None


def _metrics(tracking: Any, step: int | None) -> dict[str, float]:
    try:
        feed = _feeds.get(tracking)
        if feed is None:
            feed = _feeds[tracking] = tracker.StepMetrics()
        return feed.collect(step)
    except Exception as err:  # a metrics problem never stops training
        _say_once("metrics", "stepskip: skip metrics left out of verl's tracking: %s: %s", type(err).__name__, err)
        return {}


def _send_samples(tracking: Any, step: int, backends: Sequence[str] | None, caller: Any) -> None:
    """Send the waiting samples of steps up to ``step`` to each backend of this ``Tracking``."""
    samples = tracker.take_samples(step)
    if not samples:
        return
    decode = tracker.decoder(_trainer_tokenizer(caller))
    for name, instance in dict(getattr(tracking, "logger", {}) or {}).items():
        if backends is not None and name not in backends:
            continue
        try:
            _send(name, instance, samples, step, decode)
        except Exception as err:  # a backend that refuses them never stops training
            _say_once(f"send:{name}", "stepskip: rollout samples not sent to verl's %s backend: %s: %s", name,
                      type(err).__name__, err)


def _trainer_tokenizer(frame: Any) -> Any:
    """The tokenizer of the trainer that called ``log``: verl's trainers call it from their own methods, so
    the nearest caller whose ``self`` has a ``tokenizer`` is the trainer (a few frames up at most)."""
    for _ in range(6):
        if frame is None:
            return None
        tokenizer = getattr(frame.f_locals.get("self"), "tokenizer", None)
        if tokenizer is not None:
            return tokenizer
        frame = frame.f_back
    return None


def _send(name: str, instance: Any, samples: list[tracker.StepSamples], step: int, decode: Any) -> None:
    if name in ("wandb", "vemlp_wandb") and hasattr(instance, "Table"):
        for each in samples:
            tracker.log_wandb(instance, each, decode, step=step)
    elif name == "mlflow":
        for each in samples:
            tracker.log_mlflow(each, decode)
    elif name == "tensorboard" and hasattr(getattr(instance, "writer", None), "add_text"):
        for each in samples:
            instance.writer.add_text(each.key, tracker.samples_text(each, decode, indent="    "), step)
        instance.writer.flush()
    elif name == "console":
        for each in samples:
            logger.info("%s", tracker.samples_text(each, decode))
    elif name == "file":
        for each in samples:
            instance.log(data={each.key: each.records(decode)}, step=step)
    else:
        _say_once(f"unsupported:{name}", "stepskip: rollout samples are not sent to verl's %s backend (tables go to "
                  "wandb and mlflow, text to tensorboard, console and file)", name)


def _say_once(key: str, message: str, *args: Any) -> None:
    if key not in _said:
        _said.add(key)
        logger.warning(message, *args)
