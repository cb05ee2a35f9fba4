"""stepskip's warnings reach stderr when nothing configured logging, once, and never twice once something did.

The scripts run in a fresh interpreter: pytest's own log capture puts handlers on the root logger,
which is exactly the "application configured logging" case; a bare process is the only place the
unconfigured case exists.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import stepskip
from stepskip._logging import FallbackHandler, install_fallback

# Records step 1 of one prompt, then replays it for another: a real prompt-mismatch warning.
MISMATCH = """
import logging, sys, tempfile
from stepskip import Batch, SkipManager
{after}

class Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        return prompts

dump_dir = tempfile.mkdtemp()
for prompt in ("the prompt recorded", "another prompt"):
    SkipManager.init({{"skip": {{"rollout": {{"enable": True, "steps": [1], "dump_dir": dump_dir}}}}}})
    SkipManager.set_step(1)
    Loop().generate_sequences(Batch.from_dict(non_tensors={{"uid": ["u"], "raw_prompt": [prompt]}}))
    SkipManager.close()
print("finished")
"""
WARNING_TEXT = "was recorded for other prompts than this call's"


def _run(after: str = "") -> subprocess.CompletedProcess[str]:
    src = str(Path(stepskip.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", MISMATCH.format(after=after)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished"
    return done


def test_a_warning_reaches_stderr_once_when_nothing_configured_logging():
    err = _run().stderr
    assert err.count(WARNING_TEXT) == 1, err
    line = next(line for line in err.splitlines() if WARNING_TEXT in line)
    assert line.startswith("WARNING:stepskip.")  # what logging.basicConfig would have printed
    assert "summary" not in err  # INFO stays out, as it would without stepskip's handler


def test_logging_configured_after_import_gets_the_warning_once_through_its_own_handler():
    err = _run(after="logging.basicConfig(format='app: %(message)s')").stderr
    assert err.count(WARNING_TEXT) == 1, err
    assert any(line.startswith("app: ") and WARNING_TEXT in line for line in err.splitlines()), err


@contextlib.contextmanager
def bare_logging() -> Iterator[None]:
    """This process's logging as a script that configured nothing sees it: pytest's capture handlers
    (added to the root logger around each test's call) are taken off inside the block."""
    root, package = logging.getLogger(), logging.getLogger("stepskip")
    saved = root.handlers, package.handlers, package.propagate
    root.handlers, package.handlers = [], list(package.handlers)
    try:
        yield
    finally:
        root.handlers, package.handlers, package.propagate = saved


class Keep(logging.Handler):
    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def test_the_fallback_prints_warnings_and_worse_only(capsys):
    with bare_logging():
        logging.getLogger("stepskip.roles").info("an info line")
        logging.getLogger("stepskip.roles").warning("a %s line", "warning")
    assert capsys.readouterr().err == "WARNING:stepskip.roles:a warning line\n"


@pytest.mark.parametrize("where", ["", "stepskip", "stepskip.roles"])
def test_the_fallback_is_silent_when_the_application_put_a_handler_on_the_way(where, capsys):
    keep = Keep(level=logging.CRITICAL)  # whatever its level: where records go is the application's choice
    with bare_logging():
        logging.getLogger(where).addHandler(keep)
        try:
            logging.getLogger("stepskip.roles").warning("routed")
        finally:
            logging.getLogger(where).removeHandler(keep)
    assert capsys.readouterr().err == ""


def test_the_fallback_speaks_when_propagation_stops_before_any_handler(capsys):
    keep = Keep()
    with bare_logging():
        logging.getLogger().addHandler(keep)
        logging.getLogger("stepskip").propagate = False  # the root's handler never sees stepskip's records
        logging.getLogger("stepskip.roles").error("lost otherwise")
    assert keep.seen == []
    assert capsys.readouterr().err == "ERROR:stepskip.roles:lost otherwise\n"


def test_the_package_logger_has_one_fallback():
    handlers = [h for h in logging.getLogger("stepskip").handlers if isinstance(h, FallbackHandler)]
    assert len(handlers) == 1
    install_fallback("stepskip")
    assert [h for h in logging.getLogger("stepskip").handlers if isinstance(h, FallbackHandler)] == handlers
