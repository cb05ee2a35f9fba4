"""How few bytes any exact encoding of the user-path benchmark's V1 step can take, against verl's.

Run: .venv/bin/python benchmarks/bench_v1_floor.py [--results RUN.json] [--mode full|quick|smoke]

The rows are the ones ``bench_user_path.py`` puts in the queue (``make_inputs``, at both sizes):
independent draws of token ids, uniform over the ids below the largest one drawn, and of log-probs
``-5 * torch.rand()``. ``torch.rand`` draws float32 multiples of 2**-24, so a log-prob takes one of
2**24 equally likely inputs to ``-5 * r``; the Shannon entropy of what that product rounds to is
computed here over all 2**24 of them (some neighbours round to one float32, so it is a little under
24 bits). No lossless encoding stores independent draws in fewer bits than their entropy. The bound
printed counts the response tokens' log-probs and ids only (masks and prompts are left out, so it
is a lower bound), next to the target's share of the bytes verl's own code wrote in a full run of
the user-path benchmark (its JSON output; the newest in ``benchmarks/results/`` by default) and to
what stepskip wrote in that run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_user_path import SIZES, TARGETS, make_inputs  # noqa: E402

GRID = 1 << 24  # torch.rand's float32 values: k / 2**24 for k in [0, 2**24)


def newest_results() -> str:
    # by name: the runs are named by date and letter (a fresh clone's file times say nothing)
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                          "bench_user_path-*.json")))
    if not paths:
        raise SystemExit("no benchmarks/results/bench_user_path-*.json: run bench_user_path.py with --json first")
    return paths[-1]


def log_prob_bits() -> float:
    """The entropy in bits of ``-5 * torch.rand()`` in float32, its 2**24 inputs equally likely."""
    draws = torch.arange(GRID, dtype=torch.float64).mul(1 / GRID).float()
    _, counts = np.unique((-draws * 5).numpy().view(np.uint32), return_counts=True)
    return float(np.log2(GRID) - (counts * np.log2(counts)).sum() / GRID)


def recorded_bytes(path: str) -> dict[str, tuple[int, int]]:
    """Size label -> (verl's V1 bytes, stepskip's), from a user-path run's JSON output."""
    with open(path) as fh:
        runs = json.load(fh)["runs"]
    return {run["size"]: (run["v1"]["verl"]["bytes"], run["v1"]["stepskip"]["bytes"])
            for run in runs if "bytes" in (run.get("v1") or {}).get("verl", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", help="a bench_user_path.py --json output (default: the newest)")
    parser.add_argument("--mode", choices=sorted(SIZES), default="full", help="the sizes bench_user_path.py ran")
    args = parser.parse_args()
    path = args.results or newest_results()
    measured = recorded_bytes(path)
    bits = log_prob_bits()
    print(f"V1 bytes: the lossless floor against {TARGETS['bytes']}x of verl's bytes "
          f"(verl's and stepskip's from {os.path.relpath(path)})")
    print(f"{'size':24s} {'tokens':>10s} {'distinct lp':>12s} {'log-probs MB':>13s} {'+ ids MB':>9s}"
          f" {'target MB':>14s} {'floor / verl':>13s} {'stepskip / verl':>16s}")
    for rows, prompt, response in SIZES[args.mode]:
        label = f"{rows} x ({prompt} + {response})"
        if label not in measured:
            print(f"{label:24s} not in that run")
            continue
        verl, ours = measured[label]
        v1 = make_inputs(rows, prompt, response)["v1"]["tensors"]
        log_probs = np.concatenate(v1["rollout_log_probs"])
        tokens = log_probs.size
        distinct = np.unique(log_probs.view(np.uint32)).size
        vocab_bits = math.log2(int(np.concatenate(v1["responses"]).max()) + 1)
        lp_bytes = tokens * bits / 8
        floor = lp_bytes + tokens * vocab_bits / 8
        print(f"{label:24s} {tokens:10d} {distinct:12d} {lp_bytes / 1e6:13.2f} {floor / 1e6:9.2f}"
              f" {TARGETS['bytes'] * verl / 1e6:14.2f} {floor / verl:13.3f} {ours / verl:16.3f}")
    print(f"log-probs MB: {bits:.3f} bits per response token (the entropy of -5 * torch.rand() in float32); "
          "+ ids: log2(largest id + 1) bits each added; distinct lp: distinct log-prob bit patterns")


if __name__ == "__main__":
    main()
