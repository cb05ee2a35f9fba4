"""Errors of the command line: what the user must fix before a command can run (exit code 2)."""

from __future__ import annotations

__all__ = ["CliError", "PickleRefusedError"]


class CliError(Exception):
    """A wrong path, a directory that is not a cache, a bad option value.

    The message says what is wrong and what to do instead; the command exits with code 2.
    """


class PickleRefusedError(CliError):
    """A pickle-based entry (``gen_batch.dp``, ``tq_batch.pt``) met without ``--allow-pickle``."""

    def __init__(self, path: str, format_name: str, what: str = "read it") -> None:
        super().__init__(
            f"{path} is a pickle-based entry (format {format_name!r}, as verl writes it); to {what}, pass "
            "--allow-pickle (it is read through stepskip's allow-list unpickler, which refuses any global "
            "outside the data types such a file holds)"
        )
        self.path = path
        self.format_name = format_name
