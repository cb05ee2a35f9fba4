"""Layered caches on a real S3-compatible server (moto in server mode): an S3 source under a local dump
dir and a local source under an S3 dump dir, ``replay_from`` an S3 run directory, V1 steps published by
manifest, a damaged source entry, and sources that cannot be reached. The source's server counts every
request it serves: reading a layer sends no PUT, POST or DELETE to it."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from skip_configs import run_path, training_config
from unreachable_stores import bad_credentials, closed_endpoint, s3_options

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip.testing import make_rollout_batch


class Loop:
    def __init__(self, marker: int) -> None:
        self.marker = marker
        self.calls: list[int] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls.append(SkipManager.step)
        batch = make_rollout_batch(4, 8, 6, n=2)
        batch.batch["marker"] = torch.full((len(batch),), 1000 * self.marker + SkipManager.step)
        return batch


def prompts() -> Batch:
    return Batch.from_dict(tensors={"input_ids": torch.arange(8).reshape(4, 2)},
                           non_tensors={"uid": [f"u{i}" for i in range(4)]})


def run(config: dict, steps: list[int], marker: int) -> tuple[Loop, dict[int, int]]:
    SkipManager.init(config)
    loop = Loop(marker)
    seen = {}
    for step in steps:
        SkipManager.set_step(step)
        seen[step] = int(loop.generate_sequences(prompts()).batch["marker"][0]) // 1000
    SkipManager.flush()
    SkipManager.reset()
    return loop, seen


def objects(options: dict[str, Any], url: str) -> dict[str, Any]:
    """Every object below ``url``: size, ETag and time (what a write of any kind changes)."""
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.invalidate_cache()
    return {key: (info.get("size"), info.get("ETag"), str(info.get("LastModified")))
            for key, info in fs.find(url, detail=True).items()}


def local_tree(root: Path) -> dict[str, Any]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns,
                                       hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def writes(requests: list[str], bucket: str) -> list[str]:
    """The requests that would change the bucket (the server saw them, whatever their outcome)."""
    return [r for r in requests if r.split(" ", 1)[0] in ("PUT", "POST", "DELETE") and f"/{bucket}" in r]


@pytest.fixture
def team(counting_s3) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    """A team cache on S3 holding steps 1 and 2 of the run (marker 1): its URL, options, and the requests
    its server serves from now on."""
    bucket = counting_s3.bucket()
    url = f"s3://{bucket}/team"
    loop, _ = run(training_config(url, steps=[1, 2], storage_options=counting_s3.options), [1, 2], marker=1)
    assert loop.calls == [1, 2]
    counting_s3.requests.clear()
    yield url, counting_s3.options, counting_s3.requests


def test_an_s3_source_under_a_local_dump_dir(team, tmp_path):
    url, options, requests = team
    before = objects(options, url)
    config = training_config(tmp_path, steps=[1, 2, 3], sources=[{"url": url, "storage_options": options}])
    loop, seen = run(config, [1, 2, 3], marker=2)
    assert seen == {1: 1, 2: 1, 3: 2} and loop.calls == [3]
    assert sorted(os.listdir(run_path(tmp_path))) == ["3"]  # hits are not copied; the miss is written here
    assert objects(options, url) == before
    assert writes(requests, url.split("/")[2]) == []
    bucket_requests = [r for r in requests if f"/{url.split('/')[2]}" in r]
    assert bucket_requests  # it was read


def test_a_source_string_takes_the_roles_storage_options(team, tmp_path):
    url, options, requests = team
    config = training_config(tmp_path, steps=[1], action="replay", sources=[url], storage_options=options)
    loop, seen = run(config, [1], marker=2)
    assert seen == {1: 1} and loop.calls == []
    assert writes(requests, url.split("/")[2]) == []


def test_a_local_source_under_an_s3_dump_dir(s3_server, tmp_path):
    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    team = tmp_path / "team"
    run(training_config(team, steps=[1]), [1], marker=1)
    before = local_tree(team)
    dump = f"s3://{bucket}/mine"
    SkipManager.init(training_config(dump, steps=[1, 2], sources=[str(team)], storage_options=options))
    loop = Loop(2)
    seen = {}
    for step in (1, 2):
        SkipManager.set_step(step)
        seen[step] = int(loop.generate_sequences(prompts()).batch["marker"][0]) // 1000
    SkipManager.flush()
    assert SkipManager.stats()["skip/rollout/hits_from/0"] == 1
    SkipManager.reset()
    assert seen == {1: 1, 2: 2} and loop.calls == [2]
    assert local_tree(team) == before
    run_name = "GBS4_N2_in8_out6/"
    written = {key.split(run_name, 1)[1].split("/")[0] for key in objects(options, dump) if run_name in key}
    assert written == {"2"}


def test_a_damaged_entry_of_an_s3_source_is_passed_over_and_left_as_it_is(team, tmp_path):
    import s3fs

    url, options, requests = team
    fs = s3fs.S3FileSystem(**options)
    step_dir = f"{url}/exp_proj/GBS4_N2_in8_out6/1"
    import json

    listed = json.loads(fs.cat_file(f"{step_dir}/meta.json"))["files"]["data.safetensors"]
    data = f"{step_dir}/{listed.get('object', 'data.safetensors')}"
    raw = bytearray(fs.cat_file(data))
    raw[-3] ^= 0xFF
    fs.pipe_file(data, bytes(raw))  # the test damages it; the run must not touch it again
    before = objects(options, url)
    requests.clear()
    loop, seen = run(training_config(tmp_path, steps=[1, 2], sources=[{"url": url, "storage_options": options}]),
                     [1, 2], marker=2)
    assert seen == {1: 2, 2: 1} and loop.calls == [1]
    assert objects(options, url) == before
    assert writes(requests, url.split("/")[2]) == []
    assert (run_path(tmp_path) / "1" / "meta.json").is_file()  # regenerated into the dump dir


def test_replay_from_an_s3_run_directory(team, tmp_path):
    url, options, requests = team
    run_dir = f"{url}/exp_proj/GBS4_N2_in8_out6"
    config = training_config(tmp_path, steps=[1, 2], action="replay", replay_from=run_dir, storage_options=options)
    config["trainer"]["experiment_name"] = "exp-b"
    SkipManager.init(config)
    loop = Loop(2)
    for step in (1, 2):
        SkipManager.set_step(step)
        loop.generate_sequences(prompts())
    assert SkipManager.stats()["skip/rollout/hits_from/replay_from"] == 2
    SkipManager.reset()
    assert loop.calls == [] and writes(requests, url.split("/")[2]) == []


def test_a_missing_replay_from_experiment_on_s3_lists_the_runs_there(team):
    url, options, _ = team
    config = training_config(url, steps=[1], replay_from={"experiment_name": "exq"}, storage_options=options)
    with pytest.raises(SkipConfigError, match=r"skip\.rollout\.replay_from = .*does not exist; the runs there: "
                                              r"s3://.*/team/exp_proj/GBS4_N2_in8_out6"):
        SkipManager.init(config)


def test_rollout_tq_steps_published_by_manifest_replay_from_an_s3_source(counting_s3, tmp_path):
    from v1_harness import V1Trainer

    from stepskip.tq import InProcessTQClient

    def config(dump_dir, **skip):
        return {"actor_rollout_ref": {"rollout": {"n": 2}}, "data": {"train_batch_size": 3},
                "trainer": {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 2}}},
                "skip": {"rollout_tq": {"enable": True, "steps": [1, 2], "dump_dir": str(dump_dir), **skip}}}

    url = f"s3://{counting_s3.bucket()}/team"
    V1Trainer(config(url, storage_options=counting_s3.options), InProcessTQClient(), prompts_per_step=4,
              sync_steps=2).fit(2)
    SkipManager.reset()
    assert any(key.endswith("/step.json") for key in objects(counting_s3.options, url))
    before = objects(counting_s3.options, url)
    counting_s3.requests.clear()
    replayer = V1Trainer(config(tmp_path, action="replay", sources=[url], storage_options=counting_s3.options),
                         InProcessTQClient(), prompts_per_step=4, sync_steps=2)
    replayer.fit(2)
    assert replayer.agent_loop.calls == 0
    assert SkipManager.stats()["skip/rollout_tq/hits_from/0"] == 2
    assert objects(counting_s3.options, url) == before
    assert writes(counting_s3.requests, url.split("/")[2]) == []


def test_a_source_that_cannot_be_reached_is_a_startup_error_naming_it(tmp_path, monkeypatch):
    bad_credentials(monkeypatch)
    (tmp_path / "team").mkdir()
    with closed_endpoint() as endpoint:
        unreachable = {"url": "s3://stepskip-cache/team", "storage_options": s3_options(endpoint)}
        with pytest.raises(SkipConfigError) as info:
            SkipManager.init(training_config(tmp_path / "d", sources=[str(tmp_path / "team"), unreachable]))
    message = str(info.value)
    assert message.startswith("skip.rollout.sources[1] = s3://stepskip-cache/team: cannot reach the object store")
    assert endpoint in message and "\n" not in message
    assert SkipManager.skip_instances == {}
