"""verl 0.9.1's real ``FullyAsyncAgentLoopManager.generate_sequences_single`` gets hits from stepskip.

The record and replay runs go one after another in one process in verl's own environment
(``verl_side/fully_async.py``): verl's Hydra
config, ``RLHFDataset`` and a one-prompt dataloader, ``prepare_single_generation_data``, the
``uid_sample_{epoch}_{feed index}`` ids the Rollouter embeds, ``SkipManager.init`` as the Rollouter
runs it, verl's decorated ``generate_sequences_single`` and ``addition_process`` on each result.
Stand-ins, because they need GPUs or inference servers: the agent-loop worker handle; the
Rollouter's feeding loop (a Ray actor with a message queue) is reproduced in a few lines.

The record run dumps every feed index; the replay run generates nothing, gets a hit per sample,
and what it returns is verl's own ``DataProto`` with the recorded responses and rewards, which
``addition_process`` (reading ``meta_info["metrics"]``) accepts.
"""

from __future__ import annotations

import pytest
import torch
from verl_real_support import load_tensors, needs_verl_env, ok, role_stats, run_scenario

pytestmark = [pytest.mark.heavy, needs_verl_env]

SAMPLES = [1, 2, 3]


def section(dump_dir, fmt: str, action: str) -> dict:
    out = {"enable": True, "dump_dir": str(dump_dir), "steps": SAMPLES, "action": action, "format": fmt}
    if fmt == "verl":
        out["allow_pickle"] = True
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple:
    """A record run and its replay per format, one after another in one verl-env process (one import of
    verl: seconds a run). Returns the base directory (each run's outputs in ``<name>.pt`` there) and each
    run's report by name, with the process's log."""
    base = tmp_path_factory.mktemp("fully-async")
    specs = [{"name": f"{action}-{fmt}", "skip": section(base / f"dump-{fmt}", fmt, action),
              "outputs": str(base / f"{action}-{fmt}.pt")}
             for fmt in ("safe", "verl") for action in ("cache", "replay")]
    report = ok(run_scenario("fully_async", {"runs": specs}, base / "run"))
    return base, {entry["name"]: dict(entry, log=report["log"]) for entry in report["runs"]}


@pytest.mark.parametrize("fmt", ["safe", "verl"])
def test_fully_async_rollouter_replays_verl_dataprotos(runs, fmt):
    base, reports = runs
    recorded = ok(reports[f"cache-{fmt}"])
    assert recorded["impl"] == "stepskip" and recorded["generation_calls"] == 3
    stats = role_stats(recorded, "async_rollout")
    assert (stats["misses"], stats["dumps"], stats["hits"]) == (3, 3, 0)
    steps = sorted({int(f.split("/")[-2]) for f in recorded["dump_files"] if f.endswith("meta.json")})
    assert steps == SAMPLES  # keyed by the feed index parsed from uid_sample_0_<index>

    replayed = ok(reports[f"replay-{fmt}"])
    stats = role_stats(replayed, "async_rollout")
    assert replayed["generation_calls"] == 0
    assert (stats["hits"], stats["misses"], stats["dumps"]) == (3, 0, 0)
    assert replayed["is_verl_dataproto"] == [True, True, True], replayed["result_types"]
    assert replayed["processing_times"] == recorded["processing_times"]
    first, second = load_tensors(base / f"cache-{fmt}.pt"), load_tensors(base / f"replay-{fmt}.pt")
    assert len(first) == len(second) == 3
    for a, b in zip(first, second):
        assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["rm_scores"], b["rm_scores"])


def test_fully_async_trainer_syncs_no_weights_into_an_engine_while_its_rollouter_replays(tmp_path):
    """verl's real Rollouter class runs as a Ray actor (its ``__init__`` stood in: it would build
    datasets, resource pools and engines on GPUs; see ``verl_side/fully_async_sync.py``), its samples
    1-4 recorded; verl's real ``CheckpointEngineManager`` (naive backend, the actor worker group stood
    in) is built over the replicas it returns and awaited as the ``FullyAsyncTrainer`` awaits it. The
    first sync is skipped: the Rollouter can take only samples 1-4 before the next one. The second is
    pushed: sample 5, not recorded, is then within reach. (Validation keeping verl's order, and a
    request in flight, are tested on classes shaped like verl's in
    ``tests/unit/integrations/test_verl_fully_async_sync.py``.)"""
    report = ok(run_scenario("fully_async_sync", {}, tmp_path))
    assert report["impl"] == report["rollouter_skip_impl"] == "stepskip" and report["unpatched"] == []
    assert report["recorded_generations"] == 4 and report["replicas_type"] == "RollouterReplicas"
    assert report["way_back"] == "ActorHandle"  # the trainer asked the Rollouter's actor through Ray
    assert report["pushed_from_sample_1"] == [] and report["pushed"] == [1]
    assert (report["counts"]["weight_syncs_deferred"], report["counts"]["weight_syncs"]) == (1, 1)
