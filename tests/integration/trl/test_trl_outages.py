"""The real TRL ``GRPOTrainer`` on a cache in S3 (a moto server) whose store stops answering for one cached
step: that step is a miss that generates, the others replay, and the recorded entry survives byte for byte.
The run is a fresh process (``trl_run.py``) talking to the server through the fault-injecting proxy
(tests/support/faultproxy.py): real sockets, nothing of the client mocked."""

from __future__ import annotations

import os
import uuid

import pytest
from faultproxy import fault_proxy
from trl_support import run_trl, skip_section

pytestmark = pytest.mark.heavy

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_endpoint(monkeypatch):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def objects(fs, root: str) -> dict[str, bytes]:
    return {key: fs.cat_file(key) for key in fs.find(root)}


def test_an_outage_on_a_cached_step_is_a_miss_that_generates_and_the_entry_survives(recording, tmp_path,
                                                                                     s3_endpoint):
    import s3fs

    cache, recorded = recording
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}, skip_instance_cache=True)
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    fs.put(f"{cache}/", f"{bucket}/dump/", recursive=True)  # the session's recording, in S3
    before = objects(fs, f"{bucket}/dump")
    assert any("/trl_generate/1/c0-r0/meta.json" in key for key in before)
    with fault_proxy(s3_endpoint) as proxy:
        # botocore retries nothing: the one 503 of each read is what the run meets
        options = {"client_kwargs": {"endpoint_url": proxy.endpoint}, "skip_instance_cache": True,
                   "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1}}}
        proxy.fault("503", lambda method, target: method in ("GET", "HEAD") and "/trl_generate/1/" in target)
        result, _ = run_trl(tmp_path, {**skip_section(tmp_path / "unused"), "dump_dir": f"s3://{bucket}/dump",
                                       "storage_options": options},
                            args={"max_steps": 3}, env={k: os.environ[k] for k in CREDENTIALS}, name="outage")
        unanswered = sum(proxy.counts(mode="503").values())
    assert result["error"] is None
    assert unanswered >= 1  # the outage was met
    assert result["generated_steps"] == [1]  # step 1 generated; 2 and 3 replayed
    assert [c["hit"] for c in result["calls"]] == [False, True, True]
    stats = result["stats"]
    assert (stats["skip/trl_generate/unavailable"], stats["skip/trl_generate/hits"]) == (1, 2)
    assert (stats["skip/trl_generate/corrupt"], stats["skip/trl_generate/dumps"]) == (0, 0)
    assert objects(fs, f"{bucket}/dump") == before  # the recorded step 1 was not written over
