"""Storage benchmark: stepskip's formats against verl 0.9's pickle format, side by side in one run.

Run:  .venv/bin/python benchmarks/bench_store.py [--sizes small,medium,large] [--repeat 3]

For each rollout batch (stepskip.testing.make_rollout_batch: int64 prompts/responses/input_ids/
masks/position ids, float32 log-probs, real lengths 20-100 % of the maximum, uids and chat
messages) it measures, per format:

- bytes on disk;
- dump critical path: how long a miss blocks the trainer (stepskip: the snapshot taken before
  the background write; verl: its whole synchronous ``save_to_disk``);
- full write: snapshot + encode + atomic write (fsync included for stepskip);
- load: read and decode with every tensor materialised (stepskip: checksums verified);
- peak extra memory of a load, measured in a fresh subprocess (VmHWM reset before loading).

"verl 0.9 (re-enacted)" runs verl's DataProto save/load path (consolidate + torch.save inside
pickle.dump; unrestricted pickle.load) on a stand-in class, so it runs without verl. When verl
0.9.1's environment exists (`make verl-env`, or STEPSKIP_VERL_PYTHON) verl's own code is timed
too. "raw read" is reading the verl file's bytes. Ratios are against verl (re-enacted) from the
same run; these machines are noisy, so each timing is the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from stepskip import SkipManager
from stepskip._storage import EntryStore, LocalBackend
from stepskip._formats import get_format
from stepskip.testing import make_rollout_batch

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"small": (256, 512, 1024), "medium": (1024, 1024, 2048), "large": (2048, 1024, 4096)}


def _install_verl_stand_in() -> type:
    """A class named verl.protocol.DataProto with verl 0.9.1's own __getstate__/__setstate__ logic."""
    if "verl.protocol" in sys.modules:
        return sys.modules["verl.protocol"].DataProto
    protocol = types.ModuleType("verl.protocol")
    package = types.ModuleType("verl")
    package.protocol = protocol

    class DataProto:
        def __init__(self, batch=None, non_tensor_batch=None, meta_info=None):
            self.batch, self.non_tensor_batch, self.meta_info = batch, non_tensor_batch, meta_info

        def __getstate__(self):
            batch = self.batch.contiguous().consolidate() if len(self.batch.keys()) else self.batch
            buffer = io.BytesIO()
            torch.save(batch, buffer)
            return buffer.getvalue(), self.non_tensor_batch, self.meta_info

        def __setstate__(self, data):
            raw, self.non_tensor_batch, self.meta_info = data
            self.batch = torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")

    DataProto.__module__ = "verl.protocol"
    DataProto.__qualname__ = "DataProto"
    protocol.DataProto = DataProto
    sys.modules["verl"] = package
    sys.modules["verl.protocol"] = protocol
    return DataProto


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def warm(path: str) -> None:
    """Keep reads comparable: every format is read warm (from the page cache), as a raw read is."""
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass


def materialise(value) -> None:
    for t in value.batch.values():
        t.sum()  # touch every tensor


def measure_load_memory(kind: str, path: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--load-child", kind, path], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_child(kind: str, path: str) -> None:
    """In a fresh process: reset the peak RSS, load once, report peak extra bytes."""
    if kind == "verl":
        _install_verl_stand_in()
    store = EntryStore(LocalBackend())
    fmt = get_format("safe")
    if kind == "verl":
        warm(path)
    else:
        for name in os.listdir(path):
            warm(f"{path}/{name}")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    if kind == "verl":
        with open(path, "rb") as fh:
            value = pickle.load(fh)
    else:
        probe = store.probe(path)
        value = fmt.decode(store.read_files(path, probe.meta, fmt.files, verify=True), consume=True)
    materialise(value)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "peak_extra": _status("VmHWM") - before}))


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def verl_own_code(path: str, repeat: int) -> dict | None:
    """Time verl 0.9.1's own load_from_disk/save_to_disk in its environment, if it exists."""
    python = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")
    if not os.path.exists(python):
        return None
    script = (
        "import json, os, sys, time\n"
        "from tensordict import TensorDict\n"
        "from verl.protocol import DataProto\n"
        "loaded = DataProto.load_from_disk(sys.argv[1])\n"
        "fresh = TensorDict({k: v.clone() for k, v in loaded.batch.items()}, batch_size=loaded.batch.batch_size)\n"
        "dp = DataProto(batch=fresh, non_tensor_batch=loaded.non_tensor_batch, meta_info=loaded.meta_info)\n"
        "out = sys.argv[1] + '.verl'; best_load = best_dump = 1e9\n"
        "for _ in range(int(sys.argv[2])):\n"
        "    t = time.perf_counter(); dp.save_to_disk(out); best_dump = min(best_dump, time.perf_counter() - t)\n"
        "    t = time.perf_counter(); back = DataProto.load_from_disk(out)\n"
        "    [v.sum() for v in back.batch.values()]; best_load = min(best_load, time.perf_counter() - t)\n"
        "size = os.path.getsize(out); os.remove(out)\n"
        "print(json.dumps({'load': best_load, 'dump': best_dump, 'bytes': size}))\n"
    )
    done = subprocess.run([python, "-c", script, path, str(repeat)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_size(name: str, rows: int, prompt: int, response: int, repeat: int, workdir: str) -> list[dict]:
    batch = make_rollout_batch(rows, prompt, response, n=8, seed=0)
    in_memory = sum(t.numel() * t.element_size() for t in batch.batch.values())
    store = EntryStore(LocalBackend())
    results = []

    # verl 0.9 (re-enacted): pickle.dump of a DataProto, synchronous
    stand_in = _install_verl_stand_in()
    dp = stand_in(batch.batch, batch.non_tensor_batch, batch.meta_info)
    verl_path = f"{workdir}/{name}-gen_batch.dp"

    def verl_dump():
        with open(verl_path, "wb") as fh:
            pickle.dump(dp, fh)

    def verl_load():
        with open(verl_path, "rb") as fh:
            value = pickle.load(fh)
        materialise(value)

    dump_s, _ = best(verl_dump, repeat)
    warm(verl_path)
    load_s, _ = best(verl_load, repeat)
    mem = measure_load_memory("verl", verl_path)
    verl = {"format": "verl 0.9 (re-enacted)", "bytes": os.path.getsize(verl_path), "critical": dump_s,
            "write": dump_s, "load": load_s, "peak": mem["peak_extra"]}
    results.append(verl)

    raw_s, _ = best(lambda: Path(verl_path).read_bytes(), repeat)
    results.append({"format": "raw read of the verl file", "bytes": verl["bytes"], "critical": None, "write": None,
                    "load": raw_s, "peak": None})

    own = verl_own_code(verl_path, repeat)
    if own and "error" not in own:
        results.append({"format": "verl 0.9.1 own code", "bytes": own["bytes"], "critical": own["dump"],
                        "write": own["dump"], "load": own["load"], "peak": None})

    for label, fmt_name, compress in (("stepskip safe (compact)", "safe", "auto"),
                                      ("stepskip safe (compress: none)", "safe", "none"),
                                      ("stepskip format: verl", "verl", None)):
        fmt = get_format(fmt_name, compress=compress)
        path = f"{workdir}/{name}-{fmt_name}-{compress}"
        critical_s, frozen = best(lambda: fmt.freeze(batch, copy=True), repeat)
        write_s, written = best(lambda: store.write_entry(path, fmt.encode(fmt.freeze(batch, copy=True)),
                                                          {"global_steps": 1, "format": fmt.name}), repeat)

        def load():
            probe = store.probe(path)
            value = fmt.decode(store.read_files(path, probe.meta, fmt.files, verify=True), consume=True)
            materialise(value)

        load_s, _ = best(load, repeat)
        disk = sum(os.path.getsize(f"{path}/{f}") for f in os.listdir(path))
        peak = measure_load_memory("safe", path)["peak_extra"] if fmt_name == "safe" else None
        results.append({"format": label, "bytes": disk, "critical": critical_s, "write": write_s, "load": load_s,
                        "peak": peak})
    for row in results:
        row.update(size=name, rows=rows, in_memory=in_memory)
    return results


def render(results: list[dict]) -> str:
    lines = []
    for size in dict.fromkeys(r["size"] for r in results):
        rows = [r for r in results if r["size"] == size]
        verl = rows[0]
        first = rows[0]
        lines.append(f"\n{size}: {first['rows']} rows, batch {first['in_memory'] / 1e6:.1f} MB in memory")
        lines.append(f"{'format':34s} {'disk MB':>8s} {'x verl':>7s} {'crit ms':>8s} {'x verl':>7s} "
                     f"{'write ms':>9s} {'x verl':>7s} {'load ms':>8s} {'x verl':>7s} {'peak x batch':>12s}")

        def ratio(value, base):
            return f"{value / base:7.3f}" if value is not None and base else f"{'-':>7s}"

        def ms(value):
            return f"{value * 1000:8.1f}" if value is not None else f"{'-':>8s}"

        for r in rows:
            peak = f"{r['peak'] / r['in_memory']:12.2f}" if r["peak"] is not None else f"{'-':>12s}"
            lines.append(f"{r['format']:34s} {r['bytes'] / 1e6:8.1f} {ratio(r['bytes'], verl['bytes'])} "
                         f"{ms(r['critical'])} {ratio(r['critical'], verl['critical'])} "
                         f"{ms(r['write'])}  {ratio(r['write'], verl['write'])} "
                         f"{ms(r['load'])} {ratio(r['load'], verl['load'])} {peak}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="small,medium,large")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--load-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_child:
        load_child(*args.load_child)
        return
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = []
    with tempfile.TemporaryDirectory(prefix="stepskip-bench-store-") as workdir:
        for name in args.sizes.split(","):
            results += bench_size(name, *SIZES[name], repeat=args.repeat, workdir=workdir)
    SkipManager.reset()
    print(render(results))
    print("\ncrit = time a miss blocks the trainer; write = snapshot + encode + atomic write; "
          "load = read + decode, every tensor materialised; peak = extra RSS of one load / batch size")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
