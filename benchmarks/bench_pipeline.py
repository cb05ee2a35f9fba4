"""Step time with generation versus replayed, per reference pipeline (one run, ratios side by side).

Run: .venv/bin/python benchmarks/bench_pipeline.py [--steps 8] [--pipelines colocated v1 fully_async] [key=value ...]

Each pipeline trains twice on one temporary cache with every step listed in its skip role: the
first pass generates and records each step, the second replays each step. Printed per pipeline:
mean step seconds when generated and when replayed, their ratio (and the speed-up), the share of
a generated step spent obtaining the rollout, and the mean seconds a replayed step took to get
its rollout from the cache. Trailing key=value arguments are Hydra overrides for every pipeline
(e.g. data.max_response_length=128 makes rollout dominate more). Timings on a shared 2-core
machine are noisy: compare the ratios of one run, not absolute seconds across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time

from stepskip.pipelines.demo import _runner, _skip_overrides
from stepskip.pipelines.runtime import PIPELINES, load_config, quiet_torch_notices


def bench(pipeline: str, steps: int, overrides: list[str]) -> dict[str, float]:
    dump = tempfile.mkdtemp(prefix="stepskip-bench-")
    try:
        base = [f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
                *overrides]
        probe = load_config(pipeline, base)
        config = load_config(pipeline, [*base, *_skip_overrides(pipeline, list(range(1, steps + 1)), dump,
                                                                int(probe.data.train_batch_size))])
        run = _runner(pipeline)
        recorded, replayed = run(config), run(config)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
    # the first step of each pass carries one-off costs (allocator, thread pools): leave it out
    gen = [r for r in recorded.records[1:] if r.mode == "generated"]
    rep = [r for r in replayed.records[1:] if r.mode == "replayed"]
    gen_step = statistics.mean(r.step_s for r in gen)
    rep_step = statistics.mean(r.step_s for r in rep)
    return {
        "generated_step_s": gen_step,
        "replayed_step_s": rep_step,
        "ratio": rep_step / gen_step,
        "rollout_share": statistics.mean(r.rollout_s / r.step_s for r in gen),
        "replay_rollout_s": statistics.mean(r.rollout_s for r in rep),
        "losses_equal": float(recorded.losses == replayed.losses),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--pipelines", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    quiet_torch_notices()
    rows = []
    with contextlib.ExitStack() as stack:
        if "fully_async" in args.pipelines:
            from stepskip.pipelines.fully_async import ray_session

            stack.enter_context(ray_session(2))
        for pipeline in args.pipelines:
            start = time.perf_counter()
            rows.append((pipeline, bench(pipeline, args.steps, args.overrides), time.perf_counter() - start))
    print(f"{args.steps} steps per pass (step 1 of each pass left out); overrides: {args.overrides or 'none'}")
    print(f"{'pipeline':12s} {'generated s':>11s} {'replayed s':>10s} {'ratio':>6s} {'speed-up':>8s} "
          f"{'rollout share':>13s} {'replay load s':>13s} {'losses equal':>12s} {'wall s':>7s}")
    for pipeline, r, wall in rows:
        print(f"{pipeline:12s} {r['generated_step_s']:11.3f} {r['replayed_step_s']:10.3f} {r['ratio']:6.2f} "
              f"{1 / r['ratio']:7.1f}x {r['rollout_share']:12.0%} {r['replay_rollout_s']:13.4f} "
              f"{'yes' if r['losses_equal'] else 'NO':>12s} {wall:7.1f}")


if __name__ == "__main__":
    main()
