"""The cached-role core: one directory per role, the recorded role checked, unreadable entries kept,
a lifecycle without I/O in constructors, and verl's names on the role objects."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import (
    SKIP_REGISTRY,
    Batch,
    CacheMissError,
    RolloutSkip,
    RolloutSkipConfig,
    SkipManager,
    SkipRoleConfig,
    UnreadableEntryError,
    register_skip,
)
from stepskip._storage import TMP_PREFIX, checksum
from stepskip.errors import ReplayMissError
from stepskip.roles import RunContext


def batch(value: float, rows: int = 2) -> Batch:
    return Batch.from_dict(tensors={"x": torch.full((rows, 2), value)}, non_tensors={"uid": [f"u{i}" for i in range(rows)]})


PROMPTS = Batch.from_dict(non_tensors={"uid": ["p0", "p1"]})


class Worker:
    def __init__(self) -> None:
        self.calls: list[str] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls.append("rollout")
        return batch(1.0)

    @SkipManager.annotate(role="ref_log_prob")
    def compute_ref_log_prob(self, prompts):
        self.calls.append("ref_log_prob")
        return batch(2.0)


@pytest.fixture
def ref_log_prob_role():
    """The docs' custom-role recipe (docs/own-trainer.md): a RolloutSkip subclass registered under another name."""

    @dataclass
    class RefLogProbSkipConfig(SkipRoleConfig):
        section: ClassVar[str] = "skip.ref_log_prob"
        min_rows: int = 1

    @register_skip("ref_log_prob")
    class RefLogProbSkip(RolloutSkip):
        config_class = RefLogProbSkipConfig

    yield RefLogProbSkip
    SKIP_REGISTRY.pop("ref_log_prob", None)


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_custom_role_recipe_cannot_collide_with_rollout(tmp_path, ref_log_prob_role):
    config = training_config(tmp_path)
    config["skip"]["ref_log_prob"] = dict(config["skip"]["rollout"])
    for _ in range(2):  # record, then replay in a new run
        SkipManager.init(config)
        SkipManager.set_step(1)
        worker = Worker()
        rollout_out = worker.generate_sequences(PROMPTS)
        ref_out = worker.compute_ref_log_prob(PROMPTS)
        assert float(rollout_out.batch["x"][0, 0]) == 1.0 and float(ref_out.batch["x"][0, 0]) == 2.0
    assert worker.calls == []  # both replayed, each from its own entry
    run = run_path(tmp_path)
    assert json.loads((run / "1" / "meta.json").read_text())["role"] == "rollout"
    assert json.loads((run / "ref_log_prob" / "1" / "meta.json").read_text())["role"] == "ref_log_prob"


def _record_one(tmp_path, **fields) -> Path:
    SkipManager.init(training_config(tmp_path, **fields))
    SkipManager.set_step(1)
    Worker().generate_sequences(PROMPTS)
    return run_path(tmp_path) / "1"


def _rewrite_meta(entry: Path, **changes) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta.update(changes)
    (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("action", ["cache", "repeat", "random", "replay"])
def test_an_entry_of_another_role_is_unreadable_and_kept(tmp_path, action):
    entry = _record_one(tmp_path)
    _rewrite_meta(entry, role="ref_log_prob")  # what the old recipe wrote into rollout's directory
    before = tree_digest(entry)
    SkipManager.init(training_config(tmp_path, action=action))
    SkipManager.set_step(1)
    worker = Worker()
    with pytest.raises(UnreadableEntryError, match="recorded by role 'ref_log_prob'"):
        worker.generate_sequences(PROMPTS)
    assert worker.calls == [] and tree_digest(entry) == before


@pytest.mark.parametrize("action", ["cache", "repeat", "replay"])
def test_an_unknown_format_is_unreadable_never_regenerated_over(tmp_path, action):
    entry = _record_one(tmp_path)
    _rewrite_meta(entry, format="safe-v9")
    before = tree_digest(entry)
    SkipManager.init(training_config(tmp_path, action=action))
    SkipManager.set_step(1)
    worker = Worker()
    with pytest.raises(UnreadableEntryError) as info:
        worker.generate_sequences(PROMPTS)
    message = str(info.value)
    assert str(entry) in message and "newer stepskip" in message and "action: record" in message
    SkipManager.flush()
    assert worker.calls == [] and tree_digest(entry) == before
    assert SkipManager.stats()["skip/rollout/corrupt"] == 0


def test_record_replaces_an_unreadable_entry(tmp_path):
    entry = _record_one(tmp_path)
    _rewrite_meta(entry, format="safe-v9")
    SkipManager.init(training_config(tmp_path, action="record"))
    SkipManager.set_step(1)
    worker = Worker()
    worker.generate_sequences(PROMPTS)
    SkipManager.flush()
    assert worker.calls == ["rollout"]
    assert json.loads((entry / "meta.json").read_text())["format"] == "safe"


def test_repeat_passes_over_an_unreadable_neighbour_without_touching_it(tmp_path):
    SkipManager.init(training_config(tmp_path))
    worker = Worker()
    for step in (1, 2):
        SkipManager.set_step(step)
        worker.generate_sequences(PROMPTS)
    newer = run_path(tmp_path) / "2"
    _rewrite_meta(newer, format="safe-v9")
    before = tree_digest(newer)
    SkipManager.init(training_config(tmp_path, action="repeat"))
    SkipManager.set_step(3)
    assert SkipManager.skip_instances["rollout"].resolve_load_step(3) == 1
    out = worker.generate_sequences(PROMPTS)
    assert float(out.batch["x"][0, 0]) == 1.0 and worker.calls == ["rollout", "rollout"]
    assert tree_digest(newer) == before


def test_intact_bytes_that_do_not_decode_are_unreadable(tmp_path):
    entry = _record_one(tmp_path)
    tree = b'{"format": "safe", "version": 1, "root": {"kind": "no-such-node"}}'
    (entry / "data.json").write_bytes(tree)
    meta = json.loads((entry / "meta.json").read_text())
    meta["files"]["data.json"].update(bytes=len(tree), checksum=checksum(tree))  # intact by its checksums
    (entry / "meta.json").write_text(json.dumps(meta))
    before = tree_digest(entry)
    for verify in (True, False):
        SkipManager.init(training_config(tmp_path, verify=verify))
        SkipManager.set_step(1)
        with pytest.raises(UnreadableEntryError, match="cannot be decoded.*match their checksums"):
            Worker().generate_sequences(PROMPTS)
        SkipManager.flush()
        assert tree_digest(entry) == before


def _newer_tree(text: str, how: str) -> str:
    if how == "value tag":
        assert '"__t":"tuple"' in text
        return text.replace('"__t":"tuple"', '"__t":"tuple-v9"')
    tree = json.loads(text)
    tree["version"] = 99
    return json.dumps(tree)


@pytest.mark.parametrize("how", ["value tag", "tree version"])
def test_intact_bytes_of_a_newer_stepskip_are_unreadable_and_never_regenerated_over(tmp_path, how):
    """A value tag (or tree version) this stepskip does not know, in an entry whose checksums match:
    written by a newer stepskip, so it is said and left untouched, never counted damaged and replaced."""
    from stepskip._formats.safe import SafeFormat

    entry = _record_one(tmp_path)
    value = batch(1.0)
    value.non_tensor_batch["pair"] = np.array([(1, 2), (3, 4)] + [None], dtype=object)[:2]
    fmt = SafeFormat()
    files = fmt.encode(fmt.freeze(value, copy=True))
    files["data.json"] = _newer_tree(files["data.json"].decode(), how).encode()
    meta = json.loads((entry / "meta.json").read_text())
    for name, data in files.items():
        (entry / name).write_bytes(data)
        meta["files"][name].update(bytes=len(data), checksum=checksum(data))  # intact by its checksums
    (entry / "meta.json").write_text(json.dumps(meta))
    before = tree_digest(entry)
    SkipManager.init(training_config(tmp_path))
    SkipManager.set_step(1)
    worker = Worker()
    with pytest.raises(UnreadableEntryError):
        worker.generate_sequences(PROMPTS)
    SkipManager.flush()
    assert worker.calls == [] and SkipManager.stats()["skip/rollout/corrupt"] == 0
    assert tree_digest(entry) == before


def test_bytes_that_fail_their_checksum_are_damage_and_regenerated(tmp_path):
    entry = _record_one(tmp_path)
    size = len((entry / "data.json").read_bytes())
    (entry / "data.json").write_bytes(b"{" * size)  # same size: only its checksum (or its decoder) can tell
    SkipManager.init(training_config(tmp_path, verify=False))  # not verified up front: found by the decode
    SkipManager.set_step(1)
    worker = Worker()
    worker.generate_sequences(PROMPTS)
    SkipManager.flush()
    assert worker.calls == ["rollout"]
    stats = SkipManager.stats()
    assert stats["skip/rollout/corrupt"] >= 1 and stats["skip/rollout/dumps"] == 1


def test_constructors_do_no_io_and_bind_starts_the_role(tmp_path):
    run = run_path(tmp_path)
    leftover = run / f"{TMP_PREFIX}1-0123456789ab"
    leftover.mkdir(parents=True)
    os.utime(leftover, (0, 0))
    config = training_config(tmp_path)
    role = RolloutSkip(config["skip"]["rollout"], config)
    assert leftover.exists()  # nothing touched yet
    from stepskip._identity import RunIdentity

    role.bind(RunContext(name="rollout", run_id="r1", identity=RunIdentity.from_config(config)))
    assert not leftover.exists()
    assert role.name == "rollout" and role.run_id == "r1" and role.step_dump_dir(1) == str(run / "1")


def test_a_role_used_before_init_binds_itself_on_first_use_and_starts(tmp_path):
    run = run_path(tmp_path)
    leftover = run / f"{TMP_PREFIX}1-0123456789ab"
    leftover.mkdir(parents=True)
    os.utime(leftover, (0, 0))
    config = training_config(tmp_path)
    role = RolloutSkip(config["skip"]["rollout"], config)
    assert leftover.exists() and role.run_id == ""  # nothing touched, no run yet
    assert role.step_dump_dir(1) == str(run / "1")  # the run its config names, as SkipManager.init would bind it
    assert not leftover.exists() and role.name == "rollout" and len(role.run_id) == 32


def test_the_role_keeps_verls_names(tmp_path):
    config = training_config(tmp_path, steps=[1, "3-5"], action="repeat")
    SkipManager.init(config)
    role = SkipManager.skip_instances["rollout"]
    assert role.steps == [1, "3-5"] and isinstance(role.local_config, RolloutSkipConfig)
    assert (role.gbs, role.n, role.prompt_len, role.response_len) == (4, 2, 8, 6)
    assert (role.prompt_length, role.response_length, role.exp_name, role.project_name) == (8, 6, "exp", "proj")
    assert role._get_step_dump_dir(3) == run_path(tmp_path) / "3"
    assert role._get_project_dump_dir() == run_path(tmp_path)
    assert role._get_available_steps() == [] and role._find_latest_step(4) == -1
    with pytest.raises(ReplayMissError) as info:
        role.warp_function(3, None, None, PROMPTS)  # verl raises RuntimeError for a missing repeat dump
    assert isinstance(info.value, CacheMissError) and isinstance(info.value, RuntimeError)
    SkipManager.set_step(3)
    Worker().generate_sequences(PROMPTS)
    SkipManager.flush()
    assert role._check_valid_step_path(role._get_step_dump_dir(3)) is True
    assert role._check_valid_step_path(role._get_step_dump_dir(4)) is False
    assert role._get_available_steps() == [3] and role._find_latest_step(5) == 3 and role._find_latest_step(1) == 3
    assert SkipManager._should_bypass_for_validation((None, Batch.from_dict(meta_info={"validate": True})), {})
    assert not SkipManager._should_bypass_for_validation((None, PROMPTS), {})


def test_is_enabled_is_honoured(tmp_path):
    @register_skip("rollout")
    class Switched(RolloutSkip):
        def is_enabled(self) -> bool:
            return False

    try:
        SkipManager.init(training_config(tmp_path))
        SkipManager.set_step(1)
        worker = Worker()
        worker.generate_sequences(PROMPTS)
        SkipManager.flush()
        assert worker.calls == ["rollout"] and not (run_path(tmp_path) / "1").exists()
    finally:
        register_skip("rollout")(RolloutSkip)


def test_a_cached_role_needs_a_skip_role_config(tmp_path):
    @dataclass
    class Plain:
        enable: bool = True
        dump_dir: str = str(tmp_path)
        steps: list = None  # type: ignore[assignment]
        action: str = "cache"

    class Odd(RolloutSkip):
        config_class = Plain

    with pytest.raises(ValueError, match="must derive from stepskip.SkipRoleConfig"):
        Odd(Plain(steps=[1]), {})


class Treacherous:
    """A DataProto look-alike whose parts fail to read with errors no format anticipates."""

    batch = None
    non_tensor_batch: dict = {}

    @property
    def meta_info(self):
        raise KeyError("a meta_info that cannot be read")

    def __len__(self) -> int:
        return 1


@pytest.mark.parametrize("async_dump", [True, False])
def test_any_error_while_snapshotting_is_a_counted_dump_failure(tmp_path, caplog, async_dump):
    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            return Treacherous()

    SkipManager.init(training_config(tmp_path, async_dump=async_dump))
    SkipManager.set_step(1)
    out = Loop().generate_sequences(PROMPTS)
    SkipManager.flush()
    assert isinstance(out, Treacherous)  # training goes on with the result
    assert SkipManager.stats()["skip/rollout/dump_failures"] == 1
    assert not (run_path(tmp_path) / "1").exists()
    assert "a meta_info that cannot be read" in caplog.text and "KeyError" in caplog.text


def test_an_entry_over_the_decode_bound_is_refused_and_kept(tmp_path):
    entry = _record_one(tmp_path)
    before = tree_digest(entry)
    SkipManager.init(training_config(tmp_path, max_decode_bytes=16))
    SkipManager.set_step(1)
    worker = Worker()
    with pytest.raises(UnreadableEntryError, match="max_decode_bytes"):
        worker.generate_sequences(PROMPTS)
    SkipManager.flush()
    assert worker.calls == [] and tree_digest(entry) == before
    with pytest.raises(ValueError, match=r"max_decode_bytes = 0 is not valid"):
        SkipManager.init(training_config(tmp_path, max_decode_bytes=0))
