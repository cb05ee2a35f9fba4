"""``stepskip rerun``: call a function on a stage's recorded inputs, compare with its recorded output
(registered in :mod:`stepskip.cli.app`; the work is :func:`stepskip.rerun.rerun_stage`)."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from stepskip.cli import render

__all__ = ["rerun_command", "rerun_json"]

StorageOptions = Annotated[Optional[list[str]], typer.Option(
    "--storage-option", "-o", metavar="KEY=VALUE", show_default=False,
    help="An fsspec option for URL caches, repeatable (anon=true, client_kwargs.endpoint_url=http://host:9000).")]


def rerun_json(report: Any) -> dict[str, Any]:
    """The report as JSON: every step's figures, and the first divergence."""
    first = report.first_divergence
    return {
        "stage": report.stage, "passed": report.passed, "skipped_without_inputs": report.skipped,
        "first_divergence": None if first is None else {"run": first.run, "step": first.step, "field": first.field,
                                                         "row": first.row, "error": first.error},
        "steps": [{"run": s.run, "step": s.step, "path": s.path, "passed": s.passed, "field": s.field, "row": s.row,
                   "error": s.error, "record": s.record} for s in report.steps],
    }


def _line(step: Any) -> str:
    if step.error is not None:
        return f"step {step.step}  [bold red]FAILED[/]  {escape(step.error)}"
    record = step.record or {}
    worst = (record.get("fields") or {}).get(step.field or "") or {}
    figures = [f"worst field {escape(repr(step.field))}" if step.field else "no field on both sides"]
    if worst.get("match") is not None:
        figures.append(f"match {worst['match']:.4g}")
    if worst.get("max_delta") is not None:
        figures.append(f"max |delta| {worst['max_delta']:.4g}")
    if record.get("token_match") is not None:
        figures.append(f"token match {record['token_match']:.4g}")
    verdict = "[green]pass[/]" if step.passed else "[bold red]DIVERGED[/]"
    where = "" if step.passed or step.row is None else f"  (first at row {step.row})"
    return f"step {step.step}  {verdict}  {', '.join(figures)}{where}"


def rerun_command(
    dump_dir: Annotated[str, typer.Argument(metavar="DUMP_DIR", show_default=False, help="The cache: a dump_dir, an "
                                            "experiment or run directory; a local path or a URL.")],
    stage: Annotated[str, typer.Option("--stage", show_default=False, help="The stage role whose steps to re-run "
                                       "(its key under skip, recorded with record_inputs: true).")],
    fn: Annotated[str, typer.Option("--fn", show_default=False, metavar="MODULE_OR_FILE:FUNC",
                                    help="The function to call: module:function or path/to/file.py:function.")],
    steps: Annotated[Optional[str], typer.Option("--steps", help='Only these steps: "3", "1-5,8", "10-100:10" (the '
                                                 'syntax of skip.<role>.steps).')] = None,
    rtol: Annotated[float, typer.Option("--rtol", min=0.0, help="Relative tolerance of float elements.")] = 1e-5,
    atol: Annotated[float, typer.Option("--atol", min=0.0, help="Absolute tolerance of float elements.")] = 1e-8,
    min_match: Annotated[float, typer.Option("--min-match", min=0.0, max=1.0, help="The least share of a field that "
                                             "must match for a step to pass.")] = 1.0,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickle-based outputs through the "
                                               "allow-list unpickler.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    options: StorageOptions = None,
) -> None:
    """Re-run a recorded stage offline: call a function on each step's recorded inputs, compare with its output.

    The stage must have been recorded with record_inputs: true. Each step's function is called with
    the recorded call's arguments after the method's self, positional and keyword, on this machine
    (no trainer, no Ray), and its result is compared with the recorded one as action: compare does:
    token match for integer tensors, elements within --rtol/--atol for float tensors, equal rows
    for other columns. One line per step; on a divergence, the first divergent step, row and field.
    Exit code 0 when every step matches, 1 on a divergence, 2 on a usage error.

    [bold]Examples[/]
      stepskip rerun /data/dump --stage reward --fn my_rewards:compute
      stepskip rerun /data/dump --stage reward --fn path/to/rewards.py:compute --rtol 1e-4 --atol 1e-6
      stepskip rerun /data/dump --stage advantage --fn stepskip.rerun:grpo_advantages --steps 1-10 --json
    """
    from stepskip.cli.app import storage_options
    from stepskip.rerun import rerun_stage

    report = rerun_stage(dump_dir, stage, fn, steps=steps, rtol=rtol, atol=atol, min_match=min_match,
                         allow_pickle=allow_pickle, storage_options=storage_options(options))
    if as_json:
        render.print_json(rerun_json(report))
    else:
        runs = {s.run for s in report.steps}
        for step in report.steps:
            prefix = f"{escape(step.run)} " if len(runs) > 1 else ""
            render.out.print(prefix + _line(step))
        if report.skipped:
            render.out.print(f"[yellow]recorded without inputs (not re-run): steps "
                             f"{', '.join(map(str, report.skipped))}[/]")
        first = report.first_divergence
        if first is None:
            render.out.print(f"all {len(report.steps)} steps of {escape(stage)} match their recording")
        elif first.error is not None:
            render.out.print(f"first divergence: step {first.step}: {escape(first.error)}")
        else:
            render.out.print(f"first divergence: step {first.step}, row {first.row}, field {escape(repr(first.field))}")
    raise typer.Exit(0 if report.passed else 1)
