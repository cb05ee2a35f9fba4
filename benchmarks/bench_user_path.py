"""The path users call, side by side with verl 0.9.1's own skip code: ratios from one run.

Run:  .venv/bin/python benchmarks/bench_user_path.py [--quick | --smoke] [--small] [--rounds 2] [--repeat 5]
          [--processes 3] [--json out.json]

Everything goes through ``SkipManager.init`` and the decorated method, never the formats alone
(benchmarks/bench_store.py is the format-level breakdown):

- colocated role (``rollout``): ``generate_sequences(self, prompts)`` with prompts shaped like the
  ones verl hands it (input_ids / attention_mask / position_ids of prompt length; non-tensor uid,
  chat messages, data source, reward-model and extra-info dicts, index, tool kwargs; rows share
  those objects across the n samples, as verl's ``DataProto.repeat`` does with ``np.repeat``) and a
  rollout result built from them. Measured: how long a miss blocks the caller, the full write
  (miss + background dump until flushed), a hit with every tensor touched, bytes on disk, peak
  extra memory of a hit in a fresh process, the prompt check's own cost, and a raw read of verl's
  file. Sizes 1024 x (1024 + 2048) and 2048 x (1024 + 4096), n = 8 (``--quick``: 256 x (256 + 512)
  and 512 x (512 + 1024)); torch threads 1 and the default. Debugging batches too, a tiny
  32 x (128 + 256) and a small 256 x (512 + 1024) (this role and the first calls only; the runs of
  a round are 4 x --repeat below 1024 rows, a call there takes milliseconds).
- first calls: a process's first hit and its first miss, each the first decorated call of a fresh
  process after ``SkipManager.init`` (timed apart), --processes of them a side, alternated with
  verl's: what the first call starts or allocates (pools, buffers, lazy imports) is in its time.
  ``--skip first`` leaves them out (the colocated table then has no first-call rows).
- V1 role (``rollout_tq``): the sample phase saving what ``ReplayBuffer.sample`` handed out, read
  back through ``stepskip.tq.InProcessTQClient``, and the submit phase injecting a cached step.
- async role (``async_rollout``): many one-sample entries, samples per second written (until
  flushed) and replayed.
- per-call cost with 10 / 1,000 / 2,000 / 10,000 entries on disk (``--quick``: 10 / 100 / 1,000) for
  the actions cache, repeat (exact step missing) and random, and for repeat and random with the run
  directory changed before each call (so that each call lists it).

A targets table closes the run: each size's steady-state hit (<= 1.0 x verl below 256 rows, 0.5 x
from 256, 0.3 x from 1024), first hit and first miss (<= 1.0 x), and repeat/random with 2,000
entries against 10 (at most 1 ms more per call), each judged by medians and marked met or missed.
Below 1024 rows the steady-state hit has its floor beside it (:func:`hit_floor`: what no reader of
the entry can leave out, in the hit's order, touched the same way), against the same verl hit: a
target under the floor is marked so.
``--small`` runs only the debugging sizes, their first calls and repeat/random at 10 and 2,000
entries (a few minutes); ``--small --smoke`` the tiny size once, with 10 and 30 entries.

verl's side runs benchmarks/_verl_side.py in verl's environment (``.venv-verl`` from
``make verl-env``, or STEPSKIP_VERL_PYTHON) on the same data; without it the ratio columns are
empty. Each part runs --rounds rounds, the two sides alternated (stepskip, verl, stepskip, verl
...), each round --repeat runs: a drift of the machine's speed during a part (these machines drift by
2-3x within minutes) then reaches both sides alike, where running one side's runs after the other's
gave the drift to whichever ran second. Timings are the best of all rounds' runs (median in
brackets): these machines are shared and noisy, the best is the least disturbed run. A "noise"
figure (median / best - 1) is printed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from stepskip import Batch, SkipManager
from stepskip._matching.hints import HINTS_DIR, TableWriter
from stepskip._fidelity import prompt_digest, prompt_row_digests, shared_object_digests
from stepskip.testing import make_rollout_batch
from stepskip.tq import InProcessTQClient, KVBatchMeta

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
N = 8
#: The async part also writes with this much of another file dirty (see :func:`stepskip_async`).
DIRTY_BYTES = 256 << 20
SIZES = {
    "full": [(1024, 1024, 2048), (2048, 1024, 4096)],
    "quick": [(256, 256, 512), (512, 512, 1024)],
    "smoke": [(16, 16, 32)],
}
#: Debugging batches (a tiny and a small one): only the colocated role and the first calls run at these.
SMALL_SIZES = {"full": [(32, 128, 256), (256, 512, 1024)], "small": [(32, 128, 256), (256, 512, 1024)],
               "small-smoke": [(32, 128, 256)]}
#: Below 1024 rows a call takes milliseconds: each round takes this many times --repeat runs, for steadier medians.
SMALL_REPEAT_FACTOR = 4
ENTRY_COUNTS = {"full": [10, 1000, 2000, 10000], "quick": [10, 100, 1000], "smoke": [10, 30], "small": [10, 2000],
                "small-smoke": [10, 30]}
S3_ENTRY_COUNTS = {"full": [10, 1000], "quick": [10, 100, 1000], "smoke": [10, 30]}
ASYNC_COUNTS = {"full": 200, "quick": 100, "smoke": 8}
TARGETS = {"miss": 0.1, "write": 0.5, "hit": 0.3, "bytes": 0.12, "peak": 1.3, "hit_raw": 2.0, "digest": 0.10}
#: A process's first hit and first miss against verl's, at every size (judged by medians).
FIRST_CALL_TARGET = 1.0
#: repeat and random with many entries against 10 entries: at most this many ms more per call (medians).
ENTRIES_TARGET_MS = 1.0
#: The entry count the per-call target is judged at (the largest counted when a run has fewer).
ENTRIES_JUDGED = 2000


def hit_target(rows: int) -> float:
    """The steady-state hit's target against verl's (judged by medians): the fixed cost of a call
    weighs more the smaller the batch, so small batches get a looser bound."""
    return 0.3 if rows >= 1024 else 0.5 if rows >= 256 else 1.0


# ---------------------------------------------------------------------------------------------- data


def make_inputs(rows: int, prompt: int, response: int, n: int = N, seed: int = 0) -> dict[str, Any]:
    """Prompts and a rollout result as plain numpy arrays and Python objects (readable by both envs)."""
    rollout = make_rollout_batch(rows, prompt, response, n=n, seed=seed)
    groups = rows // n
    rng = np.random.default_rng(seed)

    def repeated(values: list[Any]) -> np.ndarray:
        column = np.empty(groups, dtype=object)
        for i, v in enumerate(values):
            column[i] = v
        return np.repeat(column, n)  # rows share the objects, as DataProto.repeat does

    uids = [uuid.UUID(int=int(rng.integers(0, 2**62)) << 64 | g).hex for g in range(groups)]
    questions = [f"Natalia sold clips to {g} of her friends in April, and then she sold half as many clips in May. "
                 f"How many clips did Natalia sell altogether in April and May? (variant {g})" for g in range(groups)]
    shared = {
        "uid": repeated(uids),
        "raw_prompt": repeated([[{"role": "system", "content": "You are a helpful assistant. Think step by step."},
                                 {"role": "user", "content": q + " Let's think step by step and output the final "
                                  "answer after \"####\"."}] for q in questions]),
        "data_source": repeated(["openai/gsm8k"] * groups),
        "reward_model": repeated([{"ground_truth": str(3 * g // 2), "style": "rule"} for g in range(groups)]),
        "extra_info": repeated([{"index": g, "split": "train", "question": q, "answer": f"#### {3 * g // 2}"}
                                for g, q in enumerate(questions)]),
        "index": repeated(list(range(groups))),
        "tools_kwargs": repeated([{} for _ in range(groups)]),
        "interaction_kwargs": repeated([{} for _ in range(groups)]),
    }
    tensors = {k: v.numpy() for k, v in rollout.batch.items()}
    prompt_tensors = {"input_ids": tensors["prompts"].copy(),
                      "attention_mask": tensors["attention_mask"][:, :prompt].copy(),
                      "position_ids": tensors["position_ids"][:, :prompt].copy()}
    turns = np.empty(rows, dtype=object)
    turns[:] = [2] * rows
    multi_modal = np.empty(rows, dtype=object)
    multi_modal[:] = [{} for _ in range(rows)]
    result_non_tensor = {k: shared[k] for k in ("uid", "raw_prompt", "data_source", "reward_model", "extra_info",
                                                "index")}
    result_non_tensor.update(__num_turns__=turns, multi_modal_inputs=multi_modal)
    return {
        "shape": {"rows": rows, "n": n, "prompt": prompt, "response": response},
        "prompts": {"tensors": prompt_tensors, "non_tensor": shared, "meta": {"global_steps": 1}},
        "result": {"tensors": tensors, "non_tensor": result_non_tensor,
                   "meta": {"timing": {"generate_sequences": 12.5}, "global_token_num": [prompt + response] * 4}},
        "v1": _v1_rows(rollout, uids, n),
        "async": _async_inputs(prompt, response, ASYNC_COUNTS["full"]),
    }


def _v1_rows(rollout: Batch, uids: list[str], n: int) -> dict[str, Any]:
    """What the agent loop put in the queue: per trajectory, unpadded tensors (the queue stores rows)."""
    td = rollout.batch
    prompt_real = td["attention_mask"][:, : td["prompts"].shape[1]].sum(1).tolist()
    response_real = td["response_mask"].sum(1).tolist()
    tensors: dict[str, list[np.ndarray]] = {"prompts": [], "responses": [], "response_mask": [],
                                            "rollout_log_probs": []}
    for i, (p, r) in enumerate(zip(prompt_real, response_real)):
        tensors["prompts"].append(td["prompts"][i, td["prompts"].shape[1] - p:].numpy().copy())
        tensors["responses"].append(td["responses"][i, :r].numpy().copy())
        tensors["response_mask"].append(td["response_mask"][i, :r].numpy().copy())
        tensors["rollout_log_probs"].append(td["rollout_log_probs"][i, :r].numpy().copy())
    keys = [f"{uids[i // n]}_{i % n}_0" for i in range(len(prompt_real))]
    tags = [{"global_steps": 1, "status": "finished", "seq_len": p + r} for p, r in zip(prompt_real, response_real)]
    return {"tensors": tensors, "keys": keys, "tags": tags, "prompt_uids": uids}


def _async_inputs(prompt: int, response: int, count: int) -> dict[str, Any]:
    one = make_rollout_batch(1, prompt, response, n=1, seed=1)
    messages = np.empty(1, dtype=object)
    messages[0] = [{"role": "user", "content": "What is 2 + 2?"}]
    return {
        "count": count,
        "prompts": {"tensors": {"input_ids": one.batch["prompts"].numpy().copy()}, "meta": {}},
        "result": {"tensors": {k: v.numpy() for k, v in one.batch.items()},
                   "non_tensor": {"uid": np.array(["uid_sample_0_0"], dtype=object), "raw_prompt": messages},
                   "meta": {}},
    }


def to_batch(part: dict[str, Any]) -> Batch:
    tensors = {k: torch.from_numpy(v) for k, v in part["tensors"].items()}
    rows = next(iter(tensors.values())).shape[0]
    return Batch(batch=TensorDict(tensors, batch_size=[rows]), non_tensor_batch=dict(part.get("non_tensor", {})),
                 meta_info=dict(part["meta"]))


def nbytes_in_memory(part: dict[str, Any]) -> int:
    return sum(v.nbytes for v in part["tensors"].values())


def config(workdir: str, shape: dict[str, int], role: str, steps: Any = "all", action: str = "cache",
           **extra: Any) -> dict[str, Any]:
    rows, n = shape["rows"], shape["n"]
    return {
        "trainer": {"experiment_name": "bench", "project_name": "user_path"},
        "data": {"train_batch_size": max(1, rows // n), "max_prompt_length": shape["prompt"],
                 "max_response_length": shape["response"]},
        "actor_rollout_ref": {"rollout": {"n": n}},
        "skip": {role: {"enable": True, "dump_dir": workdir, "steps": steps, "action": action, **extra}},
    }


# ---------------------------------------------------------------------------------------------- timing


def timed(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def touch(value: Any) -> None:
    for t in value.batch.values():
        t.sum()


def dir_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


# ---------------------------------------------------------------------------------------------- stepskip


class Loop:
    result: Any = None

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Any) -> Any:
        return self.result


def quiet_disk() -> None:
    """Write back what earlier parts (and the inputs file) left dirty, before a part is timed, for both
    sides: with more than ``stepskip._storage._linux.SYNCFS_MAX_DIRTY_BYTES`` dirty in the system, stepskip's
    batched small-entry commits keep one ``fsync`` per file instead of one ``syncfs`` (so as never to
    wait for another program's writeback), and which part ran before would decide which path is
    timed. (The async part also times that path, with another program's data dirty on purpose.)"""
    os.sync()


#: A settled filesystem creates a file in about 0.03 ms here; the run waits while creating takes more ...
SETTLED_CREATE_SECONDS = 1e-4
#: ... for at most this long (ext4 forgets a freed inode after 5 minutes), measuring again this often.
SETTLE_MAX_SECONDS = 330.0
SETTLE_POLL_SECONDS = 10.0


def create_seconds(where: str, count: int = 64) -> float:
    """Seconds to create a directory holding one small file, as a dump creates its entries (the
    median of ``count``; the files are kept: deleting them would slow the next creations down)."""
    os.makedirs(where)
    times = []
    for i in range(count):
        start = time.perf_counter()
        os.mkdir(f"{where}/{i}")
        with open(f"{where}/{i}/f", "wb") as fh:
            fh.write(b"x" * 1024)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def settle_disk(workdir: str) -> str:
    """Wait until creating files is as cheap as on a settled filesystem; what was measured, for the header.

    ext4 without a journal (this machine's root filesystem) passes over every inode freed in the last
    5 seconds each time it creates a file, and over those freed in the last 5 minutes while their inode
    table block is unwritten, which creating files next to them makes it again. After a large
    deletion (an earlier run's clean-up, the test suite's temporary directories) creating a directory
    and a file took 0.3-1 ms of kernel time instead of 0.03 here, for minutes, and the async part
    creates 4 a sample: whichever side ran first would pay most. The run itself deletes nothing
    before it ends.
    """
    os.sync()
    start, probe = time.perf_counter(), 0
    while True:
        cost = create_seconds(f"{workdir}/settle-{probe}")
        waited = time.perf_counter() - start
        if cost <= SETTLED_CREATE_SECONDS or waited >= SETTLE_MAX_SECONDS:
            return f"creating a directory and a file {cost * 1e3:.2f} ms after waiting {waited:.0f} s"
        probe += 1
        time.sleep(SETTLE_POLL_SECONDS)


def stepskip_colocated(inputs: dict[str, Any], workdir: str, repeat: int) -> dict[str, Any]:
    prompts, loop = to_batch(inputs["prompts"]), Loop()
    loop.result = to_batch(inputs["result"])
    SkipManager.init(config(workdir, inputs["shape"], "rollout"))
    skip = SkipManager.skip_instances["rollout"]
    SkipManager.set_step(99)  # warm-up, untimed: lazy imports, first-use allocations; then a hit of it
    loop.generate_sequences(prompts)
    SkipManager.flush()
    touch(loop.generate_sequences(prompts))
    miss, write = [], []
    for i in range(repeat):
        SkipManager.set_step(100 + i)
        start = time.perf_counter()
        loop.generate_sequences(prompts)
        miss.append(time.perf_counter() - start)
        SkipManager.flush()
        write.append(time.perf_counter() - start)

    held: list[Any] = [None]

    def hit() -> None:  # the last hit's batch stays alive while the next one loads, as a trainer's loop variable does
        SkipManager.set_step(100)
        out = loop.generate_sequences(prompts)
        touch(out)
        held[0] = out

    hits = timed(hit, repeat)
    held[0] = None
    floor: list[float] = []
    if inputs["shape"]["rows"] < 1024:  # debugging batches: the floor under their hit, measured the same way
        SkipManager.set_step(100)
        replayed = loop.generate_sequences(prompts).batch
        floor_call = hit_floor(skip.step_dump_dir(100), prompts, skip.rebind_keys, replayed)
        if floor_call is not None:
            rebuilt = floor_call().batch  # the floor rebuilds the very tensors a hit returns
            assert rebuilt.keys() == set(replayed.keys()) and all(torch.equal(rebuilt[k], replayed[k]) for k in rebuilt)

            def floor_hit() -> None:
                out = floor_call()
                touch(out)
                held[0] = out

            floor = timed(floor_hit, repeat)
            held[0] = None
        del replayed
    digest = timed(lambda: prompt_digest(prompts, ["uid"]), repeat)
    # where a miss's blocking time goes: the two halves of the snapshot, measured alone
    result, fmt = loop.result, skip.format
    tensors_only = Batch(batch=result.batch, non_tensor_batch={}, meta_info={})
    non_tensor_only = Batch(batch=None, non_tensor_batch=result.non_tensor_batch, meta_info=result.meta_info)

    def snapshot_time(value: Any) -> float:
        start = time.perf_counter()
        frozen = fmt.freeze(value, copy=True)
        seconds = time.perf_counter() - start
        fmt.encode(frozen)  # untimed: hands the snapshot's buffers back for the next one, as a dump does
        return seconds

    snap_tensors = [snapshot_time(tensors_only) for _ in range(repeat)]
    snap_non_tensor = [snapshot_time(non_tensor_only) for _ in range(repeat)]
    # a miss records the per-row prompt digests (action match) and the prompt digest together, each
    # distinct prompt object hashed once for both: what the prompt check adds to a miss is the difference
    def both_digests() -> None:
        with shared_object_digests():
            prompt_row_digests(prompts, ["uid"])
            prompt_digest(prompts, ["uid"])

    row_prompts: list[float] = []
    digests_on_miss: list[float] = []
    for _ in range(3 * repeat):  # milliseconds each, and a difference is reported: interleaved, more samples
        row_prompts += timed(lambda: prompt_row_digests(prompts, ["uid"]), 1)
        digests_on_miss += timed(both_digests, 1)
    stats = SkipManager.stats()
    hits_made = repeat + 1 + (1 if inputs["shape"]["rows"] < 1024 else 0)
    assert stats["skip/rollout/hits"] == hits_made and stats["skip/rollout/dumps"] == repeat + 1, stats
    out = {"miss": miss, "write": write, "hit": hits, "floor": floor, "digest": digest, "bytes": dir_bytes(skip.step_dump_dir(100)),
           "snap_tensors": snap_tensors, "snap_non_tensor": snap_non_tensor, "row_prompts": row_prompts,
           "digests_on_miss": digests_on_miss}
    SkipManager.reset()
    return out


class _Tensors:
    """What :func:`touch` reads: ``batch``, a mapping of tensors."""

    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch


def hit_floor(entry: str, prompts: Any, exclude: list[str], like: Any) -> Any:
    """A function doing, in the order a hit does it, the work no reader of the ``safe`` entry at ``entry``
    can leave out, and returning what it rebuilt (the tensors) for the caller to touch.

    Each call: open, ``fstat``, read and close the two data files (into buffers kept between calls, as
    the hit's recycled pages), their xxh3-64 checksums, ``data.json`` parsed, the prompt check
    (``prompt_digest`` of the live prompts in the entry's scheme), the tensor file's header read, and
    each stored tensor widened into an output the size of the batch's (``input_ids`` by one
    concatenation of its two parts), outputs kept between calls in two sets, as a trainer holding the
    last result while the next one loads. Left out: building the non-tensor columns, the ``TensorDict``
    and the batch, the probe, ``meta.json`` and every other check. A floor for narrowed entries (the
    debugging batches of 17 rows up); None for an entry with other encodings. ``like``: the tensors a hit
    of the entry returned, whose shapes and dtypes the outputs take.
    """
    import xxhash

    from stepskip._fidelity import digest_like
    from stepskip._formats.st_read import load_view

    names = ("data.safetensors", "data.json")
    paths = [os.path.join(entry, name) for name in names]
    recorded = json.loads(Path(entry, "meta.json").read_bytes())["prompt_digest"]
    tree = json.loads(Path(entry, "data.json").read_bytes())
    entries = tree["root"]["batch"]["entries"]
    if any(node.get("enc") not in (None, "narrow", "concat") for node in entries.values()):
        return None  # trimmed (16 rows or fewer, 2^20 elements or more): measured for narrowed entries only
    buffers = [[bytearray(os.path.getsize(path)) for path in paths] for _ in range(2)]
    outputs = [{key: torch.empty_like(like[key]) for key in entries} for _ in range(2)]
    turn = [0]

    def call() -> Any:
        files, out = buffers[turn[0]], outputs[turn[0]]
        turn[0] ^= 1
        for path, buffer in zip(paths, files):
            fd = os.open(path, os.O_RDONLY)
            try:
                size, view, done = os.fstat(fd).st_size, memoryview(buffer), 0
                while done < size:
                    done += os.readv(fd, [view[done:size]])
            finally:
                os.close(fd)
        for buffer in files:
            xxhash.xxh3_64_intdigest(buffer)
        json.loads(files[1])
        digest_like(recorded, prompts, exclude)
        parts = load_view(memoryview(files[0]), views=set())
        for key, node in entries.items():
            if node.get("enc") != "concat":
                out[key].copy_(parts[node["ref"]])
        for key, node in entries.items():
            if node.get("enc") == "concat":
                torch.cat([out[part] for part in node["parts"]], dim=1, out=out[key])
        return _Tensors(out)

    return call


def bytecode_env(workdir: str) -> dict[str, str]:
    """The environment of stepskip's fresh processes: its modules compiled once, into a cache under
    ``workdir``, as an installed package's are (pip compiles them, and verl's side has them). Where
    PYTHONDONTWRITEBYTECODE is set, a process would otherwise compile every stepskip module it
    imports, and a first call's lazy imports would time the compiler."""
    prefix = f"{workdir}/pycache"
    env = dict(os.environ, PYTHONPYCACHEPREFIX=prefix)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not os.path.isdir(prefix):
        import stepskip

        subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(stepskip.__file__).parent), str(HERE)],
                       env=env, check=True, capture_output=True)
    return env


def stepskip_first(kind: str, inputs_path: str, workdir: str, threads: int) -> dict[str, Any]:
    """A process's first call (``kind`` "hit" or "miss"), in a fresh process: see :func:`first_child`."""
    quiet_disk()
    done = subprocess.run([sys.executable, __file__, "--first-child", kind, inputs_path, workdir, str(threads)],
                          capture_output=True, text=True, timeout=900,
                          env=bytecode_env(str(Path(workdir).parent)))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def first_child(kind: str, inputs_path: str, workdir: str, threads: str) -> None:
    """The first decorated call of this process, after ``SkipManager.init`` (timed apart): whatever
    the first call starts or allocates (pools, buffers, lazy imports) is in its time, as in a
    trainer's first step.

    ``hit``: on the entry of step 100 under ``workdir`` (its files read once first, warm, as on
    verl's side and every other read here), with the peak extra memory (no recycled pages yet).
    ``miss``: in an empty ``workdir``, how long the call blocks, then how long until its dump is
    flushed."""
    torch.set_num_threads(int(threads))
    with open(inputs_path, "rb") as fh:
        inputs = pickle.load(fh)
    prompts, shape = to_batch(inputs["prompts"]), inputs["shape"]
    loop = Loop()
    if kind == "miss":
        loop.result = to_batch(inputs["result"])
    del inputs
    start = time.perf_counter()
    SkipManager.init(config(workdir, shape, "rollout"))
    init = time.perf_counter() - start
    SkipManager.set_step(100)
    if kind == "miss":
        start = time.perf_counter()
        loop.generate_sequences(prompts)
        blocked = time.perf_counter() - start
        SkipManager.flush()
        written = time.perf_counter() - start
        assert SkipManager.stats()["skip/rollout/dumps"] == 1, SkipManager.stats()
        print(json.dumps({"first_miss": blocked, "first_write": written, "init": init}))
        return
    for f in Path(SkipManager.skip_instances["rollout"].step_dump_dir(100)).iterdir():
        f.read_bytes()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    touch(loop.generate_sequences(prompts))
    seconds = time.perf_counter() - start
    assert SkipManager.stats()["skip/rollout/hits"] == 1
    print(json.dumps({"peak_extra": _status("VmHWM") - before, "first_hit": seconds, "init": init}))


def first_calls(inputs_path: str, workdir: str, tag: str, threads: int, processes: int
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Each side's first hit and first miss, ``processes`` fresh processes each, the sides alternated.

    The hits read the entries of step 100 the colocated part's first round wrote (``ours-TAG-0``,
    ``verl-TAG-0``); each miss writes into an empty directory of its own."""
    ours: dict[str, Any] = {"first_hit": [], "first_miss": [], "first_write": [], "init_hit": [], "init_miss": [],
                            "peak_runs": []}
    verl: dict[str, Any] | None = {"first_hit": [], "first_miss": [], "init_hit": [], "init_miss": [],
                                   "peak_runs": []} if verl_python() else None
    for i in range(processes):
        got = stepskip_first("hit", inputs_path, f"{workdir}/ours-{tag}-0", threads)
        ours["first_hit"].append(got["first_hit"])
        ours["init_hit"].append(got["init"])
        ours["peak_runs"].append(got["peak_extra"])
        if verl is not None and "error" not in verl:
            theirs = run_verl("peak", inputs_path, f"{workdir}/verl-{tag}-0", threads, 1) or {}
            if "error" in theirs:
                verl = theirs
            else:
                verl["first_hit"].append(theirs["first_hit"])
                verl["init_hit"].append(theirs["init"])
                verl["peak_runs"].append(theirs["peak_extra"])
        got = stepskip_first("miss", inputs_path, f"{workdir}/first-miss-ours-{tag}-{i}", threads)
        for key in ("first_miss", "first_write"):
            ours[key].append(got[key])
        ours["init_miss"].append(got["init"])
        if verl is not None and "error" not in verl:
            theirs = run_verl("first_miss", inputs_path, f"{workdir}/first-miss-verl-{tag}-{i}", threads, 1) or {}
            if "error" in theirs:
                verl = theirs
            else:
                verl["first_miss"].append(theirs["first_miss"])
                verl["init_miss"].append(theirs["init"])
    for side in (ours, verl):
        if side is not None and "error" not in side:
            side["peak"] = max(side["peak_runs"])  # the highest of the processes
    return ours, verl


class V1Owner:
    """The trainer side of verl's V1 split (`_next_train_batch` / `_submit_batch_to_rollout`)."""

    def __init__(self, uids: list[str], prompts: Batch) -> None:
        self.uids, self.prompts = uids, prompts

    def _next_train_batch(self) -> Batch:
        return self.prompts

    def _submit_batch_to_rollout(self, batch: Batch) -> None:
        return None  # the trajectories are already in the queue

    @SkipManager.annotate_tq(role="rollout_tq", phase="submit")
    def _add_batch_to_generate(self) -> None:
        raise AssertionError("replaced by the decorator on eligible steps")


class V1Buffer:
    def __init__(self, keys: list[str], tags: list[dict[str, Any]]) -> None:
        self.meta = KVBatchMeta(keys=keys, tags=tags, partition_id="train")

    @SkipManager.annotate_tq(role="rollout_tq", phase="sample")
    def sample(self) -> KVBatchMeta:
        return self.meta


class TimedQueue(InProcessTQClient):
    """The in-process queue, counting the seconds spent inside it: verl's side gets a stand-in that
    hands back a prebuilt TensorDict and stores a reference, so the queue's own copies are told apart."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.shares: list[float] = []  # the queue's seconds inside each call in_queue times

    def kv_batch_get(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().kv_batch_get(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def kv_batch_put(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return super().kv_batch_put(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def in_queue(tq: TimedQueue, fn: Any) -> Any:
    """``fn`` as timed() calls it, recording the queue's share of each call in ``tq.shares``."""
    def call() -> Any:
        before = tq.seconds
        try:
            return fn()
        finally:
            tq.shares.append(tq.seconds - before)
    return call


def stepskip_v1(inputs: dict[str, Any], workdir: str, repeat: int) -> dict[str, Any]:
    rows = inputs["v1"]
    tq = TimedQueue()
    fields = TensorDict({k: torch.nested.as_nested_tensor([torch.from_numpy(r) for r in v], layout=torch.jagged)
                         for k, v in rows["tensors"].items()}, batch_size=[len(rows["keys"])])
    tq.kv_batch_put(keys=rows["keys"], fields=fields, tags=rows["tags"], partition_id="train")
    prompts = Batch(non_tensor_batch={"uid": np.array(rows["prompt_uids"], dtype=object)})
    owner, buffer = V1Owner(rows["prompt_uids"], prompts), V1Buffer(rows["keys"], rows["tags"])
    SkipManager.init(config(workdir, inputs["shape"], "rollout_tq"), tq_client=tq)
    get = timed(lambda: tq.kv_batch_get(keys=rows["keys"], partition_id="train"), repeat)
    SkipManager.set_step(99)  # warm-up, untimed, as for the other roles: a step saved, then injected
    owner._add_batch_to_generate()
    buffer.sample()
    SkipManager.flush()
    owner._add_batch_to_generate()
    save, write, save_queue = [], [], []
    for i in range(repeat):
        SkipManager.set_step(100 + i)
        owner._add_batch_to_generate()  # a miss: the step is recorded at sample time
        before = tq.seconds
        start = time.perf_counter()
        buffer.sample()
        save.append(time.perf_counter() - start)
        save_queue.append(tq.seconds - before)
        SkipManager.flush()
        write.append(time.perf_counter() - start)
    SkipManager.set_step(100)
    inject = timed(in_queue(tq, owner._add_batch_to_generate), repeat)
    inject_queue = tq.shares
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/hits"] == repeat + 1, stats
    skip = SkipManager.skip_instances["rollout_tq"]
    out = {"save": save, "write": write, "inject": inject, "queue_get": get,
           "save_net": [a - b for a, b in zip(save, save_queue)],
           "write_net": [a - b for a, b in zip(write, save_queue)],
           "inject_net": [a - b for a, b in zip(inject, inject_queue)],
           "bytes": dir_bytes(skip.step_dump_dir(100))}
    SkipManager.reset()
    return out


class Rollouter:
    result: Any = None

    @SkipManager.annotate(role="async_rollout")
    def generate_sequences_single(self, prompts: Any) -> Any:
        return self.result


def stepskip_async(inputs: dict[str, Any], workdir: str, count: int, repeat: int, dirty: int = 0) -> dict[str, Any]:
    """Samples per second written (until flushed) and replayed, best of ``repeat`` runs, each in a fresh
    dump dir after one untimed sample (lazy imports, the worker's first start), as on verl's side.

    ``dirty``: bytes of another file written (not synced) first, as another program's checkpoint
    would be: above ``SYNCFS_MAX_DIRTY_BYTES``, each small entry keeps an ``fsync`` per file."""
    if dirty:
        os.makedirs(workdir, exist_ok=True)
        with open(f"{workdir}/someone-elses-checkpoint", "wb") as fh:
            chunk = os.urandom(1 << 20)
            for _ in range(dirty >> 20):
                fh.write(chunk)
    small = inputs["async"]
    rollouter = Rollouter()
    rollouter.result = to_batch(small["result"])

    def prompt(i: int) -> Batch:
        return to_batch(dict(small["prompts"], non_tensor={"uid": np.array([f"uid_sample_0_{i}"], dtype=object)}))

    prompts = [prompt(i) for i in range(count)]
    warm = prompt(count)
    writes, replays, calls = [], [], []
    for run in range(repeat):
        SkipManager.init(config(f"{workdir}/{run}", inputs["shape"], "async_rollout"))
        rollouter.generate_sequences_single(warm)
        SkipManager.flush()
        touch(rollouter.generate_sequences_single(warm))
        start = time.perf_counter()
        for p in prompts:
            rollouter.generate_sequences_single(p)
        calls.append(count / (time.perf_counter() - start))
        SkipManager.flush()
        writes.append(count / (time.perf_counter() - start))
        start = time.perf_counter()
        for p in prompts:
            touch(rollouter.generate_sequences_single(p))
        replays.append(count / (time.perf_counter() - start))
        stats = SkipManager.stats()
        assert stats["skip/async_rollout/dumps"] == count + 1 and stats["skip/async_rollout/hits"] == count + 1, stats
        SkipManager.reset()
    return {"write_per_s": max(writes), "replay_per_s": max(replays), "write_runs": writes, "replay_runs": replays,
            "calls_per_s": max(calls), "call_runs": calls}


def writer_tables(first: str, records: list[tuple[str, dict[str, Any]]]) -> dict[str, bytes]:
    """Name -> bytes of the digest tables the writer whose first table is named ``first`` would have
    written had it recorded ``records`` (entry name, its meta.json) itself: its own code, rolling included."""
    head, _, token = first.removesuffix(".keys").rpartition("+")
    writer = TableWriter(token)
    return {f"{head}+{name_token}.keys": data for name_token, data in writer.add(records)}


def per_call_curve(counts: list[int], workdir: str, repeat: int) -> list[dict[str, Any]]:
    """ms per call with ``count`` entries on disk, for the actions that look beyond the exact step
    (``repeat`` and ``random`` also with the run directory changed just before each call, so that
    each lists it), and ms of ``match``'s first call of a run (``SkipManager.init`` before each, not
    timed): it builds its prompt index lazily, looking the live prompts up in the writer's digest
    table (the copies are added to the table of the run that wrote the first entry, with the
    writer's own code, as that writer would have added them)."""
    shape = {"rows": 2, "n": 1, "prompt": 4, "response": 4}
    small = make_rollout_batch(2, 4, 4, n=1)
    out = []
    for count in counts:
        root = f"{workdir}/curve-{count}"
        SkipManager.init(config(root, shape, "rollout"))
        loop = Loop()
        loop.result = small
        SkipManager.set_step(0)
        loop.generate_sequences(small)
        SkipManager.flush()
        skip = SkipManager.skip_instances["rollout"]
        first = Path(skip.step_dump_dir(0))
        files = {f.name: f.read_bytes() for f in first.iterdir()}
        meta = json.loads(files.pop("meta.json"))
        (document,) = (first.parent.parent / HINTS_DIR).iterdir()  # the digest table of step 0's writer
        records = [("0", meta)]
        for step in range(1, count):  # copies of one entry, each with its own step (no fsync: setup only)
            target = Path(skip.step_dump_dir(2 * step))  # even steps only: odd ones are missing
            target.mkdir()
            for name, data in files.items():
                (target / name).write_bytes(data)
            (target / "meta.json").write_text(json.dumps(dict(meta, global_steps=2 * step)))
            records.append((str(2 * step), dict(meta, global_steps=2 * step)))
        for name, data in writer_tables(document.name, records).items():
            (document.parent / name).write_bytes(data)
        settled = time.time() - 60  # a cache written before this run (a listing is reused once its directory settled)
        for directory in (first.parent, first.parent.parent, first.parent.parent / HINTS_DIR):
            os.utime(directory, (settled, settled))
        SkipManager.reset()
        row: dict[str, Any] = {"entries": count}
        for action, step in (("cache", 2 * (count // 2)), ("repeat", 2 * (count // 2) + 1), ("random", 1)):
            SkipManager.init(config(root, shape, "rollout", action=action))

            def call(step: int = step) -> None:
                SkipManager.set_step(step)
                loop.generate_sequences(small)

            row[action] = timed(call, repeat)
            hits = repeat
            if action != "cache":  # and with the run directory just changed, as another writer's entry would
                row[f"{action}_listing"] = []
                for _ in range(repeat):
                    os.utime(first.parent)  # untimed: the call cannot reuse its listing, it lists again
                    row[f"{action}_listing"] += timed(call, 1)
                os.utime(first.parent, (settled, settled))  # settled again for the next action
                hits += repeat
            assert SkipManager.stats()["skip/rollout/hits"] == hits, (action, SkipManager.stats())
            SkipManager.reset()
        row["match_first"], row["match_later"] = [], []
        for i in range(repeat):
            SkipManager.init(config(root, shape, "rollout", action="match"))
            SkipManager.set_step(10 * count + 1 + 2 * i)
            row["match_first"] += timed(lambda: loop.generate_sequences(small), 1)
            assert SkipManager.stats()["skip/rollout/hits"] == 1, SkipManager.stats()
            SkipManager.reset()
        SkipManager.init(config(root, shape, "rollout", action="match"))
        for i in range(1 + repeat):  # the later calls of one run (its first one not timed)
            SkipManager.set_step(10 * count + 1 + 2 * i)
            times = timed(lambda: loop.generate_sequences(small), 1)
            row["match_later"] += times if i else []
        assert SkipManager.stats()["skip/rollout/hits"] == 1 + repeat, SkipManager.stats()
        SkipManager.reset()
        out.append(row)
        shutil.rmtree(root)
    return out


class CountingS3:
    """A real moto S3 server (in server mode, on 127.0.0.1, as tests/integration/storage starts it)
    that counts the HTTP requests it serves: the requests a call costs on object storage."""

    def __init__(self) -> None:
        import threading

        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        self.requests: list[str] = []
        lock = threading.Lock()
        counter = self

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:  # moto's own app, behind a counter
                app = DomainDispatcherApplication(create_backend_app)

                def counted(environ: dict[str, Any], start_response: Any) -> Any:
                    with lock:
                        counter.requests.append(f"{environ['REQUEST_METHOD']} {environ.get('QUERY_STRING', '')}")
                    return app(environ, start_response)

                self._server = make_server(self._ip_address, self._port, counted, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.server = Server(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "skip_instance_cache": True}

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.options)

    def stop(self) -> None:
        self.server.stop()


def per_call_curve_s3(counts: list[int], repeat: int) -> list[dict[str, Any]]:
    """Requests and ms per call with ``count`` entries on a moto S3 server, for every action.

    Each action starts a fresh ``SkipManager.init`` (a fresh s3fs instance: no listing cached from an
    earlier action); the first call of a run is counted apart from the later ones (``match`` builds
    its prompt index on its first call, from the writer's digest table: the copies are added to the
    table of the run that wrote the first entry, with the writer's own code, as that writer would have
    added them).
    """
    try:
        server = CountingS3()
    except ImportError as err:
        return [{"error": f"moto/s3fs not installed: {err}"}]
    shape = {"rows": 2, "n": 1, "prompt": 4, "response": 4}
    small = make_rollout_batch(2, 4, 4, n=1)
    out = []
    try:
        for count in counts:
            fs = server.fs()
            bucket = f"stepskip-curve-{count}-{uuid.uuid4().hex[:6]}"
            fs.mkdir(bucket)
            root = f"s3://{bucket}/dump"
            base = config(root, shape, "rollout", storage_options=server.options, async_dump=False)
            SkipManager.init(base)
            loop = Loop()
            loop.result = small
            SkipManager.set_step(0)
            loop.generate_sequences(small)
            skip = SkipManager.skip_instances["rollout"]
            first = skip.step_dump_dir(0).removeprefix("s3://")
            objects = {name.rsplit("/", 1)[-1]: fs.cat_file(name) for name in fs.find(first)}
            meta = json.loads(objects.pop("meta.json"))
            run = first.rsplit("/", 1)[0]
            SkipManager.reset()
            hints_dir = f"{run.rsplit('/', 1)[0]}/{HINTS_DIR}"
            (document,) = fs.ls(hints_dir)  # the digest table of the writer of step 0
            records = [("0", meta)]
            batch: dict[str, bytes] = {}
            for step in range(1, count):  # copies of one entry, each with its own step (setup only, not counted)
                target = f"{run}/{2 * step}"  # even steps only: odd ones are missing
                batch.update({f"{target}/{name}": data for name, data in objects.items()})
                batch[f"{target}/meta.json"] = json.dumps(dict(meta, global_steps=2 * step)).encode()
                records.append((str(2 * step), dict(meta, global_steps=2 * step)))
                if len(batch) >= 3000 or step == count - 1:
                    fs.pipe(batch)
                    batch = {}
            fs.pipe({f"{hints_dir}/{name}": data
                     for name, data in writer_tables(document.rsplit("/", 1)[1], records).items()})
            last = 2 * ((count - 1) if count > 1 else 0)
            row: dict[str, Any] = {"entries": count}
            for action, step in (("cache", last), ("repeat", last + 1), ("random", 1), ("replay", last),
                                 ("match", 10 * count + 1)):
                before = len(server.requests)
                SkipManager.init(config(root, shape, "rollout", action=action, storage_options=server.options,
                                        async_dump=False))
                row.setdefault("init", len(server.requests) - before)  # the run's start: its listing included
                calls, times = [], []
                for i in range(1 + repeat):
                    SkipManager.set_step(step + (2 * i if action == "match" else 0))
                    before = len(server.requests)
                    start = time.perf_counter()
                    loop.generate_sequences(small)
                    times.append(time.perf_counter() - start)
                    calls.append(len(server.requests) - before)
                stats = SkipManager.stats()
                served = stats["skip/rollout/hits"] if action != "match" else stats["skip/rollout/rows_replayed"]
                assert served >= 1 + repeat and not stats["skip/rollout/dumps"], (action, stats)
                SkipManager.reset()
                row[action] = {"first": calls[0], "later": max(calls[1:]), "ms": times[1:]}
            out.append(row)
            fs.rm(bucket, recursive=True)
    finally:
        server.stop()
    return out


# ---------------------------------------------------------------------------------------------- verl


def verl_python() -> str | None:
    python = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")
    return python if os.path.exists(python) else None


def run_verl(mode: str, inputs_path: str, workdir: str, threads: int, repeat: int) -> dict[str, Any] | None:
    python = verl_python()
    if python is None:
        return None
    quiet_disk()
    done = subprocess.run([python, str(HERE / "_verl_side.py"), mode, inputs_path, workdir, str(threads),
                           str(repeat)], capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PYTHONPATH=""))
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()
        return {"error": tail[-1] if tail else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


#: Rates over runs (key -> the list of its runs): a side's rate is the best of every round's runs.
_RATES = {"write_per_s": "write_runs", "replay_per_s": "replay_runs", "calls_per_s": "call_runs"}


def merged(rounds: list[Any]) -> Any:
    """One side's results over the rounds: the timing lists joined, rates the best of all runs, the
    rest (bytes, paths) from the last round; a failed round (verl's side) is the result."""
    if not rounds or any(r is None or "error" in r for r in rounds):
        return next((r for r in rounds if r is not None and "error" in r), None)
    out = dict(rounds[-1])
    for key, value in rounds[-1].items():
        if isinstance(value, list) and all(isinstance(r.get(key), list) for r in rounds):
            out[key] = [x for r in rounds for x in r[key]]
    for rate, runs in _RATES.items():
        if rate in out and runs in out:
            out[rate] = max(out[runs])
    if isinstance(out.get("median"), dict):
        out["median"] = {k: statistics.median(out[k]) for k in out["median"] if isinstance(out.get(k), list)}
    return out


def alternate(rounds: int, ours: Any, theirs: Any) -> tuple[Any, Any]:
    """``ours(r)`` and ``theirs(r)`` for r in range(rounds), alternated; each side's results merged."""
    mine, verl = [], []
    for r in range(rounds):
        quiet_disk()
        mine.append(ours(r))
        verl.append(theirs(r))
    return merged(mine), merged(verl)


# ---------------------------------------------------------------------------------------------- report


def best(values: Any) -> float | None:
    return min(values) if isinstance(values, list) and values else values


def noise(values: Any) -> str:
    if not isinstance(values, list) or len(values) < 2:
        return ""
    return f"{statistics.median(values) / min(values) - 1:5.0%}"


def median(values: Any) -> float | None:
    return statistics.median(values) if isinstance(values, list) and values else values


def _milli(seconds: float) -> str:
    """Milliseconds, with two decimals below 10 ms (a small batch's hit takes about one)."""
    return f"{seconds * 1000:.2f}" if seconds < 0.01 else f"{seconds * 1000:.1f}"


def ms(values: Any) -> str:
    value = best(values)
    if value is None:
        return f"{'-':>9s}"
    text = f"{_milli(value):>9s}"
    return text + (f" ({_milli(statistics.median(values))})" if isinstance(values, list) and len(values) > 1 else "")


def ratio(ours: Any, theirs: Any, target: float | None = None) -> str:
    a, b = best(ours), best(theirs)
    if a is None or not b:
        return f"{'-':>7s}"
    value = a / b
    mark = "" if target is None else (" ok" if value <= target else " MISS")
    return f"{value:7.3f}{mark}"


def render_colocated(size: str, threads: str, ours: dict[str, Any], verl: dict[str, Any] | None,
                     batch_bytes: int, rows: int = 1024) -> list[str]:
    """The colocated role's table for one size. Below 1024 rows only the hit has a target here (its
    own, :func:`hit_target`); the others are set for batches from 1024 rows and are left blank."""
    v = verl if verl and "error" not in verl else {}
    big = rows >= 1024
    at = lambda target: target if big else None  # noqa: E731
    lines = [f"\ncolocated role, {size}, torch threads {threads}, batch {batch_bytes / 1e6:.1f} MB in memory"
             + (f"  [verl side failed: {verl['error']}]" if verl and "error" in verl else "")]
    lines.append(f"{'measure':44s} {'stepskip ms (median)':>22s} {'verl ms (median)':>20s} {'ratio':>11s} "
                 f"{'target':>7s} {'noise':>6s} {'ratio of medians':>16s}")

    def row(label: str, a: Any, b: Any, target: float | None, fmt: Any = ms) -> None:
        lines.append(f"{label:44s} {fmt(a):>22s} {fmt(b):>20s} {ratio(a, b, target):>11s} "
                     f"{'' if target is None else f'<= {target:g}':>7s} {noise(a):>6s} "
                     f"{ratio(median(a), median(b)) if isinstance(a, list) else '':>16s}")

    row("miss: time the caller is blocked", ours["miss"], v.get("miss"), at(TARGETS["miss"]))
    row("full write (miss + background dump)", ours["write"], v.get("miss"), at(TARGETS["write"]))
    row("hit, every tensor touched", ours["hit"], v.get("hit"), hit_target(rows))
    row("hit vs raw read of verl's gen_batch.dp", ours["hit"], v.get("raw"), at(TARGETS["hit_raw"]))
    if ours.get("floor"):
        row("  floor under that hit (see hit_floor), touched", ours["floor"], v.get("hit"), None)
    if ours.get("first_hit"):  # a fresh process each: no recycled pages, pools or buffers yet (judged below)
        row("a process's first hit", ours["first_hit"], v.get("first_hit"), None)
        row("a process's first miss (blocks the caller)", ours["first_miss"], v.get("first_miss"), None)
        row("  first miss until its dump is flushed", ours["first_write"], v.get("first_miss"), None)
        row("  SkipManager.init before a first hit", ours["init_hit"], v.get("init_hit"), None)
        row("  SkipManager.init before a first miss", ours["init_miss"], v.get("init_miss"), None)
    mb = lambda x: f"{x / 1e6:9.2f} MB" if x is not None else f"{'-':>9s}"  # noqa: E731
    row("bytes on disk", ours["bytes"], v.get("bytes"), at(TARGETS["bytes"]), fmt=mb)
    times = lambda x: f"{x / batch_bytes:9.2f} x" if x is not None else f"{'-':>9s}"  # noqa: E731
    lines.append(f"{'peak extra memory of a hit (x batch)':44s} {times(ours.get('peak')):>22s} "
                 f"{times(v.get('peak')):>20s} {'':>11s} {'<= 1.3' if big else '':>7s}")
    lines.append(f"{'miss breakdown: snapshot of the tensors':44s} {ms(ours['snap_tensors']):>22s}")
    lines.append(f"{'  snapshot of the non-tensor columns':44s} {ms(ours['snap_non_tensor']):>22s}")
    if ours.get("row_prompts") is not None:
        lines.append(f"{'  per-row prompt digests (matching)':44s} {ms(ours['row_prompts']):>22s}")
    d = best(ours["digest"])
    lines.append(f"{'prompt check (prompt_digest) alone':44s} {ms(ours['digest']):>22s} {'':>20s} "
                 f"{'':>11s} {'':>7s} {noise(ours['digest']):>6s}")
    on_miss = d
    if ours.get("digests_on_miss") is not None and ours.get("row_prompts") is not None:
        on_miss = max(0.0, best(ours["digests_on_miss"]) - best(ours["row_prompts"]))
        lines.append(f"{'  added to a miss (row digests + it, shared)':44s} {on_miss * 1000:22.1f}")
    def added(part: float, whole: float) -> float:
        """What the check adds: its time against the rest of the call (a hit or miss that included it)."""
        return part / max(whole - part, 1e-9)

    share = f"{added(d, best(ours['hit'])):.1%} / {added(on_miss, best(ours['miss'])):.1%}"
    lines.append(f"{'  added to a hit / to the miss block':44s} {share:>22s}{'':>21s} {'':>11s} "
                 f"{'<= 10%' if big else '':>7s}")
    return lines


def colocated_targets(size: str, rows: int, threads: int, ours: dict[str, Any], verl: dict[str, Any] | None
                      ) -> list[dict[str, Any]]:
    """The rows of the targets table for one size and thread setting (medians judge)."""
    v = verl if verl and "error" not in verl else {}
    out = []
    for measure, key, target in (("steady-state hit", "hit", hit_target(rows)),
                                 ("first hit of a process", "first_hit", FIRST_CALL_TARGET),
                                 ("first miss of a process", "first_miss", FIRST_CALL_TARGET)):
        a, b = ours.get(key), v.get(key)
        ratio_median = median(a) / median(b) if a and b else None
        out.append({"size": size, "threads": threads, "measure": measure, "stepskip": a, "verl": b,
                    "ratio": ratio_median, "ratio_best": best(a) / best(b) if a and b else None,
                    "target": target, "met": None if ratio_median is None else ratio_median <= target})
        floor = ours.get("floor") if key == "hit" else None
        if floor and b:  # what no reader can leave out, against the same verl hit: a target under it cannot be met
            out[-1]["floor"] = {"stepskip": floor, "ratio": median(floor) / median(b),
                                "ratio_best": best(floor) / best(b)}
    return out


def curve_targets(curve: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``repeat`` and ``random`` at ENTRIES_JUDGED entries (or the most a run counted) against 10 entries."""
    few = next((row for row in curve if row["entries"] == 10), None)
    many = [row for row in curve if row["entries"] > 10]
    if few is None or not many:
        return []
    judged = next((row for row in many if row["entries"] == ENTRIES_JUDGED), max(many, key=lambda r: r["entries"]))
    out = []
    for action in ("repeat", "random"):
        for key, how in ((action, "listing reused"), (f"{action}_listing", "listed each call")):
            added = median(judged[key]) - median(few[key])
            out.append({"measure": f"{action}, {judged['entries']} vs 10 entries ({how})",
                        "added_ms": added * 1000, "added_best_ms": (best(judged[key]) - best(few[key])) * 1000,
                        "target_ms": ENTRIES_TARGET_MS, "met": added * 1000 <= ENTRIES_TARGET_MS})
    return out


def render_targets(rows: list[dict[str, Any]], entries: list[dict[str, Any]], processes: int) -> list[str]:
    verdict = {True: "met", False: "missed", None: "-"}
    lines = [f"\ntargets, stepskip / verl through the decorator: judged by the ratio of medians (of the best runs "
             f"in brackets); a first hit or miss is one fresh process each, {processes} a side"]
    lines.append(f"  {'size':20s} {'threads':>7s}  {'measure':26s} {'stepskip ms median / best':>26s} "
                 f"{'verl ms median / best':>22s} {'ratio (best)':>15s} {'target':>8s} {'result':>7s}")

    def cell(values: Any) -> str:
        return "-" if not values else f"{_milli(median(values))} / {_milli(best(values))}"

    for r in rows:
        ratio_cell = "-" if r["ratio"] is None else f"{r['ratio']:.2f} ({r['ratio_best']:.2f})"
        lines.append(f"  {r['size']:20s} {r['threads']:>7d}  {r['measure']:26s} {cell(r['stepskip']):>26s} "
                     f"{cell(r['verl']):>22s} {ratio_cell:>15s} {'<= ' + format(r['target'], 'g'):>8s} "
                     f"{verdict[r['met']]:>7s}")
        floor = r.get("floor")
        if floor:
            under = floor["ratio"] > r["target"]
            floor_cell = f"{floor['ratio']:.2f} ({floor['ratio_best']:.2f})"
            lines.append(f"  {'':20s} {'':>7s}  {'  its floor (hit_floor)':26s} {cell(floor['stepskip']):>26s} "
                         f"{cell(r['verl']):>22s} {floor_cell:>15s} {'':>8s} "
                         f"{'target below the floor' if under else 'floor under the target'}")
    for r in entries:
        added = f"{r['added_ms']:+.2f} ms ({r['added_best_ms']:+.2f})"
        lines.append(f"  {r['measure']:56s} {'added per call, median (best)':>30s} {added:>20s} "
                     f"{'<= +' + format(r['target_ms'], 'g') + ' ms':>10s} {verdict[r['met']]:>7s}")
    return lines


def _commit() -> str:
    """The checked-out commit, with '+changes' when the work tree differs from it ('unknown' outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+changes" if git("status", "--porcelain", "--untracked-files=no")
                                                      else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="smaller sizes, for development")
    group.add_argument("--smoke", action="store_true", help="the smallest sizes, one repeat (the smoke test)")
    parser.add_argument("--repeat", type=int, default=None, help="runs per round (default 5, 1 with --smoke)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per part, the two sides alternated (default 2, 1 with --smoke)")
    parser.add_argument("--threads", default=None,
                        help="torch thread settings, e.g. 1,default (default: 1,default; 1 with --small)")
    parser.add_argument("--skip", default="",
                        help="comma list of parts to leave out: colocated,first,v1,async,curve,s3 "
                             "(first: the fresh processes of the first calls, run with the colocated role)")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--small", action="store_true",
                        help="only the parts for small batches, in a few minutes: the colocated role and the first "
                             "calls at the tiny and small sizes, repeat/random at 10 and 2,000 entries (with "
                             "--smoke: the tiny size, one run, 10 and 30 entries)")
    parser.add_argument("--processes", type=int, default=None,
                        help="fresh processes a side for a first hit and for a first miss (default 3, 1 with --smoke)")
    parser.add_argument("--first-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_child:
        first_child(*args.first_child)
        return
    if args.small and args.quick:
        parser.error("--small runs its own sizes: leave out --quick")
    mode = ("small-smoke" if args.smoke else "small") if args.small else \
        "smoke" if args.smoke else "quick" if args.quick else "full"
    repeat = args.repeat or (1 if args.smoke else 5)
    rounds = args.rounds or (1 if args.smoke else 2)
    processes = args.processes or (1 if args.smoke else 3)
    thread_settings = (args.threads or ("1" if args.small else "1,default")).split(",")
    skip = set(filter(None, args.skip.split(",")))
    if args.small:
        skip |= {"v1", "async", "s3"}
    default_threads = torch.get_num_threads()
    commit = _commit()
    results: dict[str, Any] = {"mode": mode, "repeat": repeat, "rounds": rounds, "processes": processes,
                               "verl": verl_python() is not None, "commit": commit, "runs": [], "targets": []}
    lines = [f"bench_user_path: {mode} sizes, commit {commit}, best of {rounds} rounds x {repeat} runs (median; "
             f"{SMALL_REPEAT_FACTOR} x as many below 1024 rows), "
             f"the two sides alternated round by round, cpu cores {os.cpu_count()}, "
             f"load average {os.getloadavg()[0]:.1f}; verl 0.9.1 side: "
             + ("its own code in " + str(verl_python()) if verl_python() else "not available (make verl-env)")]
    # the small sizes run the colocated role and the first calls only; the others every part
    plan = [(size, True) for size in SMALL_SIZES.get(mode, [])] + [(size, False) for size in SIZES.get(mode, [])]
    with tempfile.TemporaryDirectory(prefix="stepskip-bench-user-") as workdir:
        if mode in ("full", "quick"):
            lines[0] += f"; disk: {settle_disk(workdir)}"
        for (rows, prompt, response), small in plan:
            inputs = make_inputs(rows, prompt, response)
            inputs["async"]["count"] = ASYNC_COUNTS.get(mode, 0)
            size = f"{rows} x ({prompt} + {response})"
            inputs_path = f"{workdir}/inputs-{rows}.pkl"
            with open(inputs_path, "wb") as fh:
                pickle.dump(inputs, fh, protocol=5)
            batch_bytes = nbytes_in_memory(inputs["result"])
            runs = repeat * SMALL_REPEAT_FACTOR if rows < 1024 else repeat
            for threads_name in thread_settings:
                threads = default_threads if threads_name == "default" else int(threads_name)
                torch.set_num_threads(threads)
                run: dict[str, Any] = {"size": size, "threads": threads}
                tag = f"{rows}-{threads}"
                if "colocated" not in skip:
                    ours, verl = alternate(
                        rounds, lambda r, data=inputs: stepskip_colocated(data, f"{workdir}/ours-{tag}-{r}", runs),
                        lambda r: run_verl("colocated", inputs_path, f"{workdir}/verl-{tag}-{r}", threads, runs))
                    if "first" not in skip:
                        first_ours, first_verl = first_calls(inputs_path, workdir, tag, threads, processes)
                        ours.update(first_ours)
                        if verl and "error" not in verl and first_verl is not None:
                            verl.update(first_verl if "error" not in first_verl
                                        else {"first_error": first_verl["error"]})
                    run["colocated"] = {"stepskip": ours, "verl": verl}
                    lines += render_colocated(size, f"{threads} ({threads_name})", ours, verl, batch_bytes, rows)
                    results["targets"] += colocated_targets(size, rows, threads, ours, verl)
                if small:
                    results["runs"].append(run)
                    continue
                if "v1" not in skip:
                    ours, verl = alternate(
                        rounds, lambda r, data=inputs: stepskip_v1(data, f"{workdir}/v1-ours-{tag}-{r}", repeat),
                        lambda r: run_verl("v1", inputs_path, f"{workdir}/v1-verl-{tag}-{r}", threads, repeat))
                    v = verl if verl and "error" not in verl else {}
                    run["v1"] = {"stepskip": ours, "verl": verl}
                    lines.append(f"\nV1 role (rollout_tq), {size}, threads {threads}"
                                 + (f"  [verl side failed: {verl['error']}]" if verl and "error" in verl else ""))
                    lines.append(f"  sample phase blocks the caller: {ms(ours['save'])} ms vs verl {ms(v.get('save'))}"
                                 f" ms -> {ratio(ours['save'], v.get('save'), TARGETS['miss'])}"
                                 f"  (of which InProcessTQClient.kv_batch_get: {ms(ours['queue_get'])} ms; "
                                 "verl's side reads a prebuilt TensorDict from a stand-in queue)")
                    lines.append(f"    net of the in-process queue's get: {ms(ours['save_net'])} ms -> "
                                 f"{ratio(ours['save_net'], v.get('save'), TARGETS['miss'])}")
                    lines.append(f"  full write: {ms(ours['write'])} ms -> "
                                 f"{ratio(ours['write'], v.get('save'), TARGETS['write'])}")
                    lines.append(f"    net of the in-process queue's get: {ms(ours['write_net'])} ms -> "
                                 f"{ratio(ours['write_net'], v.get('save'), TARGETS['write'])}")
                    lines.append(f"  inject a cached step (hit): {ms(ours['inject'])} ms vs verl "
                                 f"{ms(v.get('inject'))} ms -> {ratio(ours['inject'], v.get('inject'))}  "
                                 "(stepskip's puts go into InProcessTQClient; verl's into a dict)")
                    lines.append(f"    net of the in-process queue's put: {ms(ours['inject_net'])} ms -> "
                                 f"{ratio(ours['inject_net'], v.get('inject'), TARGETS['hit'])}")
                    lines.append(f"  bytes: {ours['bytes'] / 1e6:.2f} MB vs verl "
                                 f"{(v.get('bytes') or 0) / 1e6:.2f} MB -> {ratio(ours['bytes'], v.get('bytes'))}")
                results["runs"].append(run)
            if "async" not in skip and not small:
                count = ASYNC_COUNTS[mode]
                ours, verl = alternate(
                    rounds,
                    lambda r, data=inputs: stepskip_async(data, f"{workdir}/async-ours-{rows}-{r}", count, repeat),
                    lambda r: run_verl("async", inputs_path, f"{workdir}/async-verl-{rows}-{r}", default_threads,
                                       repeat))
                quiet_disk()
                ours_dirty = stepskip_async(inputs, f"{workdir}/async-dirty-{rows}", count, repeat, dirty=DIRTY_BYTES) \
                    if mode != "smoke" else None  # (256 MB more to write: not in the smoke test)
                v = verl if verl and "error" not in verl else {}
                results["runs"].append({"size": size, "async": {"stepskip": ours, "verl": verl,
                                                                 "stepskip_dirty": ours_dirty}})
                vw, vr = v.get("write_per_s"), v.get("replay_per_s")
                lines.append(f"\nasync role (async_rollout), {count} one-sample entries of 1 x ({prompt} + "
                             f"{response}), best of {rounds} x {repeat} runs each (after one untimed sample)")
                lines.append(f"  written: {ours['write_per_s']:8.1f} samples/s (until flushed) vs verl "
                             + (f"{vw:8.1f} -> {ours['write_per_s'] / vw:5.2f} x" if vw else "-"))
                lines.append(f"  calls returned (the caller's side; verl's caller waits for each write): "
                             f"{ours['calls_per_s']:8.1f} samples/s"
                             + (f" -> {ours['calls_per_s'] / vw:5.2f} x" if vw else ""))
                if ours_dirty is not None:
                    lines.append(f"  written with {DIRTY_BYTES >> 20} MB of another file dirty (an fsync per file, no "
                                 f"syncfs): {ours_dirty['write_per_s']:8.1f} samples/s"
                                 + (f" -> {ours_dirty['write_per_s'] / vw:5.2f} x" if vw else ""))
                lines.append(f"  replayed: {ours['replay_per_s']:8.1f} samples/s vs verl "
                             + (f"{vr:8.1f} -> {ours['replay_per_s'] / vr:5.2f} x" if vr else "-"))
            os.remove(inputs_path)
            del inputs
        if "curve" not in skip:
            torch.set_num_threads(default_threads)
            curve = per_call_curve(ENTRY_COUNTS[mode], workdir, repeat * SMALL_REPEAT_FACTOR)  # calls of ~1 ms
            results["curve"] = curve
            lines.append("\nper-call cost with N entries on local disk (ms, best (median)); "
                         "repeat and random look beyond the exact step (they reuse the run directory's listing "
                         "while the directory is unchanged; the entries here were written a minute earlier)")
            lines.append(f"  {'entries':>8s} {'cache (hit)':>20s} {'repeat (nearest)':>20s} {'random':>20s} "
                         f"{'match (first call)':>20s} {'match (later calls)':>20s} {'repeat, listing':>20s} "
                         f"{'random, listing':>20s}")
            for row in curve:
                lines.append(f"  {row['entries']:8d} {ms(row['cache']):>20s} {ms(row['repeat']):>20s} "
                             f"{ms(row['random']):>20s} {ms(row['match_first']):>20s} {ms(row['match_later']):>20s} "
                             f"{ms(row['repeat_listing']):>20s} {ms(row['random_listing']):>20s}")
            lines.append("  repeat/random, listing: the run directory changed just before each call (as when another "
                         "writer adds an entry), so each call lists it")
        if "s3" not in skip:
            counts = S3_ENTRY_COUNTS[mode]
            curve_s3 = per_call_curve_s3(counts, repeat)
            results["curve_s3"] = curve_s3
            lines.append("\nper-call cost with N entries on object storage (a moto S3 server on 127.0.0.1): HTTP "
                         "requests of the first call of a run / of each later call (max), and ms of the later calls"
                         + (f"; {'/'.join(map(str, counts))} entries (10,000 take too long to create on moto here)"
                            if mode == "full" else ""))
            if curve_s3 and "error" in curve_s3[0]:
                lines.append(f"  skipped: {curve_s3[0]['error']}")
            else:
                actions = ("cache", "repeat", "random", "replay", "match")
                lines.append(f"  {'entries':>8s} {'init':>5s} " + " ".join(f"{a:>24s}" for a in actions))
                for row in curve_s3:
                    cells = [f"{row[a]['first']:>3d} / {row[a]['later']:<3d} {ms(row[a]['ms']):>14s}" for a in actions]
                    lines.append(f"  {row['entries']:8d} {row['init']:5d} " + " ".join(f"{c:>24s}" for c in cells))
                lines.append("  init: requests of SkipManager.init (its clean-up lists the run directory recursively: "
                             "one request per 1,000 objects, s3fs keeps that listing for the run, and looks only at "
                             "entries that listing shows may hold a leftover); match's first call reads the writers' "
                             "digest tables (one read per writer) and indexes only the entries they name for the live "
                             "prompts, from their meta.json; later calls read only those and new entries")
    lines += render_targets(results["targets"], curve_targets(results.get("curve", [])), processes)
    results["targets"] += curve_targets(results.get("curve", []))
    lines.append("\nratios in the tables of each part: stepskip / verl (best against best, the ratio of medians "
                 "beside it); noise = median/best - 1 of stepskip's runs; the targets table "
                 "judges by medians")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
