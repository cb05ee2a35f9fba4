"""Terminal and JSON output of the commands (rich on stdout; errors and progress on stderr)."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from stepskip._index import EntryRecord, IssueKind, RunDir, compress_steps

if TYPE_CHECKING:  # types only: importing them at run time would load torch for every command
    from stepskip.cli.content import SampleRow
    from stepskip.cli.convert import ConvertReport
    from stepskip.cli.describe import EntryInfo
    from stepskip.cli.prune import PrunePlan
    from stepskip.cli.verify import RepairResult, VerifyReport

__all__ = ["err", "out", "plural", "print_json", "progress"]

logger = logging.getLogger(__name__)

# Long lines are not cut (soft wrap): the output stays greppable and pastes whole.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
_unbounded = Console(highlight=False, width=10_000)  # tables written to a pipe or file: natural width


# --------------------------------------------------------------------------- small formatters


def human_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_time(t: float | None) -> str:
    """``t`` as local time; ``?`` for one no calendar holds (a time in a cache is anything its writer put)."""
    if t is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    except (OverflowError, ValueError, OSError):
        return "?"


def iso_time(t: float | None) -> str | None:
    """``t`` in ISO 8601, UTC; None as for an unknown time where no calendar holds it."""
    try:
        return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
    except (OverflowError, ValueError, OSError):
        return None


def plural(count: int, one: str, many: str | None = None) -> str:
    """``plural(2, "entry", "entries")`` -> ``"2 entries"``."""
    return f"{count} {one if count == 1 else (many or one + 's')}"


def relative(path: str, root: str) -> str:
    """``path`` below ``root`` when it is (local paths and URLs alike), else unchanged."""
    prefix = root.rstrip("/") + "/"
    return path[len(prefix):] if path.startswith(prefix) else path


def plain(value: Any) -> Any:
    """Data classes, enums and containers as JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(plain(data), indent=2) + "\n")


@contextmanager
def progress(label: str, total: int) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr; silent when stderr is not a terminal. Yields the advance callback."""
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err, transient=True, disable=not err.is_terminal)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda *_: bar.advance(task)


def _table(*columns: str, right: tuple[str, ...] = ()) -> Table:
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in columns:  # on a narrow terminal, long cells fold onto a second line: nothing is cut off
        table.add_column(column, justify="right" if column in right else "left", overflow="fold")
    return table


def _print_table(table: Table) -> None:
    """A table fitted to the terminal; unwrapped when stdout is a pipe or a file (grep, logs)."""
    if out.is_terminal:
        out.print(table)
    else:
        _unbounded.print(table)


# --------------------------------------------------------------------------- ls


def ls_json(runs: list[RunDir], root: str) -> dict[str, Any]:
    listing = []
    for run in runs:
        roles = run.roles()
        newest = max((r.newest for r in roles if r.newest is not None), default=None)
        listing.append({
            "path": run.path, "name": run.name, "experiment_project": run.name.split("/")[0], "shape": run.shape,
            "entries": sum(r.entries for r in roles), "bytes": sum(s.bytes for s in run.steps),
            "newest": iso_time(newest), "problems": len(run.issues()),
            "roles": [{"role": r.role, "formats": r.formats, "steps": r.steps, "steps_spec": compress_steps(r.steps),
                       "invalid_steps": r.invalid_steps, "entries": r.entries, "bytes": r.bytes,
                       "newest": iso_time(r.newest), "newest_unix": r.newest} for r in roles],
        })
    return {"dump_dir": root, "runs": listing}


def render_ls(runs: list[RunDir], root: str, given: str) -> None:
    if not runs:
        out.print(f"no runs cached under {escape(root)}")
        return
    table = _table("RUN", "ROLE", "FORMAT", "STEPS", "ENTRIES", "SIZE", "NEWEST", right=("ENTRIES", "SIZE"))
    entries = size = problems = 0
    kinds: set[str] = set()
    for run in runs:
        roles = run.roles()
        issues = run.issues()
        problems += len(issues)
        kinds.update(i.kind.value for i in issues)
        size += sum(s.bytes for s in run.steps)
        if not roles:
            table.add_row(escape(run.name), "-", "-", "-", "0", human_bytes(sum(s.bytes for s in run.steps)), "-")
        for i, r in enumerate(roles):
            entries += r.entries
            steps = compress_steps(r.steps) or "-"
            if r.invalid_steps:
                steps += f" [yellow](+{len(r.invalid_steps)} invalid)[/]"
            table.add_row(escape(run.name) if i == 0 else "", escape(r.role), ", ".join(r.formats), steps,
                          str(r.entries), human_bytes(r.bytes), human_time(r.newest))
    _print_table(table)
    out.print(f"{plural(len(runs), 'run')}, {plural(entries, 'entry', 'entries')}, {human_bytes(size)}")
    if problems:
        out.print(f"[yellow]{plural(problems, 'problem')} ({', '.join(sorted(kinds))}): "
                  f"run `stepskip verify {escape(given)}` for details[/]")


# --------------------------------------------------------------------------- info


def _generation_seconds(info: EntryInfo) -> float | None:
    seconds = [e.meta.get("generation_seconds") for e in info.entries if e.meta]
    values = [s for s in seconds if isinstance(s, (int, float)) and not isinstance(s, bool)]
    return sum(values) if values else None


def _entry_json(e: EntryRecord) -> dict[str, Any]:
    return {"path": e.path, "inner": e.inner, "role": e.role, "format": e.format, "state": e.state.value,
            "reason": e.reason, "written_by": e.written_by, "run_id": e.run_id, "bytes": e.bytes,
            "recorded": iso_time(e.time), "meta": e.meta}


def info_json(info: EntryInfo) -> dict[str, Any]:
    data = plain(info)
    data["entries"] = [_entry_json(e) for e in info.entries]
    data["generation_seconds"] = _generation_seconds(info)
    data["fingerprint"] = (info.meta or {}).get("fingerprint")
    return data


def render_info(info: EntryInfo) -> None:
    meta = info.meta or {}
    entry = info.entries[0] if info.entries else None
    v1 = info.kind == "v1"
    out.print(f"[bold]{escape(info.path)}[/]")
    step = str(info.step)
    if meta.get("global_steps") not in (None, info.step):
        step += f" (global_steps {meta['global_steps']})"
    seconds = _generation_seconds(info)
    pairs = [
        ("role", str(info.role or "?")), ("kind", info.kind), ("step", step),
        ("format", ", ".join(sorted({e.format for e in info.entries if e.format})) or "-"),
        ("written by", entry.written_by if entry else "-"),
        ("recorded", human_time(entry.time) if entry else "-"),
        ("size", human_bytes(sum(e.bytes for e in info.entries))),
    ]
    if info.rows is not None:
        pairs.append(("rows", str(info.rows)))
    if "num_trajectories" in meta and not v1:
        pairs.append(("trajectories", str(meta["num_trajectories"])))
    pairs.append(("generation", "not recorded" if seconds is None else f"{seconds:.3f} s recorded"))
    for key in ("run_id", "prompt_digest", "parameter_sync_step", "converted_from"):
        if meta.get(key) is not None and not (key == "run_id" and v1):
            pairs.append((key.replace("_", " "), str(meta[key])))
    inputs = meta.get("inputs")
    if isinstance(inputs, dict):
        keywords = ", ".join(map(str, inputs.get("kwargs") or [])) or "none"
        pairs.append(("inputs", f"{inputs.get('args')} positional, keyword: {keywords} (stepskip rerun can call a "
                                "function on them)"))
    width = max(len(key) for key, _ in pairs)
    for key, value in pairs:
        out.print(f"[bold]{key:<{width}}[/]  {escape(value)}")
    fingerprint = meta.get("fingerprint")
    if isinstance(fingerprint, dict):
        out.print("[bold]fingerprint[/]" + ("" if fingerprint else "  (empty: no rollout settings were set)"))
        for key, value in fingerprint.items():
            out.print(f"  {escape(str(key))} = {escape(repr(value))}")
    if v1:
        table = _table("INNER", "RUN ID", "TRAJECTORIES", "FORMAT", "SIZE", "STATE")
        for e in info.entries:
            state = e.state.value + (f": {e.reason}" if e.reason else "")
            table.add_row(str(e.inner), escape(e.run_id or "-"), str((e.meta or {}).get("num_trajectories", "-")),
                          e.format or "-", human_bytes(e.bytes), escape(state))
        out.print("[bold]inner entries[/]")
        _print_table(table)
    elif info.kind == "calls":
        table = _table("CALL", "RUN ID", "FORMAT", "SIZE", "STATE")
        for e in info.entries:
            state = e.state.value + (f": {e.reason}" if e.reason else "")
            table.add_row(escape(str(e.call)), escape(e.run_id or "-"), e.format or "-", human_bytes(e.bytes),
                          escape(state))
        out.print("[bold]call entries[/]")
        _print_table(table)
    elif isinstance(meta.get("files"), dict):
        out.print("[bold]files[/]")
        for name, item in meta["files"].items():
            item = item if isinstance(item, dict) else {}
            out.print(f"  {escape(name)}  {human_bytes(item.get('bytes'))}  {escape(str(item.get('checksum', '')))}")
    elif entry is not None and entry.meta is not None:
        out.print("[bold]files[/]  (written by verl: meta.json lists no files or checksums)")
    if info.fields:
        table = _table("FIELD", "KIND", "DTYPE", "SHAPE", "BYTES", right=("BYTES",))
        for f in info.fields:
            shape = "[" + ", ".join(map(str, f.shape)) + "]"
            table.add_row(escape(f.name), f.kind, f.dtype, escape(shape), human_bytes(f.bytes))
        out.print("[bold]fields[/]")
        _print_table(table)
    for stat in info.stats:
        out.print(f"[bold]{stat.name}[/] ({escape(stat.source)}): n={stat.count}  min {stat.min:.4g}  "
                  f"mean {stat.mean:.4g}  max {stat.max:.4g}")
    if info.meta_info:
        out.print("[bold]meta_info[/]")
        for key, value in info.meta_info.items():
            text = repr(value)
            out.print(f"  {escape(str(key))} = {escape(text if len(text) < 200 else text[:200] + '…')}")
    render_drift(info.drift, info.entries)
    for issue in info.issues:
        out.print(f"[red]{issue.kind.value}[/]: {escape(issue.path)}: {escape(issue.detail)}")
    if info.note:
        out.print(f"[yellow]{escape(info.note)}[/]")


def _figure(value: Any) -> float | None:
    """A number of a drift record (a record is a file someone else may have written: anything else is None)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def drift_line(record: dict[str, Any]) -> str:
    """One drift record in a line: verdict, token match, worst field and its figures (rich markup)."""
    if record.get("damaged"):
        return f"[red]not compared[/]: the entry was damaged ({escape(str(record.get('reason', '')))})"
    verdict = ("[green]matches[/]" if record.get("passed") is True else "[yellow]saw other prompts than[/]"
               if record.get("prompts_equal") is False else "[bold red]drifted from[/]")
    parts = [f"step {escape(str(record.get('step')))} {verdict} its recording"]
    token_match, worst_match = _figure(record.get("token_match")), _figure(record.get("worst_match"))
    worst_delta, first_row = _figure(record.get("worst_delta")), _figure(record.get("first_row"))
    if token_match is not None:
        parts.append(f"token match {token_match:.4g}")
    if record.get("worst_field") is not None:
        worst = f"worst field {escape(repr(str(record['worst_field'])))}"
        if worst_match is not None:
            worst += f" {worst_match:.4g}"
        if worst_delta is not None:
            worst += f", max |delta| {worst_delta:.4g}"
        if first_row is not None:
            worst += f", first row {int(first_row)}"
        parts.append(worst)
    if isinstance(record.get("prompts_equal"), bool):
        parts.append(f"prompts {'equal' if record['prompts_equal'] else 'differ'}")
    parts.append(f"train_on {escape(str(record.get('train_on', '?')))}")
    return "; ".join(parts)


def render_drift(records: list[dict[str, Any]], entries: list[EntryRecord]) -> None:
    """The drift records of a step (``action: compare``), each noted when made against an earlier recording."""
    if not records:
        return
    runs = {e.run_id for e in entries}
    out.print("[bold]drift[/] (action: compare)")
    for record in records:
        entry = record.get("entry")
        entry = entry if isinstance(entry, dict) else {}
        run_id = entry.get("run_id")
        stale = isinstance(run_id, str) and runs and run_id not in runs
        compared = _figure(record.get("compared_unix"))
        when = human_time(compared) if compared is not None else "?"
        out.print(f"  {drift_line(record)}; compared {when}" + (" [yellow](against an earlier recording of this "
                                                                  "step)[/]" if stale else ""))


# --------------------------------------------------------------------------- verify


def verify_json(report: VerifyReport, result: RepairResult | None, root: str) -> dict[str, Any]:
    data = plain(report)
    data["dump_dir"] = root
    data["clean"] = report.clean
    if result is not None:
        data["repaired"] = result.removed
        data["kept"] = plain(result.kept)
    return data


def render_verify(report: VerifyReport, result: RepairResult | None, root: str, grace: str) -> None:
    checked = (f"checked {plural(report.entries, 'entry', 'entries')} in {plural(report.runs, 'run')}: "
               f"{report.checksummed} against their checksums")
    if report.decoded:
        checked += f", {report.decoded} decoded"
    out.print(checked)
    if report.unverified:
        out.print(f"{plural(len(report.unverified), 'entry', 'entries')} written by verl carry no checksums "
                  "(only presence checked; --deep --allow-pickle decodes them)")
    width = max((len(p.kind.value) for p in report.problems), default=0)
    for p in report.problems:  # one line each: easy to grep
        recent = f" (modified less than {grace} ago: may be in progress)" if p.recent else ""
        detail = _without_path(p.detail, p.path)
        out.print(f"[red]{p.kind.value:<{width}}[/]  {escape(relative(p.path, root))}: {escape(detail)}{recent}")
    for path in report.others:
        out.print(f"[dim]not part of the cache layout, left alone: {escape(relative(path, root))}[/]")
    for path in report.links:
        out.print(f"[dim]symbolic link, not followed, left alone: {escape(relative(path, root))}[/]")
    if result is not None and report.problems:
        for path in sorted(result.removed):
            out.print(f"removed {escape(relative(path, root))}")
        unreadable = [p for p in result.kept if p.kind in (IssueKind.UNSUPPORTED, IssueKind.UNDECODABLE)]
        shadowed = [p for p in result.kept if p.kind is IssueKind.SHADOWED]
        unavailable = [p for p in result.kept if p.kind is IssueKind.UNAVAILABLE]
        in_progress = [p for p in result.kept if p not in unreadable and p not in shadowed and p not in unavailable]
        if unreadable:
            out.print(f"[yellow]kept {plural(len(unreadable), 'entry', 'entries')} this stepskip cannot read "
                      "(intact: never removed; upgrade stepskip, or re-record with action: record)[/]")
        if shadowed:
            out.print(f"[yellow]kept {plural(len(shadowed), 'in-place inner directory', 'in-place inner directories')} "
                      "written after the manifest beside them (never removed: remove them yourself if unwanted)[/]")
        if unavailable:
            out.print(f"[yellow]kept {plural(len(unavailable), 'entry', 'entries')} the store did not answer for "
                      "(a timeout, a connection error or a 5xx: never removed; run verify again when it answers)[/]")
        if in_progress:
            out.print(f"[yellow]kept {plural(len(in_progress), 'problem')} modified less than {grace} ago "
                      "(a write may be in progress; --grace 0 removes them)[/]")
    elif report.problems:
        out.print(f"[red]{plural(len(report.problems), 'problem')}[/]; "
                  "`stepskip verify --repair` removes what can never become valid")
    else:
        out.print("[green]no problems found[/]")


# --------------------------------------------------------------------------- prune


def _without_path(detail: str, path: str) -> str:
    """A message without the path it starts with (the line names it already)."""
    for prefix in (f"{path}: ", f"{path} "):
        if detail.startswith(prefix):
            return detail[len(prefix):]
    return detail


def prune_json(plan: PrunePlan, removed: list[str], dry_run: bool) -> dict[str, Any]:
    return {"run": plan.run.path, "dry_run": dry_run,
            "remove": [{"path": s.path, "role": s.role, "step": s.step, "bytes": s.bytes,
                        "recorded": iso_time(s.time)} for s in plan.remove],
            "removed": removed, "kept": [s.path for s in plan.keep], "protected": plain(plan.protected)}


def render_prune(plan: PrunePlan, dry_run: bool) -> None:
    verb = "would remove" if dry_run else "removed"
    for issue in plan.protected:
        out.print(f"[yellow]kept[/] {escape(issue.path)}: {issue.kind.value}: "
                  f"{escape(_without_path(issue.detail, issue.path))}")
    for s in plan.remove:
        out.print(f"{verb} {escape(s.role or '?')} step {s.step} ({human_bytes(s.bytes)}, "
                  f"recorded {human_time(s.time)})")
    size = sum(s.bytes for s in plan.remove)
    out.print(f"{verb} {plural(len(plan.remove), 'step')} ({human_bytes(size)}), kept {len(plan.keep)}"
              + (" (dry run: nothing removed)" if dry_run else ""))


# --------------------------------------------------------------------------- convert


def render_convert(report: ConvertReport, src_root: str, dst_root: str, to: str) -> None:
    for done in report.converted:
        out.print(f"{escape(relative(done.dest, dst_root))}: {done.source_format} -> {done.dest_format}  "
                  f"{human_bytes(done.bytes)}  verified")
    for done in report.failed:
        out.print(f"[red]failed[/] {escape(relative(done.source, src_root))}: {escape(done.error or '')}")
    for issue in report.skipped:
        out.print(f"[yellow]skipped[/] {escape(relative(issue.path, src_root))}: {issue.kind.value}: "
                  f"{escape(issue.detail)}")
    summary = f"converted {plural(len(report.converted), 'entry', 'entries')} to {to} under {escape(dst_root)}"
    if report.failed:
        summary += f"; {len(report.failed)} failed"
    if report.skipped:
        summary += f"; {plural(len(report.skipped), 'invalid source entry', 'invalid source entries')} left out"
    out.print(summary)


# --------------------------------------------------------------------------- show


def _decoded(tokenizer: Any, ids: list[int]) -> str | None:
    """The text of ``ids``; None when the tokenizer cannot take them (a float column, ids outside its vocabulary)."""
    try:
        return str(tokenizer.decode(ids, skip_special_tokens=False))
    except Exception as err:  # an entry's columns are anything its writer put: the ids are shown instead
        logger.debug("tokenizer could not decode %d ids: %s", len(ids), err)
        return None


def _tokens(ids: list[int] | None, tokenizer: Any, limit: int) -> str:
    if ids is None:
        return "-"
    if tokenizer is not None and (text := _decoded(tokenizer, ids)) is not None:
        return repr(text)
    shown = ids if not limit or len(ids) <= limit else ids[:limit]
    more = f" … (+{len(ids) - len(shown)} more)" if len(shown) < len(ids) else ""
    return "[" + ", ".join(map(str, shown)) + "]" + more


def show_json(path: str, step: int, samples: list[SampleRow], tokenizer: Any,
              drift: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    rows = [plain(s) for s in samples]
    if tokenizer is not None:
        for row, s in zip(rows, samples):
            row["prompt_decoded"] = None if s.prompt is None else _decoded(tokenizer, s.prompt)
            row["response_decoded"] = None if s.response is None else _decoded(tokenizer, s.response)
    return {"path": path, "step": step, "rows": rows, "drift": drift or []}


def render_show(path: str, step: int, samples: list[SampleRow], tokenizer: Any, max_tokens: int,
                drift: list[dict[str, Any]] | None = None) -> None:
    out.print(f"[bold]{escape(path)}[/]  step {step}, showing {plural(len(samples), 'row')}")
    for record in drift or []:
        out.print(f"drift (action: compare): {drift_line(record)}")
    for s in samples:
        head = f"[bold]row {s.index}[/]"
        if s.id is not None:
            head += f"  id {escape(s.id)}"
        if s.reward is not None:
            head += f"  reward {s.reward:.4g}"
        for key, text in s.extra.items():
            head += f"  {escape(key)} {escape(text)}"
        out.print(head)
        if s.prompt is None and s.prompt_text is not None:
            out.print(f"  prompt: {escape(s.prompt_text)}")
        else:
            count = "" if s.prompt is None else f" ({len(s.prompt)} tokens)"
            out.print(f"  prompt{count}: {escape(_tokens(s.prompt, tokenizer, max_tokens))}")
        count = "" if s.response is None else f" ({len(s.response)} tokens)"
        out.print(f"  response{count}: {escape(_tokens(s.response, tokenizer, max_tokens))}")
