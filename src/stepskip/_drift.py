"""Drift records of ``action: compare``: kept per role, counted, said once per step, written beside the entries.

A compared step's record (:meth:`~stepskip._compare.Drift.as_record` plus where and when) is kept
in memory for :meth:`stepskip.SkipManager.drift` and written to
``{directory of the role's steps}/.stepskip-drift/{entry}.json`` (``12.json`` for step 12; the
entry's path below that directory with ``/`` as ``-`` for roles with several entries per step)
through the store's small-file write: atomically, one file per entry, never inside an entry. The
command line (``stepskip info``, ``stepskip show``) and ``stepskip view`` read it back with
:func:`drift_records`; a record whose ``entry.run_id`` differs from the entry's own was made
against an earlier recording of that step.

Where a record goes is the role's layout's to say (:meth:`stepskip._layout.Layout.drift_path`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stepskip._storage.meta import is_number
from stepskip.errors import CorruptEntryError, DriftError
from stepskip._layout import DRIFT_DIR, Layout
from stepskip._policies import OnDrift

__all__ = ["DRIFT_DIR", "Recorded", "DriftLog", "drift_records"]

logger = logging.getLogger(__name__)

#: A drift record larger than this is not read back (a planted file cannot exhaust memory).
MAX_RECORD_BYTES = 8 << 20
#: Drift records read back for one step (one per entry of the step: a role with several entries per step).
MAX_RECORDS_PER_STEP = 64
#: Nesting deeper than this is no drift record (the writer's nest 6 levels).
MAX_RECORD_DEPTH = 32
#: Records a role keeps in memory for ``SkipManager.drift`` (the oldest go first).
MAX_KEPT = 10_000


@dataclass
class Recorded:
    """What ``action: compare`` read of a step before the live call ran.

    Args:
        path: the entry (a V1 step: its step directory).
        value: the recorded result, decoded.
        meta: the entry's ``meta.json`` (a V1 step: its first inner entry's).
        nbytes: bytes read.
        seconds: seconds the read took.
        prompts_equal: whether the live call's prompts are the recorded ones (None: not known).
    """

    path: str
    value: Any
    meta: dict[str, Any]
    nbytes: int = 0
    seconds: float = 0.0
    prompts_equal: bool | None = None


def drift_records(store: Any, step_dir: str) -> list[dict[str, Any]]:
    """The drift records of the step at ``step_dir`` (its own, and those of entries below it), by name.

    Files that are not small JSON objects are passed over: a record is a report, never trusted data.
    """
    name = step_dir.rstrip("/").rpartition("/")[2]
    where = Layout.drift_dir_of(step_dir)
    names = sorted(n for n in store.list_dir(where)
                   if n == f"{name}.json" or (n.startswith(f"{name}-") and n.endswith(".json")))
    out: list[dict[str, Any]] = []
    for file_name in names[:MAX_RECORDS_PER_STEP]:
        try:
            raw = store.read_small(f"{where}/{file_name}", MAX_RECORD_BYTES)
            record = json.loads(raw, parse_constant=_refuse_constant) if raw is not None else None
        except (CorruptEntryError, ValueError, RecursionError) as err:
            logger.debug("drift record %s/%s not read: %s", where, file_name, err)
            continue
        if isinstance(record, dict) and _as_written(record):
            out.append(record)
        else:
            logger.debug("drift record %s/%s passed over: not a record action: compare writes", where, file_name)
    return out


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} in a drift record (its writer never writes one)")


def _as_written(record: dict[str, Any]) -> bool:
    """Whether ``record`` holds only what :meth:`DriftLog.report` writes: finite numbers a float holds,
    nesting no deeper than :data:`MAX_RECORD_DEPTH` (so no reader of it overflows or recurses out)."""
    pending: list[tuple[Any, int]] = [(record, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_RECORD_DEPTH:
                return False
            pending.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not is_number(value):
            return False
    return True


def _compact(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record as kept in memory: each field's figures without its per-row lists and examples."""
    kept = {k: v for k, v in record.items() if k != "fields"}
    fields = record.get("fields")
    if isinstance(fields, Mapping):
        kept["fields"] = {name: {k: f.get(k) for k in ("kind", "match", "passed", "max_delta", "mean_delta",
                                                       "first_row", "note")}
                          for name, f in fields.items() if isinstance(f, Mapping)}
    return kept


class DriftLog:
    """The drift records of one role, and what reporting one does (counters, log line, file, error)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: deque[dict[str, Any]] = deque(maxlen=MAX_KEPT)

    def records(self) -> list[dict[str, Any]]:
        """One record per compared step, oldest first (copies)."""
        with self._lock:
            return [dict(r) for r in self._records]

    def _keep(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records.append(_compact(record))

    def damaged(self, role: Any, step: int, path: str, reason: str) -> None:
        """A compared step whose entry is damaged: reported (the role counted it; the call runs live)."""
        self._keep({"step": int(step), "role": role.name, "damaged": True, "reason": reason, "prompts_equal": None,
                    "token_match": None, "worst_field": None, "worst_delta": None, "passed": False,
                    "entry": {"path": path}, "compared_unix": time.time()})
        logger.warning("%s compare: step %d was not compared: its entry at %s is damaged (%s); the live result is "
                       "used and recorded in its place", role.name, step, path, reason)

    def report(self, role: Any, step: int, drift: Any, recorded: Recorded) -> dict[str, Any]:
        """Count, keep, write and say the comparison of ``step``; raise under ``on_drift: error``.

        Args:
            role: the role (its ``name``, ``stats``, ``store``, ``config``, ``layout``).
            step: the step compared.
            drift: the :class:`~stepskip._compare.Drift`.
            recorded: what was read of the entry.

        Returns:
            The record as written.

        Raises:
            DriftError: a field drifted and the role's ``on_drift`` is ``error`` (after the record is written).
        """
        meta = recorded.meta
        path = role.layout.drift_path(recorded.path)
        record: dict[str, Any] = {
            "step": int(step), "role": role.name, **drift.as_record(),
            "train_on": str(role.config.train_on), "run_id": role.run_id, "compared_unix": time.time(),
            "entry": {"path": recorded.path, "run_id": meta.get("run_id"), "created_unix": meta.get("created_unix"),
                      "global_steps": meta.get("global_steps")},
            "record_path": path,
        }
        drifted = drift.prompts_equal is not False and bool(drift.drifted)
        role.stats.add(compared=1, drifted=int(drifted))
        if drift.token_match is not None:
            role.stats.set(token_match=float(drift.token_match))
        self._keep(record)
        try:
            if not role.config.read_only:  # a read-only cache keeps its records in memory (SkipManager.drift)
                role.store.put_small(path, json.dumps(record, allow_nan=False, default=str).encode())
        except Exception as err:  # a report: the run goes on without its file
            logger.warning("%s compare: the drift record of step %d could not be written to %s: %s: %s",
                           role.name, step, path, type(err).__name__, err)
        if drift.prompts_equal is False:
            logger.warning("%s compare: step %d saw other prompts than its recording (entry %s): the two results "
                           "answer different prompts, so they are not judged; %s", role.name, step, recorded.path,
                           drift.describe())
        elif drifted:
            logger.warning("%s compare: step %d drifted from its recording (entry %s): %s, below compare_min_match "
                           "%g", role.name, step, recorded.path, drift.describe(), drift.tolerance.min_match)
        else:
            logger.info("%s compare: step %d matches its recording (%s)", role.name, step, drift.describe())
        if drifted and role.config.on_drift is OnDrift.ERROR:
            raise DriftError(f"{role.name}: step {step} drifted from its recording: {drift.describe()}, below "
                             f"compare_min_match {drift.tolerance.min_match:g} (skip.{role.name}.on_drift = error; "
                             f"drift record at {path})")
        return record
