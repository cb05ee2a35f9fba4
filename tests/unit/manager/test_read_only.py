"""``read_only: true``: a cache others recorded is replayed and never changed. Every test snapshots the
dump dir (names, sizes, modification times) before the run and compares it after; on a local dump dir
and on fsspec's memory:// store. The moto S3 server runs the same in
tests/integration/storage/test_sharing_s3.py."""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sharing_runs import Rollout, prompts, role_dir, run_flat, steps_in, training_config, tree, v1_config
from unprivileged import as_unprivileged, owned_tmp_dir

from stepskip import SkipConfigError, SkipManager
from stepskip.errors import ReplayMissError
from stepskip.tq import InProcessTQClient


@pytest.fixture(params=["local", "memory"])
def dump_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "dump") if request.param == "local" else f"memory://stepskip-{uuid.uuid4().hex[:8]}/dump"


def stats(role: str = "rollout") -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in SkipManager.stats().items() if k.startswith(f"skip/{role}/")}


@pytest.mark.parametrize("async_dump", [False, True])
def test_a_miss_is_generated_and_never_written(dump_dir: str, async_dump: bool) -> None:
    run_flat(training_config(dump_dir), [1, 2])
    SkipManager.reset()
    before = tree(dump_dir)
    generated = run_flat(training_config(dump_dir, read_only=True, async_dump=async_dump), [1, 2, 3, 4])
    assert generated == [3, 4]
    counted = stats()
    assert (counted["hits"], counted["misses"], counted["dumps"], counted["dump_failures"]) == (2, 2, 0, 0)
    assert tree(dump_dir) == before


def test_a_step_generated_under_read_only_is_generated_again_when_called_again(dump_dir: str) -> None:
    """The result of a miss is the caller's alone: nothing is kept for a later call of the same step."""
    run_flat(training_config(dump_dir), [1])
    SkipManager.reset()
    before = tree(dump_dir)
    assert run_flat(training_config(dump_dir, read_only=True), [2, 2]) == [2, 2]
    assert tree(dump_dir) == before


def test_replay_of_a_missing_step_raises(dump_dir: str) -> None:
    run_flat(training_config(dump_dir), [1])
    SkipManager.reset()
    before = tree(dump_dir)
    SkipManager.init(training_config(dump_dir, read_only=True, action="replay"))
    rollout = Rollout()
    SkipManager.set_step(1)
    rollout.generate_sequences(prompts(1))
    SkipManager.set_step(2)
    with pytest.raises(ReplayMissError, match="no entry for step 2"):
        rollout.generate_sequences(prompts(2))
    assert rollout.calls == [] and tree(dump_dir) == before


@pytest.mark.parametrize("action", ["repeat", "random", "match"])
def test_other_actions_replay_and_write_nothing(dump_dir: str, action: str) -> None:
    run_flat(training_config(dump_dir), [1, 2])
    SkipManager.reset()
    before = tree(dump_dir)
    SkipManager.init(training_config(dump_dir, read_only=True, action=action))
    rollout = Rollout()
    SkipManager.set_step(5)
    rollout.generate_sequences(prompts(1))  # step 1's prompts: match finds them, repeat/random a step
    SkipManager.set_step(6)
    rollout.generate_sequences(prompts(9))  # prompts never recorded: generated under match
    SkipManager.flush()
    assert rollout.calls == ([9] if action == "match" else [])
    assert stats()["dumps"] == 0 and tree(dump_dir) == before


def test_compare_keeps_its_drift_records_in_memory(dump_dir: str) -> None:
    run_flat(training_config(dump_dir), [1])
    SkipManager.reset()
    before = tree(dump_dir)
    run_flat(training_config(dump_dir, read_only=True, action="compare"), [1, 2])
    assert [r["step"] for r in SkipManager.drift("rollout")] == [1]
    assert tree(dump_dir) == before


def test_a_stage_role_writes_nothing(dump_dir: str) -> None:
    run_flat(training_config(dump_dir, role="reward"), [1], role="reward")
    SkipManager.reset()
    before = tree(dump_dir)
    assert run_flat(training_config(dump_dir, role="reward", read_only=True), [1, 2], role="reward") == [2]
    assert tree(dump_dir) == before


@pytest.mark.parametrize("sync", [1, 2])
def test_v1_steps_are_replayed_and_never_recorded(dump_dir: str, sync: int) -> None:
    from v1_harness import V1Trainer

    V1Trainer(v1_config(dump_dir, sync=sync), InProcessTQClient(), prompts_per_step=2 * sync, sync_steps=sync).fit(1)
    SkipManager.reset()
    before = tree(dump_dir)
    trainer = V1Trainer(v1_config(dump_dir, sync=sync, read_only=True), InProcessTQClient(),
                        prompts_per_step=2 * sync, sync_steps=sync)
    reads = trainer.fit(3)
    assert trainer.agent_loop.calls == 2  # steps 2 and 3 generated, step 1 replayed
    assert all(len(meta.keys) == 4 for per_step in reads for meta, _ in per_step)
    assert stats("rollout_tq")["dumps"] == 0 and tree(dump_dir) == before


def test_stale_leftovers_are_left_in_place(tmp_path: Path) -> None:
    """Start-up cleans up what crashed writers left, except under read_only (the same run without it removes them)."""
    dump_dir = str(tmp_path / "dump")
    run_flat(training_config(dump_dir), [1])
    SkipManager.reset()
    leftover = Path(role_dir(dump_dir)) / ".tmp-7-0123456789ab"
    leftover.mkdir()
    (leftover / "data").write_bytes(b"x")
    old = time.time() - 7 * 86400
    for path in (leftover / "data", leftover):
        os.utime(path, (old, old))
    before = tree(dump_dir)
    run_flat(training_config(dump_dir, read_only=True), [1])
    assert tree(dump_dir) == before
    SkipManager.reset()
    run_flat(training_config(dump_dir), [1])
    assert not leftover.exists()


def test_a_dump_dir_that_does_not_exist_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stepskip")
    missing = str(tmp_path / "not" / "there")
    assert run_flat(training_config(missing, read_only=True), [1]) == [1]
    assert not (tmp_path / "not").exists()
    assert any("does not exist" in r.getMessage() and "read_only" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"action": "record"}, "skip.rollout.action = 'record' writes every step"),
    ({"max_keep": 3}, "skip.rollout.max_keep is a retention setting"),
    ({"max_bytes": "1GB"}, "skip.rollout.max_bytes is a retention setting"),
    ({"pin_steps": [1]}, "skip.rollout.pin_steps is a retention setting"),
    ({"read_only": "yes"}, "skip.rollout.read_only = 'yes' (str) is not valid"),
])
def test_bad_read_only_settings_are_start_up_errors(tmp_path: Path, fields: dict[str, Any], expected: str) -> None:
    config = training_config(str(tmp_path), read_only=True)
    config["skip"]["rollout"].update(fields)
    with pytest.raises(SkipConfigError) as raised:
        SkipManager.init(config)
    assert expected in str(raised.value)


def test_the_store_refuses_every_change(dump_dir: str) -> None:
    run_flat(training_config(dump_dir), [1])
    SkipManager.reset()
    SkipManager.init(training_config(dump_dir, read_only=True))
    store = SkipManager.skip_instances["rollout"].store
    step = f"{role_dir(dump_dir)}/1"
    before = tree(dump_dir)
    for change in (lambda: store.write_entry(f"{role_dir(dump_dir)}/9", {"a": b"1"}, {"global_steps": 9}),
                   lambda: store.put_small(f"{role_dir(dump_dir)}/hint.json", b"{}"),
                   lambda: store.remove(step), lambda: store.retire_entry(step),
                   lambda: store.remove_leftovers(role_dir(dump_dir)),
                   lambda: store.publish_dir(f"{role_dir(dump_dir)}/.tmp-9-x", f"{role_dir(dump_dir)}/9")):
        with pytest.raises(PermissionError, match="skip.rollout.read_only is true"):
            change()
    assert all(isinstance(r, PermissionError) for r in store.write_entries([(f"{role_dir(dump_dir)}/8", {}, {})]))
    assert tree(dump_dir) == before and steps_in(dump_dir) == [1]


# --------------------------------------------------------------------------- a dump dir this process cannot write


def share_read_only(dump_dir: Path) -> dict[str, Any]:
    """Record steps 1-2, make the cache read-only (chmod 0555), then: the start-up error of action cache,
    and a read_only run over steps 1-3 (its calls, and whether the tree changed)."""
    run_flat(training_config(str(dump_dir)), [1, 2])
    SkipManager.reset()
    for directory, _, _ in os.walk(dump_dir):
        os.chmod(directory, 0o555)
    before = tree(str(dump_dir))
    try:
        SkipManager.init(training_config(str(dump_dir)))
        refused = None
    except SkipConfigError as err:
        refused = str(err)
    SkipManager.reset()
    calls = run_flat(training_config(str(dump_dir), read_only=True), [1, 2, 3])
    counted = stats()
    SkipManager.reset()
    return {"refused": refused, "calls": calls, "unchanged": tree(str(dump_dir)) == before,
            "failures": counted["dump_failures"]}


def test_an_unwritable_dump_dir_names_read_only_and_replays_under_it() -> None:
    with owned_tmp_dir() as dump_dir:
        seen = as_unprivileged(lambda: share_read_only(dump_dir))
    assert seen["refused"] is not None and "cannot write" in seen["refused"]
    assert "set skip.rollout.read_only = true" in seen["refused"]
    assert seen["calls"] == [3] and seen["unchanged"] and seen["failures"] == 0
