"""Starting a command that the test stops with Ctrl-C (SIGINT), whatever the test runner inherited."""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def _sigint_to_default() -> None:
    # A shell without job control starts `cmd &` with SIGINT ignored, and a Python started with
    # SIGINT ignored installs no KeyboardInterrupt handler: the child must not inherit that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_interruptible(args: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """``subprocess.Popen(args, text=True, pipes for stdout and stderr)`` whose child stops on SIGINT."""
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint_to_default, **kwargs)
