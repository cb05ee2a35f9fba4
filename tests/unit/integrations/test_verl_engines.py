"""The verl engine gate without verl: its reading of verl's config, the objects standing where no engine was
built, the deferred weight sync, and the V1 refill / resume of a replayed step served from the cache.

verl is not installed in this environment: the patches are applied to small classes shaped like
verl 0.9.1's (same method names, same calls: ``_add_prompts_to_generate`` builds a batch with
``_next_train_batch`` and hands it to ``_submit_batch_to_rollout``, which calls
``self.agent_loop_manager.generate_sequences``). verl's real classes go through the same patches in
``tests/integration/verl_real/test_engines.py``.
"""

from __future__ import annotations

import asyncio
import uuid
from types import ModuleType

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict
from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip._engines import decide
from stepskip.errors import EngineNotStartedError, ReplayMissError
from stepskip.integrations.verl import _engines
from stepskip._policies import Engines
from stepskip.tq import InProcessTQClient


@pytest.fixture(autouse=True)
def _fresh_gate():
    _engines.GATE.reset()
    yield
    _engines.GATE.reset()


def verl_config(**trainer) -> dict:
    return {"trainer": {"total_training_steps": 5, "resume_mode": "disable", "val_before_train": False,
                        "test_freq": -1, **trainer}}


# --------------------------------------------------------------------------- reading verl's config


def test_planned_steps_come_from_the_total_or_what_the_trainer_wrote_into_the_optimiser_config():
    assert _engines.planned_steps(verl_config()) == [1, 2, 3, 4, 5]
    computed = {"trainer": {"total_training_steps": None, "use_v1": True, "v1": {"trainer_mode": "sync",
                                                                                 "sync": {"parameter_sync_step": 2}}},
                "actor_rollout_ref": {"actor": {"optim": {"total_training_steps": 8}}}}
    assert _engines.planned_steps(computed) == [1, 2, 3, 4]  # V1 multiplied the total by parameter_sync_step
    assert _engines.planned_steps({"trainer": {}}) is None


def test_a_resumed_run_plans_from_the_step_after_its_checkpoint(tmp_path):
    config = verl_config(resume_mode="resume_path", resume_from_path=str(tmp_path / "global_step_3"))
    assert _engines.planned_steps(config) == [4, 5]
    assert _engines.resume_step(verl_config(resume_mode="resume_path", resume_from_path="elsewhere")) == 0


def test_validation_need_names_the_keys_and_how_to_turn_them_off():
    assert _engines.validation_need(verl_config()) is None
    need = _engines.validation_need(verl_config(val_before_train=True, test_freq=5))
    assert "trainer.val_before_train=True" in need and "trainer.test_freq=5" in need
    assert "trainer.val_before_train=False trainer.test_freq=-1" in need


def test_the_role_follows_the_trainer_verl_runs():
    assert _engines.role_of({"trainer": {"use_v1": True}}) == "rollout_tq"
    assert _engines.role_of({"trainer": {"use_v1": False}}) == "rollout"
    assert _engines.role_of({"trainer": {}, "async_training": {}}) == "async_rollout"


# --------------------------------------------------------------------------- no engine


PLAN = decide("rollout", Engines.AUTO, planned=[1, 2], generate=[])


def test_without_an_engine_every_use_of_it_is_refused_naming_the_step():
    SkipManager.set_step(2)
    worker = _engines.NoEngineWorker(PLAN)
    with pytest.raises(EngineNotStartedError, match=r"step 2 needs generation .*engines=start"):
        worker.generate_sequences.remote("batch")
    client = _engines.NoEngineServerManager({}, PLAN).get_client()
    with pytest.raises(EngineNotStartedError, match="step 2"):
        asyncio.run(client.generate("prompt"))


def test_without_an_engine_the_managers_do_nothing_whether_awaited_or_not():
    manager = _engines.NoEngineCheckpointManager(PLAN)
    assert manager.update_weights(3) == {} and manager.sleep_replicas() is None

    async def awaited():
        return await manager.update_weights(3), await manager.sleep_replicas()

    assert asyncio.run(awaited()) == ({}, None)
    servers = _engines.NoEngineServerManager({}, PLAN)
    assert servers.get_replicas() == [] and servers.get_addresses() == []


# --------------------------------------------------------------------------- the deferred weight sync


class CheckpointEngineManager:
    """Shaped like verl's: ``update_weights`` pushes the weights (wakes the replicas), ``sleep_replicas``."""

    def __init__(self, config=None, actor_wg=None, replicas=None):
        self.replicas = replicas
        self.pushed: list = []
        self.sleeps = 0

    def update_weights(self, global_steps=None):
        self.pushed.append(global_steps)
        return {}

    def sleep_replicas(self):
        self.sleeps += 1


def own(cls: type) -> dict:
    """The attributes ``cls`` defines, for a class of its own (patches change the class they are given)."""
    return {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}


def checkpoint_module() -> ModuleType:
    module = ModuleType("fake_checkpoint_engine")
    module.CheckpointEngineManager = type("CheckpointEngineManager", (), own(CheckpointEngineManager))
    _engines.patch_checkpoint_engine(module)
    _engines.patch_checkpoint_engine(module)  # a second patch changes nothing
    return module


def test_weight_syncs_wait_for_a_dispatch_and_asleep_replicas_are_not_put_to_sleep(tmp_path):
    cls = checkpoint_module().CheckpointEngineManager
    config = {**verl_config(total_training_steps=3, use_v1=False),
              "skip": {"rollout": {"enable": True, "dump_dir": str(tmp_path), "steps": [1, 2, 3]}}}
    assert _engines.GATE.plan_for(config).start  # nothing cached: the engine starts
    manager = cls(replicas=["replica"])
    manager.sleep_replicas()  # after building the engine
    for step in (0, 1, 2):
        manager.update_weights(step)  # deferred: no dispatch yet
        manager.sleep_replicas()  # the replicas never woke: nothing to do
    assert manager.pushed == [] and manager.sleeps == 1
    _engines.GATE.before_dispatch()  # a miss reaches the workers: the latest weights first
    assert manager.pushed == [2]
    manager.sleep_replicas()
    assert manager.sleeps == 2
    _engines.GATE.before_dispatch()
    assert manager.pushed == [2]  # nothing pending: no second push
    counts = _engines.engine_counts()
    assert (counts["weight_syncs"], counts["weight_syncs_deferred"], counts["sleeps_skipped"]) == (1, 3, 3)
    assert counts["weight_sync_requests"] == 3  # verl's three calls; the sync run at dispatch is not one


def test_in_the_async_modes_a_sync_waits_only_while_no_prompt_given_to_the_engine_is_unfinished(tmp_path,
                                                                                              monkeypatch):
    """V1's asynchronous modes keep requests on the engine across steps: a sync is deferred only while
    none of the prompts dispatched to it is pending or running in the queue (a stand-in for
    TransferQueue's ``kv_list``), and every manager's deferred sync (standalone and hybrid replicas)
    runs before the next dispatch."""
    statuses: dict[str, str] = {}
    queue = ModuleType("transfer_queue")
    queue.kv_list = lambda partition: {partition: {k: {"is_prompt": True, "status": v} for k, v in statuses.items()}
                                       } if partition == "train" else {}
    monkeypatch.setitem(__import__("sys").modules, "transfer_queue", queue)
    cls = checkpoint_module().CheckpointEngineManager
    config = {**verl_config(total_training_steps=3, use_v1=True, v1={"trainer_mode": "separate_async"}),
              "skip": {"rollout_tq": {"enable": True, "dump_dir": str(tmp_path), "steps": [1, 2, 3]}}}
    assert _engines.GATE.plan_for(config).start
    standalone, hybrid = cls(replicas=["standalone"]), cls(replicas=["hybrid"])
    standalone.update_weights(1)
    hybrid.update_weights(1)
    assert standalone.pushed == hybrid.pushed == []  # nothing given to the engine yet
    _engines.GATE.before_dispatch({"uid": ["u1", "u2"]})
    assert standalone.pushed == hybrid.pushed == [1]  # neither deferred sync is lost
    statuses.update(u1="finished", u2="running")
    standalone.update_weights(2)
    assert standalone.pushed == [1, 2]  # u2 still generates on the engine: it needs the new weights now
    statuses["u2"] = "finished"
    standalone.update_weights(3)
    assert standalone.pushed == [1, 2]  # all finished: deferred again
    _engines.GATE.before_dispatch(object())  # a batch whose prompts cannot be told apart
    assert standalone.pushed == [1, 2, 3]
    standalone.update_weights(4)
    assert standalone.pushed == [1, 2, 3, 4]  # the engine may be busy: synced as verl orders it


def test_without_skip_the_checkpoint_manager_behaves_as_verls(tmp_path):
    cls = checkpoint_module().CheckpointEngineManager
    _engines.GATE.plan_for(verl_config(use_v1=False))
    manager = cls(replicas=["replica"])
    manager.update_weights(0)
    manager.sleep_replicas()
    manager.sleep_replicas()
    assert manager.pushed == [0] and manager.sleeps == 2


def test_over_a_run_without_engine_the_checkpoint_manager_is_none_at_all(tmp_path):
    cls = checkpoint_module().CheckpointEngineManager
    servers = _engines.NoEngineServerManager({}, PLAN)
    _engines.GATE._plan = PLAN
    manager = cls(config=None, actor_wg=None, replicas=servers.get_replicas())
    assert isinstance(manager, _engines.NoEngineCheckpointManager)
    assert isinstance(cls(replicas=[]), cls)  # an empty list of verl's own is not the marker


# --------------------------------------------------------------------------- V1: prompts added to a replayed step


class PPOTrainer:
    """Shaped like verl's V1 trainer where the patches apply (see the module docstring)."""

    def __init__(self, tq, prompts):
        self.tq, self.queue, self.global_steps = tq, list(prompts), 0
        self.config = {"skip": {"rollout_tq": {"enable": True}}}
        self.agent_loop_manager = self
        self.generated: list[list[int]] = []

    def generate_sequences(self, batch):  # the agent-loop manager: reaching it is generating
        self.generated.append(batch["prompt_id"].tolist())

    def _next_train_batch(self, num_prompts):
        ids, self.queue = self.queue[:num_prompts], self.queue[num_prompts:]
        return batch_of(ids)

    def _submit_batch_to_rollout(self, batch):
        self.tq.kv_batch_put(keys=list(batch["uid"]), partition_id="train",
                             tags=[{"is_prompt": True, "status": "pending"} for _ in range(len(batch))])
        self.agent_loop_manager.generate_sequences(batch)
        return len(batch)

    def _add_prompts_to_generate(self, num_prompts):
        return self._submit_batch_to_rollout(self._next_train_batch(num_prompts))

    def _reissue_inflight_prompts(self, partition_id="train"):
        batch = self.inflight
        self.agent_loop_manager.generate_sequences(batch)
        return len(batch)

    def _add_async_warmup_batches(self, num_warmup_batches):
        if self.config["skip"]["rollout_tq"]["enable"]:
            return
        self._add_prompts_to_generate(num_warmup_batches)


def batch_of(prompt_ids):
    batch = TensorDict({"prompt_id": torch.tensor(prompt_ids)}, batch_size=[len(prompt_ids)])
    batch.set("uid", NonTensorStack(*(NonTensorData(data=uuid.uuid4().hex, batch_size=[]) for _ in prompt_ids),
                                    batch_size=[len(prompt_ids)]))
    return batch


@pytest.fixture
def replayed_step(tmp_path):
    """Steps 1-2 recorded (prompts 0-2 and 3-5), then step 1 replayed by a new run; the patched trainer."""
    config = {"trainer": {"experiment_name": "exp", "project_name": "proj"},
              "data": {"train_batch_size": 3, "max_prompt_length": 8, "max_response_length": 6},
              "actor_rollout_ref": {"rollout": {"n": 2}},
              "skip": {"rollout_tq": {"enable": True, "dump_dir": str(tmp_path), "steps": [1, 2, 3],
                                      "action": "cache", "async_dump": False}}}
    V1Trainer(config, InProcessTQClient(), prompts_per_step=3, n=2).fit(2)
    tq = InProcessTQClient()
    replay = V1Trainer(config, tq, prompts_per_step=3, n=2)
    SkipManager.init(config, tq_client=tq)
    replay.global_steps = 0
    replay.step()  # step 1: its submit phase is served from the cache
    assert replay.agent_loop.calls == 0
    module = ModuleType("fake_trainer_base")
    module.PPOTrainer = type("PPOTrainer", (), own(PPOTrainer))
    _engines.patch_v1_trainer(module)
    trainer = module.PPOTrainer(tq, prompts=[3, 4, 99])
    trainer.global_steps = 1
    return trainer, tq


def test_a_refill_of_a_replayed_step_is_served_from_the_cache_and_generates_nothing(replayed_step):
    trainer, tq = replayed_step
    submitted = trainer._add_prompts_to_generate(2)  # prompts 3 and 4: recorded (at step 2)
    assert submitted == 2 and trainer.generated == []
    listing = tq.kv_list("train")["train"]
    finished = [k for k, t in listing.items() if t.get("is_prompt") and t.get("status") == "finished"]
    assert len(finished) == 2 and sum(1 for k in listing if k.rsplit("_", 2)[0] in finished) == 2 + 2 * 2
    assert _engines.engine_counts()["refill_prompts_from_cache"] == 2


def test_a_refill_the_cache_cannot_serve_is_an_error_not_a_generation(replayed_step):
    trainer, _ = replayed_step
    trainer.queue = [99]
    with pytest.raises(ReplayMissError, match=r"step 1 is replayed from the cache.*1 more prompts"):
        trainer._add_prompts_to_generate(1)
    assert trainer.generated == [] and _engines.engine_counts()["refill_prompts_refused"] == 1


def test_a_refill_on_a_step_that_was_not_replayed_generates_as_verl_does(replayed_step):
    trainer, _ = replayed_step
    trainer.global_steps = 3  # not recorded: its submit phase generated
    trainer._add_prompts_to_generate(2)
    assert trainer.generated == [[3, 4]]


def test_resumed_in_flight_prompts_of_a_replayed_step_are_served_or_dropped_never_generated(replayed_step):
    trainer, tq = replayed_step
    trainer.inflight = batch_of([5, 99])
    uids = list(trainer.inflight["uid"])
    tq.kv_batch_put(keys=uids, partition_id="train", tags=[{"is_prompt": True, "status": "pending"}] * 2)
    assert trainer._reissue_inflight_prompts() == 1
    assert trainer.generated == []
    listing = tq.kv_list("train")["train"]
    assert listing[uids[0]]["status"] == "finished" and uids[1] not in listing  # 99: dropped from the queue
    counts = _engines.engine_counts()
    assert (counts["reissued_prompts_from_cache"], counts["reissued_prompts_dropped"]) == (1, 1)


def test_warm_up_runs_when_the_first_step_is_not_a_skipped_one(replayed_step):
    trainer, _ = replayed_step
    _engines.GATE._plan = decide("rollout_tq", Engines.AUTO, planned=[1, 2, 3, 4], generate=[4])
    trainer._add_async_warmup_batches(2)
    assert trainer.generated == []  # step 1 is skipped: verl's own check keeps warm-up off
    trainer.global_steps = 4  # a step outside skip.rollout_tq.steps
    trainer.queue = [7, 8]
    trainer._add_async_warmup_batches(2)
    assert trainer.generated == [[7, 8]]
