"""rollout_tq under ``action: match``: the first submit phase of a run indexes the recorded steps from
the recorder's hint document (``stepskip._matching.hints``: per step, the recording its manifest named and each
inner entry's identity and prompt digests) instead of reading every step's manifest and inner
entries; only the steps it chooses are read, as without hints, before anything is injected. Driven
through annotate_tq by the V1 harness over the in-process queue (the agent loop stands in for the
inference servers), on a local directory and on fsspec's ``memory://``, with one and two sample
calls per step."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip._matching.hints import HINTS_DIR, StepHint, document_of, parse_hints
from stepskip._storage import EntryStore, open_store
from stepskip.tq import InProcessTQClient


@pytest.fixture(params=["local", "memory"])
def dump_dir(request, tmp_path) -> str:
    return str(tmp_path / "dump") if request.param == "local" else f"memory://tq-hints-{uuid.uuid4().hex[:8]}/dump"


def make_config(dump_dir: str, steps: Any, action: str, gbs: int, sync: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "data": {"train_batch_size": gbs},
        "skip": {"rollout_tq": {"enable": True, "steps": steps, "action": action, "dump_dir": dump_dir,
                                "async_dump": False}},
    }
    if sync > 1:
        config["trainer"] = {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": sync}}}
    return config


def record(dump_dir: str, count: int, sync: int, start: int = 0) -> None:
    """``count`` steps (1 ... count) of 4 prompts each, ``start`` the first prompt id."""
    trainer = V1Trainer(make_config(dump_dir, "all", "record", 4, sync), InProcessTQClient(), prompts_per_step=4,
                        sync_steps=sync)
    trainer.next_prompt = start
    trainer.fit(count)
    SkipManager.reset()


def documents(dump_dir: str) -> dict[str, bytes]:
    store = open_store(dump_dir)
    where = f"{dump_dir}/default_experiment_name_default_project_name/{HINTS_DIR}"
    return {name: store.read_small(f"{where}/{name}", 1 << 30) for name in store.list_dir(where)
            if document_of(name) is not None}


def first_match_step(dump_dir: str, first_prompt: int, sync: int, monkeypatch: pytest.MonkeyPatch
                     ) -> tuple[V1Trainer, list[str]]:
    """One step of a match run over prompts ``first_prompt ...`` (batches of 4): (the trainer, every entry,
    manifest or small file its submit phase looked at)."""
    live = V1Trainer(make_config(dump_dir, "all", "match", 4, sync), InProcessTQClient(), prompts_per_step=4,
                     sync_steps=sync)
    live.next_prompt = first_prompt
    SkipManager.init(live.config, tq_client=live.tq)
    looked: list[str] = []
    for method in ("probe", "read_entry", "read_small"):
        original = getattr(EntryStore, method)
        monkeypatch.setattr(EntryStore, method, lambda store, path, *a, _o=original, **k: looked.append(path) or _o(
            store, path, *a, **k))
    live.global_steps = 1
    SkipManager.set_step(1)
    live._add_batch_to_generate()  # the submit phase: match_inject
    submitted = list(looked)
    monkeypatch.undo()
    return live, submitted


@pytest.mark.parametrize("sync", [1, 2])
def test_first_match_submit_looks_at_as_much_at_10_and_30_steps(dump_dir, monkeypatch, sync) -> None:
    looked = {}
    for count in (10, 30):
        root = f"{dump_dir}/{count}"
        record(root, count, sync)
        (raw,) = documents(root).values()
        hints, problem = parse_hints(raw, "doc")
        assert not problem and sorted(hints, key=int) == [str(s) for s in range(1, count + 1)]
        assert all(isinstance(h, StepHint) and len(h.inner) == sync for h in hints.values())
        live, looked[count] = first_match_step(root, 4 * count - 2, sync, monkeypatch)
        assert live.agent_loop.submitted == [[4 * count, 4 * count + 1]]  # the two never recorded
        stats = SkipManager.stats()
        assert stats["skip/rollout_tq/rows_replayed"] == 2
        SkipManager.reset()
    # (which inner entry holds a prompt depends on the uids the replay buffer sorts: distinct paths are compared)
    # document, manifest, inner entries; and the first inner entry of the two lowest steps, which the
    # document is checked on before it is used
    assert len(set(looked[10])) == len(set(looked[30])) == 2 + sync + 2, looked
    steps = {p.split("GBS4_N2_in0_out0/", 1)[1].split("/")[0] for p in looked[30] if "GBS4_N2_in0_out0/" in p}
    assert steps == {"1", "2", "30"}, looked[30]  # the step chosen alone is read whole


def test_a_step_recorded_again_since_its_hint_is_read_from_its_entries(dump_dir, monkeypatch) -> None:
    """Step 10 recorded again (other prompts) by a run whose document is then lost: its hint is stale."""
    record(dump_dir, 10, 1)
    first = set(documents(dump_dir))
    trainer = V1Trainer(make_config(dump_dir, [10], "record", 4, 1), InProcessTQClient(), prompts_per_step=4)
    trainer.next_prompt = 100
    SkipManager.init(trainer.config, tq_client=trainer.tq)
    trainer.global_steps = 9
    trainer.step()  # step 10, prompts 100-103
    SkipManager.flush()
    SkipManager.reset()
    store = open_store(dump_dir)
    where = f"{dump_dir}/default_experiment_name_default_project_name/{HINTS_DIR}"
    for name in set(documents(dump_dir)) - first:
        store.remove(f"{where}/{name}")
    live, _ = first_match_step(dump_dir, 38, 1, monkeypatch)  # prompts 38-41: 38, 39 were at step 10
    assert live.agent_loop.submitted == [[38, 39, 40, 41]]  # step 10 no longer holds them: generated
    assert SkipManager.stats()["skip/rollout_tq/rows_replayed"] == 0
    SkipManager.reset()
    for name in documents(dump_dir):  # the documents are hints only: deleting them is always safe
        store.remove(f"{where}/{name}")
    live, _ = first_match_step(dump_dir, 100, 1, monkeypatch)
    assert live.agent_loop.submitted == []  # what step 10 holds now, read from the entries


def test_a_damaged_document_leaves_the_steps_read_directly(dump_dir, monkeypatch) -> None:
    record(dump_dir, 10, 2)
    (name,) = documents(dump_dir)
    body = json.loads(documents(dump_dir)[name])
    body["entries"]["10"]["recording"] = "../../elsewhere"
    store = open_store(dump_dir)
    store.put_small(f"{dump_dir}/default_experiment_name_default_project_name/{HINTS_DIR}/{name}",
                    json.dumps(body).encode())
    live, looked = first_match_step(dump_dir, 38, 2, monkeypatch)
    assert live.agent_loop.submitted == [[40, 41]]
    assert len({p for p in looked if "/rec-" in p or p.rsplit("/", 1)[-1].isdigit()}) >= 10
