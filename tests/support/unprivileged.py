"""Run a function as a user without special rights, so that permission checks meet the filesystem's
real answers: root passes every mode bit, so under root the function runs in a forked child that
drops to ``nobody`` (tests/support/forked.py); any other user runs it in this process."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from forked import NOBODY, drop_to_nobody, run_forked


def as_unprivileged(fn: Callable[[], Any]) -> Any:
    """What ``fn`` returns when run by an unprivileged user (an exception it raises fails the caller)."""
    if os.geteuid() != 0:
        return fn()
    return run_forked(fn, before=drop_to_nobody)


@contextmanager
def passable_tmp_dir() -> Iterator[Path]:
    """A fresh directory below /tmp that the user of :func:`as_unprivileged` may pass through (mode 0711)
    but not list or write; removed afterwards whatever modes the test left below it."""
    base = Path(tempfile.mkdtemp(prefix="stepskip-unpriv-", dir="/tmp"))
    base.chmod(0o711)
    try:
        yield base
    finally:
        for sub in [base, *base.rglob("*")]:
            if sub.is_dir() and not sub.is_symlink():
                sub.chmod(0o700)
        shutil.rmtree(base)


@contextmanager
def owned_tmp_dir() -> Iterator[Path]:
    """A fresh directory below /tmp that the user of :func:`as_unprivileged` owns (and may write)."""
    with passable_tmp_dir() as base:
        path = base / "owned"
        path.mkdir()
        if os.geteuid() == 0:
            os.chown(path, NOBODY, NOBODY)
        yield path
