"""Running ``stepskip`` in process through typer's test runner: no subprocess, no fresh interpreter.

Output goes through the same rich consoles as in a terminal session (stdout and stderr captured
apart); exceptions other than the command's own exits propagate, so a crash fails the test with
its traceback. The console script itself is started in ``tests/integration/cli``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from stepskip.cli.app import app


@dataclass
class Result:
    """A finished ``stepskip`` call."""

    args: list[str]
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def __repr__(self) -> str:  # shown by pytest when an assertion on a result fails
        return f"stepskip {' '.join(self.args)} -> {self.code}\n--- stdout\n{self.out}\n--- stderr\n{self.err}"


def stepskip(*args: Any, cwd: Path | None = None) -> Result:
    """Run ``stepskip ARGS`` in this process and return its exit code and output."""
    argv = [str(a) for a in args]
    previous = os.getcwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        done = CliRunner().invoke(app, argv, prog_name="stepskip", catch_exceptions=False,
                                  env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    finally:
        os.chdir(previous)
    return Result(argv, done.exit_code, done.stdout, done.stderr)
