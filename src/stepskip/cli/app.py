"""The typer application: arguments in, library calls, rendering out (see :mod:`stepskip.cli.render`)."""

from __future__ import annotations

import enum
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.markup import escape

from stepskip._version import __version__
from stepskip.cli import render
from stepskip.cli.errors import CliError
from stepskip.config import SkipRoleConfig

__all__ = ["app"]

DEFAULT_DUMP_DIR: str = SkipRoleConfig.dump_dir

app = typer.Typer(
    name="stepskip",
    help="Inspect, verify, prune, convert and show rollout caches written by stepskip or verl.",
    epilog="Run `stepskip COMMAND --help` for a command's options and examples.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# Arguments and options shared by several commands.
DumpDir = Annotated[str, typer.Argument(metavar="DUMP_DIR", help="The cache: a dump_dir (default "
                                        "~/.verl/rollout_dump), an experiment directory or a run directory.")]
Step = Annotated[Optional[int], typer.Option("--step", "-s", help="The step inside a given run directory.")]
AllowPickle = Annotated[bool, typer.Option("--allow-pickle", help="Read pickle-based entries (verl's gen_batch.dp, "
                                           "tq_batch.pt) through the allow-list unpickler.")]
Role = Annotated[Optional[str], typer.Option("--role", help="Only this role's steps (rollout, rollout_tq, "
                                             "a stage role's name ...).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]

F = TypeVar("F", bound=Callable[..., Any])


def _errors(fn: F) -> F:
    """Turn the user-facing errors of a command into one message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CliError as error:
            render.err.print(f"[bold red]error:[/] {escape(str(error))}")
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _version_callback(value: bool) -> None:
    if value:
        render.out.print(f"stepskip {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what the library does on stderr.")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Inspect, verify, prune, convert and show rollout caches written by stepskip or verl.

    A cache is the dump_dir of skip.<role> (default ~/.verl/rollout_dump), holding
    {experiment}_{project}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/{step}/ per run shape.
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:  # torch's own one-time warnings (on nested tensors, say) are noise in a report
        logging.getLogger("torch").setLevel(logging.ERROR)


@app.command("ls")
@_errors
def ls_command(dump_dir: DumpDir = DEFAULT_DUMP_DIR, as_json: AsJson = False) -> None:
    """List every run of a cache: roles, formats, steps, entries, size, newest entry.

    Steps are written as ranges in the syntax of skip.<role>.steps (1-5,8,10-20:2). Only valid
    steps are listed; damaged ones are counted as problems (see stepskip verify).

    [bold]Examples[/]
      stepskip ls
      stepskip ls /data/rollout_dump
      stepskip ls /data/rollout_dump --json | jq '.runs[].roles[].steps_spec'
    """
    from stepskip.cli.scan import scan_cache

    runs = scan_cache(dump_dir)
    if as_json:
        render.print_json(render.ls_json(runs, _absolute(dump_dir)))
    else:
        render.render_ls(runs, _absolute(dump_dir), dump_dir)


@app.command("info")
@_errors
def info_command(
    entry: Annotated[list[str], typer.Argument(metavar="ENTRY", show_default=False, help="Step directories "
                                                 "(or V1 inner entries), or run directories with --step.")],
    step: Step = None,
    allow_pickle: AllowPickle = False,
    as_json: AsJson = False,
) -> None:
    """Show entries: meta.json, fields, statistics, generation seconds, fingerprint.

    Fields are listed with dtype, shape and bytes; response-length and reward statistics when the
    entry holds them. A V1 (rollout_tq) step directory is shown whole, its inner entries merged as
    they are replayed. Exit code 1 when an entry is damaged.

    [bold]Examples[/]
      stepskip info ~/.verl/rollout_dump/exp_proj/GBS64_N8_in512_out1024/12
      stepskip info ~/.verl/rollout_dump/exp_proj/GBS64_N8_in512_out1024 --step 12 --json
      stepskip info RUN_DIR/3 --allow-pickle      (an entry verl wrote)
    """
    from stepskip.cli.describe import describe_entry

    infos = [describe_entry(path, step, allow_pickle) for path in entry]
    if as_json:
        data = [render.info_json(i) for i in infos]
        render.print_json(data if len(data) > 1 else data[0])
    else:
        for i, info in enumerate(infos):
            if i:
                render.out.print()
            render.render_info(info)
    if any(i.issues for i in infos):
        raise typer.Exit(1)


@app.command("verify")
@_errors
def verify_command(
    dump_dir: DumpDir = DEFAULT_DUMP_DIR,
    repair: Annotated[bool, typer.Option("--repair", help="Remove what can never become valid: damaged entries, "
                                         "leftovers, half-written and incomplete steps. Never a valid entry.")] = False,
    deep: Annotated[bool, typer.Option("--deep", help="Also decode every entry (finds damage in entries verl "
                                       "wrote, which carry no checksums).")] = False,
    allow_pickle: AllowPickle = False,
    grace: Annotated[str, typer.Option("--grace", help="Leftovers, half-written and incomplete V1 steps modified "
                                       "more recently may be a write in progress: reported, not repaired.")] = "1h",
    as_json: AsJson = False,
) -> None:
    """Check checksums and completeness of every entry; find leftovers and half-written directories.

    Checks sizes, checksums and meta.json of every entry, that V1 steps are complete and written by
    one run, and finds leftovers of interrupted writes (.tmp-*, .trash-*) and step directories
    without meta.json. Exit code 0 when the cache is clean, 1 when problems were found (or remain
    after --repair).

    [bold]Examples[/]
      stepskip verify
      stepskip verify /data/rollout_dump --repair
      stepskip verify /data/rollout_dump --deep --allow-pickle --json
    """
    from stepskip.cli.prune import parse_duration
    from stepskip.cli.scan import scan_cache
    from stepskip.cli.verify import count_entries, verify_runs
    from stepskip.cli.verify import repair as repair_problems

    grace_seconds = parse_duration(grace, "--grace")
    runs = scan_cache(dump_dir)
    with render.progress("verifying", count_entries(runs)) as advance:
        report = verify_runs(runs, deep=deep, allow_pickle=allow_pickle, grace=grace_seconds, on_entry=advance)
    result = repair_problems(report) if repair and report.problems else None
    if as_json:
        render.print_json(render.verify_json(report, result, _absolute(dump_dir)))
    else:
        render.render_verify(report, result, _absolute(dump_dir), grace)
    remaining = report.problems if result is None else result.kept
    raise typer.Exit(1 if remaining else 0)


@app.command("prune")
@_errors
def prune_command(
    run_dir: Annotated[str, typer.Argument(metavar="RUN_DIR", show_default=False, help="A run directory "
                                           "(GBS<gbs>_N<n>_in<p>_out<r>), or a stage role's subdirectory of one.")],
    keep_last: Annotated[Optional[int], typer.Option("--keep-last", help="Keep the N highest steps of each role.")]
    = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="Remove steps recorded longer ago than "
                                                      "this: 90s, 30m, 12h, 7d, 2w.")] = None,
    steps: Annotated[Optional[str], typer.Option("--steps", help='Remove these steps: "3", "1-5,8", "10-100:10", '
                                                 '"all" (the syntax of skip.<role>.steps).')] = None,
    role: Role = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would be removed; remove nothing.")]
    = False,
    as_json: AsJson = False,
) -> None:
    """Remove step directories of a run, chosen by count, age or step list (exactly one of them).

    Each step vanishes at once (renamed away, then deleted), so a run reading the cache meanwhile
    sees a step whole or not at all.

    [bold]Examples[/]
      stepskip prune RUN_DIR --keep-last 10 --dry-run
      stepskip prune RUN_DIR --older-than 7d
      stepskip prune RUN_DIR --steps 1-5,8 --role rollout
    """
    from stepskip.cli.prune import apply_prune, parse_duration, parse_steps, plan_prune

    plan = plan_prune(run_dir, keep_last=keep_last,
                      older_than=None if older_than is None else parse_duration(older_than),
                      steps=None if steps is None else parse_steps(steps), role=role)
    removed = [] if dry_run else apply_prune(plan)
    if as_json:
        render.print_json(render.prune_json(plan, removed, dry_run))
    else:
        render.render_prune(plan, dry_run)


class Target(str, enum.Enum):
    """What ``convert --to`` accepts."""

    safe = "safe"
    verl = "verl"


@app.command("convert")
@_errors
def convert_command(
    src: Annotated[str, typer.Argument(metavar="SRC", show_default=False,
                                       help="The cache to read: a dump_dir, experiment or run directory.")],
    dst: Annotated[str, typer.Argument(metavar="DST", show_default=False, help="The dump dir to write; each run "
                                       "keeps its {experiment}_{project}/GBS..._N..._in..._out... path below it.")],
    to: Annotated[Target, typer.Option("--to", show_default=False, help="safe: safetensors + JSON, no pickle. "
                                       "verl: the files verl 0.9 reads (gen_batch.dp; tq_batch.pt for V1 entries).")],
    allow_pickle: AllowPickle = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace entries that exist in DST.")] = False,
    role: Role = None,
    as_json: AsJson = False,
) -> None:
    """Convert a cache to another format (safe or verl), keeping its layout and meta.json.

    Converts gen_batch.dp and V1 tq_batch.pt entries; meta.json keeps global_steps,
    num_trajectories, run id, fingerprint ... Every entry is written atomically with checksums,
    then read back and compared with its source. Exit code 1 when an entry could not be converted
    or an invalid source step was left out.

    [bold]Examples[/]
      stepskip convert ~/.verl/rollout_dump /data/safe_dump --to safe --allow-pickle
      stepskip convert /data/safe_dump /data/for_verl --to verl --role rollout
    """
    from stepskip.cli.convert import convert_cache, plan_convert

    total = len(plan_convert(src, dst, to.value, allow_pickle, overwrite, role)[0])
    with render.progress("converting", total) as advance:
        report = convert_cache(src, dst, to.value, allow_pickle=allow_pickle, overwrite=overwrite, role=role,
                               on_entry=advance)
    if as_json:
        render.print_json({"src": _absolute(src), "dst": _absolute(dst), "to": to.value, "ok": report.ok,
                           "converted": report.converted, "failed": report.failed, "skipped": report.skipped})
    else:
        render.render_convert(report, _absolute(src), _absolute(dst), to.value)
    if not report.ok:
        raise typer.Exit(1)


@app.command("show")
@_errors
def show_command(
    entry: Annotated[str, typer.Argument(metavar="ENTRY", show_default=False, help="A step directory (or V1 inner "
                                         "entry), or a run directory with --step.")],
    step: Step = None,
    rows: Annotated[int, typer.Option("--rows", "-r", min=0, help="How many trajectories to print.")] = 3,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", "-t", help="A local Hugging Face tokenizer "
                                                     "(or model) directory: print text instead of token ids.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=0, help="Token ids printed per prompt and response "
                                            "without --tokenizer (0: all).")] = 64,
    allow_pickle: AllowPickle = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON: token ids, and text with --tokenizer.")]
    = False,
) -> None:
    """Print sample trajectories of an entry: prompt, response and reward.

    Padding is removed with the attention and response masks. The tokenizer is loaded offline
    (local files only).

    [bold]Examples[/]
      stepskip show RUN_DIR/12
      stepskip show RUN_DIR --step 12 --rows 5 --tokenizer /models/Qwen2.5-7B-Instruct
    """
    from stepskip.cli.content import load_tokenizer, read_step, sample_rows
    from stepskip.cli.scan import local_store, resolve_target
    from stepskip.errors import CorruptEntryError

    step_dir, inner = resolve_target(entry, step)
    issues = [i for i in step_dir.issues() if inner is None or i.path == inner.path]
    try:
        if issues:
            raise CorruptEntryError(f"{issues[0].path}: {issues[0].detail}")
        value = read_step(local_store(step_dir.path), step_dir, allow_pickle, inner)
    except CorruptEntryError as error:  # a damaged entry is a finding (exit 1), not a usage error
        render.err.print(f"[bold red]damaged:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    tok = load_tokenizer(tokenizer) if tokenizer else None
    samples = sample_rows(value, rows)
    path = inner.path if inner is not None else step_dir.path
    if as_json:
        render.print_json(render.show_json(path, step_dir.step, samples, tok))
    else:
        render.render_show(path, step_dir.step, samples, tok, max_tokens)


@app.command("demo", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def demo_command(ctx: typer.Context) -> None:
    """Run the demo pipeline (stepskip.pipelines.demo); every argument, --help included, goes to it.

    [bold]Examples[/]
      stepskip demo --help
      stepskip demo data.max_response_length=64
    """
    try:
        from stepskip.pipelines.demo import main as demo_main
    except ImportError as error:
        message = (f"the demo pipeline is not available: cannot import stepskip.pipelines.demo ({error}); "
                   "install stepskip with its pipelines extra: pip install 'stepskip[pipelines]'")
        render.err.print(f"[bold red]error:[/] {escape(message)}")
        raise typer.Exit(2) from None
    raise typer.Exit(int(demo_main(list(ctx.args)) or 0))
