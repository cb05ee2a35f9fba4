"""Decode untrusted entries in a child process under a memory limit and a timeout, and say how each ended.

A reader fed hostile bytes must end in a value or a typed error; a segfault, a hang or a
``MemoryError`` is a failure. Such failures cannot be caught in-process (a segfault kills
pytest), so the cases run in one fresh interpreter: before each case it writes the case number
to a progress file (so a crash names the case that caused it), arms a timer of ``timeout`` seconds
of the child's CPU time (``ITIMER_PROF``: on a loaded machine, waiting for a core does not count
as hanging), resets the peak-RSS counter and decodes; afterwards it records the outcome and the
peak extra memory. A decoder stuck without spinning (a lock) is caught by ``total_timeout``, wall
time for the whole child.
``RLIMIT_AS`` is set to the interpreter's size after imports plus ``headroom``, so an
allocation beyond the decode bound fails instead of exhausting the machine.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_CHILD = r"""
import json, os, pickle, resource, signal, sys
import torch
torch.set_num_threads(1)
from stepskip.errors import CorruptEntryError, UnreadableEntryError
from stepskip._formats import get_format

cases_path, progress_path, headroom, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with open(cases_path, "rb") as fh:
    cases = pickle.load(fh)  # the test's own list of (format, files): trusted
for name in {fmt for fmt, _ in cases}:
    get_format(name)  # import every codec before the limit is set


def status(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


size = status("VmSize")
resource.setrlimit(resource.RLIMIT_AS, (size + headroom, size + headroom))


class Hang(Exception):
    pass


def on_timer(signum, frame):
    raise Hang()


signal.signal(signal.SIGPROF, on_timer)
with open(progress_path, "a") as progress:
    for i, (fmt, files) in enumerate(cases):
        progress.write(json.dumps({"start": i}) + "\n")
        progress.flush()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        before = status("VmRSS")
        signal.setitimer(signal.ITIMER_PROF, timeout)
        try:
            get_format(fmt).decode(dict(files), consume=True)
            outcome = "value"
        except Hang:
            outcome = "hang"
        except MemoryError:
            outcome = "MemoryError"
        except (CorruptEntryError, UnreadableEntryError) as err:
            outcome = type(err).__name__
            cause = err
            while cause is not None:  # an allocation the memory limit refused, reported as damage
                text = str(cause).lower()
                if isinstance(cause, MemoryError) or "allocate memory" in text or "not enough memory" in text:
                    outcome = f"MemoryError (as {type(err).__name__}): {str(err)[:200]}"
                cause = cause.__cause__ or cause.__context__
        except BaseException as err:  # noqa: BLE001 - an escape is what the test looks for
            outcome = f"escaped {type(err).__name__}: {str(err)[:200]}"
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
        peak = status("VmHWM") - before
        progress.write(json.dumps({"done": i, "outcome": outcome, "peak": peak}) + "\n")
        progress.flush()
"""


@dataclass
class Outcome:
    """How one case ended: ``value``, an error class name, ``hang``, ``MemoryError`` or ``escaped ...``."""

    outcome: str
    peak: int


@dataclass
class ChildReport:
    """The child's exit status and one :class:`Outcome` per case that finished."""

    returncode: int
    outcomes: list[Outcome]
    crashed_on: int | None
    stderr: str


def decode_isolated(cases: list[tuple[str, dict[str, bytes]]], headroom: int = 1 << 30, timeout: int = 20,
                    total_timeout: int = 900) -> ChildReport:
    """Decode each ``(format, files)`` case in one child process; see the module docstring."""
    with tempfile.TemporaryDirectory() as tmp:
        cases_path = Path(tmp) / "cases.pkl"
        progress_path = Path(tmp) / "progress.jsonl"
        cases_path.write_bytes(pickle.dumps(cases))
        progress_path.touch()
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, "-c", _CHILD, str(cases_path), str(progress_path), str(headroom),
                               str(timeout)], capture_output=True, text=True, timeout=total_timeout, env=env)
        outcomes: list[Outcome] = []
        started = None
        for line in progress_path.read_text().splitlines():
            record = json.loads(line)
            if "start" in record:
                started = record["start"]
            else:
                outcomes.append(Outcome(record["outcome"], record["peak"]))
                started = None
    return ChildReport(done.returncode, outcomes, started, done.stderr[-3000:])
