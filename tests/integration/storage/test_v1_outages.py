"""A V1 step whose manifest the store does not answer for is unavailable, never damaged: real S3 (moto)
behind the fault-injecting proxy (tests/support/faultproxy.py).

A ``rollout_tq`` step on an object store is published by its manifest, ``{step}/step.json``; a
reader looks at it first. When that read times out, is dropped or answered 503, nothing is known of
the step: under ``cache`` the step is generated and nothing is written over it; under ``replay`` the
read is retried with the bounded backoff, then the error names the store's; ``stepskip verify``,
``--repair``, ``ls`` and ``prune`` report it as unavailable and never remove it. The trainer is the
small V1 trainer of tests/support/v1_harness.py over the in-process queue (no inference servers can
run here); nothing of the S3 client is mocked, and replay's waits go through the reader's ``sleep``,
replaced by a function that records them (no test waits on a clock).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from test_store_outages import dump_dir, objects, options, proxy  # noqa: F401  (fixtures)
from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip.errors import StoreUnavailableError
from stepskip.tq import InProcessTQClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "cli"))  # the in-process CLI runner

pytestmark = pytest.mark.heavy

RUN = "default_experiment_name_default_project_name/GBS4_N2_in0_out0"
READS = ("GET", "HEAD")


def config(dump_dir: str, storage_options: dict[str, Any], action: str, steps: list[int]) -> dict[str, Any]:
    return {
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "data": {"train_batch_size": 4},
        "trainer": {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 2}}},
        "skip": {"rollout_tq": {"enable": True, "steps": steps, "action": action, "dump_dir": dump_dir,
                                "async_dump": False, "storage_options": storage_options}},
    }


def trainer(dump_dir: str, storage_options: dict[str, Any], action: str, steps: tuple[int, ...] = (1,)) -> V1Trainer:
    tq = InProcessTQClient()
    made = V1Trainer(config(dump_dir, storage_options, action, list(steps)), tq, prompts_per_step=4, sync_steps=2)
    SkipManager.init(made.config, tq_client=tq)
    return made


def record(dump_dir: str, endpoint: str) -> list[Any]:
    """Step 1 recorded through the proxy while it passes everything; what the trainer read of it."""
    recorder = trainer(dump_dir, options(endpoint), "cache")
    reads = recorder.step()
    SkipManager.flush()
    assert recorder.agent_loop.calls == 1 and SkipManager.stats()["skip/rollout_tq/dumps"] == 2
    SkipManager.reset()
    return reads


def manifest_reads(method: str, target: str) -> bool:
    return method in READS and target.split("?", 1)[0].endswith(f"/{RUN}/1/step.json")


def responses(reads: list[Any]) -> list[list[int]]:
    return sorted(r.tolist() for _, data in reads for r in data["responses"].unbind(0))


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_cache_generates_a_v1_step_whose_manifest_is_unanswered_and_never_writes_over_it(
        mode, s3_server, proxy, dump_dir, caplog):
    record(dump_dir, proxy.endpoint)
    before = objects(s3_server, dump_dir)
    assert any(key.endswith(f"{RUN}/1/step.json") for key in before)
    run = trainer(dump_dir, options(proxy.endpoint), "cache")
    proxy.fault(mode, manifest_reads)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        reads = run.step()
        SkipManager.flush()
    proxy.fault("pass")
    assert run.agent_loop.calls == 1 and len(responses(reads)) == 8  # a miss: the step was generated, and trained on
    stats = SkipManager.stats()
    assert (stats["skip/rollout_tq/unavailable"], stats["skip/rollout_tq/misses"]) == (1, 1)
    assert [stats[f"skip/rollout_tq/{name}"] for name in ("hits", "corrupt", "dumps")] == [0, 0, 0]
    assert sum(proxy.counts(mode=mode).values()) >= 1  # the outage was met, on the manifest
    assert objects(s3_server, dump_dir) == before  # not one object written over, beside or under the step
    assert "unavailable" in caplog.text and "not recorded" in caplog.text and "corrupt" not in caplog.text
    SkipManager.reset()


def test_replay_retries_a_v1_manifest_then_raises_naming_the_store_error(s3_server, proxy, dump_dir):
    record(dump_dir, proxy.endpoint)
    before = objects(s3_server, dump_dir)
    run = trainer(dump_dir, options(proxy.endpoint), "replay")
    waits: list[float] = []
    SkipManager.skip_instances["rollout_tq"].reader.sleep = waits.append
    proxy.fault("503", manifest_reads)
    with pytest.raises(StoreUnavailableError) as raised:
        run.step()
    proxy.fault("pass")
    message = str(raised.value)
    assert "ServiceUnavailable" in message and "4 tries" in message and "step.json" in message, message
    assert waits == [0.2, 0.4, 0.8]
    assert run.agent_loop.calls == 0 and SkipManager.stats()["skip/rollout_tq/unavailable"] == 1
    assert SkipManager.stats()["skip/rollout_tq/corrupt"] == 0
    assert objects(s3_server, dump_dir) == before
    SkipManager.reset()


def test_replay_rides_out_a_manifest_outage_that_ends_within_its_retries(s3_server, proxy, dump_dir):
    recorded = record(dump_dir, proxy.endpoint)
    run = trainer(dump_dir, options(proxy.endpoint), "replay")
    waits: list[float] = []

    def wait(seconds: float) -> None:  # the store is back during the second wait
        waits.append(seconds)
        if len(waits) == 2:
            proxy.fault("pass")

    SkipManager.skip_instances["rollout_tq"].reader.sleep = wait
    proxy.fault("503", manifest_reads)
    reads = run.step()
    assert waits == [0.2, 0.4] and run.agent_loop.calls == 0
    assert responses(reads) == responses(recorded)
    stats = SkipManager.stats()
    assert (stats["skip/rollout_tq/hits"], stats["skip/rollout_tq/unavailable"]) == (1, 0)
    SkipManager.reset()


def step_listings(method: str, target: str) -> bool:
    """The listings of step 1's directory (``?list-type=2&prefix=.../1/``), not of the run directory."""
    return method == "GET" and "list-type=2" in target and f"prefix=dump/{RUN}/1/" in unquote(target)


@pytest.mark.parametrize(("unanswered", "where"), [(manifest_reads, ["1", "step.json"]),
                                                   (step_listings, [RUN.rsplit("/", 1)[-1], "1"])],
                         ids=["manifest", "step-listing"])
def test_verify_repair_ls_and_prune_keep_a_v1_step_the_store_did_not_answer_for(unanswered, where, s3_server, proxy,
                                                                                 dump_dir):
    from cli_run import stepskip

    record(dump_dir, proxy.endpoint)
    before = objects(s3_server, dump_dir)
    opts = ["-o", json.dumps(options(proxy.endpoint))]
    proxy.fault("503", unanswered)
    verified = stepskip("verify", dump_dir, "--repair", "--grace", "0", "--json", *opts)
    problems = verified.json()["problems"]
    assert [(p["kind"], p["path"].rsplit("/", 2)[-2:]) for p in problems] == [("unavailable", where)], verified
    assert verified.json()["repaired"] == [] and "damaged" not in verified.out
    assert sum(proxy.counts(mode="503").values()) >= 1  # the outage was met
    listed = stepskip("ls", dump_dir, *opts)
    assert listed.code == 0 and "1 problem (unavailable)" in listed.out and "damaged" not in listed.out, listed
    pruned = stepskip("prune", f"{dump_dir}/{RUN}", "--steps", "1", "--json", *opts)
    assert pruned.json()["removed"] == [] and [p["kind"] for p in pruned.json()["protected"]] == ["unavailable"], pruned
    proxy.fault("pass")
    assert objects(s3_server, dump_dir) == before
    assert stepskip("verify", dump_dir, "--grace", "0", *opts).code == 0  # the store answers: the step is valid
