"""Tables and summaries of pipeline runs (rich output: terminal code, not library code).

``summarize`` compares a recording run with its replaying run; ``run_module`` is the shared
``main`` of ``python -m stepskip.pipelines.<name>``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from stepskip.config import ROLLOUT_ROLES
from stepskip.pipelines.runtime import RunResult, load_config, quiet_torch_notices

__all__ = ["summarize", "steps_table", "run_module"]



def summarize(recorded: RunResult, replayed: RunResult) -> dict[str, Any]:
    """Compare a recording run with a run that replays some of its steps.

    Returns:
        ``rollout_calls_avoided`` (rollout calls served from the cache: steps, or fed samples
        on the fully async path), ``time_saved_s`` (step seconds
        of those steps when generated minus when replayed), ``step_time_ratio`` (mean step time
        of the replayed steps / mean step time of the same steps when generated; None when no
        step was replayed) and ``losses_equal`` (every step's loss identical in both runs).

    Example:
        >>> from stepskip.pipelines.runtime import StepRecord
        >>> a = RunResult("colocated", [StepRecord(1, "generated", 0.2, 0.25, 0.1, 0.5)])
        >>> b = RunResult("colocated", [StepRecord(1, "replayed", 0.01, 0.05, 0.1, 0.5)],
        ...               skip_stats={"skip/rollout/hits": 1.0})
        >>> summarize(a, b)["step_time_ratio"]
        0.2
    """
    before = {r.step: r for r in recorded.records}
    hits = [r for r in replayed.records if r.mode == "replayed" and r.step in before]
    gen_time = sum(before[r.step].step_s for r in hits)
    replay_time = sum(r.step_s for r in hits)
    ratio = round((replay_time / len(hits)) / (gen_time / len(hits)), 4) if hits and gen_time > 0 else None
    avoided = int(sum(replayed.skip_stats.get(f"skip/{role}/hits", 0) for role in ROLLOUT_ROLES))
    return {
        "rollout_calls_avoided": avoided,
        "time_saved_s": round(gen_time - replay_time, 4),
        "step_time_ratio": ratio,
        "losses_equal": len(recorded.records) == len(replayed.records)
        and all(a.loss == b.loss for a, b in zip(recorded.records, replayed.records, strict=True)),
    }


def steps_table(title: str, runs: Sequence[tuple[str, RunResult]]) -> Any:
    """A rich table: one row per (pass, step) with mode, rollout and step seconds, reward and loss."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for name, justify in (("pass", "left"), ("step", "right"), ("rollout", "left"), ("rollout s", "right"),
                          ("step s", "right"), ("reward", "right"), ("loss", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for pass_name, run in runs:
        for r in run.records:
            table.add_row(pass_name, str(r.step), r.mode, f"{r.rollout_s:.3f}", f"{r.step_s:.3f}",
                          f"{r.reward:.3f}", f"{r.loss:+.6f}")
    return table


def run_module(name: str, fit: Callable[[Any], Any], argv: Sequence[str] | None = None) -> int:
    """``python -m stepskip.pipelines.<name> [hydra overrides]``: compose, train, print the steps.

    Args:
        name: the pipeline (config) name.
        fit: builds the trainer from the config and runs it: a trainer class whose instances
            have ``fit() -> RunResult``, or a function ``config -> RunResult``.
        argv: Hydra overrides (default ``sys.argv[1:]``).
    """
    from rich.console import Console

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(f"usage: python -m stepskip.pipelines.{name} [key=value ...]  (Hydra overrides of "
              f"stepskip/pipelines/configs/{name}.yaml)")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_torch_notices()
    config = load_config(name, args)
    runner = fit(config)
    result: RunResult = runner.fit() if hasattr(runner, "fit") else runner
    console = Console()
    console.print(steps_table(f"{name}: {len(result.records)} steps in {result.seconds:.1f}s", [("run", result)]))
    if result.validations:
        console.print("validation scores: " + ", ".join(f"{v:.3f}" for v in result.validations))
    stats = {k: v for k, v in result.skip_stats.items() if v}
    if stats:
        console.print("stepskip: " + ", ".join(f"{k}={v:g}" for k, v in sorted(stats.items())))
    return 0
