"""Real TRL runs in fresh processes (``trl_run.py``), and the recordings several tests replay.

Each run is a subprocess: a replay "in a fresh process" is what a user's second run is, and
``torchrun`` needs its own processes anyway. The recordings are made once per session and copied
before a test changes them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from trl_support import run_trl, skip_section  # noqa: E402


@pytest.fixture(scope="session")
def recording(tmp_path_factory):
    """4 steps on one process with steps 1-3 listed, then an evaluation; the cache it leaves."""
    work = tmp_path_factory.mktemp("trl-recording")
    result, _ = run_trl(work, skip_section(work / "cache"), evaluate=True, name="record")
    return work / "cache", result


@pytest.fixture(scope="session")
def recording_2ranks(tmp_path_factory):
    """The same on 2 ranks (torchrun, gloo), 2 prompts' completions per rank and step."""
    work = tmp_path_factory.mktemp("trl-recording-2")
    results, _ = run_trl(work, skip_section(work / "cache"), ranks=2, args={"per_device_train_batch_size": 2},
                         name="record")
    return work / "cache", results
