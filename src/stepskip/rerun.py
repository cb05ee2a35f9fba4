"""Re-run a recorded stage offline: call a function on each step's recorded arguments, compare with its output.

A stage role recorded with ``record_inputs: true`` keeps, beside each step's result, the
arguments its function was called with (those after a method's ``self``). :func:`rerun_stage`
calls another function — the same reward function on another machine, a changed one, a new
advantage estimator — on those arguments, on CPU, without a trainer, and compares what it returns
with the recorded result under the comparison of ``action: compare`` (:mod:`stepskip._compare`).
``stepskip rerun`` is its command line. :func:`grpo_advantages` is a ready function for an
``advantage`` stage.

Example:
    >>> report = rerun_stage("/data/dump", "reward", load_function("rewards.py:compute"))  # doctest: +SKIP
    >>> report.passed, report.first_divergence  # doctest: +SKIP
    (False, RerunStep(step=3, ...))
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stepskip.errors import CacheMissError, SkipConfigError

__all__ = ["RerunUsageError", "RerunStep", "RerunReport", "load_function", "rerun_stage", "grpo_advantages"]


class RerunUsageError(SkipConfigError):
    """A re-run that cannot start: no such stage, no recorded inputs, a function that cannot be imported.

    The message says what was wrong and how to fix it (``stepskip rerun`` exits with code 2).
    """


@dataclass
class RerunStep:
    """One recorded step of the stage, re-run.

    Args:
        run: the run directory's name (``{experiment}_{project}/GBS..._N..._in..._out...``).
        step: the step.
        path: the entry.
        passed: the function's result matched the recorded one.
        record: the comparison (:meth:`stepskip._compare.Drift.as_record`); None when the step could not be
            compared.
        error: why the step could not be compared (a damaged entry, the function raised ...), else None.
    """

    run: str
    step: int
    path: str
    passed: bool
    record: dict[str, Any] | None = None
    error: str | None = None

    @property
    def field(self) -> str | None:
        """The field that diverged most (None when none did, or the step was not compared)."""
        return None if self.record is None else self.record.get("worst_field")

    @property
    def row(self) -> int | None:
        """The first row where that field diverged."""
        if self.record is None:
            return None
        worst = (self.record.get("fields") or {}).get(self.field or "", {})
        return worst.get("first_row") if isinstance(worst, Mapping) else None


@dataclass
class RerunReport:
    """Every step re-run, in order.

    Args:
        stage: the stage's name.
        steps: one :class:`RerunStep` per recorded step with inputs.
        skipped: steps of the stage recorded without their inputs.
    """

    stage: str
    steps: list[RerunStep] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(s.passed for s in self.steps)

    @property
    def first_divergence(self) -> RerunStep | None:
        """The first step that did not pass."""
        return next((s for s in self.steps if not s.passed), None)


# --------------------------------------------------------------------------- the function


def load_function(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names: ``module:function`` (``package.module:Class.method`` too) or
    ``path/to/file.py:function``.

    Raises:
        RerunUsageError: ``spec`` has no ``:``, the module or file cannot be imported, or it has no such
            callable (the message says which, and the form ``--fn`` takes).

    Example:
        >>> load_function("stepskip.rerun:grpo_advantages").__name__
        'grpo_advantages'
    """
    form = "pass --fn module:function or --fn path/to/file.py:function"
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise RerunUsageError(f"--fn {spec!r} names no function; {form}")
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    try:
        if is_file:
            path = os.path.abspath(os.path.expanduser(where))
            if not os.path.isfile(path):
                raise RerunUsageError(f"--fn {spec!r}: no file {where}; {form}")
            module_name = f"_stepskip_rerun_{abs(hash(path)):x}"
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise RerunUsageError(f"--fn {spec!r}: {where} cannot be loaded as Python; {form}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RerunUsageError:
        raise
    except Exception as err:  # the user's code, imported: any failure is theirs to see
        raise RerunUsageError(f"--fn {spec!r}: importing {where} failed ({type(err).__name__}: {err}); "
                                 f"{form}") from err
    target: Any = module
    for part in name.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise RerunUsageError(f"--fn {spec!r}: {where} has no {name!r}; {form}")
    if not callable(target):
        raise RerunUsageError(f"--fn {spec!r}: {name} in {where} is not callable; {form}")
    return target  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- re-running a stage


def _stage_steps(index: Any, stage: str) -> list[tuple[Any, Any]]:
    """``(run, step directory)`` of every step of ``stage`` in the index.

    Raises:
        RerunUsageError: no step of that stage (the message lists the roles there are).
    """
    found, roles = [], set()
    for run in index.runs():
        for step_dir in run.steps:
            if step_dir.role is not None:
                roles.add(step_dir.role)
            if step_dir.role == stage:
                found.append((run, step_dir))
    if not found:
        known = ", ".join(sorted(roles)) or "none"
        raise RerunUsageError(f"no stage {stage!r} in {index.given} (roles recorded there: {known}); pass "
                                 "--stage with the name of a stage role (its key under skip)")
    return sorted(found, key=lambda pair: (pair[0].name, pair[1].step))


def _read_step(index: Any, entry: Any, allow_pickle: bool) -> tuple[Any, list[Any], dict[str, Any]]:
    """The recorded result and arguments of one entry, read as one version."""
    from stepskip._entries import FORMATS, legacy_format
    from stepskip.errors import CorruptEntryError, UnreadableEntryError
    from stepskip._formats import get_format
    from stepskip._index import PickleNotAllowedError
    from stepskip._stage_inputs import INPUT_FILES, decode_inputs

    spec = FORMATS.get(str(entry.format))
    if spec is None or not entry.valid:
        raise CorruptEntryError(f"{entry.path}: {entry.reason or 'not a complete entry'}")
    if spec.uses_pickle and not allow_pickle:
        raise PickleNotAllowedError(entry.path, spec.name)
    _, files = index.store.read_entry(entry.path, legacy_format(False).files, [*spec.files, *INPUT_FILES], True)
    try:
        output = get_format(spec.name).decode({name: files[name] for name in spec.files})
        args, kwargs = decode_inputs(files)
    except CorruptEntryError as err:  # checksums held: intact bytes this stepskip does not read
        raise UnreadableEntryError(f"{entry.path}: {err}") from err
    return output, args, kwargs


def rerun_stage(dump_dir: str, stage: str, fn: Callable[..., Any] | str, steps: Any = None, rtol: float = 1e-5,
                atol: float = 1e-8, min_match: float = 1.0, allow_pickle: bool = False,
                storage_options: Mapping[str, Any] | None = None) -> RerunReport:
    """Call ``fn`` on every recorded step of ``stage`` that holds its arguments, and compare with the output.

    Args:
        dump_dir: the cache (a dump dir, an experiment or run directory; a local path or an fsspec URL).
        stage: the stage role's name.
        fn: called as ``fn(*args, **kwargs)`` with the recorded call's arguments after ``self``; or its
            name (as :func:`load_function` takes it), imported once the stage and its inputs were found.
        steps: the steps to re-run, in the syntax of ``skip.<role>.steps`` (``"1-5,8"``, a list); None: all.
        rtol, atol: float tolerances (as ``action: compare``'s).
        min_match: the least share a field must match for a step to pass (default 1.0: every element).
        allow_pickle: read pickle-based outputs through the allow-list unpickler.
        storage_options: fsspec options for a URL.

    Returns:
        The report, one :class:`RerunStep` per step re-run.

    Raises:
        RerunUsageError: no such stage, none of its steps holds recorded arguments, or ``fn`` names a
            function that cannot be imported.
        SkipConfigError: a bad ``steps`` value, or ``dump_dir`` holds no cache.
    """
    from stepskip._compare import Tolerance, compare_values
    from stepskip.config import StepSet
    from stepskip.errors import UnreadableEntryError
    from stepskip._index import CacheIndex
    from stepskip._stage_inputs import has_inputs

    chosen = None if steps is None else StepSet.parse(_steps_list(steps), "--steps")
    index = CacheIndex(dump_dir, storage_options)
    found = [(run, s) for run, s in _stage_steps(index, stage) if chosen is None or s.step in chosen]
    if not found:
        raise RerunUsageError(f"stage {stage!r} has no recorded step in --steps {steps}; pass steps it recorded")
    report = RerunReport(stage)
    tolerance = Tolerance(rtol=rtol, atol=atol, min_match=min_match)
    with_inputs = []
    for run, step_dir in found:
        entry = step_dir.entries[0] if step_dir.entries else None
        if entry is not None and has_inputs(entry.meta):
            with_inputs.append((run, step_dir, entry))
        elif entry is not None and entry.valid:
            report.skipped.append(step_dir.step)
        else:
            with_inputs.append((run, step_dir, entry))  # damaged: reported as such below
    if not any(e is not None and has_inputs(e.meta) for _, _, e in with_inputs):
        raise RerunUsageError(
            f"stage {stage!r} has no recorded inputs in {index.given}: record them with "
            f"skip.{stage}.record_inputs: true (and action: record to record the steps again), then rerun")
    function = load_function(fn) if isinstance(fn, str) else fn
    for run, step_dir, entry in with_inputs:
        where = entry.path if entry is not None else step_dir.path
        try:
            if entry is None or not step_dir.valid:
                issues = step_dir.issues()
                raise CacheMissError(issues[0].detail if issues else "not a complete entry")
            output, args, kwargs = _read_step(index, entry, allow_pickle)
        except (CacheMissError, UnreadableEntryError) as err:
            report.steps.append(RerunStep(run.name, step_dir.step, where, False, error=f"not read: {err}"))
            continue
        try:
            result = function(*args, **kwargs)
        except Exception as err:  # the function under test failing on recorded inputs is a finding
            report.steps.append(RerunStep(run.name, step_dir.step, where, False,
                                          error=f"the function raised {type(err).__name__}: {err}"))
            continue
        drift = compare_values(output, result, tolerance)
        report.steps.append(RerunStep(run.name, step_dir.step, where, drift.passed, record=drift.as_record()))
    return report


def _steps_list(steps: Any) -> list[Any]:
    if isinstance(steps, str):
        return [part.strip() for part in steps.split(",") if part.strip()]
    if isinstance(steps, int):
        return [steps]
    return list(steps)


# --------------------------------------------------------------------------- ready functions


def grpo_advantages(scores: Any, uids: Sequence[Any] | None = None, response_mask: Any = None,
                    norm_by_std: bool = True, eps: float = 1e-6) -> Any:
    """GRPO's group-normalised advantage: each score minus its group's mean, over the group's standard
    deviation (the rows sharing a ``uid`` form a group; a group of one gets 0).

    Args:
        scores: ``[rows]`` scores, or ``[rows, T]`` token-level rewards (summed per row); or a batch
            (Batch, DataProto, TensorDict, dict) holding ``token_level_rewards`` (else
            ``token_level_scores``, else ``scores``), ``uid`` and optionally ``response_mask``.
        uids: one group id per row (when ``scores`` is not a batch).
        response_mask: ``[rows, T]``: advantages are returned per token, masked (as verl's).
        norm_by_std: divide by the group's standard deviation (GRPO); else only centre (Dr. GRPO).
        eps: added to the standard deviation.

    Returns:
        ``[rows]`` advantages, or ``[rows, T]`` with a response mask; for a batch, ``{"advantages": ...,
        "returns": ...}`` (the same tensor twice, as verl's GRPO estimator returns them).

    Raises:
        SkipConfigError: a batch without scores or uids, or ``uids`` of another length than the scores.

    Example:
        >>> import torch
        >>> [round(a, 4) for a in grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), ["a", "a", "b", "b"]).tolist()]
        [0.7071, -0.7071, 0.0, 0.0]
    """
    import torch

    batch = None
    if uids is None:
        batch = scores
        scores, uids, response_mask = _batch_columns(batch, response_mask)
    scores = torch.as_tensor(scores)
    per_row = scores.sum(dim=-1) if scores.dim() > 1 else scores
    ids = list(uids.tolist() if hasattr(uids, "tolist") else uids)
    if len(ids) != per_row.shape[0]:
        raise SkipConfigError(f"grpo_advantages: {len(ids)} uids for {per_row.shape[0]} scores")
    groups: dict[Any, list[int]] = {}
    for row, gid in enumerate(ids):
        groups.setdefault(gid, []).append(row)
    advantages = torch.zeros(per_row.shape, dtype=torch.float32)
    for rows in groups.values():
        if len(rows) < 2:
            continue
        index = torch.tensor(rows)
        group = per_row[index].float()
        centred = group - group.mean()
        advantages[index] = centred / (group.std() + eps) if norm_by_std else centred
    if response_mask is not None:
        advantages = advantages.unsqueeze(-1) * torch.as_tensor(response_mask).float()
    if batch is not None:
        return {"advantages": advantages, "returns": advantages.clone()}
    return advantages


def _batch_columns(batch: Any, response_mask: Any) -> tuple[Any, Any, Any]:
    from stepskip._compare import columns_of

    columns = columns_of(batch)
    scores = next((columns[k] for k in ("token_level_rewards", "token_level_scores", "scores") if k in columns), None)
    uids = columns.get("uid")
    if scores is None or uids is None:
        raise SkipConfigError("grpo_advantages: the batch holds no token_level_rewards, token_level_scores or "
                              "scores, or no uid column; pass scores and uids instead")
    return scores, uids, response_mask if response_mask is not None else columns.get("response_mask")
