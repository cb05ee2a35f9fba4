"""The string-valued options of a role as ``str`` enums, with one parser and one error style.

Free of heavy imports: configuration, the roles and the command line all read these.
"""

from __future__ import annotations

import enum
from typing import Any, TypeVar

__all__ = ["SkipAction", "OnMismatch", "CheckPrompts", "Compress", "MatchN", "Engines", "TrainOn", "OnDrift",
           "LogMetrics", "parse_choice"]

_E = TypeVar("_E", bound="Choice")


class Choice(str, enum.Enum):
    """A role option whose value is one of a few names."""

    @classmethod
    def parse(cls: type[_E], value: Any, key: str | None = None) -> _E:
        """The member named ``value``; the error names ``key`` and lists the valid names.

        Raises:
            SkipConfigError: ``value`` names no member.
        """
        return parse_choice(cls, value, key or cls.__name__)

    def __str__(self) -> str:
        return str(self.value)


def parse_choice(cls: type[_E], value: Any, key: str) -> _E:
    """``cls(value)`` with the project's error style: key, bad value, allowed values."""
    from stepskip.errors import SkipConfigError

    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value)
        except ValueError:
            pass
    allowed = ", ".join(member.value for member in cls)
    raise SkipConfigError(f"{key} = {value!r} is not valid; allowed values: {allowed}")


class SkipAction(Choice):
    """What a role does on an eligible step.

    ``CACHE``: load the exact step, else generate and dump. ``REPEAT``: load the nearest
    available step. ``RANDOM``: load a seeded random available step. ``REPLAY``: load the exact
    step or raise :class:`~stepskip.CacheMissError`. ``RECORD``: always generate and overwrite.
    ``MATCH``: replay each prompt group's recorded responses, whichever step recorded them, and
    generate only the groups never recorded. ``COMPARE``: run the call live *and* read the step's
    entry, compare the two and report the drift; return the recorded result or the live one
    (``train_on``). ``EMPTY``: reserved, as in verl.

    Example:
        >>> SkipAction.parse("repeat") is SkipAction.REPEAT
        True
    """

    CACHE = "cache"
    REPEAT = "repeat"
    RANDOM = "random"
    EMPTY = "empty"
    REPLAY = "replay"
    RECORD = "record"
    MATCH = "match"
    COMPARE = "compare"

    @classmethod
    def parse(cls, value: Any, key: str | None = None) -> SkipAction:
        """The action named ``value``; the error (a ``ValueError``) lists the valid names."""
        from stepskip.errors import SkipConfigError

        try:
            return parse_choice(cls, value, key or "action")
        except SkipConfigError as err:
            raise SkipConfigError(f"Unsupported action: {err}") from None


class OnMismatch(Choice):
    """``on_mismatch``: what to do when an entry's run fingerprint differs from this run's."""

    WARN = "warn"
    ERROR = "error"
    REGENERATE = "regenerate"


class CheckPrompts(Choice):
    """``check_prompts``: what to do when a replayed step saw other prompts than the live call."""

    WARN = "warn"
    ERROR = "error"
    OFF = "off"


class MatchN(Choice):
    """``match_n``: a recorded prompt group with another sample count than the live one is
    ``cycle``-d through (as the V1 remap does) or, ``strict``, treated as missing."""

    CYCLE = "cycle"
    STRICT = "strict"


class LogMetrics(Choice):
    """``log_metrics``: which of the role's counters a trainer's tracker receives: ``short`` (hits,
    misses, saved_seconds, dump_failures, corrupt and the comparison figures), ``full`` (every counter
    of ``SkipManager.stats()``) or ``off``."""

    SHORT = "short"
    FULL = "full"
    OFF = "off"


class Compress(Choice):
    """``compress``: ``auto`` (lossless encodings chosen per tensor), ``none`` or ``zstd``."""

    AUTO = "auto"
    NONE = "none"
    ZSTD = "zstd"


class Engines(Choice):
    """``engines``: whether the trainer starts its inference engine (vLLM, SGLang ...) for the run.

    ``AUTO``: start none when every step the run will take is served from the cache and nothing
    else generates (validation); otherwise start it as usual. ``START``: always start it.
    ``SKIP``: never start it; a run that would need one fails at start-up, naming the steps.
    """

    AUTO = "auto"
    START = "start"
    SKIP = "skip"


class TrainOn(Choice):
    """``train_on``: under ``action: compare``, the call returns the ``recorded`` result (the run stays
    aligned with the recording) or the ``live`` one."""

    RECORDED = "recorded"
    LIVE = "live"


class OnDrift(Choice):
    """``on_drift``: under ``action: compare``, a step whose live result drifted from its recording is a
    warning (``warn``) or stops the run (``error``)."""

    WARN = "warn"
    ERROR = "error"
