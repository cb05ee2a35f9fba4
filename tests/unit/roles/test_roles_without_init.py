"""Role objects used the way verl's own tests and code written against verl use them: constructed
with ``(local_config, global_config)`` from an OmegaConf training config and called directly, with
no ``SkipManager.init``. Such a role binds itself on first use to the run its config names (the
identity init would read from it, a fresh run id); a later bind, ``SkipManager.init``'s, replaces
that binding.

The queue of ``rollout_tq`` is the in-process TransferQueue stand-in (``InProcessTQClient``), put
where the role looks for the real ``transfer_queue`` module when no client was passed; no inference
servers run (the trajectories are made up by ``v1_harness.trajectory_fields``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from v1_harness import trajectory_fields

from stepskip import Batch, CacheMissError, SkipConfigError, SkipManager
from stepskip._identity import RunIdentity
from stepskip.roles import AsyncRolloutSkip, RolloutSkip, RolloutTqSkip
from stepskip.roles.base import RunContext
from stepskip.tq import InProcessTQClient, KVBatchMeta


def verl_config(dump_dir: Path, action: str = "cache", steps: list[int] | None = None, **trainer: Any) -> Any:
    """A training config as verl's trainer holds it: an OmegaConf node with ``skip.<role>`` sections."""
    section = {"enable": True, "dump_dir": str(dump_dir), "steps": steps or [1, 2, 3], "action": action}
    return OmegaConf.create({
        "skip": {"rollout": section, "async_rollout": dict(section), "rollout_tq": dict(section)},
        "actor_rollout_ref": {"rollout": {"n": 2, "temperature": 0.7}},
        "trainer": {"experiment_name": "ut_exp", "project_name": "ut_proj", **trainer},
        "data": {"gen_batch_size": 4, "max_prompt_length": 8, "max_response_length": 16},
    })


def run_dir(dump_dir: Path) -> Path:
    """The run directory the config above names, computed as verl does."""
    return (dump_dir / "ut_exp_ut_proj" / "GBS4_N2_in8_out16").resolve()


def noop(*args: Any, **kwargs: Any) -> None:
    return None


def generated(step: int) -> Batch:
    return Batch.from_dict({"tokens": torch.arange(6).reshape(2, 3) + 10 * step},
                           {"uid": np.array([f"u{step}-0", f"u{step}-1"], dtype=object)})


def meta_of(path: Path) -> dict[str, Any]:
    return json.loads((path / "meta.json").read_text())


def test_a_rollout_role_records_and_replays_without_init(tmp_path):
    config = verl_config(tmp_path / "dump")
    role = RolloutSkip(config.skip.rollout, config)
    assert not (tmp_path / "dump").exists()  # constructing does no I/O
    assert role.meet_precondition(2, noop) is False  # a miss: binds the role, nothing recorded yet
    role.prepare_data(2, generated(2))
    SkipManager.flush()
    assert role.meet_precondition(2, noop) is True
    replayed = role.warp_function(2, noop)
    assert torch.equal(replayed.batch["tokens"], generated(2).batch["tokens"])
    assert list(replayed.non_tensor_batch["uid"]) == ["u2-0", "u2-1"]

    run = run_dir(tmp_path / "dump")
    assert role.project_dump_dir == str(run) and role._get_project_dump_dir() == run
    assert role.step_dump_dir(2) == str(run / "2") and role._get_step_dump_dir(2) == run / "2"
    meta = meta_of(run / "2")
    assert meta["run_id"] == role.run_id and len(role.run_id) == 32 and int(role.run_id, 16) >= 0
    assert meta["role"] == "rollout" and meta["fingerprint"]["actor_rollout_ref.rollout.temperature"] == 0.7
    assert (role.exp_name, role.project_name, role.gbs, role.n) == ("ut_exp", "ut_proj", 4, 2)
    assert role.available_steps() == role._get_available_steps() == [2]
    assert role._check_valid_step_path(run / "2") is True and role._check_valid_step_path(run / "3") is False
    assert role.resolve_load_step(2) == 2 and role.resolve_load_step(3) == -1  # cache: the step itself


def test_repeat_without_init_finds_the_nearest_step(tmp_path):
    config = verl_config(tmp_path / "dump", action="repeat")
    role = RolloutSkip(config.skip.rollout, config)
    assert role._find_latest_step(4) == -1 and role.meet_precondition(4, noop) is False
    with pytest.raises(RuntimeError):  # verl's error for a repeat with nothing recorded (a CacheMissError)
        role.warp_function(4, noop)
    for step in (5, 20):
        role.prepare_data(step, generated(step))
    SkipManager.flush()
    assert role._get_available_steps() == [5, 20]
    assert (role._find_latest_step(5), role._find_latest_step(12), role._find_latest_step(3)) == (5, 5, 5)
    assert role._find_latest_step(30) == role.resolve_load_step(30) == 20
    assert role.meet_precondition(12, noop) is True
    assert torch.equal(role.warp_function(12, noop).batch["tokens"], generated(5).batch["tokens"])
    assert torch.equal(role.warp_function(99, noop).batch["tokens"], generated(20).batch["tokens"])


def test_roles_of_two_configs_keep_to_their_own_runs(tmp_path):
    config_a, config_b = verl_config(tmp_path / "a"), verl_config(tmp_path / "b", experiment_name="other")
    role_a, role_b = RolloutSkip(config_a.skip.rollout, config_a), RolloutSkip(config_b.skip.rollout, config_b)
    role_a.prepare_data(1, generated(1))
    role_b.prepare_data(1, generated(7))
    SkipManager.flush()
    assert torch.equal(role_a.warp_function(1, noop).batch["tokens"], generated(1).batch["tokens"])
    assert torch.equal(role_b.warp_function(1, noop).batch["tokens"], generated(7).batch["tokens"])
    assert role_b.step_dump_dir(1) == str((tmp_path / "b" / "other_ut_proj" / "GBS4_N2_in8_out16" / "1").resolve())
    assert role_a.run_id != role_b.run_id


def test_the_async_role_records_and_replays_a_sample_without_init(tmp_path):
    config = verl_config(tmp_path / "dump")
    role = AsyncRolloutSkip(config.skip.async_rollout, config)
    prompts = Batch.from_dict(non_tensors={"uid": np.array(["uid_sample_0_7"], dtype=object)})
    step = role.extract_step(None, prompts)
    assert step == 7 and role.meet_precondition(step, noop, None, prompts) is False
    role.prepare_data(step, generated(7), None, prompts)
    SkipManager.flush()
    assert role.meet_precondition(step, noop, None, prompts) is True
    assert torch.equal(role.warp_function(step, noop, None, prompts).batch["tokens"], generated(7).batch["tokens"])
    assert role.available_steps() == [7] and meta_of(run_dir(tmp_path / "dump") / "7")["role"] == "async_rollout"


def test_the_v1_role_records_and_injects_a_step_without_init(tmp_path, monkeypatch):
    config = verl_config(tmp_path / "dump", v1={"trainer_mode": "separate_async",
                                                "separate_async": {"parameter_sync_step": 2}})
    queue = InProcessTQClient()
    monkeypatch.setitem(sys.modules, "transfer_queue", queue)  # where verl's role imports it from
    role = RolloutTqSkip(config.skip.rollout_tq, config)
    assert role.parameter_sync_step == 2
    assert role.has_v1_cache(1) is False and role.meet_precondition(1) is False
    for inner, prompts in enumerate(([0, 1], [2, 3])):  # two sample calls make one step
        rows, fields = trajectory_fields(prompts, 2, 1)
        keys = [f"p{p}_{s}_0" for p, s in rows]
        tags = [{"global_steps": 1, "status": "finished"} for _ in keys]
        queue.kv_batch_put(keys=keys, fields=fields, tags=tags, partition_id="train")
        role.prepare_data(1, KVBatchMeta(keys=keys, tags=tags, partition_id="train"), global_steps=1)
        if inner == 0:
            SkipManager.flush()
            assert role.has_v1_cache(1) is False  # published whole, once its last inner entry is written
    SkipManager.flush()
    run = run_dir(tmp_path / "dump")
    assert sorted(p.name for p in (run / "1").iterdir()) == ["0", "1"]
    assert {meta_of(run / "1" / i)["run_id"] for i in "01"} == {role.run_id}
    assert role.has_v1_cache(1) and role.meet_precondition(1) and role._check_valid_v1_step(1)
    assert role._get_available_steps_v1() == role.available_steps() == [1]
    assert role._resolve_load_step_v1(1) == role.resolve_load_step(1) == 1
    assert role._get_v1_inner_dir(1, 1) == run / "1" / "1"

    with pytest.raises(CacheMissError):  # action cache: step 2 itself or nothing
        role.load_dump_data(step=2, new_prompt_uids=["a", "b"], n=2, global_steps=2)


def test_the_v1_role_injects_a_recorded_step_without_init(tmp_path, monkeypatch):
    config = verl_config(tmp_path / "dump", action="repeat")
    queue = InProcessTQClient()
    monkeypatch.setitem(sys.modules, "transfer_queue", queue)
    recorder = RolloutTqSkip(config.skip.rollout_tq, config)
    rows, fields = trajectory_fields([0, 1], 2, 3)
    keys = [f"p{p}_{s}_0" for p, s in rows]
    tags = [{"global_steps": 3, "status": "finished"} for _ in keys]
    queue.kv_batch_put(keys=keys, fields=fields, tags=tags, partition_id="train")
    recorder.prepare_data(3, KVBatchMeta(keys=keys, tags=tags, partition_id="train"), global_steps=3)
    SkipManager.flush()

    reader = RolloutTqSkip(config.skip.rollout_tq, config)  # another process's role, later
    assert reader.maybe_load_and_inject(5, ["a", "b"]) is True  # repeat: step 3 stands in for 5
    injected = queue.kv_batch_get(keys=["a_0_0", "a_1_0", "b_0_0", "b_1_0"], partition_id="train")
    assert [r.tolist() for r in injected["responses"].unbind()] == [r.tolist() for r in fields["responses"].unbind()]
    assert reader.run_id != recorder.run_id


def test_a_later_bind_replaces_the_binding_a_role_made_itself(tmp_path):
    config = verl_config(tmp_path / "dump")
    role = RolloutSkip(config.skip.rollout, config)
    role.prepare_data(1, generated(1))
    SkipManager.flush()
    own_run = role.run_id
    other = RunIdentity("exp2", "proj2", gbs=8, n=1)
    role.bind(RunContext(name="rollout", run_id="r-init", identity=other))
    assert role.run_id == "r-init"
    assert role.project_dump_dir == str(tmp_path / "dump" / "exp2_proj2" / "GBS8_N1_in0_out0")
    assert role.available_steps() == [] and role.meet_precondition(1, noop) is False  # the other run's cache
    role.prepare_data(1, generated(4))
    SkipManager.flush()
    assert meta_of(Path(role.step_dump_dir(1)))["run_id"] == "r-init"
    assert meta_of(run_dir(tmp_path / "dump") / "1")["run_id"] == own_run  # the first run's entry is untouched


def test_skipmanager_init_binds_its_roles_to_its_run_over_what_roles_recorded_alone(tmp_path):
    config = verl_config(tmp_path / "dump")
    alone = RolloutSkip(config.skip.rollout, config)
    alone.prepare_data(1, generated(1))
    SkipManager.flush()
    SkipManager.init(config)
    try:
        role = SkipManager.skip_instances["rollout"]
        assert role.run_id == SkipManager.run_id != alone.run_id
        assert role.project_dump_dir == alone.project_dump_dir and role.available_steps() == [1]

        class Loop:
            @SkipManager.annotate(role="rollout")
            def generate_sequences(self, prompts: Batch) -> Batch:
                raise AssertionError("step 1 was recorded by the role used alone: replayed, not generated")

        SkipManager.set_step(1)
        out = Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": np.array(["x", "y"], dtype=object)}))
        assert torch.equal(out.batch["tokens"], generated(1).batch["tokens"])
    finally:
        SkipManager.reset()


def test_a_role_with_no_run_to_bind_to_says_why(tmp_path):
    role = RolloutSkip({"enable": True, "dump_dir": str(tmp_path), "steps": [1]}, None)
    with pytest.raises(RuntimeError, match="SkipManager.init"):
        role.step_dump_dir(1)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    config = verl_config(blocked)
    role = RolloutSkip(config.skip.rollout, config)
    for _ in range(2):  # unusable: said again on the next use, never half-bound
        with pytest.raises(SkipConfigError, match="dump_dir"):
            role.meet_precondition(1, noop)
    blocked.unlink()  # the user fixes it: the next use binds
    assert role.meet_precondition(1, noop) is False


def test_a_disabled_role_binds_without_touching_the_dump_dir(tmp_path):
    config = verl_config(tmp_path / "dump")
    config.skip.rollout.enable = False
    role = RolloutSkip(config.skip.rollout, config)
    assert role.step_dump_dir(1) == str(run_dir(tmp_path / "dump") / "1")
    assert role.available_steps() == [] and not (tmp_path / "dump").exists()


def test_a_role_bound_again_writes_hints_of_its_new_run_only(tmp_path):
    """The prompt hints a role keeps describe the entries of the run it writes: after another bind,
    none of the entries it wrote for the run it bound itself to."""
    from stepskip._matching.hints import parse_table

    config = verl_config(tmp_path / "dump")
    role = RolloutSkip(config.skip.rollout, config)
    prompts = Batch.from_dict(non_tensors={"uid": np.array(["p0", "p1"], dtype=object)})
    role.prepare_data(1, generated(1), None, prompts)
    SkipManager.flush()
    role.bind(RunContext(name="rollout", run_id="r-init", identity=RunIdentity("ut_exp", "ut_proj", gbs=8, n=1)))
    role.prepare_data(2, generated(2), None, prompts)
    SkipManager.flush()
    tables = {}
    for path in (tmp_path / "dump" / "ut_exp_ut_proj" / ".stepskip-index").glob("*.keys"):
        table, problem = parse_table(path.read_bytes(), path.name)
        assert table is not None, problem
        tables[path.name.split("+")[0]] = table.names.tolist()
    assert tables == {"GBS4_N2_in8_out16": [1], "GBS8_N1_in0_out0": [2]}


def omega_conf_to_dataclass(section: Any, dataclass_type: type) -> Any:
    """What verl's ``verl.utils.config.omega_conf_to_dataclass`` does with a dataclass type: merge the
    section over the dataclass's structured schema, then build the dataclass from the result."""
    merged = OmegaConf.merge(OmegaConf.structured(dataclass_type), OmegaConf.create(section))
    return OmegaConf.to_object(merged)


@pytest.mark.parametrize("role_class", [RolloutSkip, AsyncRolloutSkip, RolloutTqSkip])
def test_config_dataclasses_convert_through_omegaconf_schemas_as_verl_builds_them(tmp_path, role_class):
    """verl's tests turn ``config.skip.<role>`` into the role's config dataclass through OmegaConf's
    structured schema, which checks every value against the field's declared type: the options that
    take names (``action``, ``compress``, ``check_prompts``, ``on_mismatch``, ``match_n``) must accept
    the names a config holds, and bad values still fail with the key named."""
    config = verl_config(tmp_path / "dump", action="repeat")
    section = OmegaConf.merge(config.skip.rollout, {"compress": "zstd", "check_prompts": "error",
                                                    "on_mismatch": "regenerate", "match_n": "strict",
                                                    "engines": "start", "train_on": "live", "on_drift": "error"})
    local = omega_conf_to_dataclass(section, role_class.config_class)
    assert isinstance(local, role_class.config_class)
    assert (local.action, local.compress, local.check_prompts, local.on_mismatch, local.match_n, local.engines,
            local.train_on, local.on_drift) == ("repeat", "zstd", "error", "regenerate", "strict", "start", "live",
                                                "error")
    role = role_class(local, config)
    assert role.action.value == "repeat" and role.available_steps() == []

    with pytest.raises(SkipConfigError, match=r"action = 'bogus'.*allowed values: cache, repeat"):
        omega_conf_to_dataclass(OmegaConf.merge(section, {"action": "bogus"}), role_class.config_class)
