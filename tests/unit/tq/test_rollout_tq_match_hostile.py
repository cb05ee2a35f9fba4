"""rollout_tq under action: match over inner entries whose metadata and data disagree:
a crafted or damaged cache (checksums recomputed) whose ``row_prompts``, keys or tags describe other
rows than its tensordict holds. The entry is counted corrupt, dropped from the prompt index, kept,
and its prompts are submitted to rollout; nothing reaches the trainer. The V1 harness's agent loop
stands in for the inference servers, which cannot run here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_rollout_tq_match import by_prompt, make_config, record
from v1_harness import V1Trainer, rewrite_inner_entry

from stepskip import SkipManager
from stepskip.tq import InProcessTQClient


def inner(dump_dir, step, gbs=4):
    return Path(dump_dir) / "default_experiment_name_default_project_name" / f"GBS{gbs}_N2_in0_out0" / str(step) / "0"


def tamper(dump_dir, step, change):
    """Rewrite an inner entry with ``change(payload)`` applied, its meta (row_prompts ...) kept, checksums valid."""
    path = str(inner(dump_dir, step))
    rewrite_inner_entry(path, change)
    return sorted(p.name for p in Path(path).iterdir())


def fewer_rows(payload):
    """The last row dropped, leaf by leaf: tensordict 0.10's torch cannot slice a jagged tensor on dim 0."""
    td = payload["tensordict"]
    keep = td.batch_size[0] - 1

    def first_rows(leaf):
        return torch.nested.as_nested_tensor(list(leaf.unbind())[:keep], layout=torch.jagged) if leaf.is_nested \
            else leaf[:keep]

    payload["tensordict"] = td.apply(first_rows, batch_size=[keep])


def fewer_tags(payload):
    payload["tags"] = payload["tags"][:1]


def tags_not_mappings(payload):
    payload["tags"] = [7] * len(payload["tags"])


@pytest.mark.parametrize("change", [fewer_rows, fewer_tags, tags_not_mappings])
def test_an_inner_entry_whose_data_disagrees_is_damage_and_its_prompts_are_generated(tmp_path, change):
    _, recorded = record(tmp_path, steps=2)  # prompts 0-3 at step 1, 4-7 at step 2
    files = tamper(tmp_path, 1, change)
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match"), InProcessTQClient(), prompts_per_step=4)
    live.next_prompt = 2  # prompts 2, 3 (in the damaged step 1), 4, 5 (step 2)
    (reads,) = [by_prompt(r) for r in live.fit(1)]
    assert live.agent_loop.submitted == [[2, 3]]
    assert sorted(reads) == [2, 3, 4, 5]
    for p in (4, 5):
        assert sorted(r for _, r, _, _ in reads[p][1]) == sorted(r for _, r, _, _ in recorded[1][p][1])
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/corrupt"] == 1
    assert (stats["skip/rollout_tq/rows_replayed"], stats["skip/rollout_tq/rows_generated"]) == (2, 2)
    assert sorted(p.name for p in inner(tmp_path, 1).iterdir()) == files  # kept
    index = SkipManager.skip_instances["rollout_tq"].match_index.prompts
    assert str(inner(tmp_path, 1)) not in index.entries
    SkipManager.reset()


def reward_of_another_shape(payload):
    td = payload["tensordict"]
    td.set("reward", td.get("reward").unsqueeze(1).expand(-1, 2).contiguous())


def no_reward(payload):
    del payload["tensordict"]["reward"]


def reward_of_another_dtype(payload):
    td = payload["tensordict"]
    td.set("reward", td.get("reward").to(torch.float64))


@pytest.mark.parametrize("change", [reward_of_another_shape, no_reward, reward_of_another_dtype])
def test_an_inner_entry_that_does_not_join_the_others_costs_only_its_prompts(tmp_path, change):
    """Trajectories of other columns than the other entries' (another version, a crafted entry) would
    fail the join into the queue: the odd entry is counted corrupt and its prompts submitted."""
    record(tmp_path, steps=3)  # prompts 0-3 at step 1, 4-7 at step 2, 8-11 at step 3
    files = tamper(tmp_path, 1, change)
    live = V1Trainer(make_config(tmp_path, steps=[1], action="match"), InProcessTQClient(), prompts_per_step=4)
    live.next_prompt = 3  # prompt 3 (in the odd step 1), 4, 5, 6 (step 2)
    (reads,) = [by_prompt(r) for r in live.fit(1)]
    assert live.agent_loop.submitted == [[3]]
    assert sorted(reads) == [3, 4, 5, 6]
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/corrupt"] == 1
    assert (stats["skip/rollout_tq/rows_replayed"], stats["skip/rollout_tq/rows_generated"]) == (3, 1)
    assert sorted(p.name for p in inner(tmp_path, 1).iterdir()) == files  # kept
    SkipManager.reset()
