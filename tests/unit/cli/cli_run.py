"""Running the ``stepskip`` command as a subprocess.

Every CLI call is a fresh interpreter (about 3 s, most of it importing torch), so tests start
their calls together with :func:`start` and collect them afterwards: independent calls overlap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Wide lines (rich wraps at COLUMNS), offline Hugging Face, one thread each: calls run side by side.
ENV = {**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
       "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


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


class Call:
    """A running ``python -m stepskip ...``; :meth:`result` waits for it."""

    def __init__(self, *args: Any, cwd: Path | None = None) -> None:
        self.args = [str(a) for a in args]
        self.proc = subprocess.Popen([sys.executable, "-m", "stepskip", *self.args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=ENV, cwd=cwd)
        self._result: Result | None = None

    def result(self) -> Result:
        if self._result is None:
            out, err = self.proc.communicate(timeout=600)  # a hang guard, not a timing
            self._result = Result(self.args, self.proc.returncode, out, err)
        return self._result


def start(*args: Any, cwd: Path | None = None) -> Call:
    """Start ``stepskip ARGS`` in a subprocess."""
    return Call(*args, cwd=cwd)


def stepskip(*args: Any, cwd: Path | None = None) -> Result:
    """Run ``stepskip ARGS`` in a subprocess and wait for it."""
    return start(*args, cwd=cwd).result()
