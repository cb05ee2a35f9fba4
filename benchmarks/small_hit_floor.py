"""The floor under a debugging batch's hit: the work no reader of stepskip's entry can leave out.

Run:  .venv/bin/python benchmarks/small_hit_floor.py [--sizes tiny,small] [--calls 300]

For each size (tiny 32 x (128 + 256), small 256 x (512 + 1024), the inputs of
benchmarks/bench_user_path.py), the entry a hit reads is written once with ``format: safe`` (as the
decorator writes it), and each unavoidable part of reading it back is timed alone in this process
(best and median of --calls, microseconds):

- the system calls: opening, checking (``fstat``) and reading the entry's two data files;
- the checksums: xxh3-64 of those bytes (what ``verify`` checks);
- the tensor bytes: widening each stored (narrowed) tensor into an output the size of the batch's,
  in memory used before (no page faults), plus ``input_ids`` rebuilt from its two parts;
- the tree: parsing ``data.json`` (the non-tensor columns live there);
- the prompt check: ``prompt_digest`` of the live prompts (``check_prompts``).

Their sum is the floor of each part alone, on warm caches; ``decode`` (the format's whole decode) is
printed beside it. It ranks the parts; it is not the floor a hit stands on. In a hit the parts run
one after another on a batch that no longer fits the caches (the caller holds its last result while
the next one loads, and touches every tensor): each part then reads and writes memory, and together
they take two to three times their sum here. ``bench_user_path.py`` measures that floor in sequence
(``hit_floor``) beside the hit and verl's hit in one run, and judges the targets against it. Times
are of this machine at this moment (it is shared): run it beside the benchmark and quote the load
average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_user_path import make_inputs, to_batch  # noqa: E402

from stepskip._fidelity import prompt_digest  # noqa: E402
from stepskip._formats.compact import narrow  # noqa: E402
from stepskip._formats.safe import SafeFormat  # noqa: E402

SIZES = {"tiny": (32, 128, 256), "small": (256, 512, 1024)}


def timed(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """(best, median) microseconds of ``calls`` calls after a few untimed ones."""
    for _ in range(min(10, calls)):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6, statistics.median(times) * 1e6


def read_files(paths: list[str], buffers: list[bytearray]) -> None:
    for path, buffer in zip(paths, buffers):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            view, done = memoryview(buffer), 0
            while done < size:
                done += os.readv(fd, [view[done:size]])
        finally:
            os.close(fd)


def floor(size: str, calls: int, workdir: str) -> list[str]:
    rows, prompt, response = SIZES[size]
    inputs = make_inputs(rows, prompt, response)
    batch, prompts = to_batch(inputs["result"]), to_batch(inputs["prompts"])
    fmt = SafeFormat()
    files = {name: bytes(data) for name, data in fmt.encode(fmt.freeze(batch, copy=True)).items()}
    paths = []
    for name, data in files.items():
        path = os.path.join(workdir, f"{size}-{name}")
        Path(path).write_bytes(data)
        paths.append(path)
    buffers = [bytearray(len(data)) for data in files.values()]
    stored = {key: narrow(value) for key, value in batch.batch.items() if key != "input_ids"}
    outputs = {key: torch.empty_like(value) for key, value in batch.batch.items()}
    width = batch.batch["prompts"].shape[1]

    def widen() -> None:
        for key, part in stored.items():
            outputs[key].copy_(part)
        outputs["input_ids"][:, :width].copy_(stored["prompts"])
        outputs["input_ids"][:, width:].copy_(stored["responses"])

    parts = {
        "system calls: open, fstat, read, close of the 2 data files": lambda: read_files(paths, buffers),
        "checksums: xxh3-64 of those bytes": lambda: [xxhash.xxh3_64_intdigest(b) for b in buffers],
        "tensor bytes: widen into the batch's outputs (warm memory)": widen,
        "tree: json.loads(data.json)": lambda: json.loads(files["data.json"]),
        "prompt check: prompt_digest of the live prompts": lambda: prompt_digest(prompts, ["uid"]),
    }
    stored_bytes = sum(len(b) for b in files.values())
    out_bytes = sum(t.numel() * t.element_size() for t in batch.batch.values())
    lines = [f"== {size} {SIZES[size]}: entry {stored_bytes / 1e6:.2f} MB on disk, {out_bytes / 1e6:.2f} MB of "
             f"tensors out; best / median of {calls}, us"]
    total_best = total_median = 0.0
    for name, fn in parts.items():
        best, median = timed(fn, calls)
        total_best, total_median = total_best + best, total_median + median
        lines.append(f"  {best:9.1f} / {median:9.1f}  {name}")
    lines.append(f"  {total_best:9.1f} / {total_median:9.1f}  floor (the sum)")
    best, median = timed(lambda: fmt.decode(dict(files)), calls)
    lines.append(f"  {best:9.1f} / {median:9.1f}  for comparison: the format's whole decode (tree, tensors, columns)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"small_hit_floor: cpu cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, torch threads 1")
    with tempfile.TemporaryDirectory(prefix="stepskip-floor-") as workdir:
        for size in args.sizes.split(","):
            print("\n".join(floor(size, args.calls, workdir)))


if __name__ == "__main__":
    main()
