"""``repeat`` and ``random`` list the run directory to find a step to replay; a listing the store does not
answer (503, a dropped connection) is not an empty directory: the call is a miss, the function runs, its
result is written over nothing, and the outage is counted as ``unavailable``. Real S3 (moto) behind the
fault-injecting proxy (tests/support/faultproxy.py); nothing of the client is mocked.
"""

from __future__ import annotations

import logging
from urllib.parse import unquote

import pytest
from faultproxy import FaultProxy
from test_store_outages import Loop, call, dump_dir, init, objects, proxy  # noqa: F401  (fixtures)
from test_store_outages import options as proxied
from test_v1_outages import RUN as V1_RUN
from test_v1_outages import trainer

from stepskip import SkipManager

pytestmark = pytest.mark.heavy


def options(endpoint: str) -> dict:
    """Through the proxy, with s3fs's listing cache as it comes: the run directory is asked of the store at
    each call all the same."""
    return proxied(endpoint)


def run_dir_listings(run: str):
    """The listings of the run directory itself (``?list-type=2&prefix=dump/{run}/``), nothing below it."""
    def select(method: str, target: str) -> bool:
        query = unquote(target)
        return method == "GET" and "list-type=2" in query and f"prefix=dump/{run}/&" in query + "&"
    return select


def run_of(before: dict[str, bytes]) -> str:
    """The run directory (``{experiment}_{project}/GBS..``) of the one entry recorded, from its key."""
    key = next(k for k in before if k.endswith("/1/meta.json"))
    return key.split("/dump/", 1)[1].rsplit("/1/meta.json", 1)[0]


def met(proxy: FaultProxy, mode: str) -> int:
    return sum(proxy.counts(mode=mode).values())


@pytest.mark.parametrize(("action", "mode"), [("repeat", "503"), ("random", "503"), ("repeat", "drop")])
def test_a_run_directory_listing_the_store_does_not_answer_is_a_miss_written_over_nothing(
        action, mode, s3_server, proxy, dump_dir, caplog):
    init(dump_dir, options(proxy.endpoint), "cache")
    call(Loop(), 1)  # step 1 recorded: repeat and random would replay it at step 2
    SkipManager.flush()
    SkipManager.reset()
    before = objects(s3_server, dump_dir)
    init(dump_dir, options(proxy.endpoint), action)
    loop = Loop()
    proxy.fault(mode, run_dir_listings(run_of(before)))
    assert not SkipManager.skip_instances["rollout"].would_replay(2)  # not now; counted by the call alone
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out = call(loop, 2)
        SkipManager.flush()
    proxy.fault("pass")
    assert met(proxy, mode) >= 1  # the listing went unanswered
    assert loop.calls == 1 and out.batch["responses"].shape[0] == 4  # a miss: the function ran
    stats = SkipManager.stats()
    assert (stats["skip/rollout/unavailable"], stats["skip/rollout/misses"]) == (1, 1)
    assert (stats["skip/rollout/hits"], stats["skip/rollout/corrupt"], stats["skip/rollout/dumps"]) == (0, 0, 0)
    assert objects(s3_server, dump_dir) == before  # nothing written: not step 2, not over step 1
    assert "unavailable" in caplog.text and "listing" in caplog.text
    loop_after = Loop()
    call(loop_after, 2)  # the store answers again: step 2 is served from step 1, as the action says
    assert loop_after.calls == 0 and SkipManager.stats()["skip/rollout/hits"] == 1
    SkipManager.reset()


def test_a_v1_repeat_whose_run_directory_listing_goes_unanswered_is_a_miss_recorded_nowhere(
        s3_server, proxy, dump_dir, caplog):
    from test_v1_outages import record

    record(dump_dir, proxy.endpoint)  # step 1
    before = objects(s3_server, dump_dir)
    run = trainer(dump_dir, options(proxy.endpoint), "repeat", steps=(1, 2))
    run.global_steps = 1  # the next step is 2: repeat would replay step 1 there
    proxy.fault("503", run_dir_listings(V1_RUN))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        reads = run.step()
        SkipManager.flush()
    proxy.fault("pass")
    assert met(proxy, "503") >= 1
    assert run.agent_loop.calls == 1 and sum(len(data["responses"]) for _, data in reads) == 8
    stats = SkipManager.stats()
    assert (stats["skip/rollout_tq/unavailable"], stats["skip/rollout_tq/misses"]) == (1, 1)
    assert [stats[f"skip/rollout_tq/{name}"] for name in ("hits", "corrupt", "dumps")] == [0, 0, 0]
    assert objects(s3_server, dump_dir) == before
    assert "not recorded" in caplog.text
    SkipManager.reset()
