"""Run a function as a user without special rights, so that permission checks meet the filesystem's
real answers: root passes every mode bit, so under root the function runs in a forked child that
drops to ``nobody``; any other user runs it in this process."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

NOBODY = 65534


def as_unprivileged(fn: Callable[[], Any]) -> Any:
    """What ``fn`` returns when run by an unprivileged user (an exception it raises fails the caller)."""
    if os.geteuid() != 0:
        return fn()
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        try:
            send.send(("ok", fn()))
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            send.send(("raised", f"{type(err).__name__}: {err}"))

    proc = context.Process(target=child)
    proc.start()
    kind, value = receive.recv()
    proc.join()
    assert kind == "ok", value
    return value


@contextmanager
def owned_tmp_dir() -> Iterator[Path]:
    """A fresh directory below /tmp that the user of :func:`as_unprivileged` owns (and may write)."""
    base = Path(tempfile.mkdtemp(prefix="stepskip-unpriv-", dir="/tmp"))
    base.chmod(0o711)
    path = base / "owned"
    path.mkdir()
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    try:
        yield path
    finally:
        for sub in [base, *base.rglob("*")]:
            if sub.is_dir() and not sub.is_symlink():
                sub.chmod(0o700)
        shutil.rmtree(base)
