"""TRL GRPO step time, generated versus replayed, on a tiny local model (the real ``trl`` package).

Run: .venv/bin/python benchmarks/bench_trl.py [--steps 8] [--codec-only]
Records ``--steps`` steps (every step listed), then runs the same training again, replayed from the
cache, both in this one process. Prints the median step time of each (TRL's ``step_time``:
generation, rewards, log-probs and the update) and their ratio, and the share of a generated step
the replay saved. Step 1 is left out of both medians (warm-up). Needs ``pip install "stepskip[trl]"``.
The model, tokenizer and data are those of the TRL tests (tests/integration/trl/trl_run.py).

First it measures how ``format: safe`` stores a large generation result, 512 completions x 2048
token ids and their log-probs (``None`` holes included): packed into tensors (what it does) against
item by item as JSON (what it did before), encode (snapshot and files) and decode, median of 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration" / "trl"))

import trl_run  # noqa: E402


def ragged_codec(rows: int = 512, width: int = 2048, repeats: int = 5) -> None:
    """Print the safe format's encode / decode time of a TRL-sized result, packed and as JSON lists."""
    import random
    import time

    import stepskip._formats.values as values
    from stepskip._formats import get_format

    rng = random.Random(0)
    ids = [[rng.randrange(150_000) for _ in range(rng.randrange(width // 2, width + 1))] for _ in range(rows)]
    logprobs = [[None if rng.random() < 0.01 else -rng.random() * 5 for _ in row] for row in ids]
    codec = get_format("safe")
    packed_at = values.PACK_MIN_ITEMS
    print(f"format safe, one call's result: {rows} x <= {width} token ids and their log-probs "
          f"({sum(map(len, ids))} of each), median of {repeats}")
    for name, threshold in (("as JSON lists", 1 << 62), ("packed", packed_at)):
        values.PACK_MIN_ITEMS = threshold  # the threshold at which rows are packed: never, or as shipped
        try:
            encode, decode = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                files = codec.encode(codec.freeze((ids, logprobs), copy=True))
                encode.append(time.perf_counter() - start)
                start = time.perf_counter()
                back = codec.decode(dict(files))
                decode.append(time.perf_counter() - start)
            assert back == (ids, logprobs), "the result must come back exactly"
        finally:
            values.PACK_MIN_ITEMS = packed_at
        size = sum(map(len, files.values()))
        print(f"  {name:14s} encode {statistics.median(encode):6.3f} s   decode {statistics.median(decode):6.3f} s"
              f"   {size / 1e6:6.1f} MB")


def step_times(result: dict) -> list[float]:
    return [log["step_time"] for log in result["log_history"] if "step_time" in log]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--completion-length", type=int, default=24)
    parser.add_argument("--completions", type=int, default=8, help="completions per step and process")
    parser.add_argument("--codec-only", action="store_true", help="only the storage figures")
    options = parser.parse_args()
    ragged_codec()
    if options.codec_only:
        return
    work = Path(tempfile.mkdtemp(prefix="bench_trl_"))
    args = {"max_steps": options.steps, "max_completion_length": options.completion_length,
            "num_generations": options.completions, "per_device_train_batch_size": options.completions}
    skip = {"enable": True, "dump_dir": str(work / "cache"), "steps": f"1-{options.steps}"}
    results = {}
    for name in ("generated", "replayed"):
        spec = {"output_dir": str(work / f"{name}-out"), "skip": skip, "args": args,
                "hidden_size": options.hidden_size}
        (work / f"{name}.spec.json").write_text(json.dumps(spec))
        trl_run.main(str(work / f"{name}.spec.json"), str(work / f"{name}.json"))
        results[name] = json.loads((work / f"{name}.json").read_text())
    generated = statistics.median(step_times(results["generated"])[1:])
    replayed = statistics.median(step_times(results["replayed"])[1:])
    assert results["replayed"]["generated_steps"] == [], "the second run should replay every step"
    print(f"TRL GRPO, hidden {options.hidden_size}, {options.completions} completions x "
          f"{options.completion_length} tokens a step, 1 process, {options.steps} steps")
    print(f"  generated step: {generated * 1e3:8.1f} ms (median)")
    print(f"  replayed step:  {replayed * 1e3:8.1f} ms (median)")
    print(f"  replayed / generated: {replayed / generated:.2f}  ({1 - replayed / generated:.0%} of a step saved)")


if __name__ == "__main__":
    main()
