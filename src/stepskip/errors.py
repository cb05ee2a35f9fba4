"""Typed errors raised by stepskip."""

from __future__ import annotations

__all__ = [
    "SkipConfigError", "CacheMissError", "CorruptEntryError", "TruncatedEntryError", "DecodeLimitError",
    "UnreadableEntryError",
    "UnstorableValueError", "FingerprintMismatchError", "PromptMismatchError", "ReplayMissError", "DriftError",
]


class SkipConfigError(ValueError):
    """A ``skip`` configuration value (or an entry the configuration forbids) is not acceptable.

    The message names the key, the value given and what is allowed instead.
    """


class CacheMissError(LookupError):
    """The cache has no usable entry where the action requires one (``action: replay``)."""


class CorruptEntryError(CacheMissError):
    """An entry exists but cannot be trusted: bad checksum, truncated file, unreadable meta.

    Under every action except ``replay`` a corrupt entry is logged, counted and regenerated;
    under ``replay`` this error propagates to the caller.
    """


class TruncatedEntryError(CorruptEntryError):
    """A decoder saw an entry's bytes end early: damage even for verl entries that list no checksums."""


class DecodeLimitError(CorruptEntryError):
    """Decoding an entry would allocate more than the decode bound (see :mod:`stepskip.formats.bounds`).

    Shapes, widths and sizes recorded in the entry ask for far more memory than its bytes justify:
    the entry is damaged or hostile. The message names the file, the field and the bound.
    """


class UnreadableEntryError(SkipConfigError):
    """An entry's bytes are intact but cannot be decoded here (an unknown format, a refused pickle ...).

    Unlike a corrupt entry it is never regenerated over or deleted: the message names the entry,
    the reason and the fix; only ``action: record`` replaces it.
    """


class ReplayMissError(CacheMissError, RuntimeError):
    """A step the action must replay has no entry; also a ``RuntimeError``, as verl raises it."""


class UnstorableValueError(TypeError):
    """A value cannot be written by the chosen storage format; the message names the field."""


class FingerprintMismatchError(SkipConfigError):
    """The entry was recorded by a run whose rollout settings differ (``on_mismatch: error``)."""


class PromptMismatchError(SkipConfigError):
    """The replayed step saw other prompts than the live call (``check_prompts: error``)."""


class DriftError(RuntimeError):
    """Under ``action: compare`` with ``on_drift: error``, a step's live result drifted from its recording.

    The message names the role, the step, the field that drifted most and its figure; the drift
    record was written beside the entry before it was raised.
    """
