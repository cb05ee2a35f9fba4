"""``stepskip convert``: verl's own caches to safe (replayed without pickle), safe to verl, pickle refused."""

from __future__ import annotations

import json
import os
import shutil

from cli_caches import FIXTURE_RUN, ROLLOUT_STEPS, SAFE_RUN, V1_RUN, replay_rollout
from cli_run import stepskip
from v1_harness import V1Trainer

from stepskip import SkipManager
from stepskip._index import CacheIndex
from stepskip.tq import InProcessTQClient


def v1_rows(data, keys) -> list[tuple]:
    """Trajectory contents independent of keys and order."""
    return sorted((tuple(data["prompts"][i].tolist()), tuple(data["responses"][i].tolist()),
                   float(data["reward_score"][i]), str(data["messages"][i])) for i in range(len(keys)))


def replay_fixture_v1(dump_dir, **skip) -> tuple:
    """Run three V1 trainer steps over the fixture's run shape; step 3 must replay the cached step."""
    config = {
        "trainer": {"experiment_name": "fx", "project_name": "verl"},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout_tq": {"enable": True, "dump_dir": str(dump_dir), "steps": [3], "action": "replay", **skip}},
    }
    trainer = V1Trainer(config, InProcessTQClient(), prompts_per_step=3, n=2)
    reads = trainer.fit(3)
    SkipManager.reset()
    (meta, data), = reads[2]
    return trainer, meta, data


def test_convert_verl_written_cache_to_safe_and_replay_it_without_pickle(copy_cache, tmp_path, exact):
    dump = copy_cache("dump")
    out = tmp_path / "converted"
    refused = stepskip("convert", dump / "fx_verl", tmp_path / "refused", "--to", "safe")
    converted = stepskip("convert", dump / "fx_verl", out, "--to", "safe", "--allow-pickle", "--json")

    result = refused
    assert result.code == 2, result
    assert "--allow-pickle" in result.err and not (tmp_path / "refused").exists()

    result = converted
    assert result.code == 0, result
    report = result.json()
    assert report["ok"] and len(report["converted"]) == 3
    assert {(c["source_format"], c["dest_format"]) for c in report["converted"]} == {("verl", "safe"),
                                                                                     ("verl-tq", "safe")}
    for step, extra in (("1", {}), ("2", {}), ("3/0", {"num_trajectories": 6})):
        meta = json.loads((out / FIXTURE_RUN / step / "meta.json").read_text())
        assert meta["format"] == "safe" and meta["converted_from"] in ("verl", "verl-tq")
        assert meta["global_steps"] == int(step[0]) and all(meta[k] == v for k, v in extra.items())
        assert sorted(meta["files"]) == ["data.json", "data.safetensors"]
    assert not list((out / FIXTURE_RUN).rglob("*.dp")) and not list((out / FIXTURE_RUN).rglob("*.pt"))

    # Replays through SkipManager with allow_pickle false and equals what verl's files hold.
    original = replay_rollout(dump, "fx", "verl", [1, 2], allow_pickle=True)
    replayed = replay_rollout(out, "fx", "verl", [1, 2])
    for step in (1, 2):
        exact(replayed[step], original[step])

    trainer, meta, data = replay_fixture_v1(out)
    assert trainer.agent_loop.calls == 2  # steps 1 and 2 generated, step 3 replayed
    index = CacheIndex(str(dump))
    cached = index.read_entry(index.scan_run(str(dump / FIXTURE_RUN)).steps[-1].entries[0], allow_pickle=True)
    assert v1_rows(data, meta.keys) == v1_rows(cached["tensordict"], cached["keys"])


def test_convert_safe_cache_to_verl(copy_cache, tmp_path, exact):
    dump = copy_cache("dump")
    for other in (f"{SAFE_RUN}/reward", "exp_verlfmt", "fx_verl"):  # keep the two runs in format safe
        shutil.rmtree(dump / other)
    out = tmp_path / "verl"
    result = stepskip("convert", dump, out, "--to", "verl")

    assert result.code == 0, result
    assert f"converted {len(ROLLOUT_STEPS) + 6} entries to verl" in result.out
    for step in ROLLOUT_STEPS:
        assert sorted(os.listdir(out / SAFE_RUN / str(step))) == ["gen_batch.dp", "meta.json"]
    original = replay_rollout(dump, "exp", "proj", ROLLOUT_STEPS)
    exported = replay_rollout(out, "exp", "proj", ROLLOUT_STEPS, allow_pickle=True)
    for step in ROLLOUT_STEPS:
        exact(exported[step], original[step])

    src_index, dst_index = CacheIndex(str(dump)), CacheIndex(str(out))
    source, target = src_index.scan_run(str(dump / V1_RUN)), dst_index.scan_run(str(out / V1_RUN))
    assert [(s.step, [e.inner for e in s.entries]) for s in target.steps] == \
           [(s.step, [e.inner for e in s.entries]) for s in source.steps]
    for src_step, dst_step in zip(source.steps, target.steps):
        for src, dst in zip(src_step.entries, dst_step.entries):
            assert sorted(os.listdir(dst.path)) == ["meta.json", "tq_batch.pt"]
            assert dst.format == "verl-tq" and dst.run_id == src.run_id  # the step stays one run's
            assert dst.meta["num_trajectories"] == src.meta["num_trajectories"]
            exact(dst_index.read_entry(dst, allow_pickle=True), src_index.read_entry(src, allow_pickle=False))
