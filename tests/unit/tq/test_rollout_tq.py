"""rollout_tq driven through annotate_tq by a small V1 trainer over the in-process queue."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict
from v1_harness import ReplayBuffer, V1Trainer

from stepskip import CacheMissError, CorruptEntryError, SkipManager
from stepskip.tq import InProcessTQClient

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "verl"


def make_config(dump_dir, steps=(1, 2), action="cache", n=2, sync=1, **skip):
    config = {
        "actor_rollout_ref": {"rollout": {"n": n}},
        "data": {"train_batch_size": 3},
        "skip": {"rollout_tq": {"enable": True, "steps": list(steps), "action": action, "dump_dir": str(dump_dir), **skip}},
    }
    if sync > 1:
        config["trainer"] = {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": sync}}}
    return config


def project_dir(dump_dir, n=2):
    return Path(dump_dir) / "default_experiment_name_default_project_name" / f"GBS3_N{n}_in0_out0"


def rows_by_uid(meta, data):
    """{uid: sorted [(session, prompts, responses, reward, messages)]} of what the trainer read."""
    out = {}
    for i, key in enumerate(meta.keys):
        uid, session, _ = key.split("_")
        out.setdefault(uid, []).append((int(session), data["prompts"][i].tolist(), data["responses"][i].tolist(),
                                        float(data["reward"][i]), data["messages"][i]))
    return {uid: sorted(v) for uid, v in out.items()}


def content(rows):
    """What a group holds, without session numbers."""
    return tuple(sorted((tuple(p), tuple(r), w, str(m)) for _, p, r, w, m in rows))


def record_and_replay(tmp_path, record_kwargs=None, replay_kwargs=None, steps=2, **config_kwargs):
    config = make_config(tmp_path, **config_kwargs)
    recorder = V1Trainer(config, InProcessTQClient(), n=config["actor_rollout_ref"]["rollout"]["n"],
                         **(record_kwargs or {}))
    recorded = recorder.fit(steps)
    SkipManager.reset()
    replayer = V1Trainer(config, InProcessTQClient(), n=config["actor_rollout_ref"]["rollout"]["n"],
                         **(replay_kwargs or {}))
    replayed = replayer.fit(steps)
    return recorder, recorded, replayer, replayed


def test_record_then_replay_injects_recorded_trajectories_under_new_keys(tmp_path):
    recorder, recorded, replayer, replayed = record_and_replay(tmp_path, steps=3)

    assert recorder.agent_loop.calls == 3
    assert replayer.agent_loop.calls == 1  # only step 3, which is not in steps
    assert replayer.next_prompt == recorder.next_prompt == 9  # the dataloader advanced on replayed steps too
    for step in (0, 1):
        (old_meta, old_data), = recorded[step]
        (new_meta, new_data), = replayed[step]
        old, new = rows_by_uid(old_meta, old_data), rows_by_uid(new_meta, new_data)
        assert not set(old) & set(new)  # the new run's uids, not the recorded ones
        assert sorted(content(v) for v in old.values()) == sorted(content(v) for v in new.values())
        for uid, group in new.items():
            assert [s for s, *_ in group] == [0, 1]
        for key, tag in zip(new_meta.keys, new_meta.tags):
            assert key.endswith("_0") and len(key.split("_")) == 3
            assert tag["global_steps"] == tag["min_global_steps"] == tag["max_global_steps"] == step + 1
            assert "is_prompt" not in tag
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/hits"] == 2 and stats["skip/rollout_tq/dumps"] == 0


def test_entry_layout_and_meta(tmp_path):
    V1Trainer(make_config(tmp_path), InProcessTQClient()).fit(2)
    for step in (1, 2):
        meta = json.loads((project_dir(tmp_path) / str(step) / "0" / "meta.json").read_text())
        assert meta["global_steps"] == step
        assert meta["num_trajectories"] == 6
        assert meta["format"] == "safe"
        assert set(meta["files"]) == {"data.safetensors", "data.json"}


def test_each_new_prompt_gets_one_whole_cached_group_even_with_scrambled_keys(tmp_path):
    _, recorded, _, replayed = record_and_replay(tmp_path, steps=1)
    (old_meta, old_data), = recorded[0]
    (new_meta, new_data), = replayed[0]
    old_groups = {tuple(content(v)) for v in rows_by_uid(old_meta, old_data).values()}
    for group in rows_by_uid(new_meta, new_data).values():
        assert tuple(content(group)) in old_groups


def test_fewer_cached_groups_than_prompts_cycle(tmp_path):
    _, recorded, replayer, replayed = record_and_replay(
        tmp_path, record_kwargs={"prompts_per_step": 2}, replay_kwargs={"prompts_per_step": 5}, steps=1)
    (old_meta, old_data), = recorded[0]
    (new_meta, new_data), = replayed[0]
    assert replayer.agent_loop.calls == 0
    old_groups = [content(v) for v in rows_by_uid(old_meta, old_data).values()]
    new_by_uid = rows_by_uid(new_meta, new_data)
    assert len(new_by_uid) == 5 and len(new_meta.keys) == 10
    # the trainer's uids, in dataloader order, map onto groups 0, 1, 0, 1, 0
    order = [key.split("_")[0] for key in new_meta.keys]
    uids_in_order = list(dict.fromkeys(sorted(order, key=lambda u: min(i for i, k in enumerate(order) if k == u))))
    assert {tuple(content(new_by_uid[u])) for u in uids_in_order} == {tuple(g) for g in old_groups}


def test_more_cached_groups_than_prompts_uses_first_groups(tmp_path):
    config = make_config(tmp_path, steps=[1])
    recorder = V1Trainer(config, InProcessTQClient(), prompts_per_step=4)
    (old_meta, old_data), = recorder.fit(1)[0]
    SkipManager.reset()
    client = InProcessTQClient()
    SkipManager.init(config, tq_client=client)
    SkipManager.set_step(1)
    SkipManager.skip_instances["rollout_tq"].maybe_load_and_inject(1, ["newa", "newb"])
    listing = client.kv_list("train")["train"]
    traj = [k for k, t in listing.items() if not t.get("is_prompt")]
    assert sorted(traj) == ["newa_0_0", "newa_1_0", "newb_0_0", "newb_1_0"]
    # groups are taken in order of first appearance in the recorded keys
    first_uids = list(dict.fromkeys(k.split("_")[0] for k in old_meta.keys))[:2]
    expected = [content(rows_by_uid(old_meta, old_data)[u]) for u in first_uids]
    got = client.kv_batch_get(keys=["newa_0_0", "newa_1_0", "newb_0_0", "newb_1_0"], partition_id="train")
    got_meta = type(old_meta)(keys=["newa_0_0", "newa_1_0", "newb_0_0", "newb_1_0"], tags=[{}] * 4, partition_id="train")
    by_uid = rows_by_uid(got_meta, got)
    assert [content(by_uid["newa"]), content(by_uid["newb"])] == expected
    assert all(listing[u] == {"is_prompt": True, "status": "finished", "global_steps": 1} for u in ("newa", "newb"))


def test_groups_shorter_than_n_cycle_within_the_group(tmp_path):
    config = make_config(tmp_path, steps=[1], n=3)
    recorder = V1Trainer(config, InProcessTQClient(), n=3, fail_sessions={1})  # sessions 0 and 2 survive
    (old_meta, old_data), = recorder.fit(1)[0]
    assert len(old_meta.keys) == 6
    SkipManager.reset()
    replayer = V1Trainer(config, InProcessTQClient(), n=3)
    (new_meta, new_data), = replayer.fit(1)[0]
    assert len(new_meta.keys) == 9
    old_by_uid = rows_by_uid(old_meta, old_data)
    for group in rows_by_uid(new_meta, new_data).values():
        sessions = [s for s, *_ in group]
        assert sessions == [0, 1, 2]
        # session s takes cached trajectory group[s % 2]: sessions 0 and 2 repeat the first trajectory
        assert group[0][1:] == group[2][1:] != group[1][1:]
        source = next(v for v in old_by_uid.values() if content(v)[0] in content(group))
        assert {tuple(map(str, g[1:])) for g in group} == {tuple(map(str, g[1:])) for g in source}


def test_validation_partition_is_never_saved(tmp_path):
    client = InProcessTQClient()
    SkipManager.init(make_config(tmp_path, steps=[1]), tq_client=client)
    SkipManager.set_step(1)
    client.kv_batch_put(keys=["u_0_0"], partition_id="val", fields=TensorDict({"x": torch.ones(1, 2)}, batch_size=[1]),
                        tags=[{"global_steps": 1}])
    client.kv_batch_put(keys=["u"], partition_id="val", tags=[{"is_prompt": True, "status": "finished"}])
    meta, _ = ReplayBuffer(client).sample(1, "val", 1)
    assert meta.keys == ["u_0_0"]
    SkipManager.flush()
    assert not project_dir(tmp_path).exists()


def test_parameter_sync_step_writes_inner_entries_and_merges_them(tmp_path):
    _, recorded, replayer, replayed = record_and_replay(
        tmp_path, record_kwargs={"prompts_per_step": 4, "sync_steps": 2},
        replay_kwargs={"prompts_per_step": 4, "sync_steps": 2}, steps=1, sync=2)
    step_dir = project_dir(tmp_path) / "1"
    assert sorted(os.listdir(step_dir)) == ["0", "1"]
    assert [json.loads((step_dir / i / "meta.json").read_text())["num_trajectories"] for i in "01"] == [4, 4]
    assert replayer.agent_loop.calls == 0
    old = [content(v) for meta, data in recorded[0] for v in rows_by_uid(meta, data).values()]
    new = [content(v) for meta, data in replayed[0] for v in rows_by_uid(meta, data).values()]
    assert sorted(old) == sorted(new)


def test_half_written_step_is_rerecorded_whole(tmp_path):
    config = make_config(tmp_path, steps=[1], sync=2)
    V1Trainer(config, InProcessTQClient(), prompts_per_step=4, sync_steps=2).fit(1)
    step_dir = project_dir(tmp_path) / "1"
    old_run = json.loads((step_dir / "0" / "meta.json").read_text())["run_id"]
    shutil.rmtree(step_dir / "1")  # the recording run died between its two sample calls
    SkipManager.reset()
    rerun = V1Trainer(config, InProcessTQClient(), prompts_per_step=4, sync_steps=2)
    rerun.fit(1)
    assert rerun.agent_loop.calls == 1
    runs = {json.loads((step_dir / i / "meta.json").read_text())["run_id"] for i in "01"}
    assert runs == {SkipManager.run_id} and old_run not in runs


def test_step_mixing_two_runs_is_not_complete(tmp_path):
    config = make_config(tmp_path, steps=[1], sync=2)
    V1Trainer(config, InProcessTQClient(), prompts_per_step=4, sync_steps=2).fit(1)
    meta_path = project_dir(tmp_path) / "1" / "1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["run_id"] = "another-run"
    meta_path.write_text(json.dumps(meta))
    SkipManager.reset()
    SkipManager.init(config, tq_client=InProcessTQClient())
    role = SkipManager.skip_instances["rollout_tq"]
    assert not role.has_v1_cache(1)
    assert role.available_steps() == []


def test_repeat_resolves_over_complete_steps_only(tmp_path):
    V1Trainer(make_config(tmp_path, steps=[1, 2], sync=2), InProcessTQClient(), prompts_per_step=4,
              sync_steps=2).fit(2)
    shutil.rmtree(project_dir(tmp_path) / "2" / "1")
    SkipManager.reset()
    SkipManager.init(make_config(tmp_path, steps=[3], action="repeat", sync=2), tq_client=InProcessTQClient())
    role = SkipManager.skip_instances["rollout_tq"]
    assert role.available_steps() == [1]
    assert role.resolve_load_step(3) == 1
    assert SkipManager.will_replay("rollout_tq", [3])


def test_random_is_reproducible_over_complete_steps(tmp_path):
    V1Trainer(make_config(tmp_path, steps=[1, 2, 3]), InProcessTQClient()).fit(3)
    choices = []
    for _ in range(2):
        SkipManager.reset()
        SkipManager.init(make_config(tmp_path, steps=["all"], action="random", seed=7), tq_client=InProcessTQClient())
        role = SkipManager.skip_instances["rollout_tq"]
        choices.append([role.resolve_load_step(s) for s in range(10, 30)])
    assert choices[0] == choices[1]
    assert set(choices[0]) <= {1, 2, 3} and len(set(choices[0])) > 1


def test_replay_of_a_missing_step_raises_and_never_submits(tmp_path):
    trainer = V1Trainer(make_config(tmp_path, steps=[1], action="replay"), InProcessTQClient())
    with pytest.raises(CacheMissError):
        trainer.fit(1)
    assert trainer.agent_loop.calls == 0


def test_corrupt_inner_entry_regenerates_under_cache_and_raises_under_replay(tmp_path, caplog):
    V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient()).fit(1)
    data = project_dir(tmp_path) / "1" / "0" / "data.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    SkipManager.reset()
    with pytest.raises(CorruptEntryError):
        V1Trainer(make_config(tmp_path, steps=[1], action="replay"), InProcessTQClient()).fit(1)
    SkipManager.reset()
    trainer = V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient())
    trainer.fit(1)
    assert trainer.agent_loop.calls == 1
    assert SkipManager.stats()["skip/rollout_tq/corrupt"] >= 1
    assert "corrupt entry" in caplog.text
    SkipManager.reset()
    again = V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient())
    again.fit(1)
    assert again.agent_loop.calls == 0  # the regenerated entry is valid


def test_record_always_regenerates_and_overwrites(tmp_path):
    V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient()).fit(1)
    meta_path = project_dir(tmp_path) / "1" / "0" / "meta.json"
    first_run = json.loads(meta_path.read_text())["run_id"]
    SkipManager.reset()
    trainer = V1Trainer(make_config(tmp_path, steps=[1], action="record"), InProcessTQClient())
    trainer.fit(1)
    assert trainer.agent_loop.calls == 1
    assert json.loads(meta_path.read_text())["run_id"] not in (first_run, None)


def test_disabled_role_and_ineligible_steps_run_the_body(tmp_path):
    config = make_config(tmp_path, steps=[5])
    trainer = V1Trainer(config, InProcessTQClient())
    trainer.fit(2)
    assert trainer.agent_loop.calls == 2
    assert not project_dir(tmp_path).exists()
    SkipManager.reset()
    config["skip"]["rollout_tq"]["enable"] = False
    trainer = V1Trainer(config, InProcessTQClient())
    trainer.fit(2)
    assert trainer.agent_loop.calls == 2


def test_annotate_tq_rejects_unknown_phase():
    with pytest.raises(ValueError, match="phase"):
        SkipManager.annotate_tq(role="rollout_tq", phase="collect")


def test_annotate_tq_drives_only_a_two_phase_role(tmp_path):
    """A role without the submit and sample phases is refused with an error naming what it lacks, not an
    AttributeError from deep inside the decorator; rollout_tq is a two-phase role."""
    from stepskip.roles import TwoPhaseRole

    class Owner:
        def _next_train_batch(self):
            return {"uid": ["a"]}

        def _submit_batch_to_rollout(self, batch):
            return batch

        @SkipManager.annotate_tq(role="rollout", phase="submit")
        def _add_batch_to_generate(self):
            return "untouched"

        @SkipManager.annotate_tq(role="rollout", phase="sample")
        def sample(self):
            return "sampled"

    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(tmp_path)}}})
    SkipManager.set_step(1)
    for phase in (Owner()._add_batch_to_generate, Owner().sample):
        with pytest.raises(ValueError, match=r"skip.rollout is a RolloutSkip.*lacks .*begin_recording"):
            phase()
    SkipManager.set_step(2)  # not an eligible step: passed through untouched
    assert Owner()._add_batch_to_generate() == "untouched"
    SkipManager.reset()
    SkipManager.init(make_config(tmp_path), tq_client=InProcessTQClient())
    assert isinstance(SkipManager.skip_instances["rollout_tq"], TwoPhaseRole)


def test_verl_format_writes_tq_batch_pt_and_replays(tmp_path):
    _, recorded, replayer, replayed = record_and_replay(tmp_path, steps=1, format="verl", allow_pickle=True)
    assert (project_dir(tmp_path) / "1" / "0" / "tq_batch.pt").is_file()
    assert replayer.agent_loop.calls == 0
    (old_meta, old_data), = recorded[0]
    (new_meta, new_data), = replayed[0]
    assert sorted(content(v) for v in rows_by_uid(old_meta, old_data).values()) == \
        sorted(content(v) for v in rows_by_uid(new_meta, new_data).values())


def test_cache_written_by_verl_itself_is_injected(tmp_path):
    source = FIXTURES / "cache" / "fx_verl" / "GBS4_N2_in8_out6" / "3"
    target = tmp_path / "fx_verl" / "GBS4_N2_in8_out6" / "3"
    shutil.copytree(source, target)
    config = {
        "trainer": {"experiment_name": "fx", "project_name": "verl"},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout_tq": {"enable": True, "steps": [3], "dump_dir": str(tmp_path)}},
    }
    client = InProcessTQClient()
    SkipManager.init(config, tq_client=client)
    role = SkipManager.skip_instances["rollout_tq"]
    with pytest.raises(Exception, match="allow_pickle"):
        role.maybe_load_and_inject(3, ["a", "b", "c"])
    SkipManager.reset()
    config["skip"]["rollout_tq"]["allow_pickle"] = True
    SkipManager.init(config, tq_client=client)
    assert SkipManager.skip_instances["rollout_tq"].maybe_load_and_inject(3, ["a", "b", "c"])
    keys = ["a_0_0", "a_1_0", "b_0_0", "b_1_0", "c_0_0", "c_1_0"]
    got = client.kv_batch_get(keys=keys, partition_id="train")
    # verl recorded 3 uids x 2 sessions, in key order: prompt i gets recorded group i, session s row s
    expected = load_file(FIXTURES / "expected" / "tq_batch_step3.safetensors")
    assert got["reward_score"].tolist() == expected["reward_score"].tolist()
    responses = torch.nested.nested_tensor_from_jagged(expected["responses.values"], expected["responses.offsets"])
    assert [r.tolist() for r in got["responses"].unbind()] == [r.tolist() for r in responses.unbind()]
    tags = client.kv_list("train")["train"]
    assert all(tags[k]["global_steps"] == 3 and "is_prompt" not in tags[k] for k in keys)


def test_misaligned_prompts_are_reported(tmp_path, caplog):
    config = make_config(tmp_path, steps=[1])
    V1Trainer(config, InProcessTQClient()).fit(1)
    SkipManager.reset()
    caplog.set_level(logging.WARNING, logger="stepskip")
    aligned = V1Trainer(config, InProcessTQClient())
    aligned.fit(1)
    assert aligned.agent_loop.calls == 0 and "other prompts" not in caplog.text
    SkipManager.reset()
    shifted = V1Trainer(config, InProcessTQClient())
    shifted.next_prompt = 100  # another data order
    shifted.fit(1)
    assert shifted.agent_loop.calls == 0
    assert "recorded for other prompts" in caplog.text


def bound_role(tmp_path, **fields):
    """A RolloutTqSkip bound to an in-process queue, as SkipManager.init binds it: ``(role, queue)``."""
    from stepskip._identity import RunIdentity
    from stepskip.roles.base import RunContext
    from stepskip.roles.rollout_tq import RolloutTqSkip

    config = make_config(tmp_path, async_dump=False, **fields)
    tq = InProcessTQClient()
    role = RolloutTqSkip(config["skip"]["rollout_tq"], config)
    role.bind(RunContext(name="rollout_tq", run_id="r1", identity=RunIdentity.from_config(config),
                         runtime={"tq_client": tq}))
    return role, tq


def record_step_1(role, tq):
    """The agent loop puts step 1's trajectories (3 prompts x 2) in the queue; the sample phase records them."""
    from v1_harness import trajectory_fields

    from stepskip.tq import KVBatchMeta

    role.begin_recording(1)
    _, fields = trajectory_fields([0, 1, 2], 2, 1)
    keys = [f"u{p}_{s}_0" for p in range(3) for s in range(2)]
    tags = [{"global_steps": 1, "status": "finished"} for _ in keys]
    tq.kv_batch_put(keys=keys, fields=fields, tags=tags, partition_id="train")
    role.save_sample(1, KVBatchMeta(keys=keys, tags=tags, partition_id="train"))


def test_a_step_published_after_a_listing_is_seen_where_directory_times_never_change(tmp_path, monkeypatch):
    """A listing taken between the last inner entry's write and the step's publish (another thread
    of the trainer, here: inside the publish) must not hide the published step from ``repeat``, on a
    mount with fixed directory times (mountpoint-s3, goofys: one settled version, faked here)."""
    role, tq = bound_role(tmp_path, steps=[1, 2], action="repeat")
    monkeypatch.setattr(role.store, "dir_version", lambda path: (1, 2, 0, 0))
    publish = role.store.publish_dir

    def listed_meanwhile(staging, target):
        assert role.listed_steps() == []  # listed (and kept: its version is settled) before the step appears
        return publish(staging, target)

    monkeypatch.setattr(role.store, "publish_dir", listed_meanwhile)
    record_step_1(role, tq)
    assert (project_dir(tmp_path) / "1" / "0" / "meta.json").is_file()  # published
    assert role.listed_steps() == [1]
    assert role.resolve_load_step(2) == 1  # repeat finds it


def test_a_step_that_fails_to_publish_keeps_nothing_for_its_hint(tmp_path, monkeypatch):
    """The inner entries' metas kept for the step's prompt hint go with a step that is not published."""
    role, tq = bound_role(tmp_path, steps=[1], action="match")

    def refused(staging, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(role.store, "publish_dir", refused)
    record_step_1(role, tq)
    assert role.stats["dump_failures"] == 1
    assert [record.metas for record in role.step_commit.records.values()] == [{}]
