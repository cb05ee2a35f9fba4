"""The typer application: argument parsing and rendering only; the work is done in the sibling modules."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from stepskip._version import __version__
from stepskip.cli.errors import CliError
from stepskip.config import SkipRoleConfig

__all__ = ["app"]

DEFAULT_DUMP_DIR: str = SkipRoleConfig.dump_dir

out = Console(highlight=False, soft_wrap=False)
err = Console(stderr=True, highlight=False)

F = TypeVar("F", bound=Callable[..., Any])

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


# --------------------------------------------------------------------------- shared rendering


def _errors(fn: F) -> F:
    """Turn the user-facing errors of a command into one message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CliError as error:
            err.print(f"[bold red]error:[/] {escape(str(error))}")
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def human_time(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def iso_time(t: float | None) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(_plain(data), indent=2, sort_keys=False) + "\n")


def _rel(path: str, root: str) -> str:
    try:
        rel = os.path.relpath(path, root)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr for long runs; silent when stderr is not a terminal."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err, transient=True, disable=not err.is_terminal)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda *_: bar.advance(task)


def _version_callback(value: bool) -> None:
    if value:
        out.print(f"stepskip {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what the library does (INFO) on stderr.")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version_callback, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """Inspect, verify, prune, convert and show rollout caches written by stepskip or verl.

    A cache is the dump_dir of skip.<role> (default ~/.verl/rollout_dump):
    {experiment}_{project}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/{step}/ per run shape.
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not verbose:  # torch's own one-time warnings (e.g. on nested tensors) are noise in a report
        logging.getLogger("torch").setLevel(logging.ERROR)


# --------------------------------------------------------------------------- ls


@app.command("ls")
@_errors
def ls_command(
    dump_dir: Annotated[str, typer.Argument(metavar="[DUMP_DIR]",
                                            help="The cache: a dump_dir, an experiment directory or a run directory.")]
    = DEFAULT_DUMP_DIR,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List every run of a cache: roles, formats, steps, entries, size, newest entry.

    Steps are written as ranges in the syntax of skip.<role>.steps (1-5,8,10-20:2); only valid
    steps are listed, damaged ones are counted as problems (see stepskip verify).

    [bold]Examples[/]
      stepskip ls
      stepskip ls /data/rollout_dump
      stepskip ls /data/rollout_dump --json | jq '.runs[].roles[].steps_spec'
    """
    from stepskip.cli.scan import compress_steps, scan_cache

    root = os.path.abspath(os.path.expanduser(dump_dir))
    runs = scan_cache(dump_dir)
    listing = []
    for run in runs:
        roles = run.roles()
        listing.append({
            "path": run.path,
            "name": run.name,
            "experiment_project": run.name.split("/")[0],
            "shape": run.shape,
            "entries": sum(r.entries for r in roles),
            "bytes": sum(s.bytes for s in run.steps),
            "newest": iso_time(max((r.newest for r in roles if r.newest is not None), default=None)),
            "problems": len(run.issues()),
            "roles": [{
                "role": r.role, "formats": r.formats, "steps": r.steps, "steps_spec": compress_steps(r.steps),
                "invalid_steps": r.invalid_steps, "entries": r.entries, "bytes": r.bytes,
                "newest": iso_time(r.newest), "newest_unix": r.newest,
            } for r in roles],
        })
    if as_json:
        print_json({"dump_dir": root, "runs": listing})
        return
    if not runs:
        out.print(f"no runs cached under {escape(root)}")
        return
    table = Table(title=None, box=None, header_style="bold", pad_edge=False)
    for column, justify in (("RUN", "left"), ("ROLE", "left"), ("FORMAT", "left"), ("STEPS", "left"),
                            ("ENTRIES", "right"), ("SIZE", "right"), ("NEWEST", "left")):
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    problems = 0
    for run, item in zip(runs, listing):
        problems += item["problems"]
        roles = run.roles()
        if not roles:
            table.add_row(escape(run.name), "-", "-", "-", "0", human_bytes(item["bytes"]), "-")
        for i, r in enumerate(roles):
            steps = compress_steps(r.steps) or "-"
            if r.invalid_steps:
                steps += f" [yellow](+{len(r.invalid_steps)} invalid)[/]"
            table.add_row(escape(run.name) if i == 0 else "", escape(r.role), ", ".join(r.formats),
                          steps, str(r.entries), human_bytes(r.bytes), human_time(r.newest))
    out.print(table)
    total = sum(i["entries"] for i in listing)
    size = sum(i["bytes"] for i in listing)
    out.print(f"{len(runs)} run{'s' if len(runs) != 1 else ''}, {total} entries, {human_bytes(size)}")
    if problems:
        out.print(f"[yellow]{problems} problem{'s' if problems != 1 else ''} (damaged or half-written steps, "
                  f"leftovers): run `stepskip verify {escape(dump_dir)}` for details[/]")


# --------------------------------------------------------------------------- info


def _entry_rows(info: Any) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("INNER", "RUN ID", "TRAJECTORIES", "FORMAT", "SIZE", "STATE"):
        table.add_column(column)
    for e in info.entries:
        meta = e.meta or {}
        table.add_row(str(e.inner), escape(str(e.run_id or "-")), str(meta.get("num_trajectories", "-")),
                      str(e.format or "-"), human_bytes(e.bytes), e.state.value + (f": {escape(e.reason)}" if e.reason else ""))
    return table


def _render_info(info: Any) -> None:
    meta = info.meta or {}
    entry = info.entries[0] if info.entries else None
    out.print(f"[bold]{escape(info.path)}[/]")
    pairs: list[tuple[str, str]] = [
        ("role", str(info.role or "?")),
        ("kind", info.kind),
        ("step", str(info.step) + (f" (global_steps {meta['global_steps']})"
                                   if meta.get("global_steps") not in (None, info.step) else "")),
        ("format", ", ".join(sorted({e.format for e in info.entries if e.format})) or "-"),
        ("written by", entry.written_by if entry else "-"),
        ("recorded", human_time(entry.time) if entry else "-"),
        ("size", human_bytes(sum(e.bytes for e in info.entries))),
    ]
    if info.rows is not None:
        pairs.append(("rows", str(info.rows)))
    if "num_trajectories" in meta and info.kind != "v1":
        pairs.append(("trajectories", str(meta["num_trajectories"])))
    seconds = [e.meta.get("generation_seconds") for e in info.entries if e.meta]
    seconds = [s for s in seconds if isinstance(s, (int, float))]
    pairs.append(("generation", f"{sum(seconds):.3f} s recorded" if seconds else "not recorded"))
    for key in ("run_id", "prompt_digest", "parameter_sync_step", "converted_from"):
        if meta.get(key) is not None and (key != "run_id" or info.kind != "v1"):
            pairs.append((key.replace("_", " "), str(meta[key])))
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for key, value in pairs:
        grid.add_row(key, escape(value))
    out.print(grid)
    fingerprint = meta.get("fingerprint")
    if isinstance(fingerprint, dict):
        out.print("[bold]fingerprint[/]" + ("" if fingerprint else "  (empty: no rollout settings were set)"))
        for key, value in fingerprint.items():
            out.print(f"  {escape(str(key))} = {escape(repr(value))}")
    if info.kind == "v1":
        out.print("[bold]inner entries[/]")
        out.print(_entry_rows(info))
    files = meta.get("files")
    if isinstance(files, dict) and info.kind != "v1":
        out.print("[bold]files[/]")
        for name, item in files.items():
            item = item if isinstance(item, dict) else {}
            out.print(f"  {escape(name)}  {human_bytes(item.get('bytes'))}  {escape(str(item.get('checksum', '')))}")
    elif entry is not None and not entry.has_checksums and info.kind != "v1":
        out.print("[bold]files[/]  (written by verl: meta.json lists no files or checksums)")
    if info.fields:
        table = Table(box=None, header_style="bold", pad_edge=False, title_justify="left")
        for column, justify in (("FIELD", "left"), ("KIND", "left"), ("DTYPE", "left"), ("SHAPE", "left"),
                                ("BYTES", "right")):
            table.add_column(column, justify=justify)  # type: ignore[arg-type]
        for f in info.fields:
            table.add_row(escape(f.name), f.kind, f.dtype, escape("[" + ", ".join(map(str, f.shape)) + "]"),
                          human_bytes(f.bytes))
        out.print("[bold]fields[/]")
        out.print(table)
    for stat in info.stats:
        out.print(f"[bold]{stat.name}[/] ({escape(stat.source)}): n={stat.count}  min {stat.min:.4g}  "
                  f"mean {stat.mean:.4g}  max {stat.max:.4g}")
    if info.meta_info:
        out.print("[bold]meta_info[/]")
        for key, value in info.meta_info.items():
            text = repr(value)
            out.print(f"  {escape(str(key))} = {escape(text if len(text) < 200 else text[:200] + '…')}")
    for issue in info.issues:
        out.print(f"[red]{issue.kind.value}[/]: {escape(issue.path)}: {escape(issue.detail)}")
    if info.note:
        out.print(f"[yellow]{escape(info.note)}[/]")


@app.command("info")
@_errors
def info_command(
    entries: Annotated[list[str], typer.Argument(metavar="ENTRY", help="Step directories (or V1 inner entries), "
                                                 "or a run directory with --step.",
                                                 show_default=False)],
    step: Annotated[Optional[int], typer.Option("--step", "-s", help="The step inside each given run directory.")] = None,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Decode pickle-based entries (verl's "
                                               "gen_batch.dp / tq_batch.pt) through the allow-list unpickler.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
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

    infos = [describe_entry(path, step, allow_pickle) for path in entries]
    if as_json:
        print_json([_info_json(i) for i in infos] if len(infos) > 1 else _info_json(infos[0]))
    else:
        for i, info in enumerate(infos):
            if i:
                out.print()
            _render_info(info)
    if any(i.issues for i in infos):
        raise typer.Exit(1)


def _entry_json(e: Any) -> dict[str, Any]:
    return {"path": e.path, "inner": e.inner, "role": e.role, "format": e.format, "state": e.state.value,
            "reason": e.reason, "written_by": e.written_by, "run_id": e.run_id, "bytes": e.bytes,
            "recorded": iso_time(e.time), "meta": e.meta}


def _info_json(info: Any) -> dict[str, Any]:
    data = _plain(info)
    data["entries"] = [_entry_json(e) for e in info.entries]
    seconds = [e.meta.get("generation_seconds") for e in info.entries if e.meta]
    seconds = [s for s in seconds if isinstance(s, (int, float))]
    data["generation_seconds"] = sum(seconds) if seconds else None
    data["fingerprint"] = (info.meta or {}).get("fingerprint")
    return data


# --------------------------------------------------------------------------- verify


@app.command("verify")
@_errors
def verify_command(
    dump_dir: Annotated[str, typer.Argument(metavar="[DUMP_DIR]",
                                            help="The cache: a dump_dir, an experiment directory or a run directory.")]
    = DEFAULT_DUMP_DIR,
    repair: Annotated[bool, typer.Option("--repair", help="Remove what can never become valid: damaged entries, "
                                         "half-written and incomplete steps, leftovers. Valid entries are never touched.")]
    = False,
    deep: Annotated[bool, typer.Option("--deep", help="Also decode every entry (catches damage in entries verl "
                                       "wrote, which carry no checksums).")] = False,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="With --deep: decode pickle-based entries "
                                               "through the allow-list unpickler.")] = False,
    grace: Annotated[str, typer.Option("--grace", help="Leftovers, half-written and incomplete V1 steps modified "
                                       "more recently than this may be a write in progress: reported, not repaired.")]
    = "1h",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Check checksums and completeness of every entry; find leftovers and half-written directories.

    Checks sizes, checksums and meta.json of every entry, that V1 steps are complete and written by
    one run, and finds leftovers of interrupted writes (.tmp-*, .trash-*) and step directories
    without meta.json. Exit code 0 when the cache is clean, 1 when problems were found (or remain after --repair).

    [bold]Examples[/]
      stepskip verify
      stepskip verify /data/rollout_dump --repair
      stepskip verify /data/rollout_dump --deep --allow-pickle --json
    """
    from stepskip.cli.prune import parse_duration
    from stepskip.cli.scan import scan_cache
    from stepskip.cli.verify import count_entries, repair as do_repair, verify_runs

    grace_seconds = parse_duration(grace, "--grace")
    root = os.path.abspath(os.path.expanduser(dump_dir))
    runs = scan_cache(dump_dir)
    with _progress("verifying", count_entries(runs)) as advance:
        report = verify_runs(runs, deep=deep, allow_pickle=allow_pickle, grace=grace_seconds, on_entry=advance)
    result = do_repair(report) if repair and report.problems else None
    remaining = report.problems if result is None else result.kept
    if as_json:
        data = _plain(report)
        data["dump_dir"] = root
        data["clean"] = report.clean
        if result is not None:
            data["repaired"] = result.removed
            data["kept"] = _plain(result.kept)
        print_json(data)
    else:
        _render_verify(report, result, root, grace)
    raise typer.Exit(1 if remaining else 0)


def _render_verify(report: Any, result: Any, root: str, grace: str) -> None:
    checked = f"checked {report.entries} entr{'y' if report.entries == 1 else 'ies'} in {report.runs} run" \
              f"{'s' if report.runs != 1 else ''}: {report.checksummed} against their checksums"
    if report.decoded:
        checked += f", {report.decoded} decoded"
    out.print(checked)
    if report.unverified:
        out.print(f"{len(report.unverified)} entr{'y' if len(report.unverified) == 1 else 'ies'} written by verl "
                  "carry no checksums (only presence checked; --deep --allow-pickle decodes them)")
    if report.problems:
        table = Table(box=None, header_style="bold", pad_edge=False)
        for column in ("PROBLEM", "PATH", "DETAIL"):
            table.add_column(column, overflow="fold")
        for p in report.problems:
            detail = p.detail + (f" (modified less than {grace} ago: may be in progress)" if p.recent else "")
            table.add_row(f"[red]{p.kind.value}[/]", escape(_rel(p.path, root)), escape(detail))
        out.print(table)
    for path in report.others:
        out.print(f"[dim]not part of the cache layout, left alone: {escape(_rel(path, root))}[/]")
    if result is not None:
        for path in result.removed:
            out.print(f"removed {escape(_rel(path, root))}")
        if result.kept:
            out.print(f"[yellow]kept {len(result.kept)} problem{'s' if len(result.kept) != 1 else ''} modified less "
                      f"than {grace} ago (a write may be in progress; --grace 0 removes them)[/]")
    elif report.problems:
        out.print(f"[red]{len(report.problems)} problem{'s' if len(report.problems) != 1 else ''}[/]; "
                  "`stepskip verify --repair` removes what can never become valid")
    else:
        out.print("[green]no problems found[/]")


# --------------------------------------------------------------------------- prune


@app.command("prune")
@_errors
def prune_command(
    run_dir: Annotated[str, typer.Argument(metavar="RUN_DIR", help="A run directory (GBS<gbs>_N<n>_in<p>_out<r>), or a stage role's "
                                           "subdirectory of one.", show_default=False)],
    keep_last: Annotated[Optional[int], typer.Option("--keep-last", help="Keep the N highest steps of each role.")] = None,
    older_than: Annotated[Optional[str], typer.Option("--older-than", help="Remove steps recorded before this age: "
                                                      "90s, 30m, 12h, 7d, 2w.")] = None,
    steps: Annotated[Optional[str], typer.Option("--steps", help='Remove these steps: "3", "1-5,8", "10-100:10", '
                                                 '"all" (the syntax of skip.<role>.steps).')] = None,
    role: Annotated[Optional[str], typer.Option("--role", help="Only this role's steps (rollout, rollout_tq, a stage "
                                                "name ...).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="Show what would be removed; remove nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
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
        print_json({"run": plan.run.path, "dry_run": dry_run,
                    "remove": [{"path": s.path, "role": s.role, "step": s.step, "bytes": s.bytes,
                                "recorded": iso_time(s.time)} for s in plan.remove],
                    "removed": removed, "kept": [s.path for s in plan.keep]})
        return
    verb = "would remove" if dry_run else "removed"
    for s in plan.remove:
        out.print(f"{verb} {escape(s.role or '?')} step {s.step}  {human_bytes(s.bytes)}  {human_time(s.time)}  "
                  f"{escape(_rel(s.path, plan.run.path))}")
    size = sum(s.bytes for s in plan.remove)
    out.print(f"{verb} {len(plan.remove)} step{'s' if len(plan.remove) != 1 else ''} ({human_bytes(size)}), "
              f"kept {len(plan.keep)}" + (" (dry run: nothing removed)" if dry_run else ""))


# --------------------------------------------------------------------------- convert


class Target(str, enum.Enum):
    safe = "safe"
    verl = "verl"


@app.command("convert")
@_errors
def convert_command(
    src: Annotated[str, typer.Argument(metavar="SRC", help="The cache to read: a dump_dir, experiment or run directory.",
                                       show_default=False)],
    dst: Annotated[str, typer.Argument(metavar="DST", help="Where to write; SRC's layout is kept below it.", show_default=False)],
    to: Annotated[Target, typer.Option("--to", help="safe: safetensors + JSON, no pickle. verl: the files verl 0.9 "
                                       "reads (gen_batch.dp, tq_batch.pt for V1 entries).", show_default=False)],
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Read pickle-based entries (caches verl "
                                               "wrote) through the allow-list unpickler.")] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace entries that exist in DST.")] = False,
    role: Annotated[Optional[str], typer.Option("--role", help="Only this role's steps.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Convert a cache to another format (safe or verl), keeping its layout and meta.json.

    meta.json keeps global_steps, num_trajectories, run id, fingerprint ... Handles gen_batch.dp entries and V1 tq_batch.pt entries. Every entry is written atomically with
    checksums, then read back and compared with its source. Invalid source steps are left out
    (exit code 1).

    [bold]Examples[/]
      stepskip convert ~/.verl/rollout_dump /data/safe_dump --to safe --allow-pickle
      stepskip convert /data/safe_dump /data/for_verl --to verl
    """
    from stepskip.cli.convert import convert_cache, plan_convert

    total = len(plan_convert(src, dst, to.value, allow_pickle, overwrite, role)[0])
    with _progress("converting", total) as advance:
        report = convert_cache(src, dst, to.value, allow_pickle=allow_pickle, overwrite=overwrite, role=role,
                               on_entry=advance)
    if as_json:
        print_json({"src": os.path.abspath(os.path.expanduser(src)), "dst": os.path.abspath(os.path.expanduser(dst)),
                    "to": to.value, "ok": report.ok, "converted": report.converted, "failed": report.failed,
                    "skipped": report.skipped})
    else:
        src_root = os.path.abspath(os.path.expanduser(src))
        for done in report.converted:
            out.print(f"{escape(_rel(done.source, src_root))}: {done.source_format} -> {done.dest_format}  "
                      f"{human_bytes(done.bytes)}  verified")
        for done in report.failed:
            out.print(f"[red]failed[/] {escape(_rel(done.source, src_root))}: {escape(done.error or '')}")
        for issue in report.skipped:
            out.print(f"[yellow]skipped[/] {escape(_rel(issue.path, src_root))}: {issue.kind.value}: "
                      f"{escape(issue.detail)}")
        dst_root = os.path.abspath(os.path.expanduser(dst))
        out.print(f"converted {len(report.converted)} entr{'y' if len(report.converted) == 1 else 'ies'} to "
                  f"{to.value} under {escape(dst_root)}"
                  + (f"; {len(report.failed)} failed" if report.failed else "")
                  + (f"; {len(report.skipped)} invalid source entr{'y' if len(report.skipped) == 1 else 'ies'} "
                     "left out" if report.skipped else ""))
    if not report.ok:
        raise typer.Exit(1)


# --------------------------------------------------------------------------- show


def _load_tokenizer(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise CliError("--tokenizer needs the transformers package (pip install transformers)") from error
    local = os.path.expanduser(path)
    try:
        return AutoTokenizer.from_pretrained(local, local_files_only=True)
    except Exception as error:  # a third-party loader's boundary: any failure means "not a usable tokenizer"
        where = "no such directory" if not os.path.exists(local) else f"{type(error).__name__}: {error}"
        raise CliError(f"--tokenizer {path}: cannot load a Hugging Face tokenizer ({where}); pass a local "
                       "tokenizer or model directory") from None


def _tokens(ids: list[int] | None, tokenizer: Any, limit: int) -> str:
    if ids is None:
        return "-"
    if tokenizer is not None:
        return repr(tokenizer.decode(ids, skip_special_tokens=False))
    shown = ids if not limit or len(ids) <= limit else ids[:limit]
    more = f" … (+{len(ids) - len(shown)} more)" if len(shown) < len(ids) else ""
    return "[" + ", ".join(map(str, shown)) + "]" + more


@app.command("show")
@_errors
def show_command(
    entry: Annotated[str, typer.Argument(metavar="ENTRY", help="A step directory (or V1 inner entry), or a run directory with --step.",
                                         show_default=False)],
    step: Annotated[Optional[int], typer.Option("--step", "-s", help="The step inside a run directory.")] = None,
    rows: Annotated[int, typer.Option("--rows", "-r", help="How many trajectories to print.")] = 3,
    tokenizer: Annotated[Optional[str], typer.Option("--tokenizer", "-t", help="A local Hugging Face tokenizer "
                                                     "(or model) directory: decode token ids to text.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Token ids printed per prompt/response without "
                                            "--tokenizer (0: all).")] = 64,
    allow_pickle: Annotated[bool, typer.Option("--allow-pickle", help="Decode pickle-based entries through the "
                                               "allow-list unpickler.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (token ids, and text with --tokenizer).")] = False,
) -> None:
    """Print sample trajectories of an entry: prompt, response and reward.

    Padding is removed with the attention / response masks. Without --tokenizer token ids are
    printed; the tokenizer is loaded offline (local files only).

    [bold]Examples[/]
      stepskip show RUN_DIR/12
      stepskip show RUN_DIR --step 12 --rows 5 --tokenizer /models/Qwen2.5-7B-Instruct
    """
    from stepskip.cli.content import read_step, sample_rows
    from stepskip.cli.scan import resolve_target
    from stepskip.cli.scan import local_store

    if rows < 0:
        raise CliError(f"--rows {rows} is not valid; expected a count >= 0")
    step_dir, inner = resolve_target(entry, step)
    issues = step_dir.issues()
    if issues:
        raise CliError(f"{step_dir.path} is not a valid entry: {issues[0].kind.value}: {issues[0].detail}")
    from stepskip.errors import CorruptEntryError

    try:
        value = read_step(local_store(step_dir.path), step_dir, allow_pickle, inner)
    except CorruptEntryError as error:
        err.print(f"[bold red]damaged:[/] {escape(str(error))}")
        raise typer.Exit(1) from None
    tok = _load_tokenizer(tokenizer) if tokenizer else None
    samples = sample_rows(value, rows)
    if as_json:
        data = [_plain(s) for s in samples]
        if tok is not None:
            for item, s in zip(data, samples):
                item["prompt_decoded"] = None if s.prompt is None else tok.decode(s.prompt)
                item["response_decoded"] = None if s.response is None else tok.decode(s.response)
        print_json({"path": inner.path if inner else step_dir.path, "step": step_dir.step, "rows": data})
        return
    out.print(f"[bold]{escape(inner.path if inner else step_dir.path)}[/]  step {step_dir.step}, "
              f"showing {len(samples)} row{'s' if len(samples) != 1 else ''}")
    for s in samples:
        head = f"[bold]row {s.index}[/]"
        if s.id is not None:
            head += f"  id {escape(s.id)}"
        if s.reward is not None:
            head += f"  reward {s.reward:.4g}"
        for key, value_text in s.extra.items():
            head += f"  {escape(key)} {escape(value_text)}"
        out.print(head)
        if s.prompt is not None or s.prompt_text is None:
            count = "" if s.prompt is None else f" ({len(s.prompt)} tokens)"
            out.print(f"  prompt{count}: {escape(_tokens(s.prompt, tok, max_tokens))}")
        else:
            out.print(f"  prompt: {escape(s.prompt_text)}")
        count = "" if s.response is None else f" ({len(s.response)} tokens)"
        out.print(f"  response{count}: {escape(_tokens(s.response, tok, max_tokens))}")


# --------------------------------------------------------------------------- demo


@app.command("demo", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def demo_command(ctx: typer.Context) -> None:
    """Run the demo pipeline (stepskip.pipelines.demo); every argument, --help included, goes to it.

    [bold]Examples[/]
      stepskip demo --help
      stepskip demo skip.rollout.dump_dir=/tmp/rollout_dump
    """
    try:
        from stepskip.pipelines.demo import main as demo_main
    except ImportError as error:
        message = (f"the demo pipeline is not available: cannot import stepskip.pipelines.demo ({error}); "
                   "install stepskip with its pipelines extra: pip install 'stepskip[pipelines]'")
        err.print(f"[bold red]error:[/] {escape(message)}")
        raise typer.Exit(2) from None
    code = demo_main(list(ctx.args))
    raise typer.Exit(int(code or 0))
