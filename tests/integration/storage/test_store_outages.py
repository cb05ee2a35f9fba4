"""A store that does not answer is not a damaged cache: real S3 (moto) behind a fault-injecting proxy.

The proxy (tests/support/faultproxy.py) sits on real sockets between s3fs and the moto server and
drops connections, leaves requests unanswered past the client's read timeout, or answers 503, as the
test switches it. Nothing of the client is mocked; waits between replay's tries go through the
reader's ``sleep``, which the tests replace by a function that records them (and may end the outage),
so no test waits on a clock.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import torch
from faultproxy import FaultProxy, fault_proxy

from stepskip import Batch, SkipManager
from stepskip.errors import StoreUnavailableError

pytestmark = pytest.mark.heavy

ROWS = 4
#: What a read of an entry asks: the outage is put on these only, so a write over the entry would pass.
READS = ("GET", "HEAD")


def options(endpoint: str, read_timeout: float = 60.0) -> dict[str, Any]:
    """One attempt per request (botocore retries nothing: replay's own retries are what is tested)."""
    return {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True,
            "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 1},
                              "read_timeout": read_timeout, "connect_timeout": 5}}


class Loop:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        self.calls += 1
        return Batch.from_dict(tensors={"responses": torch.randn(ROWS, 16)},
                               non_tensors={"uid": prompts.non_tensor_batch["uid"]})


def prompts() -> Batch:
    return Batch.from_dict(non_tensors={"uid": [str(i) for i in range(ROWS)]})


def init(dump_dir: str, storage_options: dict[str, Any], action: str) -> None:
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1, 2], "dump_dir": dump_dir, "action": action,
                                           "async_dump": False, "storage_options": storage_options}}})


def call(loop: Loop, step: int) -> Batch:
    SkipManager.set_step(step)
    return loop.generate_sequences(prompts())


def record(dump_dir: str, endpoint: str) -> Batch:
    """Step 1 recorded through the proxy while it passes everything."""
    init(dump_dir, options(endpoint), "cache")
    out = call(Loop(), 1)
    SkipManager.flush()
    SkipManager.reset()
    return out


def objects(s3_server: str, dump_dir: str) -> dict[str, bytes]:
    """Every object under the dump dir with its bytes, read straight from the server (not through the proxy)."""
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    root = dump_dir.removeprefix("s3://")
    return {key: fs.cat_file(key) for key in fs.find(root)}


@pytest.fixture
def proxy(s3_server: str) -> Any:
    with fault_proxy(s3_server) as running:
        yield running


@pytest.fixture
def dump_dir(s3_server: str) -> str:
    import s3fs

    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}/dump"


def entry_reads(proxy: FaultProxy, mode: str) -> int:
    return sum(n for key, n in proxy.counts(mode=mode).items() if "/1/" in key)


@pytest.mark.parametrize("mode", ["503", "drop", "hang"])
def test_cache_generates_but_never_writes_over_an_entry_behind_an_outage(mode, s3_server, proxy, dump_dir, caplog,
                                                                          monkeypatch):
    record(dump_dir, proxy.endpoint)
    if mode == "hang":  # one s3fs attempt a request: its own retries of a timeout only add waits
        import s3fs

        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    before = objects(s3_server, dump_dir)
    assert any(key.endswith("/1/meta.json") for key in before)
    # a short read timeout only where the proxy holds requests unanswered (s3fs retries a timeout itself)
    init(dump_dir, options(proxy.endpoint, read_timeout=0.5 if mode == "hang" else 60.0), "cache")
    loop = Loop()
    proxy.fault(mode, lambda method, target: method in READS)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out = call(loop, 1)
        SkipManager.flush()
    proxy.fault("pass")
    assert loop.calls == 1 and out.batch["responses"].shape == (ROWS, 16)  # the step ran: a miss
    stats = SkipManager.stats()
    assert (stats["skip/rollout/unavailable"], stats["skip/rollout/misses"]) == (1, 1)
    assert (stats["skip/rollout/hits"], stats["skip/rollout/corrupt"], stats["skip/rollout/dumps"]) == (0, 0, 0)
    assert entry_reads(proxy, mode) >= 1  # the outage was met
    assert objects(s3_server, dump_dir) == before  # not one byte written over the entry
    assert "not dumped" in caplog.text and "unavailable" in caplog.text


@pytest.mark.parametrize(("mode", "named"), [("503", "ServiceUnavailable"), ("drop", "EndpointConnectionError")])
def test_replay_retries_then_raises_naming_the_store_error(mode, named, s3_server, proxy, dump_dir):
    record(dump_dir, proxy.endpoint)
    before = objects(s3_server, dump_dir)
    init(dump_dir, options(proxy.endpoint), "replay")
    waits: list[float] = []
    SkipManager.skip_instances["rollout"].reader.sleep = waits.append
    loop = Loop()
    proxy.fault(mode)
    with pytest.raises(StoreUnavailableError) as raised:
        call(loop, 1)
    proxy.fault("pass")
    message = str(raised.value)
    assert named in message and "4 tries" in message and "/1" in message
    assert waits == [0.2, 0.4, 0.8]  # bounded backoff: three waits, four tries
    # each try asked the store again (a reset connection may be retried once by the HTTP client itself)
    assert proxy.counts(mode=mode)[next(k for k in proxy.counts() if k.endswith("/1/meta.json"))] in (4, 8)
    assert loop.calls == 0 and SkipManager.stats()["skip/rollout/unavailable"] == 1
    assert objects(s3_server, dump_dir) == before


def test_replay_rides_out_an_outage_that_ends_within_its_retries(s3_server, proxy, dump_dir):
    recorded = record(dump_dir, proxy.endpoint)
    init(dump_dir, options(proxy.endpoint), "replay")
    waits: list[float] = []

    def wait(seconds: float) -> None:  # the store is back during the second wait
        waits.append(seconds)
        if len(waits) == 2:
            proxy.fault("pass")

    SkipManager.skip_instances["rollout"].reader.sleep = wait
    loop = Loop()
    proxy.fault("503")
    out = call(loop, 1)
    assert waits == [0.2, 0.4] and loop.calls == 0
    assert torch.equal(out.batch["responses"], recorded.batch["responses"])
    stats = SkipManager.stats()
    assert (stats["skip/rollout/hits"], stats["skip/rollout/unavailable"]) == (1, 0)


def test_verify_reports_an_unavailable_entry_and_repair_keeps_it(s3_server, proxy, dump_dir):
    from stepskip.cache import IssueKind, open_cache, repair, verify

    record(dump_dir, proxy.endpoint)
    before = objects(s3_server, dump_dir)
    opts = options(proxy.endpoint)
    proxy.fault("503", lambda method, target: method in READS and "/1/meta.json" in target)
    report = verify(dump_dir, storage_options=opts, grace=0)
    kinds = {p.kind for p in report.problems}
    assert kinds == {IssueKind.UNAVAILABLE}, report.problems
    result = repair(open_cache(dump_dir, opts), report)
    proxy.fault("pass")
    assert result.removed == [] and [p.kind for p in result.kept] == [IssueKind.UNAVAILABLE]
    assert objects(s3_server, dump_dir) == before
    assert verify(dump_dir, storage_options=opts, grace=0).clean
