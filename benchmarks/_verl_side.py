"""verl 0.9.1's own skip code, timed in verl's environment for benchmarks/bench_user_path.py.

Run by bench_user_path.py with verl's interpreter (``.venv-verl``, or STEPSKIP_VERL_PYTHON):

    python _verl_side.py MODE INPUTS.pkl WORKDIR THREADS REPEAT

MODE is ``colocated`` (verl's ``RolloutSkip`` through its ``SkipManager.annotate`` on a miss and a
hit, a raw read of its ``gen_batch.dp``), ``peak`` (the first hit of this fresh process: its time and
peak extra RSS), ``first_miss`` (the first miss of this fresh process, in an empty WORKDIR), ``v1``
(``RolloutTqSkip.prepare_data`` / ``load_dump_data`` over a dict-backed ``transfer_queue`` stand-in,
the only part of verl's path that cannot run here without Ray) or ``async`` (``AsyncRolloutSkip``,
one small entry per sample). INPUTS.pkl holds plain numpy arrays and
Python objects written by bench_user_path.py (no class of either project), so both sides time the
same data. Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import pickle
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _dataproto(part: dict):
    from verl.protocol import DataProto

    tensors = {k: torch.from_numpy(v) for k, v in part["tensors"].items()}
    rows = next(iter(tensors.values())).shape[0]
    return DataProto(batch=TensorDict(tensors, batch_size=[rows]), non_tensor_batch=dict(part["non_tensor"]),
                     meta_info=dict(part["meta"]))


def _config(workdir: str, rows: int, n: int, prompt: int, response: int, steps: list[int], role: str):
    skip = {"rollout": {"enable": False}, "async_rollout": {"enable": False}, "rollout_tq": {"enable": False}}
    skip[role] = {"enable": True, "dump_dir": workdir, "steps": steps, "action": "cache"}
    return OmegaConf.create({
        "trainer": {"experiment_name": "bench", "project_name": "user_path",
                    "v1": {"trainer_mode": "sync", "sync": {"parameter_sync_step": 1}}},
        "data": {"train_batch_size": max(1, rows // n), "max_prompt_length": prompt, "max_response_length": response},
        "actor_rollout_ref": {"rollout": {"n": n}},
        "skip": skip,
    })


def _timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _touch(value) -> None:
    for t in value.batch.values():
        t.sum()


def colocated(inputs: dict, workdir: str, repeat: int) -> dict:
    from verl.utils.skip.skip_manager import SkipManager

    prompts, result = _dataproto(inputs["prompts"]), _dataproto(inputs["result"])
    shape = inputs["shape"]

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            return result

    SkipManager.init(_config(workdir, steps=list(range(1, 10_000)), role="rollout", **shape))
    loop = Loop()
    SkipManager.set_step(99)  # warm-up, untimed, as on stepskip's side
    loop.generate_sequences(prompts)
    _touch(loop.generate_sequences(prompts))
    steps = iter(range(100, 10_000))
    first = 100

    def miss():
        SkipManager.set_step(next(steps))
        loop.generate_sequences(prompts)

    miss_s = _timed(miss, repeat)

    held = [None]

    def hit():  # the last hit's batch stays alive while the next one loads, as a trainer's loop variable does
        SkipManager.set_step(first)
        out = loop.generate_sequences(prompts)
        _touch(out)
        held[0] = out

    hit_s = _timed(hit, repeat)
    step_dir = SkipManager.skip_instances["rollout"]._get_step_dump_dir(first)
    path = step_dir / "gen_batch.dp"
    raw_s = _timed(path.read_bytes, repeat)
    nbytes = sum(p.stat().st_size for p in step_dir.iterdir())
    return {"miss": miss_s, "hit": hit_s, "raw": raw_s, "bytes": nbytes, "entry": str(step_dir)}


def peak(inputs: dict, workdir: str) -> dict:
    """One hit on an entry written by ``colocated`` (same workdir), in this fresh process."""
    from verl.utils.skip.skip_manager import SkipManager

    shape = inputs["shape"]
    prompts = _dataproto(inputs["prompts"])
    del inputs

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            raise AssertionError("the benchmark expects a hit")

    start = time.perf_counter()
    SkipManager.init(_config(workdir, steps=[100], role="rollout", **shape))
    init_s = time.perf_counter() - start
    path = SkipManager.skip_instances["rollout"]._get_step_dump_dir(100) / "gen_batch.dp"
    path.read_bytes()  # warm, as every read in the benchmark is
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = _status("VmRSS")
    SkipManager.set_step(100)
    start = time.perf_counter()
    _touch(Loop().generate_sequences(prompts))
    seconds = time.perf_counter() - start
    return {"peak_extra": _status("VmHWM") - before, "first_hit": seconds, "init": init_s}


def first_miss(inputs: dict, workdir: str) -> dict:
    """The first call of this fresh process, a miss: how long verl's dump blocks the caller."""
    from verl.utils.skip.skip_manager import SkipManager

    shape = inputs["shape"]
    prompts, result = _dataproto(inputs["prompts"]), _dataproto(inputs["result"])
    del inputs

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            return result

    start = time.perf_counter()
    SkipManager.init(_config(workdir, steps=[100], role="rollout", **shape))
    init_s = time.perf_counter() - start
    SkipManager.set_step(100)
    start = time.perf_counter()
    Loop().generate_sequences(prompts)
    seconds = time.perf_counter() - start
    path = SkipManager.skip_instances["rollout"]._get_step_dump_dir(100) / "gen_batch.dp"
    if not path.is_file():
        raise SystemExit(f"the benchmark expects a miss that dumps {path}")
    return {"first_miss": seconds, "init": init_s}


class _Queue(types.ModuleType):
    """A dict-backed stand-in for the ``transfer_queue`` module (Ray cannot run in this child)."""

    def __init__(self) -> None:
        super().__init__("transfer_queue")
        self.data: dict = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        self.data[partition_id] = (list(keys), fields, tags)

    def kv_batch_get(self, keys, partition_id):
        return self.fields


def v1(inputs: dict, workdir: str, repeat: int) -> dict:
    queue = _Queue()
    sys.modules["transfer_queue"] = queue
    from verl.utils.skip.skip_manager import SkipManager

    shape, rows = inputs["shape"], inputs["v1"]
    tensors = {k: torch.nested.as_nested_tensor([torch.from_numpy(r) for r in v], layout=torch.jagged)
               for k, v in rows["tensors"].items()}
    queue.fields = TensorDict(tensors, batch_size=[len(rows["keys"])])
    SkipManager.init(_config(workdir, steps=list(range(1, 10_000)), role="rollout_tq", **shape))
    skip = SkipManager.skip_instances["rollout_tq"]
    meta = types.SimpleNamespace(keys=rows["keys"], tags=rows["tags"], partition_id="train")
    skip.prepare_data(step=99, batch=meta, global_steps=99)  # warm-up, untimed, as on stepskip's side
    skip.maybe_load_and_inject(99, rows["prompt_uids"])
    steps = iter(range(100, 10_000))
    save_s = _timed(lambda: skip.prepare_data(step=next(steps), batch=meta, global_steps=100), repeat)
    uids = rows["prompt_uids"]
    inject_s = _timed(lambda: skip.maybe_load_and_inject(100, uids), repeat)
    path = skip._get_v1_inner_dir(100, 0)
    return {"save": save_s, "inject": inject_s, "bytes": sum(p.stat().st_size for p in path.iterdir())}


def async_role(inputs: dict, workdir: str, repeat: int) -> dict:
    from verl.utils.skip.skip_manager import SkipManager

    shape, small = inputs["shape"], inputs["async"]
    result = _dataproto(small["result"])
    count = small["count"]

    def prompt(i: int):
        return _dataproto(dict(small["prompts"], non_tensor={"uid": np.array([f"uid_sample_0_{i}"], dtype=object)}))

    prompts = [prompt(i) for i in range(count)]
    warm = prompt(count)

    class Rollouter:
        @SkipManager.annotate(role="async_rollout")
        def generate_sequences_single(self, prompts):
            return result

    rollouter = Rollouter()
    writes, replays = [], []
    for run in range(repeat):  # best of repeat, each in a fresh dump dir after one untimed sample, as stepskip's
        SkipManager.init(_config(f"{workdir}/{run}", steps=list(range(count + 1)), role="async_rollout", **shape))
        rollouter.generate_sequences_single(warm)
        _touch(rollouter.generate_sequences_single(warm))
        start = time.perf_counter()
        for p in prompts:
            rollouter.generate_sequences_single(p)
        writes.append(count / (time.perf_counter() - start))
        start = time.perf_counter()
        for p in prompts:
            _touch(rollouter.generate_sequences_single(p))
        replays.append(count / (time.perf_counter() - start))
    return {"write_per_s": max(writes), "replay_per_s": max(replays), "write_runs": writes, "replay_runs": replays}


def main() -> None:
    mode, inputs_path, workdir, threads, repeat = sys.argv[1:6]
    if int(threads) > 0:
        torch.set_num_threads(int(threads))
    with open(inputs_path, "rb") as fh:
        inputs = pickle.load(fh)
    os.makedirs(workdir, exist_ok=True)
    if mode == "colocated":
        out = colocated(inputs, workdir, int(repeat))
    elif mode == "peak":
        out = peak(inputs, workdir)
    elif mode == "first_miss":
        out = first_miss(inputs, workdir)
    elif mode == "v1":
        out = v1(inputs, workdir, int(repeat))
    elif mode == "async":
        out = async_role(inputs, workdir, int(repeat))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    out["median"] = {k: statistics.median(v) for k, v in out.items() if isinstance(v, list)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
