"""Layered caches through the public config on local disk: ``sources`` (read-only caches searched after
``dump_dir``) and ``replay_from`` (another run's recordings), for flat, stage and V1 roles, with their
start-up errors. Every test that reads a layer checks that nothing in it changed (bytes, times, names)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, CacheMissError, SkipConfigError, SkipManager
from stepskip.errors import FingerprintMismatchError, PromptMismatchError
from stepskip.testing import make_rollout_batch


class Loop:
    def __init__(self, marker: int = 0) -> None:
        self.calls: list[int] = []
        self.marker = marker

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls.append(SkipManager.step)
        batch = make_rollout_batch(4, 8, 6, n=2)
        batch.batch["marker"] = torch.full((len(batch),), 1000 * self.marker + SkipManager.step)  # which run, step
        return batch


def prompts(tag: str = "p") -> Batch:
    return Batch.from_dict(tensors={"input_ids": torch.arange(8).reshape(4, 2) + (7 if tag != "p" else 0)},
                           non_tensors={"uid": [f"{tag}{i}" for i in range(4)]})


def record(dump_dir: Any, steps: list[int], marker: int, **fields: Any) -> None:
    """A run recording ``steps`` into ``dump_dir`` (responses tagged with ``marker``)."""
    SkipManager.init(training_config(dump_dir, steps=steps, **fields))
    loop = Loop(marker)
    for step in steps:
        SkipManager.set_step(step)
        loop.generate_sequences(prompts())
    SkipManager.flush()
    SkipManager.reset()


def run(config: dict, steps: list[int], marker: int = 9, tag: str = "p") -> tuple[Loop, dict[int, int]]:
    """One run over ``steps``: the loop (which steps it generated) and the marker each step's result carries."""
    SkipManager.init(config)
    loop = Loop(marker)
    seen = {}
    for step in steps:
        SkipManager.set_step(step)
        seen[step] = int(loop.generate_sequences(prompts(tag)).batch["marker"][0]) // 1000
    SkipManager.flush()
    return loop, seen


def tree(root: Any) -> dict[str, Any]:
    """Every name below ``root`` with its kind, size, modification time and content digest."""
    out: dict[str, Any] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = ("dir", os.lstat(path).st_mtime_ns)
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = ("file", st.st_size, st.st_mtime_ns,
                                                hashlib.sha256(Path(path).read_bytes()).hexdigest())
    return out


def stat(name: str, role: str = "rollout") -> float:
    return SkipManager.stats().get(f"skip/{role}/{name}", 0.0)


# --------------------------------------------------------------------------- sources


def test_a_source_serves_what_the_dump_dir_lacks_and_is_never_written(tmp_path, caplog):
    team, mine = tmp_path / "team", tmp_path / "mine"
    record(team, [1, 2], marker=1)
    record(mine, [2], marker=2)
    before = tree(team)
    caplog.set_level(logging.INFO, logger="stepskip")
    loop, seen = run(training_config(mine, steps=[1, 2, 3], sources=[str(team)]), [1, 2, 3])
    assert seen == {1: 1, 2: 2, 3: 9}  # step 1 from the source, 2 from the dump dir (first), 3 generated
    assert loop.calls == [3]
    assert stat("hits") == 2 and stat("hits_from/0") == 1 and stat("misses") == 1
    # a hit from a source is not copied into the dump dir; the miss is written there, never to the source
    assert sorted(p.name for p in run_path(mine).iterdir()) == ["2", "3"]
    assert tree(team) == before
    hit = [r.getMessage() for r in caplog.records if " hit: step 1 " in r.getMessage()]
    assert len(hit) == 1 and "source 0" in hit[0] and str(run_path(team)) in hit[0]


def test_sources_are_searched_in_order(tmp_path):
    first, second, mine = tmp_path / "first", tmp_path / "second", tmp_path / "mine"
    record(first, [2], marker=1)
    record(second, [1, 2], marker=2)
    _, seen = run(training_config(mine, steps=[1, 2], action="replay", sources=[str(first), str(second)]), [1, 2])
    assert seen == {1: 2, 2: 1}
    assert stat("hits_from/0") == 1 and stat("hits_from/1") == 1
    assert not mine.exists()  # replay writes nothing, anywhere


def test_repeat_sees_the_steps_of_every_layer(tmp_path):
    team, mine = tmp_path / "team", tmp_path / "mine"
    record(team, [4], marker=1)
    record(mine, [1], marker=2)
    _, seen = run(training_config(mine, steps=[4, 5], action="repeat", sources=[str(team)]), [4, 5])
    assert seen == {4: 1, 5: 1}  # the nearest step is the source's: the layers read as one cache


@pytest.mark.parametrize("damage", ["truncated", "bit-flip"])
def test_a_damaged_entry_in_a_source_counts_as_missing_there_and_stays_untouched(tmp_path, caplog, damage):
    bad, good, mine = tmp_path / "bad", tmp_path / "good", tmp_path / "mine"
    record(bad, [1, 2], marker=1)
    record(good, [1], marker=2)
    data = run_path(bad) / "1" / "data.safetensors"
    raw = bytearray(data.read_bytes())
    if damage == "truncated":
        data.write_bytes(bytes(raw[:-5]))
    else:
        raw[-3] ^= 0xFF
        data.write_bytes(bytes(raw))
    before = tree(bad)
    caplog.set_level(logging.WARNING, logger="stepskip")
    loop, seen = run(training_config(mine, steps=[1, 2], sources=[str(bad), str(good)]), [1, 2])
    assert seen == {1: 2, 2: 1}  # step 1 passed over in the damaged source, read from the next one
    assert loop.calls == [] and stat("hits_from/1") == 1 and stat("hits_from/0") == 1
    assert tree(bad) == before
    assert any("source 0" in r.getMessage() and "counts as missing" in r.getMessage() for r in caplog.records)
    # with no other source, the step is generated and written to the dump dir; the source is kept as it was
    SkipManager.reset()
    loop, seen = run(training_config(tmp_path / "mine2", steps=[1], sources=[str(bad)]), [1])
    assert loop.calls == [1] and (run_path(tmp_path / "mine2") / "1" / "meta.json").is_file()
    assert tree(bad) == before


def test_an_entry_a_source_holds_that_this_stepskip_cannot_read_is_passed_over(tmp_path):
    team, mine = tmp_path / "team", tmp_path / "mine"
    record(team, [1], marker=1)
    meta_path = run_path(team) / "1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format"] = "format-of-a-later-stepskip"
    meta_path.write_text(json.dumps(meta))
    before = tree(team)
    loop, _ = run(training_config(mine, steps=[1], sources=[str(team)]), [1])
    assert loop.calls == [1]  # in the dump dir itself this entry would be an error; in a source it is not there
    assert tree(team) == before


def test_match_finds_prompt_groups_in_a_source(tmp_path):
    team, mine = tmp_path / "team", tmp_path / "mine"
    SkipManager.init(training_config(team, steps="all", action="match"))
    SkipManager.set_step(1)
    Loop(1).generate_sequences(prompts())
    SkipManager.flush()
    SkipManager.reset()
    before = tree(team)
    loop, seen = run(training_config(mine, steps="all", action="match", sources=[str(team)]), [7])
    assert loop.calls == [] and seen == {7: 1}  # the prompts of step 1, met again at step 7
    assert stat("hits_from/0") == 1  # under match: per entry read from the source
    assert tree(team) == before


# --------------------------------------------------------------------------- replay_from


def other_run(dump_dir: Any, **fields: Any) -> dict:
    config = training_config(dump_dir, **fields)
    config["trainer"]["experiment_name"] = "exp-b"
    return config


def test_replay_from_an_experiment_of_the_same_dump_dir(tmp_path):
    record(tmp_path, [1, 2], marker=1)
    before = tree(run_path(tmp_path))
    config = other_run(tmp_path, steps=[1, 2, 3], replay_from={"experiment_name": "exp", "project_name": "proj"})
    loop, seen = run(config, [1, 2, 3])
    assert seen == {1: 1, 2: 1, 3: 9} and loop.calls == [3]
    assert stat("hits_from/replay_from") == 2
    assert tree(run_path(tmp_path)) == before
    assert sorted(p.name for p in (tmp_path / "exp-b_proj" / "GBS4_N2_in8_out6").iterdir()) == ["3"]


def test_replay_from_a_run_directory_of_another_shape(tmp_path):
    team, mine = tmp_path / "team", tmp_path / "mine"
    record(team, [1], marker=1)  # GBS4_N2
    config = training_config(mine, gbs=8, steps=[1], action="replay", replay_from=str(run_path(team)))
    loop, seen = run(config, [1])
    assert seen == {1: 1} and loop.calls == []


def test_a_replay_from_run_that_does_not_exist_lists_the_runs_that_do(tmp_path):
    record(tmp_path, [1], marker=1)
    SkipManager.init(training_config(tmp_path, gbs=8, steps=[1]))  # a second run shape, exp_proj/GBS8_N2
    SkipManager.set_step(1)
    Loop().generate_sequences(prompts())
    SkipManager.flush()
    SkipManager.reset()
    with pytest.raises(SkipConfigError) as info:
        SkipManager.init(other_run(tmp_path, replay_from={"experiment_name": "exq", "project_name": "proj"}))
    message = str(info.value)
    assert message.startswith("skip.rollout.replay_from = ") and "does not exist" in message
    assert "exp_proj/GBS4_N2_in8_out6" in message and "exp_proj/GBS8_N2_in8_out6" in message
    assert message.index("GBS4_N2") < message.index("GBS8_N2")  # the closest match first
    with pytest.raises(SkipConfigError, match=r"replay_from = .*GBS4_N2_in8_out9.* does not exist.*GBS4_N2_in8_out6"):
        SkipManager.init(other_run(tmp_path, replay_from=str(tmp_path / "exp_proj" / "GBS4_N2_in8_out9")))
    assert SkipManager.skip_instances == {}


def test_fingerprint_and_prompt_messages_name_the_run_the_entry_came_from(tmp_path):
    team = tmp_path / "team"
    recorded = training_config(team, steps=[1])
    recorded["actor_rollout_ref"]["rollout"]["temperature"] = 0.7
    SkipManager.init(recorded)
    SkipManager.set_step(1)
    Loop(1).generate_sequences(prompts())
    SkipManager.flush()
    config = other_run(tmp_path / "mine", steps=[1], action="replay", on_mismatch="error",
                       replay_from=str(run_path(team)))
    config["actor_rollout_ref"]["rollout"]["temperature"] = 1.0
    with pytest.raises(FingerprintMismatchError, match=rf"replay_from, run directory {run_path(team)}.*temperature"):
        run(config, [1])
    config = other_run(tmp_path / "mine", steps=[1], action="replay", check_prompts="error",
                       replay_from=str(run_path(team)))
    config["actor_rollout_ref"]["rollout"]["temperature"] = 0.7
    with pytest.raises(PromptMismatchError, match=rf"run directory {run_path(team)}"):
        run(config, [1], tag="q")


def test_replay_from_and_sources_together_read_in_order(tmp_path):
    record(tmp_path / "dump", [1], marker=1)
    SkipManager.init(other_run(tmp_path / "team", steps=[1, 2]))  # a source holds this run's run directory
    for step in (1, 2):
        SkipManager.set_step(step)
        Loop(2).generate_sequences(prompts())
    SkipManager.flush()
    SkipManager.reset()
    config = other_run(tmp_path / "dump", steps=[1, 2], action="replay", sources=[str(tmp_path / "team")],
                       replay_from={"experiment_name": "exp"})
    _, seen = run(config, [1, 2])
    assert seen == {1: 1, 2: 2}  # replay_from first, then the sources
    assert stat("hits_from/replay_from") == 1 and stat("hits_from/0") == 1


# --------------------------------------------------------------------------- stage and V1 roles


def test_a_stage_role_reads_a_source(tmp_path):
    calls = []

    @SkipManager.annotate(role="reward")
    def score(batch):
        calls.append(SkipManager.step)
        return {"scores": torch.full((4,), float(SkipManager.step))}

    def config(dump_dir, **fields):
        return {"skip": {"reward": {"kind": "stage", "enable": True, "dump_dir": str(dump_dir), "steps": [1, 2],
                                    "async_dump": False, **fields}}}

    SkipManager.init(config(tmp_path / "team"))
    SkipManager.set_step(1)
    score(prompts())
    SkipManager.flush()
    before = tree(tmp_path / "team")
    SkipManager.init(config(tmp_path / "mine", sources=[str(tmp_path / "team")]))
    got = []
    for step in (1, 2):
        SkipManager.set_step(step)
        got.append(float(score(prompts())["scores"][0]))
    SkipManager.flush()
    assert got == [1.0, 2.0]
    assert calls == [1, 2] and stat("hits_from/0", "reward") == 1
    assert tree(tmp_path / "team") == before


def test_rollout_tq_replays_a_source_and_another_run(tmp_path):
    from v1_harness import V1Trainer

    from stepskip.tq import InProcessTQClient

    def config(dump_dir, experiment="exp", **skip):
        return {"trainer": {"experiment_name": experiment, "project_name": "proj"},
                "actor_rollout_ref": {"rollout": {"n": 2}}, "data": {"train_batch_size": 3},
                "skip": {"rollout_tq": {"enable": True, "steps": [1, 2], "dump_dir": str(dump_dir), **skip}}}

    recorder = V1Trainer(config(tmp_path / "team"), InProcessTQClient())
    recorder.fit(2)
    SkipManager.reset()
    before = tree(tmp_path / "team")
    replayer = V1Trainer(config(tmp_path / "mine", action="replay", sources=[str(tmp_path / "team")]),
                         InProcessTQClient())
    replayer.fit(2)
    assert replayer.agent_loop.calls == 0 and stat("hits_from/0", "rollout_tq") == 2
    SkipManager.reset()
    replayer = V1Trainer(config(tmp_path / "team", experiment="exp-b", action="replay",
                                replay_from={"experiment_name": "exp", "project_name": "proj"}), InProcessTQClient())
    replayer.fit(2)
    assert replayer.agent_loop.calls == 0 and stat("hits_from/replay_from", "rollout_tq") == 2
    assert tree(tmp_path / "team") == before
    assert not (tmp_path / "mine").exists()


# --------------------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(("sources", "expected"), [
    ("s3://bucket/cache", r"skip\.rollout\.sources = 's3://bucket/cache' is not valid; expected a list"),
    ([""], r"skip\.rollout\.sources\[0\] = '' is not valid"),
    ([3], r"skip\.rollout\.sources\[0\] = 3 is not valid"),
    (["s3://"], r"skip\.rollout\.sources\[0\] = 's3://' is not a URL"),
    (["://nowhere"], r"skip\.rollout\.sources\[0\] = '://nowhere' is not a URL"),
    ([{"path": "/x"}], r"skip\.rollout\.sources\[0\] = .* has the keys url \(required\)"),
])
def test_a_malformed_source_is_a_config_error(tmp_path, sources, expected):
    with pytest.raises(SkipConfigError, match=expected):
        SkipManager.init(training_config(tmp_path, sources=sources))


def test_a_source_that_cannot_be_opened_is_a_startup_error_naming_it(tmp_path):
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.sources\[1\] = .*nowhere.* does not exist"):
        SkipManager.init(training_config(tmp_path / "d", sources=[str(tmp_path), str(tmp_path / "nowhere")]))
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.sources\[0\]: .*nosuchfs://"):
        SkipManager.init(training_config(tmp_path / "d", sources=["nosuchfs://bucket/cache"]))
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.sources\[0\] = .* is the dump_dir"):
        SkipManager.init(training_config(tmp_path, sources=[str(tmp_path)]))
    assert SkipManager.skip_instances == {}


@pytest.mark.parametrize(("replay_from", "expected"), [
    (3, r"replay_from = 3 is not valid"),
    ("  ", r"replay_from = '  ' is not valid"),
    ({"experiment": "x"}, r"replay_from has unknown key\(s\) 'experiment'"),
    ({"experiment_name": ""}, r"replay_from\.experiment_name = '' is not valid"),
    ({"experiment_name": "exp", "project_name": "proj"}, r"names this run's own experiment"),
])
def test_a_malformed_replay_from_is_a_config_error(tmp_path, replay_from, expected):
    with pytest.raises(SkipConfigError, match=expected):
        SkipManager.init(training_config(tmp_path, replay_from=replay_from))


def test_match_with_a_run_directory_to_replay_from_is_refused_at_startup(tmp_path):
    record(tmp_path, [1], marker=1)
    with pytest.raises(SkipConfigError, match=r"replay_from = .*action 'match'.*experiment_name"):
        SkipManager.init(other_run(tmp_path, steps="all", action="match", replay_from=str(run_path(tmp_path))))


def test_a_disabled_role_opens_no_layer(tmp_path):
    config = training_config(tmp_path, sources=[str(tmp_path / "nowhere")])
    config["skip"]["rollout"]["enable"] = False
    SkipManager.init(config)  # nothing to read: nothing opened, nothing refused
    assert isinstance(SkipManager.skip_instances, dict)


def test_without_layers_the_store_is_the_dump_dirs_own(tmp_path):
    SkipManager.init(training_config(tmp_path))
    store = SkipManager.skip_instances["rollout"].store
    assert type(store).__name__ == "EntryStore"
    assert "hits_from/0" not in " ".join(SkipManager.stats())


def test_a_replay_miss_names_every_layer(tmp_path):
    record(tmp_path / "team", [1], marker=1)
    with pytest.raises(CacheMissError):
        run(training_config(tmp_path / "mine", steps=[2], action="replay", sources=[str(tmp_path / "team")]), [2])


def test_match_finds_prompt_groups_in_the_run_replay_from_names(tmp_path):
    SkipManager.init(training_config(tmp_path, steps="all", action="match"))
    SkipManager.set_step(1)
    Loop(1).generate_sequences(prompts())
    SkipManager.flush()
    SkipManager.reset()
    before = tree(tmp_path / "exp_proj")
    loop, seen = run(other_run(tmp_path, steps="all", action="match", replay_from={"experiment_name": "exp"}), [5])
    assert loop.calls == [] and seen == {5: 1}
    assert stat("hits_from/replay_from") == 1
    assert tree(tmp_path / "exp_proj") == before
