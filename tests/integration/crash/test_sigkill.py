"""Crash safety: a writer SIGKILLed at any instant leaves no entry or a complete one.

A warm writer server forks a child that records steps in a loop (``async_dump`` false and true,
actions ``record`` and ``cache``, ~2 MiB per entry); the test kills the child at a random instant,
then a fresh reader replays every step: each is either missing or exactly the deterministic
data of that step, and nothing else in the project directory counts as a step. Finally a run
with action ``cache`` regenerates exactly the missing steps.

The kill instant is chosen by progress, not by the clock alone: the test waits until the child
reports a random number of completed dumps (at least one for the last child, so some entry is
always there to check), then lets it run a random fraction of a second more. How fast a loaded
machine runs the child changes where the kills land, never whether the test passes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stepskip import CacheMissError, CorruptEntryError, SkipManager

pytestmark = pytest.mark.heavy

HERE = Path(__file__).resolve().parent
WRITER_PATH = HERE / "_sigkill_writer.py"
PROGRESS_WAIT_S = 240


def _load_writer():
    spec = importlib.util.spec_from_file_location("stepskip_sigkill_writer", WRITER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


writer = _load_writer()


class WriterServer:
    """The ``serve`` process: forks one writer child per request."""

    def __init__(self, stderr_path: Path) -> None:
        self._stderr = open(stderr_path, "wb")
        self.stderr_path = stderr_path
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER_PATH), "serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        )
        line = self.proc.stdout.readline()
        assert line.strip() == "READY", f"writer server did not start: {line!r}\n{self.errors()}"

    def errors(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def start(self, **request) -> int:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"writer server died\n{self.errors()}"
        return json.loads(line)["pid"]

    def wait_dumps(self, progress: Path, dumps: int, pid: int) -> None:
        """Wait until the child ``pid`` has reported ``dumps`` completed dumps in ``progress``."""
        deadline = time.monotonic() + PROGRESS_WAIT_S  # a hang guard: reached only if the child is stuck
        while True:
            lines = progress.read_text().split() if progress.exists() else []
            if lines and int(lines[-1]) >= dumps:
                return
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"writer child reported {lines[-1:] or 'nothing'} of {dumps} dumps in "
                            f"{PROGRESS_WAIT_S}s\n{self.errors()}")
            time.sleep(0.005)

    def wait_child(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"writer server died\n{self.errors()}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:  # idle between requests: nothing of value is lost
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = WriterServer(tmp_path_factory.mktemp("writer") / "stderr.txt")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def expected():
    return {step: writer.step_data(step) for step in range(1, writer.STEPS + 1)}


def assert_same(actual, wanted, step: int) -> None:
    assert actual.meta_info == wanted.meta_info, step
    assert sorted(actual.batch.keys()) == sorted(wanted.batch.keys()), step
    for key in wanted.batch.keys():
        assert actual.batch[key].dtype == wanted.batch[key].dtype, (step, key)
        assert torch.equal(actual.batch[key], wanted.batch[key]), (step, key)
    assert sorted(actual.non_tensor_batch) == sorted(wanted.non_tensor_batch), step
    for key, column in wanted.non_tensor_batch.items():
        assert actual.non_tensor_batch[key].tolist() == column.tolist(), (step, key)


def check_cache(dump_dir: str, expected: dict) -> set[int]:
    """A fresh reader's view: returns the present steps; fails on anything half-written."""
    SkipManager.init(writer.make_config(dump_dir, "replay", async_dump=False))
    try:
        role = SkipManager.skip_instances["rollout"]
        project = Path(role.project_dump_dir)
        names = os.listdir(project) if project.is_dir() else []
        on_disk = set()
        for name in names:
            if name.isdigit():
                on_disk.add(int(name))
            else:  # the only other things a writer may leave are its temporaries and trash
                assert name.startswith((".tmp-", ".trash-")), f"unexpected {name!r} in {project}"
        present = set()
        for step in range(1, writer.STEPS + 1):
            SkipManager.set_step(step)
            try:
                out = writer.generate_sequences(writer.PROMPTS)
            except CorruptEntryError as err:
                pytest.fail(f"step {step}: half-written entry visible to a reader: {err}")
            except CacheMissError:
                assert step not in on_disk, f"step {step} has a directory but no loadable entry"
                continue
            assert_same(out, expected[step], step)
            present.add(step)
        assert on_disk == present
        assert role.available_steps() == sorted(present)
        stats = SkipManager.stats()
        assert stats["skip/rollout/corrupt"] == 0
        assert stats["skip/rollout/dumps"] == 0
        return present
    finally:
        SkipManager.reset()


@pytest.mark.timeout(1800)  # a hang guard for a loaded machine; the test takes well under a minute when idle
@pytest.mark.parametrize("async_dump", [False, True], ids=["sync_dump", "async_dump"])
def test_sigkill_leaves_no_partial_entry(tmp_path, server, expected, async_dump):
    rng = random.Random(1234 + async_dump)
    dump_dir = str(tmp_path / "dump")
    history = []
    for kill in range(writer.KILLS):
        action = "record" if kill % 2 else "cache"
        progress = tmp_path / f"progress-{kill}.txt"
        pid = server.start(dump_dir=dump_dir, action=action, async_dump=async_dump, seed=rng.randrange(2**31),
                           child=kill, progress=str(progress))
        # a cache child dumps its 4 new steps, so up to 3 completed dumps is always reached
        dumps = rng.choice([0, 1, 1, 2, 3]) if kill < writer.KILLS - 1 else rng.choice([1, 2, 3])
        delay = rng.uniform(0.0, 0.15)
        try:
            server.wait_dumps(progress, dumps, pid)
            time.sleep(delay)  # where the kill lands after that point: anywhere in the next calls
        finally:
            os.kill(pid, signal.SIGKILL)
        result = server.wait_child()
        assert result["signal"] == signal.SIGKILL, f"writer child ended on its own: {result}\n{server.errors()}"
        present = check_cache(dump_dir, expected)
        history.append((action, dumps, round(delay, 3), len(present)))

    missing = set(range(1, writer.STEPS + 1)) - present
    assert present, history  # the writers did get entries through
    leftovers = [n for n in os.listdir(Path(dump_dir) / "crash_sigkill" / f"GBS{writer.ROWS}_N1_in16_out128")
                 if not n.isdigit()]

    # a new run with action cache regenerates exactly the missing steps
    SkipManager.init(writer.make_config(dump_dir, "cache", async_dump=False))
    generated = []

    @SkipManager.annotate(role="rollout")
    def generate(prompts):
        generated.append(SkipManager.step)
        return writer.step_data(SkipManager.step)

    try:
        for step in range(1, writer.STEPS + 1):
            SkipManager.set_step(step)
            assert_same(generate(writer.PROMPTS), expected[step], step)
        assert sorted(generated) == sorted(missing), history
        stats = SkipManager.stats()
        assert stats["skip/rollout/corrupt"] == 0
        assert stats["skip/rollout/hits"] == len(present)
        assert stats["skip/rollout/dumps"] == len(missing)
    finally:
        SkipManager.reset()
    assert check_cache(dump_dir, expected) == set(range(1, writer.STEPS + 1))
    print(f"async_dump={async_dump}: kills (action, dumps, delay, present) {history}; "
          f"missing before the cache run {sorted(missing)}; leftovers {len(leftovers)}")
