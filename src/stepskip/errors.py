"""Typed errors raised by stepskip, all under one root, :class:`StepskipError`.

Each also derives from the built-in exception a caller would reach for (``ValueError`` for a bad
setting, ``LookupError`` for a missing entry), so code written against verl's errors keeps working.
Damage (:class:`CorruptEntryError`) is a kind of miss; an entry that is intact but cannot be read
here (:class:`UnreadableEntryError`) is neither a miss nor a configuration error, except a pickle
refused because ``allow_pickle`` is false, which is both (:class:`PickleRefusedError`).
"""

from __future__ import annotations

__all__ = [
    "StepskipError", "SkipConfigError", "PickleRefusedError", "CacheMissError", "CorruptEntryError",
    "TruncatedEntryError", "DecodeLimitError", "UnreadableEntryError", "UnstorableValueError",
    "FingerprintMismatchError", "PromptMismatchError", "ReplayMissError", "EngineNotStartedError", "DriftError",
    "StoreUnavailableError",
]


class StepskipError(Exception):
    """The root of every error stepskip raises: ``except StepskipError`` catches them all."""


class SkipConfigError(StepskipError, ValueError):
    """A ``skip`` configuration value (or an entry the configuration forbids) is not acceptable.

    The message names the key, the value given and what is allowed instead.
    """


class CacheMissError(StepskipError, LookupError):
    """The cache has no usable entry where the action requires one (``action: replay``)."""


class CorruptEntryError(CacheMissError):
    """An entry exists but cannot be trusted: bad checksum, truncated file, unreadable meta.

    Under every action except ``replay`` a corrupt entry is logged, counted and regenerated;
    under ``replay`` this error propagates to the caller.
    """


class TruncatedEntryError(CorruptEntryError):
    """A decoder saw an entry's bytes end early: damage even for verl entries that list no checksums."""


class DecodeLimitError(CorruptEntryError):
    """Decoding an entry would allocate more than the decode bound (see :mod:`stepskip._formats.bounds`).

    Shapes, widths and sizes recorded in the entry ask for far more memory than its bytes justify:
    the entry is damaged or hostile. The message names the file, the field and the bound.
    """


class StoreUnavailableError(CacheMissError):
    """The store holding an entry did not answer (a timeout, a refused or dropped connection, a 5xx).

    Nothing is known of the entry, so it is neither damaged nor missing: under every action except
    ``replay`` the call is a miss whose result is returned but never written over the entry; under
    ``replay`` the read is retried a few times, then this error is raised. The message names the
    store's own error.
    """


class UnreadableEntryError(StepskipError):
    """An entry's bytes are intact but cannot be decoded here (an unknown format, a refused pickle ...).

    Unlike a corrupt entry it is never regenerated over or deleted: the message names the entry,
    the reason and the fix; only ``action: record`` replaces it.
    """


class PickleRefusedError(UnreadableEntryError, SkipConfigError):
    """A pickle-based entry (as verl writes them) met while ``allow_pickle`` is false.

    A configuration matter as much as an unreadable entry: the message names ``allow_pickle`` and
    ``stepskip convert``; the entry is left untouched.
    """


class ReplayMissError(CacheMissError, RuntimeError):
    """A step the action must replay has no entry; also a ``RuntimeError``, as verl raises it."""


class UnstorableValueError(StepskipError, TypeError):
    """A value cannot be written by the chosen storage format; the message names the field."""


class FingerprintMismatchError(SkipConfigError):
    """The entry was recorded by a run whose rollout settings differ (``on_mismatch: error``)."""


class PromptMismatchError(SkipConfigError):
    """The replayed step saw other prompts than the live call (``check_prompts: error``)."""


class EngineNotStartedError(StepskipError, RuntimeError):
    """A call needs generation but the run started no inference engine (the role's ``engines`` option).

    Raised where the engine would have been used, instead of a hang or an empty result; the message
    names the step, what needed generation and the option to change.
    """


class DriftError(StepskipError, RuntimeError):
    """Under ``action: compare`` with ``on_drift: error``, a step's live result drifted from its recording.

    The message names the role, the step, the field that drifted most and its figure; the drift
    record was written beside the entry before it was raised.
    """
