"""rollout_tq over the REAL ``transfer_queue``, driven by the V1 harness of the unit tests.

Run 1 records steps through ``annotate_tq`` (submit + sample phases) while a small V1 trainer,
agent loop and replay buffer (tests/support/v1_harness.py) move trajectories through the real
queue; a fresh run (new ``SkipManager.init``, new trainer, queue emptied) replays them. What the
trainer reads back from the queue on a replayed step must be the recorded trajectories under the
new run's keys ``{new_uid}_{session}_0``: row for row as the V1 remap maps them (prompt ``i`` of the new
batch gets recorded group ``i``, groups in order of first appearance, session ``s`` gets
``group[s % len(group)]``), tags with the current step and without ``is_prompt``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tensordict import TensorDict
from v1_harness import ReplayBuffer, V1Trainer

from stepskip import SkipManager
from stepskip.tq import InProcessTQClient, KVBatchMeta

pytestmark = pytest.mark.heavy

N = 2
STEP_FIELDS = ("prompts", "responses", "reward", "messages")


# ---------------------------------------------------------------------------------- harness glue

def make_config(dump_dir: Path, steps=(1, 2), action: str = "cache", sync: int = 1, **skip: Any) -> dict:
    config = {
        "actor_rollout_ref": {"rollout": {"n": N}},
        "data": {"train_batch_size": 3},
        "skip": {"rollout_tq": {"enable": True, "steps": list(steps), "action": action,
                                "dump_dir": str(dump_dir), **skip}},
    }
    if sync > 1:
        config["trainer"] = {"v1": {"trainer_mode": "separate_async",
                                    "separate_async": {"parameter_sync_step": sync}}}
    return config


def project_dir(dump_dir: Path) -> Path:
    return Path(dump_dir) / "default_experiment_name_default_project_name" / f"GBS3_N{N}_in0_out0"


class Trainer(V1Trainer):
    """The harness trainer, remembering the uids its dataloader handed out per step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uids: dict[int, list[str]] = {}

    def _next_train_batch(self) -> TensorDict:
        batch = super()._next_train_batch()
        self.uids.setdefault(self.global_steps, []).extend(list(batch["uid"]))
        return batch


def fit(trainer: Trainer, steps: int, pass_client: bool) -> list[list]:
    """``trainer.fit``, or the same with ``SkipManager.init`` given no client (the role imports transfer_queue)."""
    if pass_client:
        return trainer.fit(steps)
    SkipManager.init(trainer.config)
    out = [trainer.step() for _ in range(steps)]
    SkipManager.flush()
    return out


def empty_queue(tq: Any) -> None:
    for partition, listing in tq.kv_list().items():
        if listing:
            tq.kv_clear(keys=list(listing), partition_id=partition)
    assert not any(tq.kv_list().values())


def rows(meta: Any, data: TensorDict) -> dict[str, tuple]:
    """{key: (prompts, responses, reward, messages, tag)} of what the trainer read from the queue."""
    assert data.batch_size[0] == len(meta.keys)
    out = {}
    for i, key in enumerate(meta.keys):
        out[key] = (data["prompts"][i].tolist(), data["responses"][i].tolist(), float(data["reward"][i]),
                    data.get("messages").tolist()[i], dict(meta.tags[i]))
    return out


def merged(reads: list) -> tuple[list[str], dict[str, tuple]]:
    """All sample calls of one step: keys in order (inner entry 0 first) and their rows."""
    keys, by_key = [], {}
    for meta, data in reads:
        keys.extend(meta.keys)
        by_key.update(rows(meta, data))
    return keys, by_key


def expected_replay(recorded_reads: list, new_uids: list[str], step: int) -> dict[str, tuple]:
    """The V1 remapping of one recorded step onto the new uids (groups by first appearance)."""
    keys, by_key = merged(recorded_reads)
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key.split("_")[0], []).append(key)
    group_list = list(groups.values())
    out = {}
    for i, uid in enumerate(new_uids):
        group = group_list[i % len(group_list)]
        for session in range(N):
            *fields, tag = by_key[group[session % len(group)]]
            tag = {k: v for k, v in tag.items() if k != "is_prompt"}
            tag.update(global_steps=step, min_global_steps=step, max_global_steps=step)
            out[f"{uid}_{session}_0"] = (*fields, tag)
    return out


def assert_replayed(recorded: list, replayed: list, replayer: Trainer, steps=(1, 2), load_steps=None) -> None:
    load_steps = load_steps or steps
    for step, load_step in zip(steps, load_steps):
        new_keys, got = merged(replayed[step - 1])
        want = expected_replay(recorded[load_step - 1], replayer.uids[step], step)
        assert sorted(new_keys) == sorted(want), f"step {step}: keys {new_keys}"
        assert len(set(new_keys)) == len(new_keys)
        old_uids = {k.split("_")[0] for k in merged(recorded[load_step - 1])[0]}
        assert not old_uids & {k.split("_")[0] for k in new_keys}  # the new run's uids only
        for key in want:
            assert got[key][:4] == want[key][:4], f"step {step} key {key}: data differs"
            assert got[key][4] == want[key][4], f"step {step} key {key}: tags {got[key][4]} != {want[key][4]}"
            assert "is_prompt" not in got[key][4]
            assert got[key][4]["global_steps"] == got[key][4]["min_global_steps"] == \
                got[key][4]["max_global_steps"] == step


# ---------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("pass_client", [True, False], ids=["tq_client=transfer_queue", "role-imports-transfer_queue"])
def test_recorded_steps_replay_through_the_real_queue(real_tq, tmp_path, pass_client):
    config = make_config(tmp_path, steps=[1, 2])
    recorder = Trainer(config, real_tq, n=N)
    recorded = fit(recorder, 3, pass_client)
    if not pass_client:
        assert SkipManager.skip_instances["rollout_tq"].tq_client is real_tq  # the module, imported by the role
    stats = SkipManager.stats()
    assert recorder.agent_loop.calls == 3
    assert (stats["skip/rollout_tq/misses"], stats["skip/rollout_tq/dumps"]) == (2, 2)
    assert stats["skip/rollout_tq/dump_failures"] == 0
    for step in (1, 2):
        meta = json.loads((project_dir(tmp_path) / str(step) / "0" / "meta.json").read_text())
        assert meta["global_steps"] == step and meta["num_trajectories"] == 3 * N
    assert not (project_dir(tmp_path) / "3").exists()

    SkipManager.reset()
    empty_queue(real_tq)
    replayer = Trainer(config, real_tq, n=N)
    replayed = fit(replayer, 3, pass_client)

    assert replayer.agent_loop.calls == 1  # step 3 only: steps 1 and 2 were injected from the cache
    assert replayer.next_prompt == recorder.next_prompt == 9  # the dataloader advanced on replayed steps
    assert replayer.replay_buffer.calls == 3
    assert_replayed(recorded, replayed, replayer)
    stats = SkipManager.stats()
    assert (stats["skip/rollout_tq/hits"], stats["skip/rollout_tq/dumps"]) == (2, 0)
    assert not any(real_tq.kv_list().values())  # the trainer consumed everything that was injected


def test_repeat_replays_another_step_with_the_current_step_in_the_tags(real_tq, tmp_path):
    recorder = Trainer(make_config(tmp_path, steps=[1]), real_tq, n=N)
    recorded = recorder.fit(1)
    SkipManager.reset()
    empty_queue(real_tq)

    replayer = Trainer(make_config(tmp_path, steps=[1, 2, 3], action="repeat"), real_tq, n=N)
    replayed = replayer.fit(3)
    assert replayer.agent_loop.calls == 0
    assert_replayed(recorded + recorded + recorded, replayed, replayer, steps=(1, 2, 3), load_steps=(1, 1, 1))


def test_parameter_sync_step_2_records_inner_entries_and_replays_them_merged(real_tq, tmp_path):
    config = make_config(tmp_path, steps=[1, 2], sync=2)
    recorder = Trainer(config, real_tq, n=N, prompts_per_step=4, sync_steps=2)
    recorded = recorder.fit(2)
    assert recorder.agent_loop.calls == 2 and recorder.replay_buffer.calls == 4
    for step in (1, 2):
        for inner in (0, 1):
            entry = project_dir(tmp_path) / str(step) / str(inner)
            meta = json.loads((entry / "meta.json").read_text())
            assert meta["global_steps"] == step and meta["num_trajectories"] == 2 * N
        assert not (project_dir(tmp_path) / str(step) / "2").exists()

    SkipManager.reset()
    empty_queue(real_tq)
    replayer = Trainer(config, real_tq, n=N, prompts_per_step=4, sync_steps=2)
    replayed = replayer.fit(2)
    assert replayer.agent_loop.calls == 0
    assert replayer.next_prompt == 8
    assert [len(meta.keys) for step_reads in replayed for meta, _ in step_reads] == [2 * N] * 4
    assert_replayed(recorded, replayed, replayer)
    assert SkipManager.stats()["skip/rollout_tq/hits"] == 2


def test_verl_format_writes_tq_batch_pt_and_replays(real_tq, tmp_path):
    config = make_config(tmp_path, steps=[1, 2], format="verl", allow_pickle=True)
    recorder = Trainer(config, real_tq, n=N)
    recorded = recorder.fit(2)
    for step in (1, 2):
        entry = project_dir(tmp_path) / str(step) / "0"
        assert (entry / "tq_batch.pt").is_file()
        assert not (entry / "data.safetensors").exists()

    SkipManager.reset()
    empty_queue(real_tq)
    replayer = Trainer(config, real_tq, n=N)
    replayed = replayer.fit(2)
    assert replayer.agent_loop.calls == 0
    assert_replayed(recorded, replayed, replayer)


GHOST = "0ddba11_0_0"


class GhostReplayBuffer(ReplayBuffer):
    """Hands out one key that is no longer in the queue (e.g. consumed or cleared meanwhile)."""

    @SkipManager.annotate_tq(role="rollout_tq", phase="sample")
    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[KVBatchMeta, dict]:
        meta, info = ReplayBuffer.sample.__wrapped__(self, global_steps, partition_id, batch_size)
        keys = meta.keys + [GHOST]
        return KVBatchMeta(keys=keys, tags=meta.tags + [{"status": "finished"}], partition_id=partition_id), info


class GhostTrainer(Trainer):
    """A trainer whose replay buffer hands out a ghost key, which the trainer itself skips when reading."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replay_buffer = GhostReplayBuffer(self.tq)

    def step(self) -> list:
        self.global_steps += 1
        SkipManager.set_step(self.global_steps)
        self._add_batch_to_generate()
        meta, _ = self.replay_buffer.sample(self.global_steps, "train", self.prompts_per_step)
        keys = [k for k in meta.keys if k != GHOST]
        data = self.tq.kv_batch_get(keys=keys, partition_id="train")
        self.tq.kv_clear(keys=keys, partition_id="train")
        return [(meta, data)]


@pytest.mark.parametrize("client", [
    "in_process",
    "real",
])
def test_a_sampled_key_missing_from_the_queue_is_a_dump_failure_not_an_unloadable_entry(real_tq, tmp_path, client):
    tq = real_tq if client == "real" else InProcessTQClient()
    config = make_config(tmp_path, steps=[1])
    GhostTrainer(config, tq, n=N).fit(1)
    first = SkipManager.stats()
    written = (project_dir(tmp_path) / "1" / "0" / "meta.json").exists()
    SkipManager.reset()
    empty_queue(tq)

    rerun = Trainer(config, tq, n=N)
    rerun.fit(1)
    second = SkipManager.stats()
    if written:  # an entry that was written must be loadable
        assert (second["skip/rollout_tq/hits"], second["skip/rollout_tq/misses"]) == (1, 0), (first, second)
        assert rerun.agent_loop.calls == 0
    else:  # otherwise the read-back failure is counted, and the next run records the step
        assert (first["skip/rollout_tq/dumps"], first["skip/rollout_tq/dump_failures"]) == (0, 1), first
        assert second["skip/rollout_tq/dumps"] == 1


def test_match_injects_recorded_prompts_and_submits_only_the_missing_ones(real_tq, tmp_path):
    """action: match over the real queue: another data order reuses every recorded prompt's trajectories."""
    recorder = Trainer(make_config(tmp_path, steps=[1, 2]), real_tq, n=N)
    recorded = recorder.fit(2)  # prompts 0-2, then 3-5
    SkipManager.reset()
    empty_queue(real_tq)

    def by_prompt(reads: list) -> dict[int, list]:
        out: dict[int, list] = {}
        for key, (prompts, responses, reward, messages, _) in merged(reads)[1].items():
            out.setdefault(prompts[0], []).append((responses, reward, messages))
        return {p: sorted(v) for p, v in out.items()}

    recorded_by_prompt = {p: v for reads in recorded for p, v in by_prompt(reads).items()}
    live = Trainer(make_config(tmp_path, steps=[1, 2], action="match"), real_tq, n=N)
    live.next_prompt = 1  # prompts 1-3, then 4-6: only 6 was never recorded
    replayed = live.fit(2)

    assert live.agent_loop.submitted == [[6]]
    for step, prompts in ((1, [1, 2, 3]), (2, [4, 5])):
        got = by_prompt(replayed[step - 1])
        for p in prompts:
            assert got[p] == recorded_by_prompt[p], f"prompt {p}"
        keys = merged(replayed[step - 1])[0]
        assert {k.split("_")[0] for k in keys} == set(live.uids[step])  # the live uids only
    stats = SkipManager.stats()
    assert (stats["skip/rollout_tq/rows_replayed"], stats["skip/rollout_tq/rows_generated"]) == (5, 1)
    assert not any(real_tq.kv_list().values())
