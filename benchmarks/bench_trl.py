"""TRL GRPO step time, generated versus replayed, on a tiny local model (the real ``trl`` package).

Run: .venv/bin/python benchmarks/bench_trl.py [--steps 8]
Records ``--steps`` steps (every step listed), then runs the same training again, replayed from the
cache, both in this one process. Prints the median step time of each (TRL's ``step_time``:
generation, rewards, log-probs and the update) and their ratio, and the share of a generated step
the replay saved. Step 1 is left out of both medians (warm-up). Needs ``pip install "stepskip[trl]"``.
The model, tokenizer and data are those of the TRL tests (tests/integration/trl/trl_run.py).
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


def step_times(result: dict) -> list[float]:
    return [log["step_time"] for log in result["log_history"] if "step_time" in log]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--completion-length", type=int, default=24)
    parser.add_argument("--completions", type=int, default=8, help="completions per step and process")
    options = parser.parse_args()
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
