"""rollout_tq behind a store that does not answer: a step with an inner entry the store did not answer for
is a miss, is generated, and is never recorded over; under ``replay`` the read is retried, then fails naming
the store's error. The store is the in-memory backend with reads refused on demand
(tests/support/outage_backend.py): it stands in for an object store that does not answer; the real-socket
tests in tests/integration/storage cover the fsspec path."""

from __future__ import annotations

import logging

import pytest
from outage_backend import OutageBackend, outage_store, snapshot
from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip.errors import StoreUnavailableError
from stepskip.tq import InProcessTQClient


def make_config(dump_dir: str, action: str = "cache", sync: int = 1) -> dict:
    config = {
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "data": {"train_batch_size": 2},
        "skip": {"rollout_tq": {"enable": True, "steps": [1, 2], "action": action, "dump_dir": dump_dir,
                                "async_dump": False}},
    }
    if sync > 1:
        config["trainer"] = {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": sync}}}
    return config


@pytest.fixture
def dump_dir():
    with outage_store() as root:
        yield root


def record(dump_dir: str, sync: int = 1) -> None:
    V1Trainer(make_config(dump_dir, sync=sync), InProcessTQClient(), prompts_per_step=2, sync_steps=sync).fit(1)
    SkipManager.reset()


def step_one_down(path: str) -> bool:
    return "/1/" in path or path.endswith("/1")


@pytest.mark.parametrize("sync", [1, 2])
def test_cache_generates_a_step_behind_an_outage_and_never_records_over_it(dump_dir, sync, caplog):
    record(dump_dir, sync)
    before = snapshot(dump_dir)
    assert any(path.endswith("/1/0/meta.json") for path in before)
    # only the last inner entry does not answer: the step is still not recorded over
    OutageBackend.down = staticmethod(lambda path: path.endswith(f"/1/{sync - 1}"))
    trainer = V1Trainer(make_config(dump_dir, sync=sync), InProcessTQClient(), prompts_per_step=2, sync_steps=sync)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        trainer.fit(1)
    assert OutageBackend.refused  # the outage was met
    assert trainer.agent_loop.calls == 1  # the step ran: a miss
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/unavailable"] >= 1 and stats["skip/rollout_tq/misses"] == 1
    assert (stats["skip/rollout_tq/hits"], stats["skip/rollout_tq/corrupt"], stats["skip/rollout_tq/dumps"]) == (0, 0, 0)
    assert snapshot(dump_dir) == before  # not one byte written over the step
    assert "unavailable" in caplog.text and "not recorded" in caplog.text


def test_the_next_call_of_the_step_asks_the_store_again(dump_dir):
    record(dump_dir)
    OutageBackend.down = staticmethod(step_one_down)
    tq = InProcessTQClient()
    trainer = V1Trainer(make_config(dump_dir), tq, prompts_per_step=2)
    SkipManager.init(trainer.config, tq_client=tq)
    trainer.step()
    assert trainer.agent_loop.calls == 1
    OutageBackend.down = staticmethod(lambda path: False)  # the store is back: step 1 is served
    trainer.global_steps = 0
    trainer.step()
    assert trainer.agent_loop.calls == 1 and SkipManager.stats()["skip/rollout_tq/hits"] == 1


@pytest.mark.parametrize("sync", [1, 2])
def test_replay_retries_then_raises_naming_the_store_error(dump_dir, sync):
    record(dump_dir, sync)
    before = snapshot(dump_dir)
    OutageBackend.down = staticmethod(lambda path: path.endswith(f"/1/{sync - 1}"))
    tq = InProcessTQClient()
    trainer = V1Trainer(make_config(dump_dir, "replay", sync), tq, prompts_per_step=2, sync_steps=sync)
    SkipManager.init(trainer.config, tq_client=tq)
    waits: list[float] = []
    SkipManager.skip_instances["rollout_tq"].reader.sleep = waits.append
    with pytest.raises(StoreUnavailableError) as raised:
        trainer.step()
    message = str(raised.value)
    assert "Read timeout" in message and "4 tries" in message and f"/1/{sync - 1}" in message
    assert waits == [0.2, 0.4, 0.8]  # bounded backoff: three waits, four tries
    assert trainer.agent_loop.calls == 0 and SkipManager.stats()["skip/rollout_tq/unavailable"] >= 1
    assert snapshot(dump_dir) == before


def test_replay_rides_out_an_outage_that_ends_within_its_retries(dump_dir):
    record(dump_dir)
    OutageBackend.down = staticmethod(step_one_down)
    tq = InProcessTQClient()
    trainer = V1Trainer(make_config(dump_dir, "replay"), tq, prompts_per_step=2)
    SkipManager.init(trainer.config, tq_client=tq)
    waits: list[float] = []

    def wait(seconds: float) -> None:  # the store is back during the second wait
        waits.append(seconds)
        if len(waits) == 2:
            OutageBackend.down = staticmethod(lambda path: False)

    SkipManager.skip_instances["rollout_tq"].reader.sleep = wait
    trainer.step()
    assert waits == [0.2, 0.4] and trainer.agent_loop.calls == 0
    assert SkipManager.stats()["skip/rollout_tq/hits"] == 1
