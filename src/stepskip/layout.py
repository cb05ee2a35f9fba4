"""Every path of a cache, built in one place and parsed back in the same place.

``{dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/{step}/``
as verl writes it; V1 entries add ``{inner_idx}/``, generic stage roles put their steps under
``{name}/``, and the TRL integration keeps one entry per generation call and rank in its step
directory, ``{step}/c{call}-r{rank}/`` (``c{call}t{turn}-r{rank}/`` for a tool loop's turns).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from stepskip.identity import RunIdentity

__all__ = ["CALL_ENTRY", "CallEntry", "Layout", "safe_component"]

_UNSAFE = re.compile(r"[/\\\x00]")
#: A run directory's name; ``_W{world_size}`` follows for runs of several processes (absent for one).
RUN_DIR = re.compile(r"^GBS(-?\d+)_N(-?\d+)_in(-?\d+)_out(-?\d+)(?:_W(\d+))?$")
#: A generation call's entry in its step directory (the TRL integration): call, tool-loop turn, rank.
CALL_ENTRY = re.compile(r"c(0|[1-9][0-9]{0,8})(?:t(0|[1-9][0-9]{0,8}))?-r(0|[1-9][0-9]{0,8})", re.ASCII)


def safe_component(name: str) -> str:
    """Make ``name`` usable as one path component that cannot leave its parent directory."""
    name = _UNSAFE.sub("_", str(name)).replace("..", "__")
    return name if name not in ("", ".") else "_"


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/prefix`` (not for ``file://``-less local paths)."""
    return "://" in path


@dataclass(frozen=True, order=True)
class CallEntry:
    """The name of one generation call's entry, parsed: ``c{call}[t{turn}]-r{rank}``.

    Ordered as the calls were made: by call, its turns after it, then by rank.

    Example:
        >>> Layout.parse_call("c1t0-r2")
        CallEntry(call=1, turn=0, rank=2)
        >>> str(Layout.parse_call("c1t0-r2")), Layout.parse_call("c01-r0")
        ('c1t0-r2', None)
    """

    call: int
    turn: int = -1
    rank: int = 0

    @property
    def name(self) -> str:
        """The call's name without the rank (``c1``, ``c1t0``), as the integration counts calls."""
        return f"c{self.call}" + (f"t{self.turn}" if self.turn >= 0 else "")

    def __str__(self) -> str:
        return f"{self.name}-r{self.rank}"


@dataclass(frozen=True)
class Layout:
    """Paths of one role's cache for one run shape.

    Example:
        >>> lay = Layout("/tmp/dump", "exp", "proj", gbs=64, n=8, prompt_len=512, response_len=1024)
        >>> lay.step_dir(3)
        '/tmp/dump/exp_proj/GBS64_N8_in512_out1024/3'
    """

    dump_dir: str
    experiment_name: str = "default_experiment_name"
    project_name: str = "default_project_name"
    gbs: int = 0
    n: int = 0
    prompt_len: int = 0
    response_len: int = 0
    subdir: str | None = None
    world_size: int = 1

    @classmethod
    def for_identity(cls, dump_dir: str, identity: RunIdentity, subdir: str | None = None) -> Layout:
        """The paths of a run with ``identity`` under ``dump_dir`` (``~`` expanded, ``file://`` and
        ``local://`` dropped: local files behind a URL are plain paths, one local backend)."""
        for prefix in ("file://", "local://"):
            if dump_dir.startswith(prefix):
                dump_dir = dump_dir[len(prefix):]
        root = dump_dir if is_url(dump_dir) else os.path.abspath(os.path.expanduser(dump_dir))
        return cls(
            dump_dir=root.rstrip("/") or "/",
            experiment_name=identity.experiment_name,
            project_name=identity.project_name,
            gbs=identity.gbs,
            n=identity.n,
            prompt_len=identity.prompt_len,
            response_len=identity.response_len,
            subdir=subdir,
            world_size=identity.world_size,
        )

    @classmethod
    def from_config(cls, dump_dir: str, config: Any, subdir: str | None = None) -> Layout:
        """Read the run shape from a verl training config as the seed §2.5 says."""
        return cls.for_identity(dump_dir, RunIdentity.from_config(config), subdir)

    @property
    def run_name(self) -> str:
        name = f"GBS{self.gbs}_N{self.n}_in{self.prompt_len}_out{self.response_len}"
        return name if self.world_size == 1 else f"{name}_W{self.world_size}"

    @property
    def experiment_dir(self) -> str:
        """The directory holding the run directories of every run shape of this experiment."""
        return f"{self.dump_dir}/{safe_component(f'{self.experiment_name}_{self.project_name}')}"

    @property
    def project_dir(self) -> str:
        """The directory holding one directory per step."""
        parts = [self.experiment_dir, self.run_name]
        if self.subdir:
            parts.append(safe_component(self.subdir))
        return "/".join(parts)

    def step_dir(self, step: int) -> str:
        return f"{self.project_dir}/{int(step)}"

    def inner_dir(self, step: int, inner_idx: int) -> str:
        return f"{self.step_dir(step)}/{int(inner_idx)}"

    def call_dir(self, step: int, call: str, rank: int) -> str:
        """The entry of generation call ``call`` (``c0``, ``c0t1`` ...) of ``step`` on ``rank``."""
        return f"{self.step_dir(step)}/{call}-r{int(rank)}"

    @staticmethod
    def parse_call(name: str) -> CallEntry | None:
        """The generation call an entry directory name stands for (see :meth:`call_dir`), or None."""
        match = CALL_ENTRY.fullmatch(name)
        if match is None:
            return None
        return CallEntry(int(match[1]), -1 if match[2] is None else int(match[2]), int(match[3]))

    @staticmethod
    def parse_step(name: str) -> int | None:
        """The step a directory name stands for, or None for anything else (temp dirs included)."""
        return int(name) if name.isascii() and name.isdigit() else None
