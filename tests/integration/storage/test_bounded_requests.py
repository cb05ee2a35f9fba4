"""What a run costs on a real S3-compatible server (moto, counting every HTTP request it serves) does not
grow with the number of entries: ``SkipManager.init``'s start-up clean-up lists the
run directory once and looks only at the entries that listing shows may hold a leftover.

Each count is taken at two cache sizes holding the same leftovers; the sizes stay below 1,000 objects,
one page of a listing, so the counts must be equal. No inference server runs: the rollouts are made up
(``generate_sequences`` returns its prompts' ids), and the V1 queue is the in-process stand-in
(``InProcessTQClient``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from v1_harness import V1Trainer

from stepskip import Batch, SkipManager
from stepskip._storage import STALE_SECONDS, EntryState, open_store
from stepskip._storage import objects as store_module
from stepskip._manifest import MANIFEST_FILE
from stepskip.tq import InProcessTQClient

LATER = 2 * STALE_SECONDS


class Rollout:
    calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        self.calls += 1
        return Batch.from_dict(tensors={"out": prompts.batch["ids"] * 10},
                               non_tensors={"uid": prompts.non_tensor_batch["uid"]})


def prompts(ids: list[int]) -> Batch:
    return Batch.from_dict(tensors={"ids": torch.tensor([[i, i] for i in ids])},
                           non_tensors={"uid": [f"u{i}" for i in ids]})


def rollout_config(dump_dir: str, options: dict[str, Any], action: str = "cache") -> dict[str, Any]:
    return {"data": {"train_batch_size": 2},
            "skip": {"rollout": {"enable": True, "steps": "all", "action": action, "dump_dir": dump_dir,
                                 "storage_options": options, "async_dump": False}}}


def rollout_cache(s3: Any, count: int) -> tuple[str, str, list[str]]:
    """A dump dir holding ``count`` rollout entries (steps 0, 2, 4 ...: copies of one recorded entry, each
    with its own step and prompts), one replaced entry and one holding a crashed writer's object:
    ``(dump dir, run directory, the leftovers)``."""
    dump_dir = f"s3://{s3.bucket()}/dump"
    SkipManager.init(rollout_config(dump_dir, s3.options, action="record"))
    rollout = Rollout()
    SkipManager.set_step(0)
    rollout.generate_sequences(prompts([0, 1]))
    SkipManager.set_step(1)  # replaced below: its first objects are retired
    rollout.generate_sequences(prompts([1, 2]))
    store = open_store(dump_dir, s3.options)
    role = SkipManager.skip_instances["rollout"]
    run = role.project_dump_dir
    old = [info["object"] for info in store.probe(f"{run}/1").meta["files"].values()]
    rollout.generate_sequences(prompts([1, 2]))
    SkipManager.reset()
    first = run.removeprefix("s3://") + "/0"
    objects = {key.rsplit("/", 1)[-1]: store.backend.fs.cat_file(key) for key in store.backend.fs.find(first)}
    meta = json.loads(objects.pop("meta.json"))
    copies: dict[str, bytes] = {}
    for step in range(1, count):
        target = f"{run.removeprefix('s3://')}/{2 * step}"
        copies.update({f"{target}/{name}": data for name, data in objects.items()})
        copies[f"{target}/meta.json"] = json.dumps(dict(meta, global_steps=2 * step)).encode()
    store.backend.fs.pipe(copies)
    orphan = f"{run}/0/data.deadbeef0000.json"
    store.backend.fs.pipe_file(store.backend.key(orphan), b"a crashed writer's object")
    return dump_dir, run, sorted([orphan, *(f"{run}/1/{o}" for o in old)])


def init_requests(s3: Any, config: dict[str, Any], **runtime: Any) -> int:
    before = len(s3.requests)
    SkipManager.init(config, **runtime)
    return len(s3.requests) - before


@pytest.mark.parametrize("leftovers_stale", [False, True])
def test_init_costs_the_same_requests_at_10_and_200_entries(counting_s3, monkeypatch, leftovers_stale):
    """One listing of the run directory; the two entries holding leftovers are probed once they are stale
    (and their leftovers deleted), the clean ones never; every entry stays readable."""
    counts = {}
    for count in (10, 200):
        dump_dir, run, leftovers = rollout_cache(counting_s3, count)
        if leftovers_stale:  # the run starts two hours after the cache was written
            monkeypatch.setattr(store_module, "_clock", lambda: store_module.time.time() + LATER)
        counts[count] = init_requests(counting_s3, rollout_config(dump_dir, counting_s3.options))
        store = open_store(dump_dir, counting_s3.options)
        assert all(store.backend.fs.exists(store.backend.key(p)) is not leftovers_stale for p in leftovers)
        for step in (0, 1, 2 * (count - 1)):
            assert store.probe(f"{run}/{step}").state is EntryState.PRESENT
        SkipManager.reset()
        monkeypatch.undo()
    assert counts[10] == counts[200], counts
    assert counts[10] <= (12 if leftovers_stale else 2), counts  # a listing (and two probes of 4 requests or so)


def v1_config(dump_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    return {"actor_rollout_ref": {"rollout": {"n": 2}},
            "skip": {"rollout_tq": {"enable": True, "steps": [1], "dump_dir": dump_dir, "storage_options": options,
                                    "async_dump": False}}}


def v1_cache(s3: Any, count: int) -> tuple[str, str]:
    """``count`` V1 steps (copies of one recorded step, its manifest and recording): ``(dump dir, run dir)``."""
    dump_dir = f"s3://{s3.bucket()}/dump"
    config = v1_config(dump_dir, s3.options)
    V1Trainer(config, InProcessTQClient()).fit(1)
    run = SkipManager.skip_instances["rollout_tq"].project_dump_dir
    SkipManager.reset()
    store = open_store(dump_dir, s3.options)
    first = run.removeprefix("s3://") + "/1"
    objects = {key[len(first) + 1:]: store.backend.fs.cat_file(key) for key in store.backend.fs.find(first)}
    assert MANIFEST_FILE in objects
    store.backend.fs.pipe({f"{run.removeprefix('s3://')}/{step}/{rel}": data
                   for step in range(2, count + 1) for rel, data in objects.items()})
    return dump_dir, run


def test_v1_init_reads_no_manifest_of_a_clean_step_at_10_and_100_steps(counting_s3):
    counts = {}
    for count in (10, 100):
        dump_dir, _ = v1_cache(counting_s3, count)
        counts[count] = init_requests(counting_s3, v1_config(dump_dir, counting_s3.options),
                                      tq_client=InProcessTQClient())
        assert SkipManager.will_replay("rollout_tq", [1])
        SkipManager.reset()
    assert counts[10] == counts[100] <= 2, counts


def match_prompts(ids: list[int]) -> Batch:
    return Batch.from_dict(tensors={"ids": torch.tensor([[i, i] for i in ids for _ in range(2)])},
                           non_tensors={"uid": [f"live{i}" for i in ids for _ in range(2)]})


def test_first_match_call_costs_the_same_requests_at_10_and_200_entries(counting_s3):
    """The run's writer keeps a digest table: the first ``match`` call lists and reads it, checks it on
    its two lowest entries (one of them chosen), reads the one other entry a live prompt points at,
    and generates (and records) the one prompt never recorded."""
    counts = {}
    for count in (10, 200):
        dump_dir = f"s3://{counting_s3.bucket()}/dump"
        SkipManager.init(rollout_config(dump_dir, counting_s3.options, action="record"))
        recorder = Rollout()
        for step in range(count):  # the real writer: entries and its digest table
            SkipManager.set_step(step)
            recorder.generate_sequences(match_prompts([2 * step, 2 * step + 1]))
        SkipManager.reset()
        SkipManager.init(rollout_config(dump_dir, counting_s3.options, action="match"))
        rollout = Rollout()
        SkipManager.set_step(10_000)
        before = len(counting_s3.requests)
        out = rollout.generate_sequences(match_prompts([0, 2 * count - 1, 99_999]))
        counts[count] = len(counting_s3.requests) - before
        assert rollout.calls == 1 and out.batch["out"][:, 0].tolist() == [0, 0, 20 * count - 10, 20 * count - 10,
                                                                         999_990, 999_990]
        stats = SkipManager.stats()
        assert stats["skip/rollout/rows_replayed"] == 4 and stats["skip/rollout/rows_generated"] == 2
        SkipManager.reset()
    assert counts[10] == counts[200], counts
    assert counts[10] <= 25, counts


def test_first_v1_match_submit_costs_the_same_requests_at_10_and_30_steps(counting_s3):
    """rollout_tq: the recorder's hint document names each step's recording and inner entries; the first
    submit phase of a match run reads it, then only the manifest and inner entries of the step it chooses."""
    counts = {}
    for count in (10, 30):
        dump_dir = f"s3://{counting_s3.bucket()}/dump"
        config = v1_config(dump_dir, counting_s3.options)
        config["data"] = {"train_batch_size": 4}
        config["skip"]["rollout_tq"].update(steps="all", action="record")
        V1Trainer(config, InProcessTQClient(), prompts_per_step=4).fit(count)
        SkipManager.reset()
        config["skip"]["rollout_tq"]["action"] = "match"
        live = V1Trainer(config, InProcessTQClient(), prompts_per_step=4)
        live.next_prompt = 4 * count - 2  # two prompts of the last step, two never recorded
        SkipManager.init(config, tq_client=live.tq)
        live.global_steps = 1
        SkipManager.set_step(1)
        before = len(counting_s3.requests)
        live._add_batch_to_generate()
        counts[count] = len(counting_s3.requests) - before
        assert live.agent_loop.submitted == [[4 * count, 4 * count + 1]]
        assert SkipManager.stats()["skip/rollout_tq/rows_replayed"] == 2  # the two recorded prompts
        SkipManager.reset()
    assert counts[10] == counts[30] <= 12, counts
