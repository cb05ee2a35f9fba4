"""Typed errors raised by stepskip."""

from __future__ import annotations

__all__ = [
    "SkipConfigError", "CacheMissError", "CorruptEntryError", "UnstorableValueError",
    "FingerprintMismatchError", "PromptMismatchError",
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


class UnstorableValueError(TypeError):
    """A value cannot be written by the chosen storage format; the message names the field."""


class FingerprintMismatchError(SkipConfigError):
    """The entry was recorded by a run whose rollout settings differ (``on_mismatch: error``)."""


class PromptMismatchError(SkipConfigError):
    """The replayed step saw other prompts than the live call (``check_prompts: error``)."""
