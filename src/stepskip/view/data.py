"""What ``stepskip view`` and ``stepskip report`` show, as JSON-ready dicts, read through the cache index.

Every entry is named by what the index listed (a run's name, a role, a step number), never by a
path taken from a request: a name the listing does not hold is refused (:class:`ViewNotFound`),
so nothing outside the dump dir can be reached, whatever a URL says. Nothing here writes.

Example:
    >>> source = ViewSource("~/.verl/rollout_dump")  # doctest: +SKIP
    >>> source.step_page("exp_proj/GBS4_N2_in8_out6", "rollout", 12, limit=5)["rows"][0]["reward"]  # doctest: +SKIP
    1.0
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stepskip.errors import CacheMissError, SkipConfigError, UnreadableEntryError
from stepskip._index import CacheIndex, IssueKind, RunDir, StepDir
from stepskip.view.follow import FOLLOW_SECONDS, LIVE_SECONDS, is_live, run_signature
from stepskip.view.groups import equal_reward_groups, sum_equal_groups
from stepskip.view.tokens import TokenStrips, fingerprint_tokenizer

__all__ = ["MAX_PAGE", "StepRows", "ViewError", "ViewNotFound", "ViewSource", "compare_groups", "percentiles",
           "query_rows"]

logger = logging.getLogger(__name__)

#: The most rows one page of a step holds.
MAX_PAGE = 500
#: Characters of a prompt or response kept per row (the page shows text, not whole documents).
TEXT_LIMIT = 4000
#: Decoded steps kept in memory by the server.
CACHED_STEPS = 4
HISTOGRAM_BINS = 20


class ViewError(Exception):
    """A request the view cannot answer (shown to the user as its message)."""

    status = 400


class ViewNotFound(ViewError):
    """A run, role or step that the cache's listing does not hold."""

    status = 404


class EntryProblem(ViewError):
    """An entry that is damaged, unreadable here or pickle-based without ``--allow-pickle``."""

    status = 422

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class StepRows:
    """One decoded step as rows the page shows.

    Args:
        rows: one dict per trajectory (``i``, ``group``, ``prompt``, ``response``, ``reward``, ``length`` ...).
        columns: which optional columns exist (``reward``, ``length``, ``group``, ``text``).
        max_length: the response length a row hits when it was cut off (the run's ``out``, else the widest row).
        reward_source, length_source: the columns rewards and lengths were read from.
        strips: the per-token columns of the rows (log-probs), when the step has any.
        tokenizer: what decoded the text (``--tokenizer``, the directory the fingerprint names ...), or None.
    """

    rows: list[dict[str, Any]]
    columns: list[str]
    max_length: int | None
    reward_source: str | None
    length_source: str | None
    strips: TokenStrips | None = None
    tokenizer: str | None = None


def _finite(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(float(v))]


def percentiles(values: Sequence[Any]) -> dict[str, float] | None:
    """Count, mean, min, p10, p50, p90 and max of the finite values (None when there are none).

    Example:
        >>> percentiles([1, 2, 3, 4])["p50"]
        2.5
    """
    data = sorted(_finite(values))
    if not data:
        return None

    def at(q: float) -> float:
        pos = q * (len(data) - 1)
        low, high = math.floor(pos), math.ceil(pos)
        return data[low] + (data[high] - data[low]) * (pos - low)

    return {"count": len(data), "mean": sum(data) / len(data), "min": data[0], "p10": at(0.1), "p50": at(0.5),
            "p90": at(0.9), "max": data[-1]}


def histogram(values: Sequence[Any], bins: int = HISTOGRAM_BINS, integer: bool = False) -> dict[str, Any] | None:
    """Bin edges and counts of the finite values; integer data gets one bin per value when few enough."""
    data = _finite(values)
    if not data:
        return None
    low, high = min(data), max(data)
    integer = integer or all(v.is_integer() for v in data)  # 0/1 rewards: one bar per value
    if integer and high - low + 1 <= bins * 2:
        edges = [low + i for i in range(int(high - low) + 2)]
    elif high == low:
        edges = [low, low + 1]
    else:
        width = (high - low) / bins
        edges = [low + i * width for i in range(bins + 1)]
    counts = [0] * (len(edges) - 1)
    for v in data:
        i = min(int((v - edges[0]) / (edges[1] - edges[0])), len(counts) - 1)
        counts[i] += 1
    return {"edges": edges, "counts": counts}


def query_rows(rows: Sequence[dict[str, Any]], sort: str | None = None, desc: bool = False,
               filters: Sequence[str] = (), q: str = "", max_length: int | None = None) -> list[dict[str, Any]]:
    """The rows a table shows: filtered (``reward0``, ``lenmax``), searched (case-insensitive text) and sorted.

    The page's script does the same for a report (``view/static/app.js``, ``queryRows``).

    Example:
        >>> query_rows([{"i": 0, "reward": 1.0}, {"i": 1, "reward": 0.0}], filters=["reward0"])
        [{'i': 1, 'reward': 0.0}]
    """
    out = list(rows)
    for name in filters:
        if name == "reward0":
            out = [r for r in out if r.get("reward") == 0]
        elif name == "lenmax":
            out = [r for r in out if max_length is not None and (r.get("length") or 0) >= max_length]
        elif name:
            raise ViewError(f"unknown filter {name!r}: use reward0 or lenmax")
    needle = q.strip().lower()
    if needle:
        out = [r for r in out if needle in _row_text(r)]
    if sort:
        if sort not in ("i", "key", "group", "reward", "length", "prompt", "response"):
            raise ViewError(f"cannot sort by {sort!r}: use i, key, group, reward, length, prompt or response")
        present = [r for r in out if r.get(sort) is not None]
        missing = [r for r in out if r.get(sort) is None]
        out = sorted(present, key=lambda r: _sort_key(r[sort]), reverse=desc) + missing
    return out


def _sort_key(value: Any) -> tuple[int, Any]:
    if isinstance(value, (int, float)):
        return (0, value)
    return (1, str(value))


def _row_text(row: Mapping[str, Any]) -> str:
    parts = [str(row.get(k) or "") for k in ("prompt", "response", "group", "key", "data_source")]
    return " ".join(parts).lower()


def compare_groups(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two steps' rows side by side, group by group: matched by GRPO group (uid) when the steps share groups
    (the same step of two runs), else by the groups' order (two steps of one run).

    Example:
        >>> g = compare_groups([{"group": "u0", "reward": 1.0, "length": 3}], [{"group": "v0", "reward": 0.0}])
        >>> g[0]["a"]["mean_reward"], g[0]["b"]["mean_reward"]
        (1.0, 0.0)
    """
    ga, gb = _groups(a), _groups(b)
    shared = set(ga) & set(gb)
    pairs: list[tuple[str | None, str | None]]
    if shared:
        keys = list(ga) + [k for k in gb if k not in ga]
        pairs = [(k if k in ga else None, k if k in gb else None) for k in keys]
    else:
        la, lb = list(ga), list(gb)
        pairs = [(la[i] if i < len(la) else None, lb[i] if i < len(lb) else None) for i in range(max(len(la), len(lb)))]
    out = []
    for n, (ka, kb) in enumerate(pairs):
        out.append({"n": n, "a": _group_summary(ka, ga.get(ka) if ka is not None else None),
                    "b": _group_summary(kb, gb.get(kb) if kb is not None else None)})
    return out


def _groups(rows: Sequence[dict[str, Any]]) -> OrderedDict[str, list[dict[str, Any]]]:
    groups: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
    for row in rows:
        key = row.get("group")
        groups.setdefault(str(key) if key is not None else f"row {row.get('i')}", []).append(row)
    return groups


def _group_summary(key: str | None, rows: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    if key is None or rows is None:
        return None
    rewards = _finite([r.get("reward") for r in rows])
    lengths = _finite([r.get("length") for r in rows])
    return {"group": key, "rows": rows, "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "mean_length": sum(lengths) / len(lengths) if lengths else None}


def _group_of(key: str) -> str:
    """A V1 queue key ``{uid}_{session}_{turn}`` belongs to the prompt group ``uid``."""
    parts = key.rsplit("_", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else key


class ViewSource:
    """A dump dir opened for viewing: listings, pages of a step's rows, distributions, trends, comparisons.

    Args:
        root: a dump dir, an experiment or run directory: a local path or a URL (``memory://``, ``s3://``).
        storage_options: fsspec options for a URL.
        allow_pickle: decode verl-written (pickle-based) entries through the allow-list unpickler.
        tokenizer: a loaded Hugging Face tokenizer (text instead of token ids), or None: then a run whose
            fingerprint names a local tokenizer directory is decoded with it (see :mod:`stepskip.view.tokens`),
            and entries of stepskip's reference pipelines (``stepskip demo``) with their character tokenizer.
        follow: the page asks every few seconds whether the cache changed, and shows new steps.
        live_seconds: a run whose newest step (or staged write) is younger than this is marked as being written.

    Raises:
        NotACacheError: ``root`` holds no cache.
    """

    def __init__(self, root: str, storage_options: Mapping[str, Any] | None = None, allow_pickle: bool = False,
                 tokenizer: Any = None, follow: bool = False, live_seconds: float = LIVE_SECONDS) -> None:
        self.index = CacheIndex(root, storage_options)
        self.allow_pickle = allow_pickle
        self.tokenizer = tokenizer
        self.follow_changes = follow
        self.live_seconds = float(live_seconds)
        self._version = 0
        self._signatures: dict[str, tuple[tuple[Any, ...], float | None]] = {}  # run path -> its listing
        self._followed = 0.0
        self._lock = threading.Lock()
        self._steps: OrderedDict[tuple[str, str, int], StepRows] = OrderedDict()
        self._runs: dict[str, RunDir] = {}
        self._drift_names: dict[str, frozenset[str]] = {}  # directory of steps -> names of its drift records
        self.refresh()

    def refresh(self) -> None:
        """Scan the cache again (new steps, removed ones)."""
        paths = self.index.find_run_dirs()
        signatures = {p: run_signature(self.index.store, p) for p in paths}  # before the scan: a step
        runs = {run.name: run for run in (self.index.scan_run(p) for p in paths)}  # landing between is seen next
        with self._lock:
            self._runs = runs
            self._signatures = signatures
            self._steps.clear()
            self._drift_names = {}
            self._version += 1

    def follow(self, now: float | None = None) -> dict[str, Any]:
        """What ``--follow`` polls: the listing's ``version`` (it grows whenever a run changed) and the runs being
        written. Only runs whose directory listings changed are scanned again; the cache is looked at most
        once a second, however many pages ask.
        """
        now = time.time() if now is None else now
        with self._lock:
            due = now - self._followed >= 1.0 or now < self._followed
            if due:
                self._followed = now
        if due:
            self._rescan_changed()
        with self._lock:
            return {"version": self._version, "live": self._live_runs(now)}

    def _rescan_changed(self) -> None:
        from stepskip._index import NotACacheError

        try:
            paths = self.index.find_run_dirs()
        except NotACacheError:  # the cache went away meanwhile: show what was there
            return
        signatures = {p: run_signature(self.index.store, p) for p in paths}
        with self._lock:
            changed = [p for p in paths if self._signatures.get(p, (None,))[0] != signatures[p][0]]
            gone = [p for p in self._signatures if p not in signatures]
        scanned = {p: self.index.scan_run(p) for p in changed}
        with self._lock:
            if not changed and not gone:
                return
            names = {RunDir(p).name for p in [*changed, *gone]}
            runs = {n: r for n, r in self._runs.items() if n not in names}
            runs.update({r.name: r for r in scanned.values()})
            self._runs = dict(sorted(runs.items()))
            for p in gone:
                del self._signatures[p]
            self._signatures.update({p: signatures[p] for p in changed})
            for k in [k for k in self._steps if k[0] in names]:
                del self._steps[k]
            self._drift_names = {}
            self._version += 1
            logger.debug("follow: %d run(s) changed, %d gone (version %d)", len(changed), len(gone), self._version)

    def _live_runs(self, now: float) -> list[str]:
        out = []
        for path, (_, staged) in self._signatures.items():
            run = self._runs.get(RunDir(path).name)
            newest = max((s.time for s in run.steps if s.valid), default=None) if run is not None else None
            if is_live(newest, staged, now, self.live_seconds):
                out.append(RunDir(path).name)
        return sorted(out)

    # ----------------------------------------------------------------- names -> listed things

    def run(self, name: str) -> RunDir:
        run = self._runs.get(name)
        if run is None:
            raise ViewNotFound(f"no run {name!r} in this cache (runs: {', '.join(sorted(self._runs)) or 'none'})")
        return run

    def step_dir(self, run: str, role: str, step: int | str) -> StepDir:
        try:
            number = int(step)
        except (TypeError, ValueError):
            raise ViewNotFound(f"step {step!r} is not a step number") from None
        found = [s for s in self.run(run).steps if s.role == role and s.step == number]
        if not found:
            raise ViewNotFound(f"run {run!r} has no step {number} of role {role!r}")
        return found[0]

    # ----------------------------------------------------------------- listings

    def listing(self) -> dict[str, Any]:
        """Runs -> roles -> steps with size, age, rows, format, fingerprint, generation seconds and problems.

        Rows come from ``meta.json`` (V1 entries record them) or from a step already decoded; else None.
        """
        now = time.time()
        runs = []
        with self._lock:
            live = set(self._live_runs(now))
        for name, run in sorted(self._runs.items()):
            roles = []
            for summary in run.roles():
                steps = [self._step_summary(s, now) for s in run.steps if s.role == summary.role]
                for step in steps:  # meta.json records rows only for V1 entries; a step already read knows them
                    if step["rows"] is None and (table := self._steps.get((name, summary.role, step["step"]))):
                        step["rows"] = len(table.rows)
                roles.append({"role": summary.role, "formats": summary.formats, "bytes": summary.bytes,
                              "valid_steps": summary.steps, "invalid_steps": summary.invalid_steps, "steps": steps})
            runs.append({"name": name, "shape": run.shape, "roles": roles, "live": name in live,
                         "issues": [{"kind": i.kind.value, "path": self._relative(i.path), "detail": i.detail}
                                    for i in run.issues()]})
        return {"root": self.index.given, "runs": runs, "allow_pickle": self.allow_pickle,
                "tokenizer": self.tokenizer is not None, "version": self._version,
                "follow": {"seconds": FOLLOW_SECONDS, "live_seconds": self.live_seconds} if self.follow_changes
                else None, "live_seconds": self.live_seconds}

    def _relative(self, path: str) -> str:
        root = self.index.root.rstrip("/") + "/"
        return path[len(root):] if path.startswith(root) else path

    def _step_summary(self, step: StepDir, now: float) -> dict[str, Any]:
        entries = step.entries
        rows = [e.rows for e in entries if e.rows is not None]
        seconds = [e.generation_seconds for e in entries if e.generation_seconds is not None]
        fingerprints = [e.fingerprint for e in entries if e.fingerprint]
        return {
            "step": step.step, "kind": step.kind.value, "bytes": step.bytes, "time": step.time,
            "recorded_utc": _utc(step.time),
            "age_seconds": max(0.0, now - step.time) if step.time else None,
            "rows": sum(rows) if rows else None, "formats": step.formats,
            "fingerprint": _fingerprint_digest(fingerprints[0]) if fingerprints else None,
            "fingerprint_values": ({str(k): _short(v) for k, v in list(fingerprints[0].items())[:50]}
                                   if fingerprints else None),
            "generation_seconds": sum(seconds) if seconds else None,
            "written_by": entries[0].written_by if entries else None,
            "inner": [{"inner": e.inner, "state": e.state.value, "rows": e.rows, "reason": e.reason}
                      for e in entries if e.inner is not None],
            "calls": [{"call": e.call, "state": e.state.value, "reason": e.reason}
                      for e in entries if e.call is not None],
            "valid": step.valid,
            "issues": [f"{i.kind.value}: {i.detail}" for i in step.issues()],
            "compared": self._compared(step),
        }

    def _compared(self, step: StepDir) -> bool:
        """Whether ``action: compare`` wrote a drift record beside the step (one listing per directory of steps)."""
        from stepskip._layout import DRIFT_DIR

        parent, _, name = step.path.rstrip("/").rpartition("/")
        names = self._drift_names.get(parent)
        if names is None:
            names = self._drift_names[parent] = frozenset(self.index.store.list_dir(f"{parent}/{DRIFT_DIR}"))
        return f"{name}.json" in names or any(n.startswith(f"{name}-") and n.endswith(".json") for n in names)

    def drift(self, run: str, role: str, step: int | str) -> list[dict[str, Any]]:
        """The drift records ``action: compare`` wrote beside a step (empty when it was never compared).

        Raises:
            ViewNotFound: no such run, role or step.
        """
        from stepskip._drift import drift_records

        return drift_records(self.index.store, self.step_dir(run, role, step).path)

    # ----------------------------------------------------------------- one step

    def rows(self, run: str, role: str, step: int | str) -> StepRows:
        """A step decoded into rows (kept for the next requests; a few steps at a time).

        A step without rewards of its own (verl's rollout before reward scoring) takes them from a
        stage role of the same run and step that holds one reward per row (``skip.reward``).

        Raises:
            ViewNotFound: no such run, role or step.
            EntryProblem: the step is damaged, unreadable, or pickle-based without ``allow_pickle``.
        """
        table = self._own_rows(run, role, step)
        if table.reward_source is None and table.rows:
            self._join_rewards(run, role, int(step), table)
        return table

    def _join_rewards(self, run: str, role: str, step: int, table: StepRows) -> None:
        for other in self.run(run).steps:
            if other.step != step or other.role in (None, role) or not other.valid:
                continue
            try:
                scored = self._own_rows(run, str(other.role), step)
            except EntryProblem:
                continue
            if scored.reward_source is None or len(scored.rows) != len(table.rows) or scored.columns != ["reward"]:
                continue
            for row, source in zip(table.rows, scored.rows):
                if source.get("reward") is not None:
                    row["reward"] = source["reward"]
            table.reward_source = f"{other.role} role ({scored.reward_source})"
            table.columns = [c for c in ("key", "group", "prompt", "response", "reward", "length", "tags")
                             if c in table.columns or c == "reward"]
            return

    def _own_rows(self, run: str, role: str, step: int | str) -> StepRows:
        step_dir = self.step_dir(run, role, step)
        key = (run, role, step_dir.step)
        with self._lock:
            if key in self._steps:
                self._steps.move_to_end(key)
                return self._steps[key]
        value = self._decode(step_dir)
        shape = self.run(run).shape
        decoded_by, tokenizer = self._tokenizer_of(step_dir)
        table = self._to_rows(value, shape.get("response_len") or None, tokenizer)
        table.tokenizer = decoded_by
        try:
            table.strips = TokenStrips.of(value)
        except (TypeError, ValueError, RuntimeError, IndexError) as err:  # columns shaped unlike verl's: no strip
            logger.debug("no token strips for %s: %s", step_dir.path, err)
        with self._lock:
            self._steps[key] = table
            while len(self._steps) > CACHED_STEPS:
                self._steps.popitem(last=False)
        return table

    def _decode(self, step_dir: StepDir) -> Any:
        from stepskip._index import PickleNotAllowedError

        issues = [i for i in step_dir.issues() if i.kind is not IssueKind.LEFTOVER]
        if issues:
            kind = "unreadable" if issues[0].kind in (IssueKind.UNSUPPORTED, IssueKind.UNDECODABLE) else "damaged"
            raise EntryProblem(kind, f"{self._relative(issues[0].path)}: {issues[0].detail}")
        try:
            return self.index.read_step(step_dir, self.allow_pickle)
        except PickleNotAllowedError as err:
            raise EntryProblem("pickle", f"{err} (restart stepskip view with --allow-pickle)") from None
        except UnreadableEntryError as err:
            raise EntryProblem("unreadable", str(err)) from None
        except (CacheMissError, SkipConfigError) as err:  # damaged, removed meanwhile
            raise EntryProblem("damaged", str(err)) from None
        except (MemoryError, RecursionError) as err:
            raise EntryProblem("unreadable", f"{step_dir.path}: too large or too deep to decode here "
                               f"({type(err).__name__})") from None

    def _tokenizer_of(self, step_dir: StepDir) -> tuple[str | None, Any]:
        """What decodes a step's text, named: the tokenizer given, else the local directory the step's recorded
        fingerprint names, else the one stepskip knows for it (its demo's); ``(None, None)``: token ids."""
        from stepskip.cli.content import recorded_tokenizer

        if self.tokenizer is not None:
            return "the tokenizer given (--tokenizer)", self.tokenizer
        fingerprints = [e.fingerprint for e in step_dir.entries if e.fingerprint]
        if not fingerprints:
            return None, None
        if (found := fingerprint_tokenizer(fingerprints[0])) is not None:
            return f"the tokenizer at {found[0]} (named by the run's fingerprint)", found[1]
        demo = recorded_tokenizer(fingerprints[0])
        return ("stepskip demo's character tokenizer", demo) if demo is not None else (None, None)

    def _to_rows(self, value: Any, response_len: int | None, tokenizer: Any = None) -> StepRows:
        from stepskip.cli.content import response_lengths, rewards, row_count, sample_rows

        total = row_count(value) or 0
        samples = sample_rows(value, total)
        reward = rewards(value)
        lengths = response_lengths(value)
        tags = value.get("tags") if isinstance(value, Mapping) and "tensordict" in value else None
        keys = value.get("keys") if isinstance(value, Mapping) and "tensordict" in value else None
        out: list[dict[str, Any]] = []
        for s in samples:
            row: dict[str, Any] = {"i": s.index}
            if s.id is not None:
                row["id"] = s.id
                row["group"] = _group_of(s.id) if keys is not None else s.id
                if keys is not None:
                    row["key"] = s.id  # the trajectory's queue key (V1)
            row["prompt"] = _text(s.prompt, tokenizer) if s.prompt is not None else (s.prompt_text or None)
            row["response"] = _text(s.response, tokenizer) if s.response is not None else None
            if s.reward is not None:
                row["reward"] = s.reward
            if lengths is not None and s.index < len(lengths[1]):
                row["length"] = int(lengths[1][s.index])
            elif s.response is not None:
                row["length"] = len(s.response)
            if s.extra.get("data_source"):
                row["data_source"] = s.extra["data_source"]
            if isinstance(tags, list) and s.index < len(tags) and isinstance(tags[s.index], Mapping):
                row["tags"] = {str(k): _short(v) for k, v in tags[s.index].items()}
            out.append(row)
        widest = max((r.get("length") or 0 for r in out), default=0)
        columns = [c for c in ("key", "group", "prompt", "response", "reward", "length", "tags")
                   if any(c in r and r[c] is not None for r in out)]
        return StepRows(out, columns, response_len or (widest or None),
                        reward[0] if reward else None, lengths[0] if lengths else None)

    def step_page(self, run: str, role: str, step: int | str, offset: int = 0, limit: int = 50,
                  sort: str | None = None, desc: bool = False, filters: Sequence[str] = (),
                  q: str = "") -> dict[str, Any]:
        """One page of a step's table (rows after filtering, search and sorting), paged on the server.

        Args:
            offset, limit: the page (at most :data:`MAX_PAGE` rows).
            sort, desc: the column to sort by.
            filters: ``reward0`` (reward exactly 0), ``lenmax`` (response length at the maximum).
            q: text a row's prompt, response or group must contain (case-insensitive).

        The page carries the step's drift records (``drift``) when ``action: compare`` compared it.
        """
        table = self.rows(run, role, step)
        chosen = query_rows(table.rows, sort, desc, filters, q, table.max_length)
        offset = max(0, int(offset))
        limit = max(1, min(int(limit), MAX_PAGE))
        return {"run": run, "role": role, "step": int(step), "total": len(table.rows), "matched": len(chosen),
                "offset": offset, "limit": limit, "rows": chosen[offset:offset + limit], "columns": table.columns,
                "max_length": table.max_length, "reward_source": table.reward_source,
                "length_source": table.length_source, "drift": self.drift(run, role, step),
                "tokenizer": table.tokenizer, "strip_columns": list(table.strips.columns) if table.strips else []}

    def token_strip(self, run: str, role: str, step: int | str, row: int | str, column: str | None = None
                    ) -> dict[str, Any]:
        """One trajectory's per-token values (log-probs), token by token (see :mod:`stepskip.view.tokens`).

        Args:
            row: the trajectory (its ``i``).
            column: the per-token column (default: the first the step has, ``rollout_log_probs`` first).

        Raises:
            ViewNotFound: no such run, role, step or row, or the step has no such column.
        """
        table = self.rows(run, role, step)
        if table.strips is None:
            raise ViewNotFound(f"step {step} of {run!r} ({role}) has no per-token column "
                               "(rollout_log_probs, old_log_probs ...)")
        name = column or next(iter(table.strips.columns))
        if name not in table.strips.columns:
            raise ViewNotFound(f"step {step} has no per-token column {name[:100]!r} "
                               f"(it has: {', '.join(table.strips.columns)})")
        try:
            index = int(row)
            _, tokenizer = self._tokenizer_of(self.step_dir(run, role, step))
            strip = table.strips.strip(index, name, tokenizer)
        except (ValueError, IndexError):
            raise ViewNotFound(f"step {step} has no row {str(row)[:40]!r} (rows 0-{len(table.rows) - 1})") from None
        return {"run": run, "role": role, "step": int(step), "row": index, "column": name,
                "columns": list(table.strips.columns), **strip}

    def step_stats(self, run: str, role: str, step: int | str) -> dict[str, Any]:
        """Reward and response-length distributions of a step (histograms and percentiles)."""
        table = self.rows(run, role, step)
        rewards = [r.get("reward") for r in table.rows]
        lengths = [r.get("length") for r in table.rows]
        return {"run": run, "role": role, "step": int(step), "rows": len(table.rows),
                "groups": equal_reward_groups(table.rows, self.run(run).shape.get("n")),
                "reward": {"summary": percentiles(rewards), "histogram": histogram(rewards),
                           "source": table.reward_source},
                "length": {"summary": percentiles(lengths), "histogram": histogram(lengths, integer=True),
                           "source": table.length_source, "max": table.max_length}}

    def trend(self, run: str, role: str) -> dict[str, Any]:
        """Mean and percentiles of reward and response length for every step of a role (unreadable ones named)."""
        steps, problems = [], []
        counts: list[dict[str, Any] | None] = []
        for step_dir in self.run(run).steps:
            if step_dir.role != role:
                continue
            try:
                table = self.rows(run, role, step_dir.step)
            except EntryProblem as err:
                problems.append({"step": step_dir.step, "kind": err.kind, "detail": str(err)})
                continue
            groups = equal_reward_groups(table.rows, self.run(run).shape.get("n"))
            counts.append(groups)
            steps.append({"step": step_dir.step, "rows": len(table.rows),
                          "reward": percentiles([r.get("reward") for r in table.rows]),
                          "length": percentiles([r.get("length") for r in table.rows]),
                          "groups": groups})
        if not steps and not problems:
            raise ViewNotFound(f"run {run!r} has no steps of role {role!r}")
        return {"run": run, "role": role, "steps": steps, "problems": problems,
                "groups": sum_equal_groups(counts)}

    def compare(self, a: tuple[str, str, int | str], b: tuple[str, str, int | str], offset: int = 0,
                limit: int = 20) -> dict[str, Any]:
        """Two steps side by side, group by group (see :func:`compare_groups`), a page of groups at a time."""
        ta, tb = self.rows(*a), self.rows(*b)
        groups = compare_groups(ta.rows, tb.rows)
        offset = max(0, int(offset))
        limit = max(1, min(int(limit), MAX_PAGE))
        return {"a": {"run": a[0], "role": a[1], "step": int(a[2]),
                      "reward": percentiles([r.get("reward") for r in ta.rows]),
                      "length": percentiles([r.get("length") for r in ta.rows])},
                "b": {"run": b[0], "role": b[1], "step": int(b[2]),
                      "reward": percentiles([r.get("reward") for r in tb.rows]),
                      "length": percentiles([r.get("length") for r in tb.rows])},
                "total": len(groups), "offset": offset, "limit": limit, "groups": groups[offset:offset + limit]}


def _text(ids: list[int], tokenizer: Any) -> str | list[int]:
    if tokenizer is None:
        return ids
    try:
        text = str(tokenizer.decode(ids, skip_special_tokens=False))
    except Exception as err:  # a tokenizer meeting ids outside its vocabulary: show the ids
        logger.debug("tokenizer could not decode %d ids: %s", len(ids), err)
        return ids
    return text if len(text) <= TEXT_LIMIT else text[:TEXT_LIMIT] + "…"


def _utc(seconds: float | None) -> str | None:
    """An absolute time as ISO-8601 in UTC (``2025-01-31T12:00:00Z``), for a report read later."""
    if not seconds or not math.isfinite(seconds):
        return None
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))
    except (OverflowError, OSError, ValueError):  # a recorded time outside what the platform represents
        return None


def _fingerprint_digest(fingerprint: Mapping[str, Any]) -> str:
    """A short name for a recorded fingerprint (a hash of its values): equal names, equal fingerprints."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _short(value: Any, limit: int = 200) -> Any:
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"

