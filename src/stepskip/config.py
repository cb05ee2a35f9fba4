"""Configuration of the ``skip`` section: dataclasses, strict validation and step sets.

Every role reads the same fields (verl's four — enable, action, steps, dump_dir — plus stepskip's extensions). Values are
validated when a dataclass is constructed; a bad value raises :class:`SkipConfigError` whose
message names the key, the value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from stepskip._entries import CONFIG_FORMATS
from stepskip.errors import SkipConfigError
from stepskip._policies import (
    CheckPrompts,
    Compress,
    Engines,
    LogMetrics,
    MatchN,
    OnDrift,
    OnMismatch,
    SkipAction,
    TrainOn,
    parse_choice,
)

__all__ = [
    "ACTIONS",
    "ROLLOUT_ROLES",
    "SkipRoleConfig",
    "StageSkipConfig",
    "RolloutSkipConfig",
    "RolloutTqSkipConfig",
    "AsyncRolloutSkipConfig",
    "SkipManagerConfig",
    "StepSet",
    "select",
]

#: The actions a role config accepts (``empty`` is reserved, as in verl).
ACTIONS = tuple(a.value for a in SkipAction if a is not SkipAction.EMPTY)
#: verl's rollout roles: sections of their own in the ``skip`` config, and the roles whose steps live
#: directly in the run directory (every other role has ``{run}/{role}/``, so that two roles never read
#: each other's entries). In the order the command line lists them.
ROLLOUT_ROLES = ("rollout", "async_rollout", "rollout_tq")

#: The most trajectories ``log_samples`` sends per step (a tracker table is not a cache browser).
MAX_LOG_SAMPLES = 256

_MISSING = object()
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


# --------------------------------------------------------------------------- config access


def select(config: Any, dotted: str, default: Any = None) -> Any:
    """Read ``a.b.c`` from an OmegaConf node, a nested mapping or an attribute object.

    Missing keys (and ``None`` values) give ``default``; nothing is ever created.
    """
    node = config
    for part in dotted.split("."):
        node = _child(node, part)
        if node is _MISSING or node is None:
            return default
    return node


def _child(node: Any, key: str) -> Any:
    if node is None:
        return _MISSING
    if isinstance(node, Mapping):
        return node.get(key, _MISSING)
    omegaconf = _omegaconf()
    if omegaconf is not None and isinstance(node, omegaconf.DictConfig):
        return node.get(key, _MISSING)
    return getattr(node, key, _MISSING)


def _omegaconf() -> Any:
    """The omegaconf module when the program imported it, else None: only an imported omegaconf can
    have made a config node, and importing it (with its parser) takes a tenth of a second."""
    return sys.modules.get("omegaconf")


def to_plain(node: Any) -> Any:
    """Turn an OmegaConf node, dataclass or attribute object into plain dicts and lists."""
    omegaconf = _omegaconf()
    if omegaconf is not None and isinstance(node, (omegaconf.DictConfig, omegaconf.ListConfig)):
        return omegaconf.OmegaConf.to_container(node, resolve=True)
    if isinstance(node, SkipRoleConfig):
        return node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    if isinstance(node, Mapping):
        return dict(node)
    if hasattr(node, "__dict__") and not isinstance(node, (str, bytes, int, float, list, tuple)):
        return {k: v for k, v in vars(node).items() if not k.startswith("_")}
    return node


# --------------------------------------------------------------------------- step sets


class StepSet:
    """The steps a role may skip: explicit integers, ranges, or every step.

    Membership is O(1) whatever the size of the configuration: integers live in a frozenset,
    ranges in :class:`range` objects (whose ``in`` is arithmetic), ``"all"`` in a flag.

    Example:
        >>> s = StepSet.parse([1, 2, "10-100:10"])
        >>> 2 in s, 30 in s, 31 in s
        (True, True, False)
    """

    __slots__ = ("_all", "_ints", "_ranges", "spec")

    def __init__(self, ints: Iterable[int] = (), ranges: Iterable[range] = (), everything: bool = False,
                 spec: Any = None) -> None:
        self._ints = frozenset(ints)
        self._ranges = tuple(ranges)
        self._all = everything
        self.spec = spec

    @classmethod
    def parse(cls, steps: Any, key: str = "steps") -> StepSet:
        """Parse a ``steps`` value: a list of ints and range strings, one int, or a string of them
        separated by commas (``"1-6,8,10"``, as ``stepskip ls`` prints steps; ``"all"``).

        Example:
            >>> 8 in StepSet.parse("1-6,8,10"), 7 in StepSet.parse("1-6,8,10"), 3 in StepSet.parse(3)
            (True, False, True)
        """
        allowed = ('a list of non-negative ints and range strings such as "1-128" or "10-100:10", one int, '
                   'a comma-separated string such as "1-6,8,10", or "all"')
        given = steps
        if isinstance(steps, int) and not isinstance(steps, bool):
            steps = [steps]
        if isinstance(steps, str):
            steps = [steps]
        if not isinstance(steps, (list, tuple)):
            raise SkipConfigError(f"{key} = {steps!r} is not valid; expected {allowed}")
        ints: set[int] = set()
        ranges: list[range] = []
        everything = False
        for item in _split_commas(steps):
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise SkipConfigError(f"{key} contains {item!r} ({type(item).__name__}); expected {allowed}")
            if isinstance(item, int):
                if item < 0:
                    raise SkipConfigError(f"{key} contains {item!r}; steps are non-negative, expected {allowed}")
                ints.add(item)
            elif item.strip().lower() == "all":
                everything = True
            elif item.strip().isascii() and item.strip().isdigit():
                ints.add(int(item))
            else:
                match = _RANGE.match(item)
                if match is None:
                    raise SkipConfigError(f"{key} contains {item!r}; expected {allowed}")
                start, stop, stride = int(match[1]), int(match[2]), int(match[3] or 1)
                if stop < start or stride < 1:
                    raise SkipConfigError(
                        f"{key} contains {item!r}: a range needs start <= end and a stride >= 1 (e.g. \"10-100:10\")"
                    )
                ranges.append(range(start, stop + 1, stride))
        return cls(ints, ranges, everything, spec=given)

    def __contains__(self, step: object) -> bool:
        if type(step) is not int:
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
                return False  # floats equal to ints and other look-alikes are never steps
            step = int(step)
        if step in self._ints:
            return True
        if self._all:
            return step >= 0
        for r in self._ranges:
            if step in r:
                return True
        return False

    def fast(self) -> Any:
        """An equivalent container whose ``in`` runs in C for int steps (frozenset or range), else self.

        Only valid for int lookups (``SkipManager.set_step`` and ``extract_step`` give ints).
        """
        if self._all:
            return range(0, sys.maxsize)
        if not self._ranges:
            return self._ints
        if not self._ints and len(self._ranges) == 1:
            return self._ranges[0]
        if sum(len(r) for r in self._ranges) <= 200_000:
            return frozenset(self._ints.union(*self._ranges))
        return self

    def __bool__(self) -> bool:
        return self._all or bool(self._ints) or any(len(r) for r in self._ranges)

    @property
    def everything(self) -> bool:
        """Whether the set is every step (``"all"``)."""
        return self._all

    def first_outside(self, other: StepSet) -> int | None:
        """The smallest step of this set that ``other`` does not hold; None when ``other`` holds them all.

        Example:
            >>> StepSet.parse("2,5-7").first_outside(StepSet.parse("1-6")), StepSet.parse(3).first_outside(StepSet.parse("all"))
            (7, None)
        """
        if other._all:
            return None
        held = other.fast()
        if self._all:
            step = 0
            while step in held:
                step += 1
            return step
        missing = [s for s in self._ints if s not in held]
        for r in self._ranges:
            missing += [next((s for s in r if s not in held), -1)]
        found = [s for s in missing if s >= 0]
        return min(found) if found else None

    def __repr__(self) -> str:
        return f"StepSet({self.spec!r})"


def _split_commas(items: Iterable[Any]) -> list[Any]:
    """The items with each string cut at its commas: ``"1-6,8"`` is ``"1-6"`` and ``"8"``.

    A string with nothing between two commas (``"1,,2"``, ``""``) keeps an empty piece, which the
    parser refuses by name.
    """
    out: list[Any] = []
    for item in items:
        if isinstance(item, str) and "," in item:
            out.extend(item.split(","))
        else:
            out.append(item)
    return out


# --------------------------------------------------------------------------- role configs


def _did_you_mean(key: Any, known: Iterable[str]) -> str:
    """`` (did you mean `steps`?)`` for the known key closest to a mistyped one, else nothing."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f" (did you mean `{close[0]}`?)" if close else ""


def _choice(key: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(str(a) for a in allowed)
    if not isinstance(value, str) or str(value) not in allowed:
        raise SkipConfigError(f"{key} = {value!r} is not valid; allowed values: {', '.join(allowed)}")


def _boolean(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SkipConfigError(f"{key} = {value!r} ({type(value).__name__}) is not valid; allowed values: true, false")


def _number(key: str, value: Any, low: float, high: float | None) -> float:
    """``value`` as a float in ``[low, high]`` (no upper bound when ``high`` is None)."""
    allowed = f"a number from {low:g} to {high:g}" if high is not None else f"a number >= {low:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or not low <= value <= (high if high is not None else float("inf")):
        raise SkipConfigError(f"{key} = {value!r} is not valid; expected {allowed}")
    return float(value)


def _integer(key: str, value: Any, expected: str, low: int | None = None, high: int | None = None) -> None:
    """``value`` is an int (not a bool) in ``[low, high]`` (a missing bound is no bound); ``expected`` says
    what is allowed, for the message."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) \
            or (high is not None and value > high):
        raise SkipConfigError(f"{key} = {value!r} is not valid; expected {expected}")


def _str_list(key: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SkipConfigError(f"{key} = {value!r} is not valid; expected a list of strings")


@dataclass
class SkipRoleConfig:
    """Fields shared by every skip role (``skip.<role>``).

    Args:
        enable: master switch of the role.
        dump_dir: cache root, a local path (``~`` expanded) or an fsspec URL.
        steps: steps eligible for skipping: a list of ints and ``"a-b"`` / ``"a-b:stride"`` ranges,
            one int, the same joined by commas in one string (``"1-6,8,10"``, as ``stepskip ls``
            prints them), or ``"all"``.
        action: ``cache`` (exact step, else generate and dump), ``repeat`` (nearest available step),
            ``random`` (a seeded random available step), ``replay`` (exact step or
            :class:`CacheMissError`), ``record`` (always generate and overwrite), ``match`` (replay
            each prompt group from whichever step recorded it; generate only the groups never recorded),
            ``compare`` (run the call live and read the step's entry, compare them and report the drift;
            a step without an entry is generated and recorded as under ``cache``).
        format: ``safe`` (safetensors + JSON, no pickle) or ``verl`` (verl 0.9's pickle files).
        allow_pickle: allow reading pickle-based entries, through an allow-list unpickler.
        verify: check file checksums when loading.
        async_dump: encode and write dumps on a background thread.
        dump_process: with ``async_dump``, small entries (the async role's one-sample ones) on a
            local dump dir are encoded and written by two helper processes, off the caller's GIL
            (:mod:`stepskip._dumping.helper`; ``STEPSKIP_DUMP_PROCESS=0`` turns it off process-wide).
        compress: ``auto``, ``none`` or ``zstd``.
        seed: seed of the ``random`` action.
        rebind_keys: identity columns copied from the live prompts onto a replayed batch.
        check_prompts: what to do when the replayed step saw other prompts.
        on_mismatch: what to do when the entry's run fingerprint differs from this run's.
        fingerprint_keys: extra config keys that identify a run.
        storage_options: options for the fsspec filesystem of a ``dump_dir`` URL.
        restore_rng: save torch's CPU (and, when initialised, CUDA) random generator state right
            after a recorded call and restore it when the call is replayed, so that code drawing
            from the global generator after the call (e.g. a shuffle) sees what it saw when recording.
        match_n: under ``action: match``, a recorded prompt group whose sample count differs from
            the live one is ``cycle``-d through, or (``strict``) generated anew.
        max_decode_bytes: the most a decode may allocate for one entry (default: 256 x the entry's
            size on disk + 256 MiB); an entry that asks for more is refused before allocating.
        engines: whether the trainer starts its inference engine: ``auto`` (none when every step
            the run takes is served from the cache and nothing else generates), ``start`` (always)
            or ``skip`` (never; fail at start-up if a step would need one). Honoured by the verl and
            TRL integrations (see :meth:`SkipManager.engine_plan`).
        train_on: under ``action: compare``, what the call returns: the ``recorded`` result (the run
            stays aligned with the recording) or the ``live`` one.
        compare_min_match: under ``action: compare``, the least share a field must match for the step
            to pass: token match over the valid positions for integer tensors, the share of elements
            within ``rtol``/``atol`` for float tensors, the share of equal rows for other columns.
        rtol: relative tolerance of float tensors under ``action: compare`` (``|live - recorded| <=
            atol + rtol * |recorded|``).
        atol: absolute tolerance of float tensors under ``action: compare``.
        on_drift: under ``action: compare``, a step that drifted (a field below ``compare_min_match``)
            is a ``warn``-ing, or an ``error`` that stops the run naming the step and the field.
        log_metrics: which of the role's counters the trainer's experiment tracker receives with each
            step's metrics (verl's ``Tracking``, TRL's ``report_to``): ``short`` (hits, misses,
            saved_seconds, dump_failures, corrupt and, under ``action: compare``, the comparison
            figures), ``full`` (every counter) or ``off``.
        log_samples: how many trajectories of each recorded or replayed step to send to the tracker
            (prompt, response, reward, source step, replayed or generated): a table where the backend
            takes tables (W&B, MLflow), text elsewhere; 0 (the default) sends none.
        fingerprint_weights: also digest the model's weight files into the run fingerprint (each
            file's size, modification time and a hash of its first, middle and last 64 KiB; whole
            when at most 4 MiB), so a checkpoint re-saved at the same path is a mismatch.
        fingerprint_code: record the git revision (HEAD's commit, uncommitted changes to tracked
            files) of the work tree the run starts in; false leaves the code out of the fingerprint.
        sources: read-only caches searched in order after ``dump_dir`` when it has no entry for a step:
            each a local path or fsspec URL laid out as a dump dir (this run's run directory under it),
            or ``{url: ..., storage_options: {...}}`` for a store of other options than ``dump_dir``'s.
            Nothing is ever written to a source; a hit from one is counted in ``hits_from/{i}``.
        replay_from: another run whose recordings this run reads after its own (never written):
            ``{experiment_name: ..., project_name: ...}`` (that experiment under ``dump_dir``, this run's
            shape) or the path or URL of a run directory; hits counted in ``hits_from/replay_from``.
        max_keep: keep at most this many recorded steps in the role's directory (the highest step
            numbers; ``pin_steps`` are kept besides and not counted): after each step this run
            records, older ones are removed as ``stepskip prune`` removes them. None: no limit.
        max_bytes: keep the recorded steps of the role's directory within this many bytes (an int,
            or a size such as ``"20GB"`` or ``"512MiB"``), removing the lowest steps first after
            each step this run records; the step just recorded always stays. None: no limit.
        pin_steps: steps never removed by ``max_keep``/``max_bytes`` (the syntax of ``steps``).
        read_only: nothing is ever written, replaced or removed under ``dump_dir``: a hit replays,
            a miss runs the call and returns its result without recording it (``action: replay``:
            :class:`ReplayMissError`). For a shared cache others recorded, or a read-only mount.

    Example:
        >>> RolloutSkipConfig(enable=True, steps=["1-3"], action="repeat").action
        <SkipAction.REPEAT: 'repeat'>
    """

    section: ClassVar[str] = "skip.<role>"
    allowed_actions: ClassVar[tuple[str, ...]] = ACTIONS

    enable: bool = False
    dump_dir: str = "~/.verl/rollout_dump"
    steps: list[Any] = field(default_factory=list)
    action: str = SkipAction.CACHE
    format: str = "safe"
    allow_pickle: bool = False
    verify: bool = True
    async_dump: bool = True
    dump_process: bool = True
    compress: str = Compress.AUTO
    seed: int = 0
    rebind_keys: list[str] = field(default_factory=lambda: ["uid"])
    check_prompts: str = CheckPrompts.WARN
    on_mismatch: str = OnMismatch.WARN
    fingerprint_keys: list[str] = field(default_factory=list)
    storage_options: dict[str, Any] = field(default_factory=dict)
    restore_rng: bool = False
    match_n: str = MatchN.CYCLE
    max_decode_bytes: int | None = None
    engines: str = Engines.AUTO
    train_on: str = TrainOn.RECORDED
    compare_min_match: float = 0.9
    rtol: float = 1e-5
    atol: float = 1e-8
    on_drift: str = OnDrift.WARN
    log_metrics: str = LogMetrics.SHORT
    log_samples: int = 0
    # content fingerprints (the digests themselves: stepskip._content)
    fingerprint_weights: bool = False
    fingerprint_code: bool = True
    # layered caches: read-only sources below dump_dir, and another run's recordings (stepskip._reading.layers)
    sources: list[Any] = field(default_factory=list)
    replay_from: Any = None
    # sharing a cache: in-run retention and read-only caches
    max_keep: int | None = None
    max_bytes: int | str | None = None
    pin_steps: list[Any] = field(default_factory=list)
    read_only: bool = False

    def __post_init__(self) -> None:
        self.validate(self.section)

    def validate(self, where: str) -> None:
        """Check every field; raise :class:`SkipConfigError` naming ``where.<key>`` on failure."""
        _boolean(f"{where}.enable", self.enable)
        if not isinstance(self.dump_dir, str) or not self.dump_dir.strip():
            raise SkipConfigError(
                f"{where}.dump_dir = {self.dump_dir!r} is not valid; expected a non-empty path or fsspec URL string"
            )
        self.step_set = StepSet.parse(self.steps, f"{where}.steps")
        if not isinstance(self.action, str) or str(self.action) not in self.allowed_actions:
            raise SkipConfigError(f"Unsupported action: {where}.action = {self.action!r} is not valid; "
                                  f"allowed values: {', '.join(self.allowed_actions)}")
        self.action = SkipAction(self.action)
        _choice(f"{where}.format", self.format, CONFIG_FORMATS)
        _boolean(f"{where}.allow_pickle", self.allow_pickle)
        _boolean(f"{where}.verify", self.verify)
        _boolean(f"{where}.async_dump", self.async_dump)
        _boolean(f"{where}.dump_process", self.dump_process)
        self.compress = parse_choice(Compress, self.compress, f"{where}.compress")
        _integer(f"{where}.seed", self.seed, "an int")
        _str_list(f"{where}.rebind_keys", self.rebind_keys)
        self.check_prompts = parse_choice(CheckPrompts, self.check_prompts, f"{where}.check_prompts")
        self.on_mismatch = parse_choice(OnMismatch, self.on_mismatch, f"{where}.on_mismatch")
        _str_list(f"{where}.fingerprint_keys", self.fingerprint_keys)
        _boolean(f"{where}.restore_rng", self.restore_rng)
        self.match_n = parse_choice(MatchN, self.match_n, f"{where}.match_n")
        self.engines = parse_choice(Engines, self.engines, f"{where}.engines")
        if self.max_decode_bytes is not None:
            _integer(f"{where}.max_decode_bytes", self.max_decode_bytes,
                     "a positive int (bytes) or null for the default bound", low=1)
        self.train_on = parse_choice(TrainOn, self.train_on, f"{where}.train_on")
        self.on_drift = parse_choice(OnDrift, self.on_drift, f"{where}.on_drift")
        self.compare_min_match = _number(f"{where}.compare_min_match", self.compare_min_match, 0.0, 1.0)
        self.rtol = _number(f"{where}.rtol", self.rtol, 0.0, None)
        self.atol = _number(f"{where}.atol", self.atol, 0.0, None)
        self.log_metrics = parse_choice(LogMetrics, self.log_metrics, f"{where}.log_metrics")
        _integer(f"{where}.log_samples", self.log_samples, f"an int from 0 (none) to {MAX_LOG_SAMPLES} "
                 "(trajectories of each recorded or replayed step)", low=0, high=MAX_LOG_SAMPLES)
        _boolean(f"{where}.fingerprint_weights", self.fingerprint_weights)
        _boolean(f"{where}.fingerprint_code", self.fingerprint_code)
        if not isinstance(self.storage_options, Mapping) or not all(isinstance(k, str) for k in self.storage_options):
            raise SkipConfigError(
                f"{where}.storage_options = {self.storage_options!r} is not valid; expected a mapping of "
                "fsspec filesystem options (e.g. {{client_kwargs: {{endpoint_url: ...}}}})"
            )
        from stepskip._reading.layers import check_layer_options

        check_layer_options(self, where)
        if self.format == "verl" and not self.allow_pickle:
            raise SkipConfigError(
                f"{where}.format = 'verl' writes pickle files that can only be read back with "
                f"{where}.allow_pickle = true; set it, or keep the default format 'safe' "
                "(use `stepskip convert --to verl` to export a cache for verl)"
            )
        self.pin_set = StepSet.parse(self.pin_steps, f"{where}.pin_steps")
        _check_sharing(self, where)

    @property
    def retains(self) -> bool:
        """Whether recorded steps are removed during the run (``max_keep`` or ``max_bytes`` is set)."""
        return self.max_keep is not None or self.max_bytes is not None

    @classmethod
    def from_mapping(cls, section: Any, where: str | None = None) -> SkipRoleConfig:
        """Build from a mapping, rejecting unknown keys with the list of known ones."""
        where = where or cls.section
        if isinstance(section, cls):
            section.validate(where)
            return section
        if isinstance(section, SkipRoleConfig):
            section = {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}
        section = to_plain(section)
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise SkipConfigError(f"{where} = {section!r} is not valid; expected a mapping of role settings")
        known = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(section) - set(known), key=str)
        if unknown:
            named = ", ".join(f"{key!r}{_did_you_mean(key, known)}" for key in unknown)
            raise SkipConfigError(f"{where} has unknown key(s) {named}; known keys: {', '.join(known)}")
        values = {k: to_plain(v) for k, v in section.items()}
        try:
            built = cls(**values)
        except SkipConfigError as err:
            if where != cls.section:
                raise SkipConfigError(str(err).replace(cls.section, where)) from None
            raise
        return built


    @classmethod
    def coerce(cls, local_config: Any, where: str | None = None) -> Any:
        """Normalise a role's section once: a config dataclass stays as it is; a mapping or an
        attribute object (as verl-style code passes) becomes ``cls``, validated.

        Objects of a role's own config class that does not derive from :class:`SkipRoleConfig`
        are returned unchanged.
        """
        if isinstance(local_config, SkipRoleConfig) or (dataclasses.is_dataclass(local_config)
                                                         and not isinstance(local_config, type)):
            return local_config
        plain = to_plain(local_config)
        if isinstance(plain, Mapping) and not isinstance(local_config, Mapping):
            known = {f.name for f in dataclasses.fields(cls) if f.init}
            plain = {k: v for k, v in plain.items() if k in known}  # attribute objects carry more than settings
        return cls.from_mapping(plain, where)


@dataclass
class StageSkipConfig(SkipRoleConfig):
    """``skip.<name>`` with ``kind: stage``: a generic stage role; the same fields as every role, and

    Args:
        kind: ``stage``: declares the section a generic stage role under a name no registered role has.
        row_wise: the stage maps each input row to one output row (a reward, a log-prob ...), so
            ``action: match`` may replay it prompt group by prompt group.
        record_inputs: store the call's arguments (those after a method's ``self``, positional and
            keyword, in the safe format) beside its result, so that ``stepskip rerun`` can call a
            function on them offline and compare it with the recorded result.
    """

    section: ClassVar[str] = "skip.<stage>"

    kind: str = "stage"
    row_wise: bool = False
    record_inputs: bool = False

    def validate(self, where: str) -> None:
        super().validate(where)
        if self.kind != "stage":
            raise SkipConfigError(f"{where}.kind = {self.kind!r} is not valid; allowed values: stage")
        _boolean(f"{where}.row_wise", self.row_wise)
        _boolean(f"{where}.record_inputs", self.record_inputs)
        if self.action == SkipAction.MATCH and not self.row_wise:
            raise SkipConfigError(
                f"{where}.action = 'match' replays prompt groups row by row; declare the stage row-wise with "
                f"{where}.row_wise = true (each input row gives one output row), or choose another action"
            )


@dataclass
class RolloutSkipConfig(SkipRoleConfig):
    """``skip.rollout``: the colocated trainer's ``generate_sequences``."""

    section: ClassVar[str] = "skip.rollout"


@dataclass
class RolloutTqSkipConfig(SkipRoleConfig):
    """``skip.rollout_tq``: the V1 trainer over TransferQueue (submit / sample phases)."""

    section: ClassVar[str] = "skip.rollout_tq"


@dataclass
class AsyncRolloutSkipConfig(SkipRoleConfig):
    """``skip.async_rollout``: the fully async rollouter; steps are feed indices."""

    section: ClassVar[str] = "skip.async_rollout"


@dataclass
class SkipManagerConfig:
    """The whole ``skip`` section: the three built-in roles plus any registered role.

    Roles other than the three built-ins live in ``extra`` and are reachable as attributes
    (``cfg.my_role``).

    Example:
        >>> cfg = SkipManagerConfig.from_section({"rollout": {"enable": True, "steps": [1, 2]}})
        >>> cfg.rollout.enable, cfg.async_rollout.enable
        (True, False)
    """

    rollout: RolloutSkipConfig = field(default_factory=RolloutSkipConfig)
    rollout_tq: RolloutTqSkipConfig = field(default_factory=RolloutTqSkipConfig)
    async_rollout: AsyncRolloutSkipConfig = field(default_factory=AsyncRolloutSkipConfig)
    extra: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        extra = self.__dict__.get("extra", {})
        if name in extra:
            return extra[name]
        raise AttributeError(name)

    def role(self, name: str) -> SkipRoleConfig | None:
        """The configuration of role ``name``, or None when the section does not know it."""
        if name in ROLLOUT_ROLES:
            built: SkipRoleConfig = getattr(self, name)
            return built
        return self.extra.get(name)

    @classmethod
    def from_section(cls, section: Any, config_classes: Mapping[str, type[SkipRoleConfig]] | None = None,
                     ) -> SkipManagerConfig:
        """Build from the ``skip`` section of a training config.

        Args:
            section: ``config.skip`` as an OmegaConf node, mapping, dataclass or None.
            config_classes: config dataclass per role name for roles beyond the built-ins
                (from the registered skip classes' ``config_class``). Names that are neither
                built-in nor listed here are rejected, except ``kind: stage`` sections.

        Returns:
            The validated configuration.
        """
        if isinstance(section, SkipManagerConfig):
            return section
        plain = to_plain(section) if section is not None else {}
        if plain is None:
            plain = {}
        if not isinstance(plain, Mapping):
            raise SkipConfigError(f"skip = {section!r} is not valid; expected a mapping of roles")
        classes: dict[str, type[SkipRoleConfig]] = {
            "rollout": RolloutSkipConfig,
            "rollout_tq": RolloutTqSkipConfig,
            "async_rollout": AsyncRolloutSkipConfig,
        }
        classes.update(config_classes or {})
        built: dict[str, SkipRoleConfig] = {}
        for name, body in plain.items():
            if name.startswith("_"):  # Hydra's _target_ and friends
                continue
            config_class = classes.get(name)
            if config_class is None:
                body_plain = to_plain(body)
                kind = body_plain.get("kind") if isinstance(body_plain, Mapping) else None
                if kind == "stage":
                    config_class = StageSkipConfig
                else:
                    raise SkipConfigError(
                        f"skip.{name} is not a known skip role{_did_you_mean(name, classes)}; known roles: "
                        f"{', '.join(sorted(classes))} "
                        "(register a new role with @register_skip, or declare a generic stage with `kind: stage`)"
                    )
            if isinstance(config_class, type) and issubclass(config_class, SkipRoleConfig):
                built[name] = config_class.from_mapping(body, f"skip.{name}")
            else:
                built[name] = _plain_config(config_class, body, f"skip.{name}")
        extra = {k: v for k, v in built.items() if k not in ROLLOUT_ROLES}
        return cls(
            rollout=built.get("rollout", RolloutSkipConfig()),  # type: ignore[arg-type]
            rollout_tq=built.get("rollout_tq", RolloutTqSkipConfig()),  # type: ignore[arg-type]
            async_rollout=built.get("async_rollout", AsyncRolloutSkipConfig()),  # type: ignore[arg-type]
            extra=extra,
        )


def _plain_config(config_class: type, body: Any, where: str) -> Any:
    """A registered role's own config class that does not derive from SkipRoleConfig."""
    plain = to_plain(body) if body is not None else {}
    if isinstance(plain, config_class):
        return plain
    if not isinstance(plain, Mapping):
        raise SkipConfigError(f"{where} = {body!r} is not valid; expected a mapping of role settings")
    try:
        return config_class(**{k: to_plain(v) for k, v in plain.items()})
    except TypeError as err:
        raise SkipConfigError(f"{where}: {err}") from err


# --------------------------------------------------------------------------- sharing a cache

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(value: Any, key: str) -> int:
    """Bytes in ``value``: a positive int, or a string such as ``"20GB"`` or ``"512MiB"``.

    Raises:
        SkipConfigError: anything else (the message shows the accepted forms).

    Example:
        >>> parse_size("1.5GiB", "max_bytes"), parse_size(4096, "max_bytes")
        (1610612736, 4096)
    """
    allowed = 'a positive number of bytes: an int, or a size such as "20GB" or "512MiB" (B, KB, MB, GB, TB, KiB ... TiB)'
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise SkipConfigError(f"{key} = {value!r} is not valid; expected {allowed}, or null for no limit")
        return value
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise SkipConfigError(f"{key} = {value!r} is not valid; expected {allowed}, or null for no limit")
    size = int(float(match[1]) * _SIZE_UNITS[(match[2] or "b").lower()])
    if size <= 0:
        raise SkipConfigError(f"{key} = {value!r} is not valid; expected {allowed}, or null for no limit")
    return size


def _check_sharing(config: SkipRoleConfig, where: str) -> None:
    """``max_keep``, ``max_bytes``, ``pin_steps`` and ``read_only``: each value, and how they go together."""
    keep = config.max_keep
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise SkipConfigError(f"{where}.max_keep = {keep!r} is not valid; expected an int >= 1 (the number of "
                              "recorded steps kept), or null for no limit")
    if config.max_bytes is not None:
        config.max_bytes = parse_size(config.max_bytes, f"{where}.max_bytes")
    _boolean(f"{where}.read_only", config.read_only)
    if config.read_only:
        if config.action == SkipAction.RECORD:
            raise SkipConfigError(f"{where}.action = 'record' writes every step, and {where}.read_only = true "
                                  "writes nothing; choose another action (replay, cache ...), or drop read_only")
        given = [k for k in ("max_keep", "max_bytes") if getattr(config, k) is not None]
        given += ["pin_steps"] if config.pin_set else []
        if given:
            raise SkipConfigError(f"{where}.{given[0]} is a retention setting (which recorded steps are removed "
                                  f"during the run), and {where}.read_only = true never removes anything; drop "
                                  f"{', '.join(given)}, or read_only")
    if config.pin_set and not config.step_set.everything:
        outside = config.pin_set.first_outside(config.step_set)
        if outside is not None:
            raise SkipConfigError(f"{where}.pin_steps = {config.pin_steps!r} names step {outside}, which "
                                  f"{where}.steps = {config.steps!r} does not hold: no entry of it is ever "
                                  "recorded to keep; pin steps from `steps`, or widen `steps`")


# --------------------------------------------------------------------------- legacy flag


def disable_legacy_flag(config: Any, skip_config: SkipManagerConfig) -> None:
    """verl's rule: when both skip mechanisms are on, warn and turn the legacy one off in place."""
    if not skip_config.rollout.enable:
        return
    legacy = select(config, "actor_rollout_ref.rollout.skip")
    if legacy is None or select(legacy, "enable", False) is not True:
        return
    warnings.warn(
        "actor_rollout_ref.rollout.skip.enable and skip.rollout.enable are both true; the legacy "
        "flag is deprecated and has been set to False so that only skip.rollout runs",
        DeprecationWarning,
        stacklevel=3,
    )
    omegaconf = _omegaconf()
    if omegaconf is not None and isinstance(legacy, omegaconf.DictConfig):
        with omegaconf.read_write(legacy):
            legacy.enable = False
        return
    if isinstance(legacy, dict):
        legacy["enable"] = False
    else:
        legacy.enable = False
