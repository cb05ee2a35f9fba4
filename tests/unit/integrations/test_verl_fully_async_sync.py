"""The fully async trainer's weight sync into its Rollouter's engine, without verl.

verl is not installed in this environment: the patches are applied to small classes shaped like
verl 0.9.1's ``FullyAsyncRollouter`` (the state its staleness control keeps: ``global_steps``,
``pending_queue``, ``max_required_samples``, ``staleness_samples``, ``total_rollout_steps``;
``get_replicas``) and ``CheckpointEngineManager`` (``update_weights`` under verl's ``auto_await``:
awaited from the trainer's coroutines, run to completion from plain code). The Rollouter answers in
this process (no Ray actor); the agent-loop worker handle is a stand-in whose requests end when the
test says. verl's real Rollouter class goes through the same patches, as a Ray actor, in
``tests/integration/verl_real/test_fully_async.py``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import pickle
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch
from skip_configs import training_config

from stepskip import Batch, SkipManager
from stepskip._engines import decide
from stepskip._policies import Engines
from stepskip.integrations.verl import _engines, _fully_async

SAMPLES = 6  # the run's samples (feed indices); 1-4 are recorded


@pytest.fixture(autouse=True)
def _fresh_gate():
    _engines.GATE.reset()
    yield
    _engines.GATE.reset()


def auto_await(fn):
    """verl's ``auto_await``: a coroutine for a caller that awaits, run to completion for plain code."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        coro = fn(*args, **kwargs)
        if sys._getframe(1).f_code.co_flags & inspect.CO_COROUTINE:
            return coro
        return asyncio.run(coro)

    return wrapper


class CheckpointEngineManager:
    def __init__(self, config=None, actor_wg=None, replicas=None):
        self.replicas = replicas
        self.pushed: list = []

    @auto_await
    async def update_weights(self, global_steps=None):
        self.pushed.append(global_steps)
        return {}

    @auto_await
    async def sleep_replicas(self):
        return None


class FullyAsyncRollouter:
    def __init__(self, config, replicas):
        self.config = config
        self.replicas = replicas
        self.global_steps = 1
        self.pending_queue: asyncio.Queue = asyncio.Queue()
        self.max_required_samples = 2
        self.staleness_samples = 0
        self.total_rollout_steps = SAMPLES

    def get_replicas(self):
        return self.replicas


def patched(cls: type, patch, name: str) -> type:
    module = ModuleType(f"fake_{name}")
    own = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    setattr(module, cls.__name__, type(cls.__name__, (), own))
    patch(module)
    patch(module)  # a second patch changes nothing
    return getattr(module, cls.__name__)


def config_of(dump_dir, **trainer) -> dict:
    config = training_config(dump_dir, "async_rollout", gbs=1, n=1, steps=list(range(1, SAMPLES + 1)))
    config["trainer"].update({"total_training_steps": SAMPLES, "val_before_train": False, "test_freq": -1, **trainer})
    config["async_training"] = {"staleness_threshold": 1, "trigger_parameter_sync_step": 1}
    return config


def record(dump_dir, samples) -> None:
    """The Rollouter's decorated ``generate_sequences_single`` over ``samples`` (their feed indices)."""

    @SkipManager.annotate(role="async_rollout")
    async def generate_sequences_single(prompts):
        index = int(str(prompts.non_tensor_batch["uid"][0]).rsplit("_", 1)[1])
        return Batch.from_dict(tensors={"responses": torch.full((1, 6), index)}, non_tensors={"uid": ["x"]})

    SkipManager.init(config_of(dump_dir))
    for index in samples:
        uid = f"uid_sample_0_{index}"
        asyncio.run(generate_sequences_single(Batch.from_dict(tensors={"input_ids": torch.ones(1, 8)},
                                                              non_tensors={"uid": [uid]})))
    assert SkipManager.flush(timeout=60)
    SkipManager.reset()


class Request:
    """A dispatched request's ``ObjectRef``: ``future()`` as Ray's, done when the test finishes it."""

    def __init__(self) -> None:
        self.done: concurrent.futures.Future = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future:
        return self.done


@pytest.fixture
def gated(tmp_path):
    """A Rollouter whose samples 1-4 are recorded, over an engine that was started (5 and 6 are not);
    the trainer's checkpoint manager built over the replicas it got from the Rollouter."""
    record(tmp_path, range(1, 5))
    config = config_of(tmp_path)
    SkipManager.init(config)
    assert _engines.GATE.plan_for(config).start and _engines.GATE.fully_async
    rollouter = patched(FullyAsyncRollouter, _fully_async.patch_rollouter, "rollouter")(config, ["replica"])
    replicas = rollouter.get_replicas()
    assert isinstance(replicas, _fully_async.RollouterReplicas) and list(replicas) == ["replica"]
    manager = patched(CheckpointEngineManager, _engines.patch_checkpoint_engine, "checkpoint")(replicas=replicas)
    yield rollouter, manager
    SkipManager.reset()


def test_a_sync_is_skipped_while_every_sample_the_rollouter_can_take_before_the_next_is_cached(gated):
    """Samples 1-4 recorded: from feed index 1 with an unused budget of 2, the Rollouter may take 1-4
    before the next sync (2 left now, 2 after the reset that follows the sync): the sync is skipped.
    Once it has used a sample of its budget and fed up to 3, sample 5 (not recorded) is within reach:
    the trainer's weights are pushed, those of the version asked for (the skipped one is not owed)."""
    rollouter, manager = gated
    manager.update_weights(0)
    assert manager.pushed == []
    rollouter.global_steps, rollouter.staleness_samples = 3, 1
    manager.update_weights(1)
    assert manager.pushed == [1]
    rollouter.pending_queue.put_nowait("sample 3")  # still queued: the window starts at it
    rollouter.global_steps, rollouter.staleness_samples = 4, 2
    assert _fully_async.FeedWindow.of(rollouter) == _fully_async.FeedWindow(3, 4)
    manager.update_weights(2)
    assert manager.pushed == [1]
    counts = _engines.engine_counts()
    assert (counts["weight_sync_requests"], counts["weight_syncs"], counts["weight_syncs_deferred"]) == (3, 1, 2)


def test_the_trainers_coroutine_awaits_the_rollouters_answer(gated):
    rollouter, manager = gated

    async def trainer_step(version):
        return await manager.update_weights(global_steps=version)

    assert asyncio.run(trainer_step(0)) == {} and manager.pushed == []
    rollouter.total_rollout_steps = SAMPLES + 10
    rollouter.global_steps = 4
    assert asyncio.run(trainer_step(1)) == {} and manager.pushed == [1]


def test_a_request_on_the_engine_gets_the_weights_as_verl_orders_it(gated):
    """A miss dispatched to the agent-loop workers is in flight until its result arrives: a sync asked
    meanwhile is pushed; once it finished, syncs are skipped again. A dispatch after a skipped sync
    (which the window rules out) is counted."""
    rollouter, manager = gated
    request = Request()
    worker = _engines.SyncingWorker(SimpleNamespace(generate_sequences=SimpleNamespace(remote=lambda b: request)))
    assert worker.generate_sequences.remote({"uid": ["uid_sample_0_5"]}) is request
    manager.update_weights(0)
    assert manager.pushed == [0]
    request.done.set_result(None)
    manager.update_weights(1)
    assert manager.pushed == [0]
    worker.generate_sequences.remote({"uid": ["uid_sample_0_6"]})
    assert _engines.engine_counts()["dispatches_after_skipped_sync"] == 1


def test_with_validation_on_every_sync_is_pushed(tmp_path):
    """Validation generates on the same engine with the weights of its version: verl's order is kept."""
    record(tmp_path, range(1, 5))
    config = config_of(tmp_path, test_freq=2)
    SkipManager.init(config)
    _engines.GATE.plan_for(config)
    rollouter = patched(FullyAsyncRollouter, _fully_async.patch_rollouter, "rollouter")(config, ["replica"])
    manager = patched(CheckpointEngineManager, _engines.patch_checkpoint_engine, "checkpoint")(
        replicas=rollouter.get_replicas())
    manager.update_weights(0)
    assert manager.pushed == [0]
    SkipManager.reset()


def test_replicas_not_from_a_rollouter_and_rollouters_that_cannot_answer_sync_as_verl_does(gated):
    _, manager = gated
    cls = type(manager)
    plain = cls(replicas=["hybrid"])  # verl's hybrid replicas: another list
    plain.update_weights(0)
    assert plain.pushed == [0]

    def refuse(*args):
        raise RuntimeError("the Rollouter is gone")

    broken = cls(replicas=_fully_async.RollouterReplicas(["replica"], SimpleNamespace(
        __ray_call__=SimpleNamespace(remote=refuse))))
    broken.update_weights(1)
    assert broken.pushed == [1]


def test_the_replica_lists_cross_to_the_trainers_process_with_what_they_carry():
    """Ray pickles what ``get_replicas`` returns into the trainer's process: the Rollouter's way back
    survives, and a run without engine builds no checkpoint engine there either (that process has no
    plan of its own)."""
    replicas = pickle.loads(pickle.dumps(_fully_async.RollouterReplicas(["r0", "r1"], "actor handle")))
    assert isinstance(replicas, _fully_async.RollouterReplicas)
    assert list(replicas) == ["r0", "r1"] and replicas.rollouter == "actor handle"
    plan = decide("async_rollout", Engines.AUTO, planned=[1], generate=[])
    none = _engines.NoEngineServerManager({}, plan).get_replicas()
    rollouter = patched(FullyAsyncRollouter, _fully_async.patch_rollouter, "rollouter")({}, none)
    crossed = pickle.loads(pickle.dumps(rollouter.get_replicas()))
    assert _engines.GATE.plan is None
    cls = patched(CheckpointEngineManager, _engines.patch_checkpoint_engine, "checkpoint")
    assert isinstance(cls(config=None, actor_wg=None, replicas=crossed), _engines.NoEngineCheckpointManager)
