"""The ``stepskip`` command line (being built: see issue 6)."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stepskip`` console script."""
    print("stepskip: the command line is not built yet", file=sys.stderr)
    return 2
