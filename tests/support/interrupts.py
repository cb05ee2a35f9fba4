"""Starting a command that the test stops with Ctrl-C (SIGINT), whatever the test runner inherited, and
``stepskip view`` run that way."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def _sigint_to_default() -> None:
    # A shell without job control starts `cmd &` with SIGINT ignored, and a Python started with
    # SIGINT ignored installs no KeyboardInterrupt handler: the child must not inherit that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_interruptible(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(args, text=True, pipes for stdout and stderr)`` whose child stops on SIGINT."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_to_default, **kwargs)


@dataclass
class ViewCommand:
    """A running ``stepskip view``: its process and the URL its first line printed."""

    proc: subprocess.Popen[str]
    line: str
    url: str

    @property
    def port(self) -> int:
        return int(self.url.split(":")[2].split("/")[0])


@contextmanager
def view_command(*args: Any) -> Iterator[ViewCommand]:
    """``python -m stepskip view ARGS`` as a real process, once it printed the URL it serves at (the line it
    writes after its socket listens); Ctrl-C (SIGINT) stops it on leaving, and it must then exit 0."""
    proc = popen_interruptible([sys.executable, "-m", "stepskip", "view", *map(str, args)])
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = proc.stdout.readline()
        # stderr only once the process ended: reading it from a live one would wait for its end
        assert line.startswith("stepskip view: serving ") and " at http://" in line, (
            line, proc.stderr.read() if proc.poll() is not None else "")
        yield ViewCommand(proc, line, line.split(" at ")[1].split()[0])
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "stopped" in out, err
