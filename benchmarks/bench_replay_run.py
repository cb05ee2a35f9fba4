"""What a replay-only run saves before its first trained step: verl's real trainer, recorded then replayed.

    python benchmarks/bench_replay_run.py [--steps N] [--trainer v0|v1|both] [--v1-mode MODE] [--json OUT]

Runs, in verl 0.9.1's environment (``make verl-env`` builds ``.venv-verl``; ``STEPSKIP_VERL_PYTHON``
names another interpreter), the scenario the engine tests run (``tests/integration/verl_real/
verl_side/engines.py``): verl's real trainer built from scratch (``RayPPOTrainer.init_workers()`` +
``fit()``, or ``PPOTrainerSync.init()`` + ``fit(manager)``) with stand-ins only for the GPU workers
and the inference server, once recording N steps (``action: cache``, the engine starts) and once
replaying them (``action: replay``, ``engines: auto``: no engine). For each run it reports the
engine parts built (rollout replicas, agent-loop workers), the weights pushed into the engine, the
start-up time (trainer built, engines included), the time to the first trained step (the first
``update_actor``) and the whole run. A last run replays the same steps under ``engines: start`` (the
engine is built, every step is served from the cache): it reports the weight syncs verl asked for
(each reached the engine before stepskip held those of replayed steps) against those that reached
it, on one before/after line.

On CPU the stand-in server starts at once: the record run's start-up holds verl's real engine
plumbing (the load balancer actor, the agent-loop workers, the checkpoint engine) but not a vLLM
start, which adds minutes on a GPU machine; the weight syncs it counts are the ones a real engine
would receive. The runs share one process (Ray starts once): a first recording (which also pays
the process's first-use costs), the replay, then a second recording into a fresh directory, which
the replay is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VERL_SIDE = ROOT / "tests" / "integration" / "verl_real" / "verl_side"


def verl_python() -> str:
    return os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")


def run_scenario(trainer: str, steps: int, work: Path, v1_mode: str = "sync") -> dict[str, Any]:
    """Record ``steps`` steps, replay them (without, then with the engine), in one verl-env process; the
    scenario's report."""
    dump = work / "dump"
    listed = list(range(1, steps + 1))
    mode = {"mode": v1_mode} if trainer == "v1" else {}
    runs = [
        {"name": "record", "steps": steps, "skip": {"enable": True, "dump_dir": str(dump), "steps": listed,
                                                    "action": "cache"}},
        {"name": "replay", "steps": steps, "skip": {"enable": True, "dump_dir": str(dump), "steps": listed,
                                                    "action": "replay"}},
        {"name": "record_again", "steps": steps, "skip": {"enable": True, "dump_dir": str(work / "dump2"),
                                                          "steps": listed, "action": "cache"}},
        {"name": "replay_engine_started", "steps": steps, "skip": {"enable": True, "dump_dir": str(dump),
                                                                   "steps": listed, "action": "replay",
                                                                   "engines": "start"}},
    ]
    runs = [{**run, **mode} for run in runs]
    work.mkdir(parents=True, exist_ok=True)
    spec = {"trainer": trainer, "runs": runs, "work": str(work), "report": str(work / "report.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(VERL_SIDE)]),
           "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([verl_python(), str(VERL_SIDE / "engines.py"), str(work / "spec.json")], cwd=work,
                          env=env, capture_output=True, text=True)
    report_path = work / "report.json"
    if not report_path.exists():
        raise RuntimeError(f"the {trainer} scenario wrote no report (exit {done.returncode}):\n{done.stderr[-4000:]}")
    report = json.loads(report_path.read_text())
    for run in report.get("runs", []):
        if "error" in run:
            raise RuntimeError(f"{trainer} {run['name']} failed: {run['error']['type']}: {run['error']['message']}")
    if "error" in report:
        raise RuntimeError(f"{trainer}: {report['error']['type']}: {report['error']['message']}")
    return report


def summary(run: dict[str, Any]) -> dict[str, Any]:
    engine, timings = run["engine"], run["timings"]
    return {
        "replicas_built": engine["replicas_constructed"],
        "agent_loop_workers": engine["workers_started"],
        "weight_syncs": len(engine["weight_syncs"]),
        "weight_syncs_asked": int(run.get("gate", {}).get("weight_sync_requests", 0)),
        "generations": engine["dispatches"],
        "start_up_s": timings["start_up_s"],
        "first_trained_step_s": timings["first_trained_step_s"],
        "run_s": timings["run_s"],
    }


def table(trainer: str, record: dict[str, Any], replay: dict[str, Any]) -> str:
    lines = [f"{trainer}: {'':24s} {'record':>10s} {'replay':>10s} {'replay/record':>14s}"]
    for key in ("replicas_built", "agent_loop_workers", "weight_syncs", "generations"):
        lines.append(f"    {key:26s} {record[key]:>10d} {replay[key]:>10d}")
    for key in ("start_up_s", "first_trained_step_s", "run_s"):
        ratio = replay[key] / record[key] if record[key] else float("nan")
        lines.append(f"    {key:26s} {record[key]:>10.2f} {replay[key]:>10.2f} {ratio:>14.2f}")
    return "\n".join(lines)


def syncs_line(trainer: str, steps: int, started: dict[str, Any]) -> str:
    """The weight syncs of a replay whose engine was started: what verl asked for (all of which reached the
    engine before replayed steps' syncs were held) and what reached it."""
    before, after = started["weight_syncs_asked"], started["weight_syncs"]
    return (f"{trainer}: engines: start, {steps} replayed steps, {started['replicas_built']} replicas built: "
            f"weight syncs {before} before -> {after} now ({after / steps:.2f} per replayed step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="training steps recorded and replayed (default 3)")
    parser.add_argument("--trainer", choices=["v0", "v1", "both"], default="both")
    parser.add_argument("--v1-mode", choices=["sync", "colocate_async"], default="sync",
                        help="the V1 trainer's trainer.v1.trainer_mode (default sync)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if not Path(verl_python()).exists():
        sys.exit(f"verl's environment is missing ({verl_python()}): run `make verl-env` or set STEPSKIP_VERL_PYTHON")
    results: dict[str, Any] = {"steps": args.steps}
    trainers = ["v0", "v1"] if args.trainer == "both" else [args.trainer]
    with tempfile.TemporaryDirectory(prefix="bench-replay-run-") as tmp:
        for trainer in trainers:
            report = run_scenario(trainer, args.steps, Path(tmp) / trainer, args.v1_mode)
            runs = {run["name"]: summary(run) for run in report["runs"]}
            results[trainer] = runs
            print(table(trainer, runs["record_again"], runs["replay"]))
            print(syncs_line(trainer, args.steps, runs["replay_engine_started"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
