"""Many nodes, one cache: a real multi-node Ray cluster on this machine and a real S3 server (moto).

Four Ray nodes (``ray.cluster_utils.Cluster``: a head and three nodes, one CPU each). On the first, an
actor records one step per round; on the second, one actor replays the step recorded the round before
while another replays the step being recorded right now (a step not there yet is a miss; a step seen
at all must be the whole step as recorded); on the third, an actor applies retention (keep the newest
steps, with the operations ``stepskip prune`` runs). Each actor reaches the store through a proxy of
its own (tests/support/faultproxy.py, passing everything) that counts its requests, so the requests one
round costs each of them are known, and printed: they stay flat as steps accumulate.

The order within a round is left to Ray and the operating system; what is asserted holds for every order.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from faultproxy import FaultProxy, fault_proxy

pytestmark = pytest.mark.heavy

ROUNDS = 8
KEEP = 3  # steps retention keeps: the one being recorded, the one being replayed, and one more
SUPPORT = Path(__file__).resolve().parents[2] / "support"
SRC = Path(__file__).resolve().parents[3] / "src"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    env = pytest.MonkeyPatch()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        env.setenv(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        env.undo()


@pytest.fixture(scope="module")
def cluster(s3_endpoint: str) -> Iterator[Any]:
    """A head and three nodes (one CPU each, a resource naming each), connected; the actors' processes
    import stepskip and the test helpers from this checkout (PYTHONPATH, inherited by every node)."""
    pytest.importorskip("ray")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already initialised in this process; this test starts its own")
    ray_tmp = tempfile.mkdtemp(prefix="ssray", dir="/tmp" if os.path.isdir("/tmp") else None)
    env = pytest.MonkeyPatch()
    env.setenv("RAY_AUTH_MODE", "disabled")
    env.setenv("RAY_TMPDIR", ray_tmp)
    env.delenv("RAY_ADDRESS", raising=False)
    env.setenv("PYTHONPATH", os.pathsep.join([str(SRC), str(SUPPORT), os.environ.get("PYTHONPATH", "")]))
    env.setenv("STEPSKIP_DUMP_PROCESS", "0")
    small = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}
    os.makedirs(os.path.join(ray_tmp, "ray"))  # where Ray keeps the running cluster's address
    nodes = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    try:
        for name in ("recording", "replaying", "retention"):
            nodes.add_node(**small, resources={name: 1})
        nodes.wait_for_nodes()
        ray.init(address=nodes.address, log_to_driver=False, logging_level="WARNING")
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()
        env.undo()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _about_step(target: str, step: str) -> bool:
    """Whether a request (path and query) is about one step's directory: the directory itself, a file in
    it, or a listing of it."""
    return re.search(rf"GBS0_N0_in0_out0/{step}(/|$|&)", unquote(target)) is not None


def test_nodes_record_replay_and_prune_one_cache(cluster, s3_endpoint):
    import ray
    import s3fs
    from cluster_cache import Pruner, Recorder, Replayer

    from stepskip.cache import verify

    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True).mkdir(bucket)
    dump_dir = f"s3://{bucket}/dump"
    run_dir = f"{dump_dir}/team_shared/GBS0_N0_in0_out0"

    def options(proxy: FaultProxy) -> dict[str, Any]:
        return {"client_kwargs": {"endpoint_url": proxy.endpoint}, "skip_instance_cache": True}

    with fault_proxy(s3_endpoint) as to_recorder, fault_proxy(s3_endpoint) as to_reader, \
            fault_proxy(s3_endpoint) as to_racer, fault_proxy(s3_endpoint) as to_pruner:
        on = {name: {"num_cpus": 0, "resources": {name: 0.25}} for name in ("recording", "replaying", "retention")}
        recorder = ray.remote(Recorder).options(**on["recording"]).remote(dump_dir, options(to_recorder), ROUNDS)
        reader = ray.remote(Replayer).options(**on["replaying"]).remote(dump_dir, options(to_reader), ROUNDS)
        racer = ray.remote(Replayer).options(**on["replaying"]).remote(dump_dir, options(to_racer), ROUNDS)
        pruner = ray.remote(Pruner).options(**on["retention"]).remote(run_dir, options(to_pruner), KEEP)
        nodes = ray.get([a.node.remote() for a in (recorder, reader, racer, pruner)])
        assert len(set(nodes)) == 3 and nodes[1] == nodes[2]  # recording, replaying, retention: a node each

        proxies = {"recorder": to_recorder, "reader": to_reader, "pruner": to_pruner}
        costs: list[dict[str, int]] = []
        pruned: list[str] = []
        for step in range(1, ROUNDS + 1):
            before = {name: proxy.total() for name, proxy in proxies.items()}
            work = [recorder.record.remote(step), racer.replay.remote([step]), pruner.prune.remote()]
            if step > 1:
                work.append(reader.replay.remote([step - 1]))
            stats, raced, removed, *read = ray.get(work)
            costs.append({name: proxy.total() - before[name] for name, proxy in proxies.items()})
            # retention's own cost, without the deletions of the steps it removed this round (how many it
            # removes in a round depends on whether the round's step was written before it looked)
            costs[-1]["pruner (looking)"] = len([r for r in to_pruner.requests[before["pruner"]:]
                                                 if not any(_about_step(r.target, name) for name in removed)])
            costs[-1]["steps removed"] = len(removed)
            pruned += removed
            # the step being written: not there yet, or there whole; never anything in between
            assert raced[step] in ("missing", "replayed"), (step, raced)
            if read:  # the step recorded the round before, while retention ran: replayed whole
                assert read[0] == {step - 1: "replayed"}, (step, read[0])
            assert stats["skip/rollout/dumps"] == step and stats["skip/rollout/dump_failures"] == 0
        final = Pruner(run_dir, options(to_pruner), KEEP).prune()  # the last round's step may have come after
        pruned += final
        kept = list(range(ROUNDS - KEEP + 1, ROUNDS + 1))
        final_read = ray.get(reader.replay.remote(kept))

    print("\nS3 requests per round (recorder writes step k; reader replays step k-1; pruner keeps the newest "
          f"{KEEP}):")
    for step, cost in enumerate(costs, 1):
        print(f"  step {step}: " + ", ".join(f"{name} {n}" for name, n in cost.items()))
    # flat: once the cache holds more steps than retention keeps, a round costs what the first such round did
    steady = costs[KEEP + 1:]
    for name in ("recorder", "reader", "pruner (looking)"):
        counts = [c[name] for c in steady]
        assert max(counts) <= min(counts) + 2, (name, counts)
    # nothing valid lost: exactly the steps retention does not keep are gone; those it keeps are whole
    assert sorted(int(p) for p in pruned) == list(range(1, ROUNDS - KEEP + 1))
    report = verify(run_dir, storage_options={"client_kwargs": {"endpoint_url": s3_endpoint},
                                              "skip_instance_cache": True}, grace=0)
    assert report.clean, report.problems
    assert final_read == {step: "replayed" for step in kept}
