"""The ``stepskip`` command line: ``ls``, ``info``, ``verify``, ``prune``, ``convert``, ``show``, ``demo``.

The typer layer (:mod:`stepskip.cli.app`) parses arguments and renders; the cache itself is read,
checked and pruned through the library's index (:mod:`stepskip._index`), so every command works on
every store the library writes to (local paths, ``memory://``, ``s3://``, any fsspec URL, with
``--storage-option`` for its options). Scripts use :mod:`stepskip.cache`, the public face of these
modules; each returns data classes:

* :mod:`stepskip.cli.content` — decoded values: fields, statistics, sample rows;
* :mod:`stepskip.cli.describe` — one entry described (``info``);
* :mod:`stepskip.cli.verify` — checksums, completeness, leftovers and repair;
* :mod:`stepskip.cli.prune` — choosing and removing steps;
* :mod:`stepskip.cli.convert` — re-encoding a cache in another format.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``stepskip`` console script and of ``python -m stepskip``.

    Args:
        argv: the arguments (without the program name); ``sys.argv[1:]`` when None.

    Returns:
        The exit code: 0 success, 1 problems found (``verify``, ``info``, ``convert``), 2 usage errors.

    Example:
        >>> main(["ls", "/tmp/rollout_dump", "--json"])  # doctest: +SKIP
        0
    """
    from stepskip.cli.app import app

    try:
        app(args=argv, prog_name="stepskip")
    except SystemExit as done:
        code = done.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 0
