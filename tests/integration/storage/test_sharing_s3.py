"""Sharing a cache on a real S3-compatible server (moto in server mode): in-run retention (``max_keep``,
``max_bytes``, ``pin_steps``) and ``read_only``, through the public config; V1 steps are committed by
their manifest there (no directory renames), and retired commit point first."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from sharing_runs import Rollout, prompts, role_dir, run_flat, steps_in, training_config, tree, v1_config

from stepskip import SkipConfigError, SkipManager
from stepskip.errors import ReplayMissError
from stepskip._index import CacheIndex
from stepskip.tq import InProcessTQClient


@pytest.fixture
def s3(s3_server: str) -> tuple[str, dict[str, Any]]:
    import s3fs

    options = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/dump", options


def stats(role: str = "rollout") -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in SkipManager.stats().items() if k.startswith(f"skip/{role}/")}


def test_max_keep_and_pin_steps(s3: tuple[str, dict[str, Any]]) -> None:
    dump_dir, options = s3
    run_flat(training_config(dump_dir, options=options, max_keep=2, pin_steps=[1], async_dump=True), range(1, 6))
    assert steps_in(dump_dir, options=options) == [1, 4, 5]
    assert stats()["retired"] == 2 and stats()["dump_failures"] == 0
    SkipManager.reset()
    assert run_flat(training_config(dump_dir, options=options, max_keep=2, pin_steps=[1]), [1, 5]) == []  # both replay


def test_max_bytes(s3: tuple[str, dict[str, Any]]) -> None:
    dump_dir, options = s3
    run_flat(training_config(dump_dir, options=options), [1])
    index = CacheIndex(role_dir(dump_dir), options)
    size = index.tree_stats(f"{index.root}/1")[0]
    SkipManager.reset()
    capped = dump_dir + "-capped"
    run_flat(training_config(capped, options=options, max_bytes=int(size * 2.5)), range(1, 6))
    assert steps_in(capped, options=options) == [4, 5]


def test_a_stage_role(s3: tuple[str, dict[str, Any]]) -> None:
    dump_dir, options = s3
    run_flat(training_config(dump_dir, options=options, role="reward", max_keep=1), range(1, 4), role="reward")
    assert steps_in(dump_dir, role="reward", options=options) == [3]


def test_v1_steps_published_by_manifest(s3: tuple[str, dict[str, Any]]) -> None:
    from v1_harness import V1Trainer

    dump_dir, options = s3
    config = v1_config(dump_dir, sync=2, max_keep=2, storage_options=options)
    V1Trainer(config, InProcessTQClient(), prompts_per_step=4, sync_steps=2).fit(4)
    index = CacheIndex(f"{dump_dir}/exp_proj/GBS3_N2_in0_out0", options)
    steps = index.scan_run(index.root).steps
    assert [s.step for s in steps] == [3, 4] and all(s.valid and s.manifest is not None for s in steps)
    SkipManager.reset()
    replayer = V1Trainer(v1_config(dump_dir, sync=2, read_only=True, storage_options=options), InProcessTQClient(),
                         prompts_per_step=4, sync_steps=2)
    before = tree(dump_dir, options)
    replayer.fit(4)
    assert replayer.agent_loop.calls == 2  # steps 1 and 2 were retired: generated, and not recorded
    assert tree(dump_dir, options) == before


def test_read_only(s3: tuple[str, dict[str, Any]]) -> None:
    dump_dir, options = s3
    run_flat(training_config(dump_dir, options=options), [1, 2])
    SkipManager.reset()
    before = tree(dump_dir, options)
    assert run_flat(training_config(dump_dir, options=options, read_only=True, async_dump=True), [1, 2, 3]) == [3]
    assert stats()["dumps"] == 0 and stats()["dump_failures"] == 0
    SkipManager.reset()
    SkipManager.init(training_config(dump_dir, options=options, read_only=True, action="replay"))
    SkipManager.set_step(4)
    with pytest.raises(ReplayMissError):
        Rollout().generate_sequences(prompts(4))
    assert tree(dump_dir, options) == before


def test_start_up_errors(s3: tuple[str, dict[str, Any]]) -> None:
    dump_dir, options = s3
    for fields, expected in [({"max_keep": 0}, "max_keep = 0"), ({"steps": [1, 2], "pin_steps": [3]}, "names step 3"),
                             ({"read_only": True, "max_keep": 2}, "read_only = true never removes")]:
        with pytest.raises(SkipConfigError, match=expected):
            SkipManager.init(training_config(dump_dir, options=options, **fields))
        SkipManager.reset()
