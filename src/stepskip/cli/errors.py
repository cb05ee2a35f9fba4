"""Errors of the command line: what the user must fix before a command can run (exit code 2)."""

from __future__ import annotations

from stepskip.errors import StepskipError

__all__ = ["CliError"]


class CliError(StepskipError):
    """A wrong path, a directory that is not a cache, a bad option value.

    The message says what is wrong and what to do instead; the command exits with code 2.
    """
