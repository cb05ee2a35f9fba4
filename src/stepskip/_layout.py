"""Every path of a cache, built in one place and parsed back in the same place.

``{dump_dir}/{experiment_name}_{project_name}/GBS{gbs}_N{n}_in{prompt_len}_out{response_len}/{step}/``
as verl writes it; V1 entries add ``{inner_idx}/`` (or ``rec-{token}/{inner_idx}/``, the recording a
step's manifest ``step.json`` names, on object stores), generic stage roles put their steps under
``{name}/``, and the TRL integration keeps one entry per generation call and rank in its step
directory, ``{step}/c{call}-r{rank}/`` (``c{call}t{turn}-r{rank}/`` for a tool loop's turns). A V1
step is built in ``.tmp-{step}-{token}/`` beside it where directories are published by a rename.
The prompt hints of every run of an experiment live in ``{experiment}/.stepskip-index/``.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stepskip._identity import RunIdentity

__all__ = ["CALL_ENTRY", "CallEntry", "DEFAULT_ROLE", "DRIFT_DIR", "HINTS_DIR", "Layout", "V1_ROLE", "is_url",
           "normalize_location", "safe_component"]

_UNSAFE = re.compile(r"[/\\\x00]")
#: A run directory's name; ``_W{world_size}`` follows for runs of several processes (absent for one).
RUN_DIR = re.compile(r"^GBS(-?\d+)_N(-?\d+)_in(-?\d+)_out(-?\d+)(?:_W(\d+))?$")
#: A generation call's entry in its step directory (the TRL integration): call, tool-loop turn, rank.
CALL_ENTRY = re.compile(r"c(0|[1-9][0-9]{0,8})(?:t(0|[1-9][0-9]{0,8}))?-r(0|[1-9][0-9]{0,8})", re.ASCII)
#: A V1 step being built where directories are published by a rename: ``.tmp-{step}-{token}``.
_STAGING = re.compile(r"\.tmp-(0|[1-9][0-9]{0,18})-[0-9a-f]{12}", re.ASCII)
#: The role of V1 steps (``{step}/{inner}/``) in the run directory, and the role of flat steps there
#: whose ``meta.json`` names none (verl's own entries).
V1_ROLE = "rollout_tq"
DEFAULT_ROLE = "rollout"
#: The directory of an experiment that holds its writers' prompt hints (hint documents, digest tables).
HINTS_DIR = ".stepskip-index"
#: The directory beside a role's steps that holds the drift records of ``action: compare``.
DRIFT_DIR = ".stepskip-drift"
_LOCAL_SCHEMES = ("file://", "local://")


def safe_component(name: str) -> str:
    """Make ``name`` usable as one path component that cannot leave its parent directory."""
    name = _UNSAFE.sub("_", str(name)).replace("..", "__")
    return name if name not in ("", ".") else "_"


def is_url(path: str) -> bool:
    """True for fsspec URLs such as ``s3://bucket/prefix`` (not for ``file://``-less local paths)."""
    return "://" in path


def normalize_location(location: str, resolve_links: bool = False) -> str:
    """A dump dir as every part of stepskip names it: a URL without its trailing slashes; a local path
    (also written ``file://`` or ``local://``: local files behind a URL are plain paths) absolute, with
    ``~`` expanded and, with ``resolve_links``, its symbolic links resolved.

    Example:
        >>> normalize_location("s3://bucket/dump/"), normalize_location("file:///tmp/dump/")
        ('s3://bucket/dump', '/tmp/dump')
    """
    for prefix in _LOCAL_SCHEMES:
        if location.startswith(prefix):
            location = location[len(prefix):]
    if is_url(location):
        return location.rstrip("/")
    local = os.path.expanduser(location)
    local = os.path.realpath(local) if resolve_links else os.path.abspath(local)
    return local.rstrip("/") or "/"


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
    """Paths of one role's cache for one run.

    Args:
        dump_dir: the dump dir, normalised (:func:`normalize_location`; :meth:`for_identity` does it).
        identity: the run (its experiment, project and shape name the directories).
        subdir: the role's directory in the run directory (None: the run directory itself).

    Example:
        >>> lay = Layout("/tmp/dump", RunIdentity("exp", "proj", gbs=64, n=8, prompt_len=512, response_len=1024))
        >>> lay.step_dir(3)
        '/tmp/dump/exp_proj/GBS64_N8_in512_out1024/3'
        >>> Layout.parse_step("3"), Layout.parse_staging(".tmp-3-0123456789ab")
        (3, 3)
    """

    dump_dir: str
    identity: RunIdentity = field(default_factory=RunIdentity)
    subdir: str | None = None

    @classmethod
    def for_identity(cls, dump_dir: str, identity: RunIdentity, subdir: str | None = None) -> Layout:
        """The paths of a run with ``identity`` under ``dump_dir`` (normalised: :func:`normalize_location`)."""
        return cls(normalize_location(dump_dir), identity, subdir)

    @classmethod
    def from_config(cls, dump_dir: str, config: Any, subdir: str | None = None) -> Layout:
        """Read the run shape from a verl training config."""
        return cls.for_identity(dump_dir, RunIdentity.from_config(config), subdir)

    # ------------------------------------------------------------------ the run

    @property
    def experiment_name(self) -> str:
        return self.identity.experiment_name

    @property
    def project_name(self) -> str:
        return self.identity.project_name

    @property
    def gbs(self) -> int:
        return self.identity.gbs

    @property
    def n(self) -> int:
        return self.identity.n

    @property
    def prompt_len(self) -> int:
        return self.identity.prompt_len

    @property
    def response_len(self) -> int:
        return self.identity.response_len

    @property
    def world_size(self) -> int:
        return self.identity.world_size

    @property
    def run_name(self) -> str:
        return self.identity.run_name

    # ------------------------------------------------------------------ directories

    # (the two directories every path starts from are computed once: a hit builds several paths)
    @functools.cached_property
    def experiment_dir(self) -> str:
        """The directory holding the run directories of every run shape of this experiment."""
        return f"{self.dump_dir}/{safe_component(f'{self.experiment_name}_{self.project_name}')}"

    @functools.cached_property
    def project_dir(self) -> str:
        """The directory holding one directory per step."""
        return self.project_dir_of(self.run_name)

    def run_dir_of(self, run_name: str) -> str:
        """The experiment's run directory ``run_name`` (this run's, or another run shape's)."""
        return f"{self.experiment_dir}/{run_name}"

    def project_dir_of(self, run_name: str) -> str:
        """The directory of this role's steps in the experiment's run directory ``run_name`` (another
        run shape's, for ``action: match``)."""
        run_dir = self.run_dir_of(run_name)
        return f"{run_dir}/{self.safe_subdir}" if self.subdir else run_dir

    def step_dir(self, step: int) -> str:
        return f"{self.project_dir}/{int(step)}"

    def inner_dir(self, step: int, inner_idx: int, recording: str | None = None) -> str:
        """A V1 step's inner entry: in place, or in the ``recording`` its manifest names."""
        return self.inner_path(self.recording_dir(step, recording) if recording else self.step_dir(step), inner_idx)

    @staticmethod
    def inner_path(root: str, inner_idx: int) -> str:
        """The inner entry ``inner_idx`` below ``root``: a step directory, or a recording in it."""
        return f"{root}/{int(inner_idx)}"

    def recording_dir(self, step: int, recording: str) -> str:
        """One recording of a V1 step, committed by the step's manifest (object stores)."""
        return self.recording_in(self.step_dir(step), recording)

    @staticmethod
    def recording_in(step_dir: str, recording: str | None) -> str:
        """Where the inner entries of the step at ``step_dir`` are: its ``recording``, else the step itself."""
        return f"{step_dir}/{recording}" if recording else step_dir

    def manifest_path(self, step: int) -> str:
        """A V1 step's manifest (:mod:`stepskip._manifest`)."""
        from stepskip._manifest import MANIFEST_FILE

        return f"{self.step_dir(step)}/{MANIFEST_FILE}"

    def staging_dir(self, step: int, token: str) -> str:
        """The hidden directory a V1 step is built in before it is renamed over the step (``token``:
        twelve hex digits, one per recording)."""
        from stepskip._storage.meta import TMP_PREFIX

        return f"{self.project_dir}/{TMP_PREFIX}{int(step)}-{token}"

    def call_dir(self, step: int, call: str, rank: int) -> str:
        """The entry of generation call ``call`` (``c0``, ``c0t1`` ...) of ``step`` on ``rank``."""
        return f"{self.step_dir(step)}/{call}-r{int(rank)}"

    def drift_path(self, entry_path: str) -> str:
        """The drift record of the entry at ``entry_path`` (``action: compare``): a file of its own in the
        :data:`DRIFT_DIR` beside the role's steps, named for the entry's path below the steps directory
        (``12.json``; ``12-c0-r0.json`` for one of several entries of step 12).

        Example:
            >>> layout = Layout.for_identity("/d", RunIdentity("exp", "proj", 4, 2, 8, 6))
            >>> layout.drift_path("/d/exp_proj/GBS4_N2_in8_out6/12")
            '/d/exp_proj/GBS4_N2_in8_out6/.stepskip-drift/12.json'
        """
        base = self.project_dir + "/"
        relative = entry_path[len(base):] if entry_path.startswith(base) else entry_path.rstrip("/").rsplit("/", 1)[-1]
        return f"{base}{DRIFT_DIR}/{relative.strip('/').replace('/', '-')}.json"

    @staticmethod
    def drift_dir_of(step_dir: str) -> str:
        """The directory holding the drift records of the step at ``step_dir`` (beside it)."""
        return f"{step_dir.rstrip('/').rpartition('/')[0]}/{DRIFT_DIR}"

    @property
    def hints_dir(self) -> str:
        """The experiment's prompt hints (every run shape's, every role's)."""
        return f"{self.experiment_dir}/{HINTS_DIR}"

    def hint_path(self, naming: Callable[[str, str | None, str], str], token: str) -> str:
        """One of this role's hint files in :attr:`hints_dir`, named by ``naming`` (the hint document's
        or the digest table's naming, :mod:`stepskip._matching.hints`) for the writer ``token``."""
        return f"{self.hints_dir}/{naming(self.run_name, self.safe_subdir, token)}"

    @property
    def safe_subdir(self) -> str | None:
        """The role's directory name as written (None for a role in the run directory)."""
        return safe_component(self.subdir) if self.subdir else None

    # ------------------------------------------------------------------ parsing back

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

    @staticmethod
    def parse_staging(name: str) -> int | None:
        """The step a staging directory's name (:meth:`staging_dir`) builds, or None for any other name."""
        match = _STAGING.fullmatch(name)
        return None if match is None else int(match[1])

    @staticmethod
    def step_dir_of(inner_path: str) -> str:
        """The step directory of an inner entry path (``{step}/{inner}`` or ``{step}/rec-{token}/{inner}``).

        Example:
            >>> Layout.step_dir_of("/d/run/3/rec-0123456789ab/1"), Layout.step_dir_of("/d/run/3/1")
            ('/d/run/3', '/d/run/3')
        """
        from stepskip._manifest import is_recording

        parent, _, name = inner_path.rsplit("/", 1)[0].rpartition("/")
        return parent if is_recording(name) else f"{parent}/{name}"
