"""In-run retention: ``max_keep``, ``max_bytes`` and ``pin_steps`` remove recorded steps after each commit,
as ``stepskip prune`` removes them; on a local dump dir and on fsspec's memory:// store (the object-store
path: commit points first, no directory renames). The moto S3 server runs the same in
tests/integration/storage/test_sharing_s3.py."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from sharing_runs import role_dir, run_flat, steps_in, training_config, v1_config

from stepskip import SkipConfigError, SkipManager
from stepskip._index import CacheIndex
from stepskip.tq import InProcessTQClient


@pytest.fixture(params=["local", "memory"])
def dump_dir(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(tmp_path / "dump") if request.param == "local" else f"memory://stepskip-{uuid.uuid4().hex[:8]}/dump"


def stats(role: str = "rollout") -> dict[str, float]:
    return {k.rsplit("/", 1)[1]: v for k, v in SkipManager.stats().items() if k.startswith(f"skip/{role}/")}


def test_max_keep_keeps_the_newest_steps_and_the_pinned_ones(dump_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stepskip")
    generated = run_flat(training_config(dump_dir, max_keep=3, pin_steps=[2]), range(1, 9))
    assert generated == list(range(1, 9))
    assert steps_in(dump_dir) == [2, 6, 7, 8]  # pinned 2 is not one of the three
    counted = stats()
    assert counted["retired"] == 4 and counted["retired_bytes"] > 0 and counted["dump_failures"] == 0
    lines = [r.getMessage() for r in caplog.records if "retired:" in r.getMessage()]
    assert len(lines) == 4  # one line per removal, with step, path and bytes
    assert "step 1 removed from " in lines[0] and f"{role_dir(dump_dir)}/1" in lines[0] and " bytes" in lines[0]
    # what stays replays: a new run hits the kept steps and generates the removed ones
    SkipManager.reset()
    assert run_flat(training_config(dump_dir, max_keep=3, pin_steps=[2]), [2, 3, 8]) == [3]


def test_retention_runs_on_the_dump_thread_under_async_dump(dump_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stepskip._retention")
    run_flat(training_config(dump_dir, max_keep=2, async_dump=True), range(1, 6))
    assert steps_in(dump_dir) == [4, 5]
    threads = {r.threadName for r in caplog.records if "retired:" in r.getMessage()}
    assert threads and threading.current_thread().name not in threads


def test_max_bytes_removes_the_lowest_steps_until_the_directory_fits(dump_dir: str) -> None:
    run_flat(training_config(dump_dir), [1])
    index = CacheIndex(role_dir(dump_dir))
    size = index.tree_stats(f"{index.root}/1")[0]
    SkipManager.reset()
    other = dump_dir + "-capped"
    run_flat(training_config(other, max_bytes=int(size * 2.5)), range(1, 7))
    assert steps_in(other) == [5, 6]
    assert stats()["retired"] == 4
    SkipManager.reset()
    # a cap below one step keeps the step just recorded alone
    tiny = dump_dir + "-tiny"
    run_flat(training_config(tiny, max_bytes=1), range(1, 4))
    assert steps_in(tiny) == [3]


def test_max_bytes_takes_sizes(dump_dir: str) -> None:
    run_flat(training_config(dump_dir, max_bytes="1KiB", steps="all", pin_steps="1-2"), range(1, 6))
    assert steps_in(dump_dir) == [1, 2, 5]  # pinned steps stay even when they alone pass the cap


def test_a_stage_role_keeps_its_own_directory(dump_dir: str) -> None:
    run_flat(training_config(dump_dir, role="reward", max_keep=2), range(1, 6), role="reward")
    assert steps_in(dump_dir, role="reward") == [4, 5]
    assert stats("reward")["retired"] == 3


@pytest.mark.parametrize("sync", [1, 2])
def test_v1_steps_are_retired_whole_once_published(dump_dir: str, sync: int) -> None:
    from v1_harness import V1Trainer

    config = v1_config(dump_dir, sync=sync, max_keep=2, pin_steps=[1])
    trainer = V1Trainer(config, InProcessTQClient(), prompts_per_step=2 * sync, sync_steps=sync)
    trainer.fit(5)
    run = f"{dump_dir}/exp_proj/GBS3_N2_in0_out0"
    index = CacheIndex(run)
    assert [s.step for s in index.scan_run(index.root).steps] == [1, 4, 5]
    assert all(s.valid for s in index.scan_run(index.root).steps)
    assert stats("rollout_tq")["retired"] == 2
    SkipManager.reset()
    replayer = V1Trainer(config, InProcessTQClient(), prompts_per_step=2 * sync, sync_steps=sync)
    replayer.fit(2)
    assert replayer.agent_loop.calls == 1  # step 1 (pinned) replays, step 2 was removed and is generated


def test_a_step_being_read_is_not_removed(dump_dir: str) -> None:
    """A commit's retention pass that runs while step 1 is being read (here: from inside the store's read)
    leaves step 1 alone; so does the next pass, step 1 being the step read last."""
    run_flat(training_config(dump_dir), [1, 2])
    SkipManager.reset()
    SkipManager.init(training_config(dump_dir, max_keep=1))
    role: Any = SkipManager.skip_instances["rollout"]
    assert role.retention is not None
    read_entry = role.store.read_entry
    during: list[list[str]] = []

    def reading(*args: Any, **kwargs: Any) -> Any:
        during.append(role.retention.apply({2}))
        return read_entry(*args, **kwargs)

    role.store.read_entry = reading
    from sharing_runs import Rollout, prompts

    rollout = Rollout()
    SkipManager.set_step(1)
    rollout.generate_sequences(prompts(1))
    assert rollout.calls == [] and during == [[]]  # replayed whole, nothing removed meanwhile
    assert steps_in(dump_dir) == [1, 2]
    role.store.read_entry = read_entry
    SkipManager.set_step(3)
    rollout.generate_sequences(prompts(3))  # generated and committed: step 2 goes, step 1 (read last) stays
    SkipManager.flush()
    assert steps_in(dump_dir) == [1, 3]


def test_an_entry_this_stepskip_cannot_read_is_never_removed(tmp_path: Path) -> None:
    dump_dir = str(tmp_path / "dump")
    run_flat(training_config(dump_dir), [1, 2])
    meta_path = Path(role_dir(dump_dir)) / "1" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["format"] = "format-of-a-newer-stepskip"
    meta_path.write_text(json.dumps(meta))
    SkipManager.reset()
    run_flat(training_config(dump_dir, max_keep=1), [3, 4])
    assert steps_in(dump_dir) == [1, 4]


def test_a_failing_pass_is_logged_and_the_run_goes_on(dump_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("listing refused")

    monkeypatch.setattr(CacheIndex, "scan_step", broken)
    assert run_flat(training_config(dump_dir, max_keep=1), range(1, 4)) == [1, 2, 3]
    assert steps_in(dump_dir) == [1, 2, 3]
    assert stats()["dumps"] == 3 and stats()["dump_failures"] == 0
    assert any("retention: not applied" in r.getMessage() and "listing refused" in r.getMessage() for r in caplog.records)


def test_retention_off_costs_no_counter(dump_dir: str) -> None:
    run_flat(training_config(dump_dir), [1])
    assert "retired" not in stats()
    assert SkipManager.skip_instances["rollout"].retention is None


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_keep": 0}, "skip.rollout.max_keep = 0 is not valid"),
    ({"max_keep": -3}, "skip.rollout.max_keep = -3 is not valid"),
    ({"max_keep": "8"}, "skip.rollout.max_keep = '8' is not valid"),
    ({"max_keep": True}, "skip.rollout.max_keep = True is not valid"),
    ({"max_bytes": 0}, "skip.rollout.max_bytes = 0 is not valid"),
    ({"max_bytes": -1}, "skip.rollout.max_bytes = -1 is not valid"),
    ({"max_bytes": "lots"}, "skip.rollout.max_bytes = 'lots' is not valid"),
    ({"steps": [1, 2, 3], "pin_steps": [3, 9]}, "skip.rollout.pin_steps = [3, 9] names step 9"),
    ({"steps": "1-10", "pin_steps": "5-12"}, "names step 11"),
    ({"pin_steps": "x"}, "skip.rollout.pin_steps contains 'x'"),
])
def test_bad_retention_settings_are_start_up_errors(tmp_path: Path, fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(SkipConfigError, match="expected|pin steps from|steps are") as raised:
        SkipManager.init(training_config(str(tmp_path), **fields))
    assert expected in str(raised.value)
    assert not list(tmp_path.iterdir())


def test_pin_steps_may_name_any_step_when_steps_is_all(tmp_path: Path) -> None:
    SkipManager.init(training_config(str(tmp_path), steps="all", pin_steps=[10**6], max_keep=2))


def test_a_role_bound_again_removes_steps_in_its_new_directory(tmp_path: Path) -> None:
    """A role used before ``SkipManager.init`` (bound to the run its config names) and then bound to
    another run applies retention to the new run's directory, not to the first one's."""
    from sharing_runs import prompts

    from stepskip._identity import RunIdentity
    from stepskip.roles import RolloutSkip
    from stepskip.roles.base import RunContext

    config = training_config(str(tmp_path), max_keep=1)
    role = RolloutSkip(config["skip"]["rollout"], config)
    for step in (1, 2):
        role.prepare_data(step, prompts(step))
    other = training_config(str(tmp_path), max_keep=1)
    other["trainer"]["experiment_name"] = "other"
    role.bind(RunContext(name="rollout", run_id="second", identity=RunIdentity.from_config(other)))
    for step in (3, 4):
        role.prepare_data(step, prompts(step))
    assert sorted(int(p.name) for p in (tmp_path / "exp_proj" / "GBS4_N2_in8_out6").iterdir()) == [2]
    assert sorted(int(p.name) for p in (tmp_path / "other_proj" / "GBS4_N2_in8_out6").iterdir()) == [4]
