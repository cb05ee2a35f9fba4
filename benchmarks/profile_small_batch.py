"""Where a small batch's hit and miss spend their fixed cost, through the decorator.

Run:  .venv/bin/python benchmarks/profile_small_batch.py [--sizes tiny,small] [--calls 200]
          [--parts steady,phases,components,first,strace] [--no-strace]

For each size (tiny 32 x (128 + 256), small 256 x (512 + 1024), the inputs of
benchmarks/bench_user_path.py), in this process:

- the wall time of a steady-state hit and miss (median of --calls; a miss's dump flushed between
  calls, untimed), and of the same calls under cProfile: the stepskip functions (and the library
  calls they make) that take the most time per call, cumulative, in microseconds;
- the background dump of a miss, profiled on the caller's thread (``async_dump: false``);
- each phase of a hit timed in place (``phases``), as the benchmark calls it (the last result held,
  every tensor touched): the probe, the read, the prompt check, the decode and its tensors;
- each part of a hit timed alone (``components``): the directory walk, the probe, meta.json's
  parse and check, the read, the checksums, the prompt digest, the decode;

and in fresh processes:

- a process's first hit and first miss after ``SkipManager.init``, their time against the
  second call's, the collector's pauses and the minor page faults (fresh memory) of each, and
  what the first call and ``init`` spend (cProfile);
- system calls per call (``strace -c``; ``--no-strace`` leaves it out): a process making --calls
  calls minus one making none, divided by --calls; the caller's thread alone and all threads
  (``-f``: the background dump and its syncs included), and for the first calls, one call against
  none after the same ``init``; and the system calls of one steady-state hit, in order.

stepskip's fresh processes import compiled bytecode (see ``bench_user_path.bytecode_env``).

cProfile slows Python code down several fold: its figures rank the parts, the unprofiled wall times
are the costs. This is a measurement aid for the profile in benchmarks/results/, not a benchmark
with targets (see bench_user_path.py for those).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_user_path import Loop, bytecode_env, config, make_inputs, to_batch, touch  # noqa: E402

from stepskip import SkipManager  # noqa: E402

SIZES = {"tiny": (32, 128, 256), "small": (256, 512, 1024)}
#: Steady-state calls made before any is timed or profiled.
WARM_CALLS = 10
#: System calls worth naming in the report (the rest are summed as "other").
NAMED_SYSCALLS = ("openat", "close", "newfstatat", "fstat", "statx", "read", "pread64", "write", "pwrite64",
                  "getdents64", "mmap", "munmap", "madvise", "futex", "fsync", "fdatasync", "syncfs", "renameat2",
                  "rename", "mkdirat", "mkdir", "unlinkat", "fcntl", "lseek", "ioctl", "getrandom", "clone3",
                  "brk", "mprotect")


def _inputs(size: str) -> dict[str, Any]:
    rows, prompt, response = SIZES[size]
    return make_inputs(rows, prompt, response)


def _loop(inputs: dict[str, Any]) -> tuple[Loop, Any]:
    loop = Loop()
    loop.result = to_batch(inputs["result"])
    return loop, to_batch(inputs["prompts"])


def _recorded(size: str, where: str) -> tuple[Loop, Any]:
    """``SkipManager.init`` on ``where`` with step 100 of ``size`` recorded (its dump flushed): the
    decorated loop and its prompts, whose next call at step 100 is a hit."""
    inputs = _inputs(size)
    loop, prompts = _loop(inputs)
    SkipManager.init(config(where, inputs["shape"], "rollout"))
    SkipManager.set_step(100)
    loop.generate_sequences(prompts)
    SkipManager.flush()
    return loop, prompts


def _top(profile: cProfile.Profile, calls: int, limit: int = 28) -> list[str]:
    """The functions with the most cumulative time per call: stepskip's, and what they call outside it."""
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = file.split("/site-packages/")[-1].split("/src/")[-1]
        if "benchmarks/" in file or name in ("<module>",) or where.startswith("cProfile"):
            continue
        rows.append((cumtime / calls * 1e6, tottime / calls * 1e6, ncalls / calls, f"{where}:{line}({name})"))
    rows.sort(reverse=True)
    out = [f"    {'cum us/call':>11s} {'own us/call':>11s} {'calls/call':>10s}  function"]
    out += [f"    {cum:11.1f} {own:11.1f} {n:10.2f}  {fn}" for cum, own, n, fn in rows[:limit]]
    return out


def _median_us(times: list[float]) -> float:
    return statistics.median(times) * 1e6


# ---------------------------------------------------------------------------------------------- in process


def steady(size: str, calls: int, workdir: str) -> list[str]:
    lines = [f"\n== {size} {SIZES[size]}: steady state, {calls} calls each"]
    loop, prompts = _recorded(size, f"{workdir}/steady-{size}")
    for _ in range(WARM_CALLS):
        touch(loop.generate_sequences(prompts))

    def hit() -> None:
        SkipManager.set_step(100)
        touch(loop.generate_sequences(prompts))

    times = []
    for _ in range(calls):
        start = time.perf_counter()
        hit()
        times.append(time.perf_counter() - start)
    touched = []
    value = loop.generate_sequences(prompts)
    for _ in range(calls):
        start = time.perf_counter()
        touch(value)
        touched.append(time.perf_counter() - start)
    lines.append(f"  hit: {_median_us(times):.0f} us median (best {min(times) * 1e6:.0f}); of which touching the "
                 f"tensors (sum of each) {_median_us(touched):.0f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        hit()
    profile.disable()
    lines.append("  hit under cProfile:")
    lines += _top(profile, calls)

    step = iter(range(1000, 10**6))
    blocked = []
    for _ in range(WARM_CALLS):
        SkipManager.set_step(next(step))
        loop.generate_sequences(prompts)
        SkipManager.flush()
    for _ in range(calls):
        SkipManager.set_step(next(step))
        start = time.perf_counter()
        loop.generate_sequences(prompts)
        blocked.append(time.perf_counter() - start)
        SkipManager.flush()
    lines.append(f"  miss (blocks the caller): {_median_us(blocked):.0f} us median (best {min(blocked) * 1e6:.0f})")
    profile = cProfile.Profile()
    for _ in range(calls):
        SkipManager.set_step(next(step))
        profile.enable()
        loop.generate_sequences(prompts)
        profile.disable()
        SkipManager.flush()
    lines.append("  miss under cProfile (the caller's thread):")
    lines += _top(profile, calls)
    SkipManager.reset()

    SkipManager.init(config(f"{workdir}/sync-{size}", _inputs(size)["shape"], "rollout", async_dump=False))
    for _ in range(WARM_CALLS):
        SkipManager.set_step(next(step))
        loop.generate_sequences(prompts)
    written = []
    for _ in range(calls):
        SkipManager.set_step(next(step))
        start = time.perf_counter()
        loop.generate_sequences(prompts)
        written.append(time.perf_counter() - start)
    lines.append(f"  miss with its dump on the caller's thread (async_dump: false): {_median_us(written):.0f} us "
                 f"median (best {min(written) * 1e6:.0f})")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        SkipManager.set_step(next(step))
        loop.generate_sequences(prompts)
    profile.disable()
    lines.append("  that miss under cProfile:")
    lines += _top(profile, calls)
    SkipManager.reset()
    return lines


#: The phases of a hit timed in place by :func:`phases`: (label, owner, attribute); the inner ones are
#: part of the outer ones above them.
PHASES = (
    ("the call through the decorator", None, None),
    ("  meet_precondition: the probe (meta.json read and checked)", "stepskip.roles.cached:CachedRole",
     "meet_precondition"),
    ("  read_once: read, check and decode", "stepskip._reading.reader:EntryReader", "read_once"),
    ("    read_entry: the data files read, checksums, fidelity", "stepskip._storage.entries:EntryStore", "read_entry"),
    ("      the prompt check (check_fidelity)", "stepskip._reading.reader:EntryReader", "check_fidelity"),
    ("    decode (format safe)", "stepskip._formats.safe:SafeFormat", "decode"),
    ("      the tensors (tensordict: narrowed parts widened, input_ids joined)", "stepskip._formats.safe:_Decoder",
     "tensordict"),
    ("the caller touching every tensor (not stepskip's)", None, None),
)


def phases(size: str, calls: int, workdir: str) -> list[str]:
    """Each phase of a steady-state hit timed in place, in the benchmark's pattern (the last hit's batch
    alive while the next loads, every tensor touched): wall times of the real calls, wrapped, medians and
    bests in microseconds. Unlike ``components`` (each part alone, repeated on warm caches), these are
    the parts as the hit pays for them, after the last hit's copies passed through the caches."""
    import importlib

    loop, prompts = _recorded(size, f"{workdir}/phases-{size}")
    times: dict[str, list[float]] = {label: [] for label, _, _ in PHASES}
    restore = []
    for label, where, name in PHASES:
        if where is None:
            continue
        module, _, cls = where.partition(":")
        owner = getattr(importlib.import_module(module), cls)
        original = getattr(owner, name)

        def timed_phase(*args: Any, _original: Any = original, _out: list[float] = times[label], **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                _out.append(time.perf_counter() - start)

        setattr(owner, name, timed_phase)
        restore.append((owner, name, original))
    try:
        held: list[Any] = [None]
        for i in range(WARM_CALLS + calls):
            if i == WARM_CALLS:
                for values in times.values():
                    values.clear()
            SkipManager.set_step(100)
            start = time.perf_counter()
            out = loop.generate_sequences(prompts)
            middle = time.perf_counter()
            touch(out)
            times[PHASES[-1][0]].append(time.perf_counter() - middle)
            times[PHASES[0][0]].append(middle - start)
            held[0] = out
    finally:
        for owner, name, original in restore:
            setattr(owner, name, original)
        SkipManager.reset()
    lines = [f"\n== {size} {SIZES[size]}: a steady-state hit's phases in place, {calls} calls (us, median / best)"]
    for label, _, _ in PHASES:
        values = times[label]
        lines.append(f"  {_median_us(values):8.0f} / {min(values) * 1e6:6.0f}  {label}"
                     + ("" if len(values) == calls else f"  ({len(values) / calls:g} a call)"))
    return lines


def components(size: str, calls: int, workdir: str) -> list[str]:
    """Each fixed cost of a steady-state hit timed alone (median of ``calls``, in microseconds), by the
    role's and the store's own functions on the entry a hit reads (some of them the role's private
    ones: this follows the code as it is, and may need adjusting when it changes)."""
    from stepskip._storage.meta import check_meta, checksum
    from stepskip._formats import get_format
    from stepskip.roles.cached import HIT_KEEP_BYTES

    loop, prompts = _recorded(size, f"{workdir}/components-{size}")
    skip = SkipManager.skip_instances["rollout"]
    store, path = skip.store, skip.step_dump_dir(100)
    legacy = skip.legacy.files
    raw_meta = (Path(path) / "meta.json").read_bytes()
    meta, files = store.read_entry(path, legacy)
    data = {name: bytes(b) for name, b in files.items()}
    fmt = get_format(meta["format"])

    def each(fn: Any) -> float:
        for _ in range(WARM_CALLS):
            fn()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return _median_us(times)

    def hit() -> None:
        SkipManager.set_step(100)
        loop.generate_sequences(prompts)

    probe = store.probe(path, legacy, HIT_KEEP_BYTES)
    rows = [
        ("the whole hit through the decorator (no tensor touched)", each(hit)),
        ("open the entry directory (dir_version: openat + openat2 + fstat + close)",
         each(lambda: store.dir_version(path))),
        (f"probe of the entry as a hit takes it (keep {HIT_KEEP_BYTES >> 10} KiB; files kept: "
         f"{probe.files is not None})", each(lambda: store.probe(path, legacy, HIT_KEEP_BYTES))),
        (f"  parse meta.json ({len(raw_meta)} bytes, json.loads)", each(lambda: json.loads(raw_meta))),
        ("  check meta.json's values (check_meta)", each(lambda: check_meta(json.loads(raw_meta)))),
        ("read_entry after that probe (as the hit does)", each(lambda: store.read_entry(
            path, legacy, probe=store.probe(path, legacy, HIT_KEEP_BYTES)))),
        ("read_entry, no probe, checksums verified", each(lambda: store.read_entry(path, legacy, verify=True))),
        ("read_entry, no probe, checksums not verified", each(lambda: store.read_entry(path, legacy, verify=False))),
        (f"  checksums alone (xxh3_64 of {sum(len(b) for b in data.values())} bytes in {len(data)} files)",
         each(lambda: [checksum(b) for b in data.values()])),
        ("prompt digest of the live prompts (prompt_digest)", each(lambda: skip_digest(prompts, skip))),
        (f"decode the files (format {meta['format']})", each(lambda: fmt.decode(dict(data)))),
        ("restore_rng + rebind identity columns", each(lambda: (skip.restore_rng(meta, 100, path),
                                                                skip.reader.rebind(fmt.decode(dict(data)), prompts)))),
        ("  (the decode in the line above, again)", each(lambda: fmt.decode(dict(data)))),
    ]
    SkipManager.reset()
    lines = [f"\n== {size} {SIZES[size]}: a steady-state hit's parts, each alone (median of {calls}, us)"]
    lines += [f"  {us:9.0f}  {label}" for label, us in rows]
    return lines


def skip_digest(prompts: Any, skip: Any) -> Any:
    from stepskip._fidelity import prompt_digest

    return prompt_digest(prompts, skip.rebind_keys)


def one_hit_trace(size: str, workdir: str) -> list[str]:
    """The system calls of one steady-state hit, in order (``strace -f``, between two marker stats)."""
    entry = f"{workdir}/first-{size}"
    log = f"{workdir}/trace-{size}.txt"
    _run_child("trace-hit", size, entry, 1, strace=["strace", "-f", "-o", log, "-e", "trace=!futex,rt_sigprocmask"])
    text = Path(log).read_text().splitlines()
    begin = next(i for i, line in enumerate(text) if "stepskip-trace-begin" in line)
    end = next(i for i, line in enumerate(text) if "stepskip-trace-end" in line)
    calls = [re.sub(r"^\d+\s+", "", line) for line in text[begin + 1:end]]
    return [f"\n== {size} {SIZES[size]}: the system calls of one steady-state hit ({len(calls)}, futex left out)"] + \
        [f"  {call[:150]}" for call in calls]


# ---------------------------------------------------------------------------------------------- fresh processes


def child(kind: str, size: str, workdir: str, calls: int, profiled: bool) -> None:
    """One fresh process: ``init``, then ``calls`` calls of ``kind`` (``hit``: on step 100 of
    ``workdir``; ``miss``: each a new step, flushed), timing each (``steady-hit``/``steady-miss``:
    after writing step 100 and warming up, for the system call counts of later calls)."""
    torch.set_num_threads(1)
    inputs = _inputs(size)
    loop, prompts = _loop(inputs)
    shape = inputs["shape"]
    del inputs
    profile = cProfile.Profile() if profiled else None
    if profile is not None:
        profile.enable()
    start = time.perf_counter()
    SkipManager.init(config(workdir, shape, "rollout"))
    init = time.perf_counter() - start
    if profile is not None:
        profile.disable()
        init_top = _top(profile, 1, limit=20)
    if kind.startswith("steady"):
        SkipManager.set_step(100)
        loop.generate_sequences(prompts)
        SkipManager.flush()
        for i in range(WARM_CALLS):
            SkipManager.set_step(100 if kind == "steady-hit" else 200 + i)
            loop.generate_sequences(prompts)
            SkipManager.flush()
    if kind == "trace-hit":
        SkipManager.set_step(100)
        for _ in range(WARM_CALLS):
            touch(loop.generate_sequences(prompts))
        os.path.exists("/stepskip-trace-begin")
        touch(loop.generate_sequences(prompts))
        os.path.exists("/stepskip-trace-end")
        print(json.dumps({}))
        return
    pauses: list[float] = []
    began: list[float] = []

    def collected(phase: str, info: dict[str, Any]) -> None:  # the collector's pauses during the calls
        if phase == "start":
            began.append(time.perf_counter())
        elif began:
            pauses.append(time.perf_counter() - began.pop())

    gc.callbacks.append(collected)
    profile = cProfile.Profile() if profiled else None
    times: list[float] = []
    faults: list[int] = []  # minor page faults: fresh memory touched for the first time
    gc_first = 0.0
    for i in range(calls):
        SkipManager.set_step(100 if kind.endswith("hit") else 1000 + i)
        if profile is not None and i == 0:
            profile.enable()
        faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        out = loop.generate_sequences(prompts)
        if kind.endswith("hit"):
            touch(out)
        times.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
        if i == 0:
            gc_first = sum(pauses)
        if profile is not None and i == 0:
            profile.disable()
        SkipManager.flush()
    report: dict[str, Any] = {"init": init, "times": times, "gc_first": gc_first, "faults": faults}
    if profile is not None:
        report["top"], report["init_top"] = _top(profile, 1, limit=30), init_top
    print(json.dumps(report))


def _run_child(kind: str, size: str, workdir: str, calls: int, profiled: bool = False,
               strace: list[str] | None = None) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", kind, size, workdir, str(calls), str(int(profiled))]
    done = subprocess.run((strace or []) + command, capture_output=True, text=True, timeout=900,
                          env=bytecode_env(str(Path(workdir).parent)))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def first_calls(size: str, workdir: str) -> list[str]:
    entry = f"{workdir}/first-{size}"
    hit = _run_child("hit", size, entry, 2)
    miss = _run_child("miss", size, f"{workdir}/first-miss-{size}", 2)
    lines = [f"\n== {size} {SIZES[size]}: a fresh process (init, then calls)",
             f"  init before a hit {hit['init'] * 1e3:.1f} ms; first hit {hit['times'][0] * 1e3:.2f} ms, second "
             f"{hit['times'][1] * 1e3:.2f} ms",
             f"  init before a miss {miss['init'] * 1e3:.1f} ms (empty dump dir); first miss "
             f"{miss['times'][0] * 1e3:.2f} ms, second {miss['times'][1] * 1e3:.2f} ms",
             f"  garbage collector pauses during the first hit {hit['gc_first'] * 1e3:.2f} ms, the first miss "
             f"{miss['gc_first'] * 1e3:.2f} ms",
             f"  minor page faults (fresh memory) of the first / second hit {hit['faults'][0]} / {hit['faults'][1]}, "
             f"of the first / second miss {miss['faults'][0]} / {miss['faults'][1]}"]
    for kind, where in (("hit", entry), ("miss", f"{workdir}/first-miss-profiled-{size}")):
        got = _run_child(kind, size, where, 1, profiled=True)
        lines.append(f"  first {kind} under cProfile ({got['times'][0] * 1e3:.1f} ms profiled):")
        lines += got["top"]
        lines.append(f"  the init before it under cProfile ({got['init'] * 1e3:.1f} ms profiled):")
        lines += got["init_top"]
    return lines


def _strace_counts(path: str) -> dict[str, int]:
    """Calls per system call from a ``strace -c`` summary (rows: % time, seconds, usecs/call, calls, [errors], name)."""
    counts: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        cells = line.split()
        if len(cells) in (5, 6) and re.fullmatch(r"\d+\.\d+", cells[0]) and cells[-1] != "total":
            counts[cells[-1]] = int(cells[3])
    return counts


def _counted(kind: str, size: str, workdir: str, calls: int, follow: bool, tmp: str) -> dict[str, float]:
    """System calls per call: ``calls`` calls against none, after the same set-up."""
    per: list[dict[str, int]] = []
    for n in (0, calls):
        where = f"{workdir}/strace-{kind}-{size}-{int(follow)}-{n}"
        if kind == "hit":
            shutil.copytree(f"{workdir}/first-{size}", where)
        log = f"{tmp}/strace-{kind}-{size}-{int(follow)}-{n}.txt"
        _run_child(kind, size, where, n, strace=["strace", "-c", "-o", log] + (["-f"] if follow else []))
        per.append(_strace_counts(log))
    none, some = per
    return {name: (some.get(name, 0) - none.get(name, 0)) / calls for name in set(none) | set(some)}


def syscalls(size: str, workdir: str, calls: int) -> list[str]:
    tmp = tempfile.mkdtemp(prefix="strace-", dir=workdir)
    columns = [("steady hit", "steady-hit", calls, False), ("steady miss", "steady-miss", calls, False),
               ("steady miss, all threads", "steady-miss", calls, True), ("first hit", "hit", 1, False),
               ("first miss", "miss", 1, False), ("first miss, all threads", "miss", 1, True)]
    table = {label: _counted(kind, size, workdir, n, follow, tmp) for label, kind, n, follow in columns}
    lines = [f"\n== {size} {SIZES[size]}: system calls per call (strace -c; the caller's thread unless 'all threads')",
             f"  {'syscall':12s} " + " ".join(f"{label:>26s}" for label, *_ in columns)]
    names = sorted({n for counts in table.values() for n in counts},
                   key=lambda n: -max(abs(c.get(n, 0)) for c in table.values()))
    for name in names:
        cells = [table[label].get(name, 0.0) for label, *_ in columns]
        if all(abs(c) < 0.05 for c in cells):
            continue
        lines.append(f"  {name:12s} " + " ".join(f"{c:26.1f}" for c in cells))
    totals = [sum(table[label].values()) for label, *_ in columns]
    lines.append(f"  {'total':12s} " + " ".join(f"{c:26.1f}" for c in totals))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small", help="comma list of: " + ", ".join(SIZES))
    parser.add_argument("--calls", type=int, default=200, help="calls per steady-state measure")
    parser.add_argument("--no-strace", action="store_true", help="leave the system call counts out")
    parser.add_argument("--parts", default="steady,phases,components,first,strace",
                        help="comma list of the parts to run: steady, phases, components, first, strace")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, size, workdir, calls, profiled = args.child
        child(kind, size, workdir, int(calls), bool(int(profiled)))
        return
    torch.set_num_threads(1)
    lines = [f"profile_small_batch: cpu cores {os.cpu_count()}, load average {os.getloadavg()[0]:.1f}, "
             "torch threads 1"]
    with tempfile.TemporaryDirectory(prefix="stepskip-profile-") as workdir:
        for size in args.sizes.split(","):
            parts = set(args.parts.split(","))
            lines += steady(size, args.calls, workdir) if "steady" in parts else []
            lines += phases(size, args.calls, workdir) if "phases" in parts else []
            lines += components(size, args.calls, workdir) if "components" in parts else []
            if parts & {"first", "strace"}:
                _run_child("steady-hit", size, f"{workdir}/first-{size}", 0)  # writes the entry they read
            lines += first_calls(size, workdir) if "first" in parts else []
            if "strace" in parts and not args.no_strace and shutil.which("strace"):
                lines += syscalls(size, workdir, max(10, args.calls // 10))
                lines += one_hit_trace(size, workdir)
            print("\n".join(lines), flush=True)
            lines = []


if __name__ == "__main__":
    main()
