"""``stepskip demo``: run a reference pipeline twice on one cache — record, then replay — and compare.

The first pass generates every step and records the chosen ones; the second replays them (and
generates the rest). Printed per pipeline: a table of both passes (generated / replayed, rollout
seconds, step seconds, reward, loss), a summary — rollout calls avoided, time saved, the
step-time ratio and whether the replaying pass reproduced the recording pass's losses exactly —
and one recorded trajectory as text. The colocated pipeline records its reward stage
(``skip.reward``) on the same steps, so the cache holds each trajectory's reward.

``--dump-dir D`` keeps the cache: ``D`` is a dump dir (each pipeline under its own
``{experiment}_{project}`` directory) that ``stepskip ls D``, ``show`` and ``view D`` open as it is;
they show its prompts and responses as text (:mod:`stepskip.pipelines.tokenizer`).

Usage::

    stepskip demo                      # the V1 pipeline (role rollout_tq: what verl's main_ppo runs)
    stepskip demo --all --json out.json
    stepskip demo --pipeline v1 --steps 8 --replay-steps 1-6 trainer.v1.trainer_mode=separate_async

Trailing ``key=value`` arguments are Hydra overrides applied to every pipeline run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from stepskip.pipelines.runtime import PIPELINES, RunResult, load_config, quiet_torch_notices

__all__ = ["main", "run_demo", "ROLES"]

#: The skip role each pipeline's rollout goes through.
ROLES = {"colocated": "rollout", "v1": "rollout_tq", "fully_async": "async_rollout"}
#: The order the demo runs and prints them: verl's default trainer (V1, ``rollout_tq``) first.
DEMO_ORDER = ("v1", *(name for name in PIPELINES if name != "v1"))


def _runner(pipeline: str) -> Callable[[Any], RunResult]:
    if pipeline == "colocated":
        from stepskip.pipelines.colocated import ColocatedTrainer

        return lambda config: ColocatedTrainer(config).fit()
    if pipeline == "v1":
        from stepskip.pipelines.v1 import run

        return run
    from stepskip.pipelines.fully_async import run as run_async

    return run_async


def _parse_steps(spec: str, total: int) -> list[int]:
    """``"1-4"``, ``"1,3,5"`` or ``"all"`` as trainer steps within ``1..total``."""
    if spec.strip().lower() == "all":
        return list(range(1, total + 1))
    steps: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            steps.update(range(lo, hi + 1))
        elif part:
            steps.add(int(part))
    bad = sorted(s for s in steps if not 1 <= s <= total)
    if bad:
        raise ValueError(f"--replay-steps {spec!r}: steps {bad} are outside 1..{total}")
    return sorted(steps)


def _skip_overrides(pipeline: str, config_steps: list[int], dump_dir: str, batch_size: int,
                    stages: Sequence[str] = ()) -> list[str]:
    """The ``skip.<role>`` overrides that record/replay ``config_steps`` (feed indices for fully_async), and the
    same trainer steps of the config's stage roles (``stages``: the colocated reward), whose entries follow
    the rollout's ``dump_dir``."""
    role = ROLES[pipeline]
    if pipeline == "fully_async":  # the async role's steps are feed indices: trainer step s eats B samples
        keys = sorted({i for s in config_steps for i in range((s - 1) * batch_size, s * batch_size)})
    else:
        keys = config_steps
    out = [f"skip.{role}.enable=true", f"skip.{role}.dump_dir={dump_dir}", f"skip.{role}.action=cache",
           f"skip.{role}.steps=[{','.join(str(k) for k in keys)}]"]
    for stage in stages:
        out += [f"skip.{stage}.enable=true", f"skip.{stage}.action=cache",
                f"skip.{stage}.steps=[{','.join(str(s) for s in config_steps)}]"]
    return out


def stage_roles(config: Any) -> list[str]:
    """The generic stage roles a pipeline config declares (``skip.<name>.kind: stage``)."""
    return [str(name) for name, section in config.skip.items() if section.get("kind") == "stage"]


def experiment_dir(pipeline: str, config: Any, dump_dir: str | None = None) -> str:
    """The ``{experiment}_{project}`` directory a pipeline's run records into (under ``dump_dir``, default the
    dump dir of the pipeline's role in ``config``)."""
    from stepskip._layout import Layout

    root = str(config.skip[ROLES[pipeline]].dump_dir) if dump_dir is None else dump_dir
    return Layout.from_config(root, config).experiment_dir


def run_demo(pipeline: str, steps: int, replay_steps: list[int], dump_dir: str,
             overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Record then replay one pipeline; the JSON-ready result (``pipeline``, ``steps``, ``summary``).

    Example:
        >>> out = run_demo("colocated", 2, [1], tempfile.mkdtemp(), ["data.max_response_length=8"])
        >>> [(s["pass"], s["step"], s["mode"]) for s in out["steps"]]
        [('record', 1, 'generated'), ('record', 2, 'generated'), ('replay', 1, 'replayed'), ('replay', 2, 'generated')]
    """
    from stepskip.pipelines.report import summarize

    base = [f"trainer.total_training_steps={steps}", f"trainer.test_freq={max(1, steps // 2)}", *overrides]
    probe = load_config(pipeline, base)
    # the caller's overrides come last: they may retarget the cache (skip.<role>.dump_dir=...) or the action
    config = load_config(pipeline, [*base, *_skip_overrides(pipeline, replay_steps, dump_dir,
                                                             int(probe.data.train_batch_size), stage_roles(probe)),
                                    *overrides])
    run = _runner(pipeline)
    passes = [("record", run(config)), ("replay", run(config))]
    rows = [{"pass": name, "step": r.step, "mode": r.mode, "rollout_s": round(r.rollout_s, 4),
             "step_s": round(r.step_s, 4), "reward": round(r.reward, 4), "loss": r.loss}
            for name, result in passes for r in result.records]
    summary = summarize(passes[0][1], passes[1][1])
    return {"pipeline": pipeline, "steps": rows, "summary": summary,
            "_runs": passes, "_replay_steps": replay_steps, "_cache_dir": experiment_dir(pipeline, config)}


@contextlib.contextmanager
def _dump_root(path: str | None) -> Iterator[str]:
    if path is None:
        tmp = tempfile.mkdtemp(prefix="stepskip-demo-")
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    root = Path(path).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    yield str(root)


def _check_apart(pipelines: Sequence[str], overrides: Sequence[str]) -> None:
    """Refuse pipelines that would record into one experiment directory (one dump dir holds them all).

    Raises:
        ValueError: two pipelines share ``trainer.experiment_name`` and ``trainer.project_name``.
    """
    if len(pipelines) < 2:
        return
    seen: dict[str, str] = {}
    for pipeline in pipelines:
        name = os.path.basename(experiment_dir(pipeline, load_config(pipeline, list(overrides)), dump_dir="/"))
        if name in seen:
            raise ValueError(f"pipelines {seen[name]} and {pipeline} would record into one experiment directory "
                             f"({name}): drop the trainer.experiment_name override, or run them one at a time")
        seen[name] = pipeline


def _dir_size(path: str) -> tuple[int, int]:
    entries, size = 0, 0
    for dirpath, _, files in os.walk(path):
        if "meta.json" in files:
            entries += 1
        size += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return entries, size


def _print_result(console: Any, result: dict[str, Any]) -> bool:
    from stepskip.pipelines.report import steps_table

    runs = result["_runs"]
    summary = result["summary"]
    replayed = runs[1][1]
    entries, size = _dir_size(result["_cache_dir"])
    console.print(steps_table(f"{result['pipeline']} (role {ROLES[result['pipeline']]})", runs))
    wanted = set(result["_replay_steps"])
    generated_on_replayed = sorted(s for s in replayed.generated_train_steps if s in wanted)
    ratio = summary["step_time_ratio"]
    validations = sum(1 for _, v in replayed.generation_calls if v)
    console.print(f"  rollout calls avoided: {summary['rollout_calls_avoided']}    "
                  f"time saved: {summary['time_saved_s']:.2f} s    "
                  f"step-time ratio: {'n/a' if ratio is None else f'{ratio:.2f}x'}")
    console.print(f"  losses equal: {'yes' if summary['losses_equal'] else 'NO'}    "
                  f"generation on replayed steps: {generated_on_replayed or 'none'}")
    console.print(f"  validation: {validations} run{'s' * (validations != 1)} in pass 2, all generated    "
                  f"cache: {entries} entr{'y' if entries == 1 else 'ies'}, {size / 1024:.0f} KiB")
    if (line := _sample_line(result)) is not None:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    return summary["losses_equal"] and not generated_on_replayed


def _sample_line(result: dict[str, Any]) -> str | None:
    """One recorded trajectory as ``stepskip view`` shows it (text, and the reward when a stage recorded it)."""
    from stepskip.view.data import ViewError, ViewSource

    role = ROLES[result["pipeline"]]
    try:
        source = ViewSource(result["_cache_dir"])
        listing = source.listing()
        run = listing["runs"][0]["name"]
        step = next(s["step"] for r in listing["runs"][0]["roles"] if r["role"] == role for s in r["steps"])
        row = source.step_page(run, role, step, limit=1)["rows"][0]
    except (ViewError, IndexError, StopIteration, OSError) as err:  # nothing recorded: nothing to show
        logging.getLogger(__name__).debug("no recorded trajectory to show: %s", err)
        return None
    reward = "" if row.get("reward") is None else f", reward {row['reward']:.3f}"
    return f"  recorded at step {step}: prompt {row.get('prompt')!r} -> response {row.get('response')!r}{reward}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``stepskip demo`` (the CLI forwards its arguments here).

    Returns:
        0 when every pipeline replayed its chosen steps without generating and reproduced the
        recorded losses exactly; 1 otherwise; 2 on bad arguments.
    """
    parser = argparse.ArgumentParser(
        prog="stepskip demo",
        description="Run a reference RL pipeline twice on one cache (record, then replay) and compare the passes.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  stepskip demo\n  stepskip demo --all --json demo.json\n"
               "  stepskip demo --pipeline v1 trainer.v1.trainer_mode=separate_async")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--pipeline", choices=DEMO_ORDER, default="v1",
                       help="pipeline to run (default v1: verl's V1 trainer, role rollout_tq, what main_ppo runs)")
    which.add_argument("--all", action="store_true", help="run the three pipelines one after another")
    parser.add_argument("--steps", type=int, default=6, help="training steps per pass (default 6)")
    parser.add_argument("--replay-steps", default="1-4",
                        help='steps recorded in pass 1 and replayed in pass 2: "1-4", "1,3", "all" (default 1-4)')
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--dump-dir", help="record into this (empty) directory and keep it: a dump dir to open "
                        "with stepskip ls/view (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="show stepskip's log lines (hits, misses, dumps)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. data.max_response_length=64")
    try:
        args = parser.parse_args(list(argv) if argv is not None else None)
        if args.steps < 1:
            parser.error("--steps must be >= 1")
        replay_steps = _parse_steps(args.replay_steps, args.steps)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except ValueError as err:
        parser.print_usage()
        print(f"stepskip demo: {err}")
        return 2
    if args.dump_dir and Path(args.dump_dir).expanduser().is_dir() and any(Path(args.dump_dir).expanduser().iterdir()):
        print(f"stepskip demo: --dump-dir {args.dump_dir} is not empty; the demo records into an empty directory")
        return 2

    from rich.console import Console

    console = Console()
    logging.getLogger("stepskip").setLevel(logging.INFO if args.verbose else logging.WARNING)
    quiet_torch_notices()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    pipelines = list(DEMO_ORDER) if args.all else [args.pipeline]
    try:
        _check_apart(pipelines, args.overrides)
    except ValueError as err:
        print(f"stepskip demo: {err}")
        return 2
    results, ok = [], True
    started = time.perf_counter()
    with _dump_root(args.dump_dir) as root, contextlib.ExitStack() as stack:
        console.print(f"cache directory: {root}" + ("" if args.dump_dir else " (temporary)"))
        if "fully_async" in pipelines:  # one Ray for all async passes (start-up costs seconds)
            from stepskip.pipelines.fully_async import ray_session

            console.print("starting Ray for the fully async pipeline ...")
            stack.enter_context(ray_session(2))
        for pipeline in pipelines:  # one dump dir: each pipeline records under its own experiment directory
            console.print(f"\n[bold]{pipeline}[/bold]: {args.steps} steps; pass 1 records steps "
                          f"{args.replay_steps}, pass 2 replays them")
            result = run_demo(pipeline, args.steps, replay_steps, root, args.overrides)
            ok = _print_result(console, result) and ok
            results.append(result)
    verdict = "replayed steps skipped generation, losses reproduced" if ok else "CHECK FAILED"
    console.print(f"\ndemo finished in {time.perf_counter() - started:.1f} s: {verdict}")
    if args.dump_dir:
        shown = shlex.quote(str(Path(args.dump_dir).expanduser()))
        console.print(f"look at the cache: stepskip ls {shown}    stepskip view {shown}", soft_wrap=True,
                      markup=False, highlight=False)
    if args.json:
        payload = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
