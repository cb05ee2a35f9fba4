"""Generation caching for the colocated trainer (``rollout``) and the fully async one (``async_rollout``)."""

from __future__ import annotations

import contextvars
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from stepskip._version import __version__
from stepskip.config import AsyncRolloutSkipConfig, RolloutSkipConfig
from stepskip.entries import GEN_BATCH_FILE
from stepskip.errors import (
    CacheMissError,
    CorruptEntryError,
    FingerprintMismatchError,
    PromptMismatchError,
    SkipConfigError,
    UnstorableValueError,
)
from stepskip.fidelity import fingerprint_diff, prompt_digest, run_fingerprint
from stepskip.formats import get_format
from stepskip.layout import Layout
from stepskip.roles.base import BaseSkip, SkipAction, register_skip
from stepskip.stats import RoleStats
from stepskip.store import EntryState, open_store
from stepskip.worker import default_worker

__all__ = ["RolloutSkip", "AsyncRolloutSkip", "parse_async_rollout_sample_step", "GENERATION_SECONDS"]

logger = logging.getLogger(__name__)

#: Seconds the decorated function took on a miss; set by SkipManager around ``prepare_data`` so
#: the signature ``prepare_data(step, result, *args, **kwargs)`` stays verl's.
GENERATION_SECONDS: contextvars.ContextVar[float | None] = contextvars.ContextVar("generation_seconds", default=None)

_RETRY_SECONDS = 0.05

ALL_ACTIONS = [SkipAction.CACHE, SkipAction.REPEAT, SkipAction.RANDOM, SkipAction.REPLAY, SkipAction.RECORD]


def _prompts_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    prompts = kwargs.get("prompts")
    if prompts is not None:
        return prompts
    if len(args) > 1:
        return args[1]
    if len(args) == 1 and hasattr(args[0], "meta_info"):
        return args[0]
    return None


@register_skip("rollout")
class RolloutSkip(BaseSkip):
    """Caches the whole output of ``generate_sequences(self, prompts)`` per trainer step.

    The step comes from ``SkipManager.set_step``. Entries live in
    ``{dump_dir}/{experiment}_{project}/GBS{gbs}_N{n}_in{p}_out{r}/{step}/``.

    Example:
        >>> from stepskip import SkipManager
        >>> SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": "/tmp/d"}}})
        >>> SkipManager.skip_instances["rollout"].step_dump_dir(1)
        '/tmp/d/default_experiment_name_default_project_name/GBS0_N0_in0_out0/1'
        >>> SkipManager.reset()
    """

    support_actions = ALL_ACTIONS
    config_class = RolloutSkipConfig
    #: Data files verl itself writes for this role (its entries list no files in meta.json).
    legacy_files: tuple[str, ...] = (GEN_BATCH_FILE,)
    #: The format of entries verl wrote (their meta.json names none), and of ``format: verl``.
    verl_format = "verl"

    def __init__(self, local_config: Any, global_config: Any) -> None:
        super().__init__(local_config, global_config)
        configured = getattr(local_config, "format", "safe")
        self.format = get_format(self.verl_format if configured == "verl" else configured,
                                 compress=getattr(local_config, "compress", "auto"))
        self.allow_pickle = bool(getattr(local_config, "allow_pickle", False))
        self.verify = bool(getattr(local_config, "verify", True))
        self.async_dump = bool(getattr(local_config, "async_dump", True))
        self.seed = int(getattr(local_config, "seed", 0))
        self.rebind_keys = list(getattr(local_config, "rebind_keys", ["uid"]))
        self.check_prompts = getattr(local_config, "check_prompts", "warn")
        self.on_mismatch = getattr(local_config, "on_mismatch", "warn")
        self.fingerprint = run_fingerprint(global_config, getattr(local_config, "fingerprint_keys", []))
        self._warned: set[tuple[str, ...]] = set()
        self.layout = Layout.from_config(self.dump_dir, global_config, subdir=self._subdir())
        self.store = open_store(self.layout.dump_dir, getattr(local_config, "storage_options", None))
        self.stats = RoleStats()
        self._pending: dict[str, threading.Event] = {}  # entry path -> its background dump finished
        self._pending_lock = threading.Lock()
        if self.enable:
            self.store.remove_leftovers(self.layout.project_dir)

    def _subdir(self) -> str | None:
        return None

    # ------------------------------------------------------------------ paths and lookups

    @property
    def project_dump_dir(self) -> str:
        """The directory holding this role's step entries."""
        return self.layout.project_dir

    def step_dump_dir(self, step: int) -> str:
        """The entry directory of ``step``."""
        return self.layout.step_dir(step)

    def available_steps(self) -> list[int]:
        """Steps with a valid entry, sorted (damaged entries and temporaries are left out)."""
        steps = []
        for name in self.store.list_dir(self.project_dump_dir):
            step = Layout.parse_step(name)
            if step is not None and self._present(step):
                steps.append(step)
        return sorted(steps)

    def resolve_load_step(self, step: int) -> int:
        """The step this role's action would load for a call at ``step``; -1 for none.

        ``cache``/``replay``: ``step`` itself. ``repeat``: ``step``, else the largest smaller
        available step, else the smallest larger one (seed §2.3). ``random``: an available step
        drawn reproducibly from ``seed`` and ``step``. ``record``: never loads.
        """
        action = self.action
        if action is SkipAction.RECORD:
            return -1
        if action in (SkipAction.CACHE, SkipAction.REPLAY):
            return step if self._present(step) else -1
        if action is SkipAction.REPEAT and self._present(step):
            return step
        available = self.available_steps()
        if not available:
            return -1
        if action is SkipAction.RANDOM:
            return random.Random(f"{self.seed}:{step}").choice(available)
        smaller = [s for s in available if s < step]
        return smaller[-1] if smaller else next((s for s in available if s > step), -1)

    def would_replay(self, step: int) -> bool:
        if step not in self.steps:
            return False
        load_step = self.resolve_load_step(step)
        return load_step != -1 and self._servable(self._probe(load_step).meta or {})

    def _servable(self, meta: dict[str, Any]) -> bool:
        """False when an entry's meta alone shows a call would not be served from it."""
        try:
            fmt = get_format(meta.get("format", self.verl_format))
        except ValueError:
            return False
        if fmt.uses_pickle and not self.allow_pickle:
            return False
        recorded = meta.get("fingerprint")
        return not (self.on_mismatch == "regenerate" and isinstance(recorded, dict)
                    and fingerprint_diff(recorded, self.fingerprint))

    def _probe(self, step: int) -> Any:
        path = self.step_dump_dir(step)
        if self._pending:
            self._await_pending(path)
        return self.store.probe(path, self.legacy_files)

    def _probe_settled(self, step: int) -> Any:
        """Probe, looking twice before calling an entry damaged (it may be mid-replacement)."""
        probe = self._probe(step)
        if probe.state is EntryState.DAMAGED:
            time.sleep(_RETRY_SECONDS)
            probe = self._probe(step)
        return probe

    def _present(self, step: int) -> bool:
        """True when ``step`` has a complete, valid-looking entry (no data read)."""
        return self._probe(step).state is EntryState.PRESENT

    # ------------------------------------------------------------------ the role protocol

    def meet_precondition(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> bool:
        action = self.action
        if action is SkipAction.RECORD:
            return False
        if action is SkipAction.REPLAY:
            return True  # warp_function raises CacheMissError when there is nothing to load
        if action is SkipAction.CACHE:
            probe = self._probe_settled(step)
            if probe.state is EntryState.DAMAGED:
                self._report_corrupt(step, self.step_dump_dir(step), probe.reason)
            hit = probe.state is EntryState.PRESENT
        else:
            hit = self.resolve_load_step(step) != -1
        if not hit:
            self.stats.add(misses=1)
            logger.info("%s miss: step %d has no usable entry under %s; generating and dumping it",
                        self.name, step, self.project_dump_dir)
        return hit

    def warp_function(self, step: int, func: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Load the entry the action resolves for ``step`` and rebind identity columns.

        Raises:
            CacheMissError: nothing to load (``replay`` on a missing step).
            CorruptEntryError: the entry is damaged.
            SkipConfigError: the entry is a pickle and ``allow_pickle`` is false.
        """
        load_step = self.resolve_load_step(step)
        probe = self._probe_settled(step) if load_step == -1 else None
        if probe is not None and probe.state is EntryState.PRESENT and self.action is not SkipAction.RECORD:
            load_step = step  # it appeared, or was being replaced, while we looked
        if load_step == -1:
            path = self.step_dump_dir(step)
            if probe is not None and probe.state is EntryState.DAMAGED:
                self._report_corrupt(step, path, probe.reason)
                raise CorruptEntryError(f"{self.name}: entry for step {step} at {path} is damaged: {probe.reason}")
            raise CacheMissError(
                f"{self.name}: no entry for step {step} under {self.project_dump_dir} (action {self.action.value!r}); "
                "record it first with action 'cache' or 'record', or check dump_dir and the run shape "
                "(GBS/N/in/out) in the directory name"
            )
        prompts = _prompts_of(args, kwargs)
        try:
            value, meta, seconds, nbytes = self.load_entry(load_step, step, prompts=prompts)
        except CacheMissError:
            if self.action is not SkipAction.REPLAY:
                self.stats.add(misses=1)  # the call is regenerated
            raise
        self._rebind(value, prompts)
        saved = float(meta.get("generation_seconds") or 0.0)
        self.stats.add(hits=1, load_seconds=seconds, bytes_read=nbytes, saved_seconds=saved)
        logger.info("%s hit: step %d replayed from step %d at %s (%d bytes, %.3fs)",
                    self.name, step, load_step, self.step_dump_dir(load_step), nbytes, seconds)
        return value

    def prepare_data(self, step: int, result: Any, *args: Any, **kwargs: Any) -> None:
        """Snapshot ``result`` and write it as the entry of ``step`` (in the background with ``async_dump``).

        Failures are logged and counted in ``dump_failures``; they never reach the caller.
        """
        frozen = self._freeze(step, self.step_dump_dir(step), result, copy=self.async_dump)
        if frozen is None:
            return
        meta = self._entry_meta(step, GENERATION_SECONDS.get(),
                                prompt_digest=prompt_digest(_prompts_of(args, kwargs), self.rebind_keys))
        self._submit_write(self.step_dump_dir(step), step, frozen, meta)

    def _freeze(self, step: int, path: str, value: Any, copy: bool) -> Any:
        try:
            return self.format.freeze(value, copy=copy)
        except UnstorableValueError as err:
            self.stats.add(dump_failures=1)
            logger.error("%s dump failed: step %d not written to %s: %s", self.name, step, path, err)
            return None

    def _entry_meta(self, step: int, generation_seconds: float | None, **extra: Any) -> dict[str, Any]:
        return {
            "global_steps": int(step),
            "role": self.name,
            "format": self.format.name,
            "stepskip_version": __version__,
            "run_id": self.run_id,
            "created_unix": time.time(),
            "generation_seconds": generation_seconds,
            "fingerprint": self.fingerprint,
            **extra,
        }

    def _submit_write(self, path: str, step: int, frozen: Any, meta: dict[str, Any]) -> None:
        if not self.async_dump:
            self._write(path, step, frozen, meta)
            return
        done = threading.Event()
        with self._pending_lock:
            self._pending[path] = done

        def job() -> None:
            try:
                self._write(path, step, frozen, meta)
            finally:
                with self._pending_lock:
                    if self._pending.get(path) is done:
                        del self._pending[path]
                done.set()

        default_worker().submit(job)

    def _await_pending(self, path: str) -> None:
        """Wait for this run's queued dump of ``path``: a call at that step then replays it
        instead of generating (and dumping) the same step a second time."""
        done = self._pending.get(path)
        if done is not None:
            done.wait()

    def _write(self, path: str, step: int, frozen: Any, meta: dict[str, Any]) -> None:
        start = time.perf_counter()
        try:
            files = self.format.encode(frozen)
            written = self.store.write_entry(path, files, meta)
        except Exception as err:  # the dump boundary: no storage error may stop the training run
            self.stats.add(dump_failures=1)
            logger.error("%s dump failed: step %d not written to %s: %s: %s",
                         self.name, step, path, type(err).__name__, err)
            return
        seconds = time.perf_counter() - start
        self.stats.add(dumps=1, dump_seconds=seconds, bytes_written=written)
        logger.info("%s dump: step %d written to %s (%d bytes, %.3fs)", self.name, step, path, written, seconds)

    # ------------------------------------------------------------------ loading

    def load_entry(self, load_step: int, step: int | None = None,
                   prompts: Any = None) -> tuple[Any, dict[str, Any], float, int]:
        """Read and decode the entry of ``load_step``: ``(value, meta, seconds, bytes)``.

        Args:
            load_step: the entry to read.
            step: the step of the call being served (defaults to ``load_step``).
            prompts: the live call's prompts, compared with the entry's prompt digest when the
                entry's step is the call's step.

        Raises:
            CorruptEntryError: damaged entry (logged and counted).
            CacheMissError: the fingerprint differs and ``on_mismatch`` is ``regenerate``.
            SkipConfigError: a pickle-based entry while ``allow_pickle`` is false, or a fingerprint
                or prompt mismatch under the ``error`` policy.
        """
        step = load_step if step is None else step
        return self._read_entry(self.step_dump_dir(load_step), step, load_step, prompts)

    def _read_entry(self, path: str, step: int, load_step: int | None = None,
                    prompts: Any = None) -> tuple[Any, dict[str, Any], float, int]:
        start = time.perf_counter()
        for attempt in range(2):
            try:
                value, meta, nbytes = self._read_entry_once(path, step, load_step, prompts)
                return value, meta, time.perf_counter() - start, nbytes
            except CorruptEntryError as err:
                if attempt:
                    self._report_corrupt(step, path, str(err))
                    raise
                time.sleep(_RETRY_SECONDS)  # a concurrent writer may be replacing the entry: look again
        raise AssertionError("unreachable")

    def _read_entry_once(self, path: str, step: int, load_step: int | None,
                         prompts: Any) -> tuple[Any, dict[str, Any], int]:
        probe = self.store.probe(path, self.legacy_files)
        if probe.state is not EntryState.PRESENT:
            raise CorruptEntryError(f"{path}: {probe.reason or 'entry vanished'}")
        meta = probe.meta or {}
        self._check_fidelity(meta, path, step, step if load_step is None else load_step, prompts)
        try:
            fmt = get_format(meta.get("format", self.verl_format))
        except ValueError as err:
            raise CorruptEntryError(f"{path}: {err}") from err
        if fmt.uses_pickle and not self.allow_pickle:
            raise SkipConfigError(
                f"{path} holds a pickle-based entry (format {fmt.name!r}, as verl writes it) and "
                f"skip.{self.name}.allow_pickle is false. Either set skip.{self.name}.allow_pickle=true "
                "(read through an allow-list unpickler), or convert the cache once with "
                "`stepskip convert SRC DST --to safe --allow-pickle`. The entry was left untouched."
            )
        files = self.store.read_files(path, meta, fmt.files, self.verify)
        nbytes = sum(len(b) for b in files.values())
        return fmt.decode(files, consume=True), meta, nbytes

    def _check_fidelity(self, meta: dict[str, Any], path: str, step: int, load_step: int, prompts: Any) -> None:
        """Compare the entry's run fingerprint and prompt digest with the live run and call."""
        recorded = meta.get("fingerprint")
        if isinstance(recorded, dict):
            diffs = fingerprint_diff(recorded, self.fingerprint)
            if diffs:
                message = (f"{self.name}: the entry at {path} was recorded with other rollout settings: "
                           + "; ".join(diffs))
                if self.on_mismatch == "error":
                    raise FingerprintMismatchError(message + f" (skip.{self.name}.on_mismatch = error)")
                if self.on_mismatch == "regenerate":
                    logger.warning("%s; regenerating step %d", message, step)
                    raise CacheMissError(message)
                if tuple(diffs) not in self._warned:
                    self._warned.add(tuple(diffs))
                    logger.warning("%s; replaying it anyway (set skip.%s.on_mismatch to error or regenerate)",
                                   message, self.name)
        recorded_digest = meta.get("prompt_digest")
        if self.check_prompts == "off" or load_step != step or prompts is None or not recorded_digest:
            return
        digest = prompt_digest(prompts, self.rebind_keys)
        if digest is None or digest == recorded_digest:
            return
        message = (f"{self.name}: step {step} was recorded for other prompts than this call's (entry {path}); "
                   "the data order or dataset changed since it was recorded (e.g. another shuffle seed)")
        if self.check_prompts == "error":
            raise PromptMismatchError(message + f" (skip.{self.name}.check_prompts = error)")
        logger.warning("%s; replaying it anyway (set skip.%s.check_prompts to error or off)", message, self.name)

    def _report_corrupt(self, step: int, path: str, reason: str) -> None:
        self.stats.add(corrupt=1)
        if self.action is SkipAction.REPLAY:
            logger.error("%s corrupt entry for step %d at %s: %s", self.name, step, path, reason)
        else:
            logger.warning("%s corrupt entry for step %d at %s: %s; it will be regenerated and overwritten",
                           self.name, step, path, reason)

    def _rebind(self, value: Any, prompts: Any) -> None:
        """Copy identity columns (``rebind_keys``) row-wise from the live prompts onto a replayed batch."""
        target = getattr(value, "non_tensor_batch", None)
        source = getattr(prompts, "non_tensor_batch", None)
        if not self.rebind_keys or not isinstance(target, dict) or not isinstance(source, dict):
            return
        for key in self.rebind_keys:
            if key in target and key in source and len(target[key]) == len(source[key]):
                target[key] = np.array(source[key], copy=True)
            elif key in target and key in source:
                logger.debug("%s: not rebinding %r: %d replayed rows vs %d live rows",
                             self.name, key, len(target[key]), len(source[key]))


def parse_async_rollout_sample_step(sample_id: str) -> int:
    """The feed index in ``sample_{epoch}_{index}`` or ``uid_sample_{epoch}_{index}``.

    The index is the order in which the Rollouter fed the prompt, not the trainer's step.

    Raises:
        ValueError: any other shape.

    Example:
        >>> parse_async_rollout_sample_step("uid_sample_0_42")
        42
    """
    text = str(sample_id)
    if text.startswith("uid_"):
        text = text[4:]
    parts = text.split("_")
    if len(parts) != 3 or parts[0] != "sample" or not parts[1] or not (parts[2].isascii() and parts[2].isdigit()):
        raise ValueError(
            f"Invalid async rollout sample_id {sample_id!r}: expected sample_<epoch>_<feed_index> "
            "or uid_sample_<epoch>_<feed_index>"
        )
    return int(parts[2])


@register_skip("async_rollout")
class AsyncRolloutSkip(RolloutSkip):
    """Caches ``generate_sequences_single(self, prompts)`` per fed sample of the fully async rollouter.

    The step of each call is the feed index parsed from ``prompts.non_tensor_batch["uid"][0]``,
    so many samples can be in flight at once without sharing a step counter.
    """

    support_online_step = True
    config_class = AsyncRolloutSkipConfig

    def extract_step(self, *args: Any, **kwargs: Any) -> int:
        prompts = kwargs.get("prompts")
        if prompts is None and len(args) > 1:
            prompts = args[1]
        non_tensor = getattr(prompts, "non_tensor_batch", None)
        if not isinstance(non_tensor, dict) or "uid" not in non_tensor or len(non_tensor["uid"]) == 0:
            raise ValueError(
                "async_rollout needs prompts (second positional argument or keyword `prompts`) whose "
                "non_tensor_batch['uid'] holds the sample id, e.g. 'uid_sample_0_42'"
            )
        return parse_async_rollout_sample_step(str(non_tensor["uid"][0]))
