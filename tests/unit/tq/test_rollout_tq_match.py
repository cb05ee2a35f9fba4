"""rollout_tq under action: match: the submit phase injects the recorded prompt groups of the
batch and submits only the missing prompts; driven through annotate_tq by the V1 harness over the
in-process queue (the agent loop stands in for the inference servers, which cannot run here)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from v1_harness import V1Trainer

from stepskip import SkipConfigError, SkipManager
from stepskip.tq import InProcessTQClient


def make_config(dump_dir, steps=(1, 2), action="cache", n=2, gbs=4, sync=1, **skip):
    config = {
        "actor_rollout_ref": {"rollout": {"n": n}},
        "data": {"train_batch_size": gbs},
        "skip": {"rollout_tq": {"enable": True, "steps": list(steps), "action": action, "dump_dir": str(dump_dir),
                                "async_dump": False, **skip}},
    }
    if sync > 1:
        config["trainer"] = {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": sync}}}
    return config


def by_prompt(reads):
    """{prompt id: (uid, sorted [(session, responses, reward, step tag)])} of what the trainer read in one step."""
    out: dict[int, tuple[str, list]] = {}
    for meta, data in reads:
        for i, key in enumerate(meta.keys):
            uid, session, _ = key.split("_")
            prompt = int(data["prompts"][i][0])
            entry = out.setdefault(prompt, (uid, []))
            assert entry[0] == uid  # one uid per prompt
            entry[1].append((int(session), tuple(data["responses"][i].tolist()), float(data["reward"][i]),
                             meta.tags[i]["global_steps"]))
    return {p: (uid, sorted(rows)) for p, (uid, rows) in out.items()}


def responses(group):
    return sorted(r for _, r, _, _ in group)


def record(tmp_path, prompts_per_step=4, steps=2, n=2, start=0, **kwargs):
    trainer = V1Trainer(make_config(tmp_path, steps=range(1, steps + 1), n=n, gbs=prompts_per_step, **kwargs),
                        InProcessTQClient(), prompts_per_step=prompts_per_step, n=n, sync_steps=kwargs.get("sync", 1))
    trainer.next_prompt = start
    reads = trainer.fit(steps)
    SkipManager.reset()
    return trainer, [by_prompt(r) for r in reads]


def test_match_injects_recorded_prompts_and_submits_only_the_missing_ones(tmp_path):
    _, recorded = record(tmp_path)  # prompts 0-3 at step 1, 4-7 at step 2
    recorded_by_prompt = {p: g for step in recorded for p, g in step.items()}
    live = V1Trainer(make_config(tmp_path, steps=[1, 2, 3], action="match", gbs=3), InProcessTQClient(),
                     prompts_per_step=3)
    live.next_prompt = 2  # another batch size and data order: prompts 2-4, 5-7, 8-10
    reads = [by_prompt(r) for r in live.fit(3)]

    assert live.agent_loop.submitted == [[8, 9, 10]]  # steps 1 and 2 were found whole; step 3 none of it
    for step, prompts in ((1, [2, 3, 4]), (2, [5, 6, 7])):
        assert sorted(reads[step - 1]) == prompts
        for p in prompts:
            uid, group = reads[step - 1][p]
            assert responses(group) == responses(recorded_by_prompt[p][1])  # the responses recorded for p
            assert uid != recorded_by_prompt[p][0]  # under the live uid
            assert [s for s, *_ in group] == [0, 1]
            assert {tag for *_, tag in group} == {step}  # tags carry the live step
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/rows_replayed"] == 6 and stats["skip/rollout_tq/rows_generated"] == 3
    assert stats["skip/rollout_tq/hits"] == 2 and stats["skip/rollout_tq/misses"] == 1


def test_partly_recorded_batch_submits_the_missing_prompts_in_order_and_merges(tmp_path, caplog):
    _, recorded = record(tmp_path, steps=1)  # prompts 0-3
    caplog.set_level(logging.INFO, logger="stepskip")
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match"), InProcessTQClient(), prompts_per_step=4)
    live.next_prompt = 2  # prompts 2, 3 recorded; 4, 5 not
    (read,) = [by_prompt(r) for r in live.fit(1)]

    assert live.agent_loop.submitted == [[4, 5]]
    assert sorted(read) == [2, 3, 4, 5]
    for p in (2, 3):
        assert responses(read[p][1]) == responses(recorded[0][p][1])
    for p in (4, 5):  # generated now, at step 1 by the live agent loop
        assert all(r[0] == 100 * p + 10 * s + 1000 for s, r, *_ in read[p][1])
    assert "injected 2 of 4 prompts (2 from step 1); 2 prompts submitted" in caplog.text

    # the step now records all four prompts, each trajectory with its prompt's digest
    project = next(Path(tmp_path).glob("*/GBS4_N2_in0_out0"))
    meta = json.loads((project / "1" / "0" / "meta.json").read_text())
    assert meta["num_trajectories"] == 8 and len(meta["row_prompts"]) == 8 and None not in meta["row_prompts"]
    SkipManager.reset()
    again = V1Trainer(make_config(tmp_path, steps=[1], action="match"), InProcessTQClient(), prompts_per_step=4)
    again.next_prompt = 2
    (read_again,) = [by_prompt(r) for r in again.fit(1)]
    assert again.agent_loop.calls == 0
    assert {p: responses(g) for p, (_, g) in read_again.items()} == {p: responses(g) for p, (_, g) in read.items()}


def test_a_fully_recorded_step_is_not_recorded_again(tmp_path):
    record(tmp_path, steps=1)
    project = next(Path(tmp_path).glob("*/GBS4_N2_in0_out0"))
    before = (project / "1" / "0" / "meta.json").read_text()
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match"), InProcessTQClient(), prompts_per_step=4)
    live.fit(1)
    assert live.agent_loop.calls == 0 and SkipManager.stats()["skip/rollout_tq/dumps"] == 0
    assert (project / "1" / "0" / "meta.json").read_text() == before


def test_another_n_cycles_or_is_missing_under_strict(tmp_path):
    _, recorded = record(tmp_path, steps=1, n=2)
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match", n=3), InProcessTQClient(),
                     prompts_per_step=4, n=3)
    (read,) = [by_prompt(r) for r in live.fit(1)]
    assert live.agent_loop.calls == 0  # the N2 run directory serves the N3 run
    for p, (_, group) in read.items():
        assert [s for s, *_ in group] == [0, 1, 2]
        recorded_responses = responses(recorded[0][p][1])
        # session s takes recorded trajectory s % 2 (in the entry's order): sessions 0 and 2 repeat one
        assert group[0][1] == group[2][1] != group[1][1]
        assert sorted([group[0][1], group[1][1]]) == recorded_responses
    SkipManager.reset()
    strict = V1Trainer(make_config(tmp_path / "strict", steps=[1], action="match", n=3, match_n="strict"),
                       InProcessTQClient(), prompts_per_step=4, n=3)
    record(tmp_path / "strict", steps=1, n=2)
    strict.fit(1)
    assert strict.agent_loop.submitted == [[0, 1, 2, 3]]


def test_steps_recorded_with_parameter_sync_step_serve_match(tmp_path):
    _, recorded = record(tmp_path, steps=1, sync=2)
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match", gbs=2), InProcessTQClient(),
                     prompts_per_step=2)
    live.next_prompt = 1
    (read,) = [by_prompt(r) for r in live.fit(1)]
    assert live.agent_loop.calls == 0
    assert {p: responses(g) for p, (_, g) in read.items()} == {p: responses(recorded[0][p][1]) for p in (1, 2)}


def test_a_damaged_source_entry_is_generated_instead(tmp_path):
    record(tmp_path, steps=1)
    project = next(Path(tmp_path).glob("*/GBS4_N2_in0_out0"))
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match"), InProcessTQClient(), prompts_per_step=4)
    SkipManager.init(live.config, tq_client=live.tq)
    SkipManager.skip_instances["rollout_tq"].match_index.refresh()  # indexed while intact
    data = project / "1" / "0" / "data.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    live.global_steps = 0
    SkipManager.set_step(1)
    live.global_steps = 1
    live._add_batch_to_generate()
    assert live.agent_loop.submitted == [[0, 1, 2, 3]]
    assert SkipManager.stats()["skip/rollout_tq/corrupt"] == 1


def test_match_needs_a_uid_column(tmp_path):
    SkipManager.init(make_config(tmp_path, steps=[1], action="match"), tq_client=InProcessTQClient())
    import torch
    from tensordict import TensorDict

    with pytest.raises(SkipConfigError, match="uid"):
        SkipManager.skip_instances["rollout_tq"].match_inject(1, TensorDict({"x": torch.ones(2)}, batch_size=[2]))
