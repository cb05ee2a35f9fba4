"""Decorator overhead: nanoseconds added per call when nothing is skipped.

Run: .venv/bin/python benchmarks/bench_overhead.py
Prints ns per call for a bare method and for the decorated method in each pass-through case,
and the added cost (decorated minus bare), all measured in this one run (best of several
timeit repeats, so noise from other processes inflates nothing but the worst repeats).
"""

from __future__ import annotations

import tempfile
import timeit

from stepskip import SkipManager

NUMBER = 200_000
REPEAT = 15


class Loop:
    def bare(self, prompts):
        return prompts

    @SkipManager.annotate(role="rollout")
    def decorated(self, prompts):
        return prompts

    @SkipManager.annotate(role="unconfigured_role")
    def unconfigured(self, prompts):
        return prompts


def ns_per_call(fn) -> float:
    return min(timeit.repeat(fn, number=NUMBER, repeat=REPEAT)) / NUMBER * 1e9


def main() -> None:
    loop, prompts = Loop(), object()
    bare = ns_per_call(lambda: loop.bare(prompts))
    rows: list[tuple[str, float]] = []
    SkipManager.reset()
    rows.append(("before SkipManager.init", ns_per_call(lambda: loop.decorated(prompts))))
    dump = tempfile.mkdtemp(prefix="stepskip-bench-")
    SkipManager.init({"skip": {"rollout": {"enable": False, "steps": [1], "dump_dir": dump}}})
    rows.append(("role disabled (enable: false)", ns_per_call(lambda: loop.decorated(prompts))))
    rows.append(("role not configured", ns_per_call(lambda: loop.unconfigured(prompts))))
    cases = {
        "steps: [1]": [1],
        "steps: 1..1000 (1000 ints)": list(range(1, 1001)),
        "steps: 1..100000 (ints)": list(range(1, 100_001)),
        'steps: ["1-1000"]': ["1-1000"],
        'steps: ["1-1000000:7"] + 1000 ints': ["1-1000000:7", *range(2_000_000, 2_001_000)],
    }
    for label, steps in cases.items():
        SkipManager.init({"skip": {"rollout": {"enable": True, "steps": steps, "dump_dir": dump}}})
        SkipManager.set_step(10**9)  # never eligible: the call passes through
        rows.append((f"step not eligible, {label}", ns_per_call(lambda: loop.decorated(prompts))))
    SkipManager.reset()
    print(f"{'case':58s} {'ns/call':>8s} {'added ns':>9s}")
    print(f"{'undecorated method (baseline)':58s} {bare:8.0f} {'-':>9s}")
    for label, ns in rows:
        print(f"{label:58s} {ns:8.0f} {ns - bare:9.0f}")


if __name__ == "__main__":
    main()
