"""Writer side of the SIGKILL crash test.

``python _sigkill_writer.py serve`` imports torch and stepskip once, prints ``READY``, then for
each JSON line on stdin (the keyword arguments of :func:`write_forever`) forks a child that
records steps with SkipManager forever, prints ``{"pid": ...}``, waits for the child (which the
test SIGKILLs) and prints ``{"signal": ...}``. Forking from a warm process keeps each kill cycle
well under a second instead of paying torch's import time per kill.

The test imports this module too, for :func:`step_data` and :func:`make_config`, so that the
reader recomputes exactly what the writer recorded.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import torch

from stepskip import Batch, SkipManager

KILLS = 15
SLICE = 4  # new steps per writer child: child k owns steps k*SLICE+1 .. (k+1)*SLICE
STEPS = KILLS * SLICE
ROWS = 64
COLS = 8192  # 64 x 8192 float32 = 2 MiB per entry, plus ids and text
#: A child that was not killed by then exits on its own (the test then fails): no orphan writers.
#: Generous, so that a loaded machine cannot make a child outlive it before the test kills it;
#: a child also stops as soon as its server process is gone.
CHILD_LIFETIME = 300.0


def step_data(step: int) -> Batch:
    """The rollout of ``step``: a pure function of the step, recomputable by the reader."""
    gen = torch.Generator().manual_seed(step)
    return Batch.from_dict(
        tensors={
            "log_probs": torch.randn(ROWS, COLS, generator=gen),
            "responses": torch.randint(0, 50_000, (ROWS, 128), generator=gen),
        },
        non_tensors={
            "uid": [f"uid-{step}-{i}" for i in range(ROWS)],
            "text": [f"step {step} row {i}" for i in range(ROWS)],
        },
        meta_info={"step": step},
    )


def make_config(dump_dir: str, action: str, async_dump: bool) -> dict:
    return {
        "trainer": {"experiment_name": "crash", "project_name": "sigkill"},
        "data": {"train_batch_size": ROWS, "max_prompt_length": 16, "max_response_length": 128},
        "actor_rollout_ref": {"rollout": {"n": 1}},
        "skip": {"rollout": {"enable": True, "dump_dir": dump_dir, "steps": f"1-{STEPS}", "action": action,
                             "async_dump": async_dump, "rebind_keys": []}},
    }


PROMPTS = Batch.from_dict(non_tensors={"uid": [f"prompt-{i}" for i in range(ROWS)]})


@SkipManager.annotate(role="rollout")
def generate_sequences(prompts: Batch) -> Batch:
    return step_data(SkipManager.step)


def write_forever(dump_dir: str, action: str, async_dump: bool, seed: int, child: int, progress: str) -> None:
    """Record this child's own steps in order, each followed half the time by an older step.

    Under ``record`` the older step is overwritten (a kill may land in the replace window); under
    ``cache`` it is a hit. Once its own steps are done the child keeps cycling until killed.
    After every call one line is appended to ``progress``: the number of dumps completed so far
    (the test waits on it to choose its kill instant by progress, not by the clock).
    """
    deadline = time.monotonic() + CHILD_LIFETIME
    parent = os.getppid()
    SkipManager.init(make_config(dump_dir, action, async_dump))
    rng = random.Random(seed)
    own = list(range(child * SLICE + 1, (child + 1) * SLICE + 1))
    older = list(range(1, own[0]))
    report = os.open(progress, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def call(step: int) -> None:
        SkipManager.set_step(step)
        generate_sequences(PROMPTS)
        os.write(report, f"{int(SkipManager.stats()['skip/rollout/dumps'])}\n".encode())

    while time.monotonic() < deadline and os.getppid() == parent:
        for step in own:
            call(step)
            if older and rng.random() < 0.5:
                call(rng.choice(older))


def serve() -> None:
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                write_forever(**request)
            except BaseException as err:  # noqa: BLE001 - reported to the test through the exit code
                print(f"writer child failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                code = 3
            os._exit(code)  # 0: the child outlived CHILD_LIFETIME without being killed
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        print(json.dumps({"signal": signal, "exit_code": code}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] != ["serve"]:
        raise SystemExit("usage: _sigkill_writer.py serve")
    serve()
