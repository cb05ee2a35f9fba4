"""Run a function in a forked child and hand its result back: for code that must run under limits this
process must not take on itself (another user, an address-space limit), or that may hang when broken.

The child sends ``("ok", result)`` or ``("raised", "Type: message")`` through a pipe. The parent waits
for that answer, never for a fixed time to pass: ``timeout`` is a hang guard, reached only when the
code under test hangs. A child that dies without answering (a crash, a signal, the memory limit) is
reported with its exit code as soon as it is gone.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
from collections.abc import Callable
from typing import Any

import pytest

NOBODY = 65534
#: Seconds before a child that neither answered nor died is taken for hung.
HANG_GUARD_S = 300.0


def run_forked(fn: Callable[[], Any], *, before: Callable[[], None] | None = None,
               timeout: float = HANG_GUARD_S) -> Any:
    """What ``fn`` returns in a forked child that first ran ``before``; an exception it raises fails the caller.

    Raises:
        pytest.fail.Exception: the child raised, died without answering, or neither answered nor died
            within ``timeout`` seconds (it is then killed).
    """
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        try:
            if before is not None:
                before()
            send.send(("ok", fn()))
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            send.send(("raised", f"{type(err).__name__}: {err}"))

    proc = context.Process(target=child)
    proc.start()
    send.close()  # the child holds the only writing end: its death ends the pipe
    try:
        if not receive.poll(timeout):
            pytest.fail(f"the child neither answered nor died within {timeout:g}s: it hung")
        try:
            kind, value = receive.recv()
        except EOFError:
            proc.join(timeout)
            pytest.fail(f"the child died without answering (exit code {proc.exitcode})")
        proc.join(timeout)
        if proc.is_alive():
            pytest.fail(f"the child answered but did not exit within {timeout:g}s")
    finally:
        receive.close()
        if proc.is_alive():
            proc.kill()
        proc.join()
    if kind != "ok":
        pytest.fail(f"the child raised {value}")
    return value


def drop_to_nobody() -> None:
    """Become ``nobody`` (the caller must be root): the filesystem's permission checks then apply."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def limit_memory(extra: int) -> Callable[[], None]:
    """A ``before`` that caps the child's address space at its size now plus ``extra`` bytes."""

    def limit() -> None:
        with open("/proc/self/status") as fh:
            size = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))

    return limit
