"""The typer application: arguments in, library calls, rendering out (see :mod:`stepskip.cli.render`)."""

from __future__ import annotations

import enum
import functools
import json
import logging
import sys
from collections.abc import Callable
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.markup import escape

from stepskip._version import __version__
from stepskip._access import describe_store_access_error, is_store_access_error
from stepskip.cli import render
from stepskip.cli.errors import CliError
from stepskip.config import SkipRoleConfig
from stepskip._entries import CONFIG_FORMATS
from stepskip.errors import SkipConfigError

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
                                        "~/.verl/rollout_dump), an experiment directory or a run directory; "
                                        "a local path or a URL (memory://..., s3://bucket/prefix).")]
Step = Annotated[Optional[int], typer.Option("--step", "-s", help="The step inside a given run directory.")]
AllowPickle = Annotated[bool, typer.Option("--allow-pickle", help="Read pickle-based entries (verl's gen_batch.dp, "
                                           "tq_batch.pt) through the allow-list unpickler.")]
Role = Annotated[Optional[str], typer.Option("--role", help="Only this role's steps (rollout, rollout_tq, "
                                             "a stage role's name ...).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
StorageOptions = Annotated[Optional[list[str]], typer.Option(
    "--storage-option", "-o", metavar="KEY=VALUE", show_default=False,
    help="An fsspec option for URL caches, repeatable: -o anon=true, -o client_kwargs.endpoint_url=http://host:9000 "
         "(values are read as JSON when they parse), or one JSON object: -o '{\"profile\": \"dev\"}'.")]

F = TypeVar("F", bound=Callable[..., Any])


def _errors(fn: F) -> F:
    """Turn the user-facing errors of a command into one message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (CliError, SkipConfigError) as error:  # a wrong path, option or URL; not a finding about a cache
            render.err.print(f"[bold red]error:[/] {escape(str(error))}")
            raise typer.Exit(2) from None
        except Exception as error:  # storage that refuses the credentials or does not answer: the user's to fix
            if not is_store_access_error(error):
                raise
            render.err.print(f"[bold red]error:[/] {escape(describe_store_access_error(_named_caches(kwargs), error))}")
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _named_caches(arguments: dict[str, Any]) -> str:
    """The caches a command was given (its path arguments), URLs first: what a storage error is about."""
    given: list[str] = []
    for name in ("dump_dir", "run_dir", "entry", "src", "dst"):
        value = arguments.get(name)
        given += [value] if isinstance(value, str) else [v for v in value or () if isinstance(v, str)]
    urls = [g for g in given if "://" in g]
    return ", ".join(dict.fromkeys(urls or given)) or "the cache"


def storage_options(values: list[str] | None) -> dict[str, Any]:
    """The fsspec options of ``--storage-option`` values: ``KEY=VALUE`` (dotted keys nest) or JSON objects.

    Raises:
        CliError: a value is neither.

    Example:
        >>> storage_options(["anon=true", "client_kwargs.endpoint_url=http://127.0.0.1:9000"])
        {'anon': True, 'client_kwargs': {'endpoint_url': 'http://127.0.0.1:9000'}}
    """
    options: dict[str, Any] = {}
    for text in values or []:
        if text.lstrip().startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as err:
                raise CliError(f"--storage-option {text!r} is not a JSON object ({err})") from None
            if not isinstance(value, dict):
                raise CliError(f"--storage-option {text!r} is not a JSON object")
            options.update(value)
            continue
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise CliError(f"--storage-option {text!r} is not KEY=VALUE (e.g. anon=true) or a JSON object")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw  # a plain string: endpoint URLs, profile names ...
        *parents, last = key.strip().split(".")
        node = options
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise CliError(f"--storage-option {text!r}: {part!r} is already set to a value, not options")
            node = child
        node[last] = value
    return options


def _index(path: str, options: list[str] | None) -> Any:
    from stepskip._index import CacheIndex  # not stepskip.cache: listing a cache loads no codec (nor torch)

    return CacheIndex(path, storage_options(options))


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
        # torch resets its root logger's level when it is imported, not its children's: both are set.
        for name in ("torch", "torch.fx"):
            logging.getLogger(name).setLevel(logging.ERROR)


@app.command("ls")
@_errors
def ls_command(dump_dir: DumpDir = DEFAULT_DUMP_DIR, as_json: AsJson = False,
               options: StorageOptions = None) -> None:
    """List every run of a cache: roles, formats, steps, entries, size, newest entry.

    Steps are written as ranges in the syntax of skip.<role>.steps (1-5,8,10-20:2). Only valid
    steps are listed; damaged ones are counted as problems (see stepskip verify).

    [bold]Examples[/]
      stepskip ls
      stepskip ls /data/rollout_dump
      stepskip ls /data/rollout_dump --json | jq '.runs[].roles[].steps_spec'
      stepskip ls s3://bucket/rollout_dump -o client_kwargs.endpoint_url=http://127.0.0.1:9000
    """
    index = _index(dump_dir, options)
    runs = index.runs()
    if as_json:
        render.print_json(render.ls_json(runs, index.root))
    else:
        render.render_ls(runs, index.root, dump_dir)


@app.command("info")
@_errors
def info_command(
    entry: Annotated[list[str], typer.Argument(metavar="ENTRY", show_default=False, help="Step directories "
                                                 "(or V1 inner entries), or run directories with --step.")],
    step: Step = None,
    allow_pickle: AllowPickle = False,
    as_json: AsJson = False,
    options: StorageOptions = None,
) -> None:
    """Show entries: meta.json, fields, statistics, generation seconds, fingerprint.

    Fields are listed with dtype, shape and bytes; response-length and reward statistics when the
    entry holds them; the drift record when action: compare compared the step. A V1 (rollout_tq)
    step directory is shown whole, its inner entries merged as they are replayed. Exit code 1 when
    an entry is damaged.

    [bold]Examples[/]
      stepskip info ~/.verl/rollout_dump/exp_proj/GBS64_N8_in512_out1024/12
      stepskip info ~/.verl/rollout_dump/exp_proj/GBS64_N8_in512_out1024 --step 12 --json
      stepskip info RUN_DIR/3 --allow-pickle      (an entry verl wrote)
    """
    from stepskip.cli.describe import describe_entry

    infos = [describe_entry(_index(path, options), step, allow_pickle) for path in entry]
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
    options: StorageOptions = None,
) -> None:
    """Check checksums and completeness of every entry; find leftovers and half-written directories.

    Checks sizes, checksums and meta.json of every entry, that V1 steps are complete and written by
    one run, and finds leftovers of interrupted writes (.tmp-*, .trash-*) and step directories
    without meta.json. Entries of a format this stepskip does not know, and entries whose intact
    bytes do not decode here (--deep), are reported and never removed; symbolic links are never
    followed. Exit code 0 when the cache is clean, 1 when problems were found (or remain
    after --repair).

    [bold]Examples[/]
      stepskip verify
      stepskip verify /data/rollout_dump --repair
      stepskip verify /data/rollout_dump --deep --allow-pickle --json
      stepskip verify s3://bucket/rollout_dump --repair -o profile=dev
    """
    from stepskip.cli.prune import parse_duration
    from stepskip.cli.verify import count_entries, verify_runs
    from stepskip.cli.verify import repair as repair_problems

    grace_seconds = parse_duration(grace, "--grace")
    index = _index(dump_dir, options)
    runs = index.runs()
    with render.progress("verifying", count_entries(runs)) as advance:
        report = verify_runs(index, runs, deep=deep, allow_pickle=allow_pickle, grace=grace_seconds,
                             on_entry=advance)
    result = repair_problems(index, report) if repair else None
    if as_json:
        render.print_json(render.verify_json(report, result, index.root))
    else:
        render.render_verify(report, result, index.root, grace)
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
    deep: Annotated[bool, typer.Option("--deep", help="Decode each chosen entry first and keep those whose intact "
                                       "bytes do not decode here (pickle-based ones with --allow-pickle).")] = False,
    allow_pickle: AllowPickle = False,
    as_json: AsJson = False,
    options: StorageOptions = None,
) -> None:
    """Remove step directories of a run, chosen by count, age or step list (exactly one of them).

    Each step vanishes at once (renamed away, then deleted; on object stores meta.json goes
    first), so a run reading the cache meanwhile sees a step whole or not at all. Steps holding an
    entry this stepskip cannot read (an unknown format; with --deep, intact bytes that do not
    decode), or one the store did not answer for, are kept and listed; symbolic links are never followed.

    [bold]Examples[/]
      stepskip prune RUN_DIR --keep-last 10 --dry-run
      stepskip prune RUN_DIR --older-than 7d
      stepskip prune RUN_DIR --steps 1-5,8 --role rollout
      stepskip prune s3://bucket/rollout_dump/exp_proj/GBS64_N8_in512_out1024 --keep-last 10
    """
    from stepskip.cli.prune import apply_prune, parse_duration, parse_steps, plan_prune

    index = _index(run_dir, options)
    plan = plan_prune(index, keep_last=keep_last,
                      older_than=None if older_than is None else parse_duration(older_than),
                      steps=None if steps is None else parse_steps(steps), role=role, deep=deep,
                      allow_pickle=allow_pickle)
    removed = [] if dry_run else apply_prune(index, plan)
    if as_json:
        render.print_json(render.prune_json(plan, removed, dry_run))
    else:
        render.render_prune(plan, dry_run)


#: What ``convert --to`` accepts: the values of the role option ``format``, from the format registry.
Target = enum.Enum("Target", {name: name for name in CONFIG_FORMATS}, type=str)  # type: ignore[misc]


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
    options: StorageOptions = None,
) -> None:
    """Convert a cache to another format (safe or verl), keeping its layout and meta.json.

    Converts gen_batch.dp and V1 tq_batch.pt entries; meta.json keeps global_steps,
    num_trajectories, run id, fingerprint ... Every entry is written atomically with checksums,
    then read back and compared with its source. Exit code 1 when an entry could not be converted
    or an invalid source step was left out.

    [bold]Examples[/]
      stepskip convert ~/.verl/rollout_dump /data/safe_dump --to safe --allow-pickle
      stepskip convert /data/safe_dump /data/for_verl --to verl --role rollout
      stepskip convert ~/.verl/rollout_dump s3://bucket/safe_dump --to safe --allow-pickle
    """
    from stepskip.cli.convert import convert_cache, plan_convert

    source, dest = _index(src, options), _index(dst, options)
    total = len(plan_convert(source, dest, to.value, allow_pickle, overwrite, role)[0])
    with render.progress("converting", total) as advance:
        report = convert_cache(source, dest, to.value, allow_pickle=allow_pickle, overwrite=overwrite, role=role,
                               on_entry=advance)
    if as_json:
        render.print_json({"src": source.root, "dst": dest.root, "to": to.value, "ok": report.ok,
                           "converted": report.converted, "failed": report.failed, "skipped": report.skipped})
    else:
        render.render_convert(report, source.root, dest.root, to.value)
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
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON: token ids, and text when they can be decoded.")]
    = False,
    options: StorageOptions = None,
) -> None:
    """Print sample trajectories of an entry: prompt, response and reward.

    Padding is removed with the attention and response masks. The tokenizer is loaded offline
    (local files only); without one, entries of stepskip demo are decoded with its own character
    tokenizer. A step holding no rewards takes them from a stage role of the same step (skip.reward).
    A step that action: compare compared shows its drift record first.

    [bold]Examples[/]
      stepskip show RUN_DIR/12
      stepskip show RUN_DIR --step 12 --rows 5 --tokenizer /models/Qwen2.5-7B-Instruct
    """
    from stepskip.cli.content import load_tokenizer, recorded_tokenizer, row_count, sample_rows
    from stepskip.errors import CorruptEntryError, UnreadableEntryError
    from stepskip._index import IssueKind, PickleNotAllowedError

    index = _index(entry, options)
    step_dir, inner = index.resolve(step=step)
    issues = [i for i in step_dir.issues() if inner is None or i.path == inner.path]
    try:
        if issues and issues[0].kind in (IssueKind.UNSUPPORTED, IssueKind.UNDECODABLE):
            raise UnreadableEntryError(f"{issues[0].path}: {issues[0].detail}")
        if issues:
            raise CorruptEntryError(f"{issues[0].path}: {issues[0].detail}")
        value = index.read_step(step_dir, allow_pickle, inner)
    except PickleNotAllowedError as error:
        raise CliError(str(error)) from None
    except UnreadableEntryError as error:  # intact but not readable here: a finding (exit 1), kept as it is
        render.err.print(f"[bold red]unreadable:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    except CorruptEntryError as error:  # a damaged entry is a finding (exit 1), not a usage error
        render.err.print(f"[bold red]damaged:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    from stepskip.cli.describe import drift_of

    recorded = inner or (step_dir.entries[0] if step_dir.entries else None)
    tok = load_tokenizer(tokenizer) if tokenizer else recorded_tokenizer(recorded.fingerprint if recorded else None)
    samples = sample_rows(value, rows)
    if samples and all(s.reward is None for s in samples) and inner is None:
        _join_stage_rewards(index, step_dir, samples, row_count(value) or 0, allow_pickle, options)
    path = inner.path if inner is not None else step_dir.path
    drift = drift_of(index, step_dir)
    if as_json:
        render.print_json(render.show_json(path, step_dir.step, samples, tok, drift))
    else:
        render.render_show(path, step_dir.step, samples, tok, max_tokens, drift)


def _join_stage_rewards(index: Any, step_dir: Any, samples: list[Any], rows: int, allow_pickle: bool,
                        options: list[str] | None) -> None:
    """Rewards for a step that holds none, from a stage role of the same run and step that scores its rows
    (``skip.reward``), as stepskip view joins them; nothing when no stage role holds one reward per row."""
    from stepskip.cli.content import scores_rows
    from stepskip.errors import CacheMissError, UnreadableEntryError
    from stepskip._index import CacheIndex, is_leftover
    from stepskip._layout import RUN_DIR, Layout

    parent, _, _ = step_dir.path.rpartition("/")
    run = parent if RUN_DIR.match(parent.rpartition("/")[2]) else parent.rpartition("/")[0]
    if not RUN_DIR.match(run.rpartition("/")[2]):
        return
    # the run directory is inside the cache whatever was named (a step of it): read through an index of it
    runs = index if (run == index.root or index.inside(run)) else CacheIndex(run, storage_options(options))
    for item in sorted(runs.store.list_items(run), key=lambda i: i.name):
        role = item.name
        if (item.kind != "dir" or role == step_dir.role or role.startswith(".") or is_leftover(role)
                or Layout.parse_step(role) is not None):
            continue
        path = f"{run}/{role}/{step_dir.step}"
        stat = runs.store.stat_item(path)
        if stat is None or stat.kind != "dir":
            continue
        other = runs.scan_step(path, step_dir.step, role=role)
        if not other.valid:
            continue
        try:
            value = runs.read_step(other, allow_pickle)
        except (CacheMissError, UnreadableEntryError, SkipConfigError):
            continue
        if (found := scores_rows(value, rows)) is not None:
            for sample in samples:
                sample.reward = found[1][sample.index]
                sample.extra["reward from"] = f"{role} role ({found[0]})"
            return


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


def _register_view_commands() -> None:
    """``stepskip view`` and ``stepskip report`` live in stepskip.view (see stepskip.view.cli)."""
    from stepskip.view.cli import report_command, view_command

    app.command("view")(_errors(view_command))
    app.command("report")(_errors(report_command))


def _register_rerun_command() -> None:
    """``stepskip rerun`` lives in stepskip.cli.rerun."""
    from stepskip.cli.rerun import rerun_command

    app.command("rerun")(_errors(rerun_command))


_register_view_commands()
_register_rerun_command()
