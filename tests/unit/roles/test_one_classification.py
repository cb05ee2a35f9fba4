"""One model of the cache: what a role decides of its entries is what the cache index (the command line,
the viewer) says of them.

Entries are written through every role and integration — the flat ``rollout`` role (formats ``safe``
and ``verl``), a stage role, the V1 role in place (local disk) and committed by a manifest (an object
store, fsspec's ``memory://``), the TRL integration's role — then left whole or damaged the ways a
crash or a foreign writer damages them. A fresh role of the same run and the index then look at the
same step: they must agree on every entry's state and on whether the step can be replayed.

The TRL integration's role is driven through ``SkipManager.annotate`` as the integration drives it,
without a trainer (generating needs a model; only the entries matter here).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from skip_configs import training_config
from v1_harness import V1Trainer

from stepskip import Batch, SkipManager
from stepskip._identity import RunIdentity
from stepskip._index import CacheIndex
from stepskip.tq import InProcessTQClient

pytest.importorskip("trl")

WRITERS = ["rollout", "rollout-verl", "stage", "v1-in-place", "v1-manifest", "trl"]
DAMAGES = ["none", "truncated-data", "no-meta", "garbage-meta", "unknown-format", "other-kind-pickle", "foreign-role",
           "leftover", "lacking-inner"]
#: Writers whose entries live directly in the run directory and name their role in meta.json: the index
#: takes an entry's role from there, so an entry relabelled as another role's is simply that role's.
ROLE_FROM_META = {"rollout", "rollout-verl"}
V1_WRITERS = {"v1-in-place", "v1-manifest"}


@dataclass
class Written:
    """A step written through one writer: how to read it back as a role, and where it lies."""

    config: dict[str, Any]
    role: str
    run_dir: str  # the run directory (or the role's directory in it)
    dump_dir: str
    runtime: dict[str, Any]
    identity: RunIdentity | None = None


class _Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        return Batch.from_dict(tensors={"responses": torch.arange(12).reshape(4, 3)},
                               non_tensors={"uid": ["a", "b", "c", "d"]})

    @SkipManager.annotate(role="reward")
    def reward(self, prompts: Batch) -> Batch:
        return Batch.from_dict(tensors={"score": torch.ones(4)})


PROMPTS = Batch.from_dict(tensors={"input_ids": torch.ones(4, 2, dtype=torch.int64)},
                          non_tensors={"uid": ["a", "b", "c", "d"]})


def _trl_identity() -> RunIdentity:
    return RunIdentity(experiment_name="grpo", project_name="tiny", gbs=2, n=2, response_len=4)


@contextmanager
def _trl_call(step: int, name: str = "c0") -> Iterator[None]:
    from stepskip.integrations import trl as integration

    token = integration._CALL.set(integration.CallRecord(step=step, name=name))
    try:
        yield
    finally:
        integration._CALL.reset(token)


def _write(writer: str, root: str, inner_entries: int) -> Written:
    """Record step 1 through ``writer`` under the fresh dump dir ``root``."""
    if writer in ("rollout", "rollout-verl"):
        fields = {"format": "verl", "allow_pickle": True} if writer == "rollout-verl" else {}
        config = training_config(root, steps=[1], action="record", **fields)
        SkipManager.init(config)
        SkipManager.set_step(1)
        _Loop().generate_sequences(PROMPTS)
        SkipManager.reset()
        return Written(config, "rollout", f"{root}/exp_proj/GBS4_N2_in8_out6", root, {})
    if writer == "stage":
        config = training_config(root, "reward", steps=[1], action="record", kind="stage")
        SkipManager.init(config)
        SkipManager.set_step(1)
        _Loop().reward(PROMPTS)
        SkipManager.reset()
        return Written(config, "reward", f"{root}/exp_proj/GBS4_N2_in8_out6/reward", root, {})
    if writer in V1_WRITERS:
        dump_dir = root if writer == "v1-in-place" else f"memory://{uuid.uuid4().hex}"
        config = {
            "actor_rollout_ref": {"rollout": {"n": 2}},
            "data": {"train_batch_size": 2 * inner_entries},
            "trainer": {"v1": {"trainer_mode": "separate_async",
                               "separate_async": {"parameter_sync_step": inner_entries}}},
            "skip": {"rollout_tq": {"enable": True, "steps": [1], "action": "record", "dump_dir": dump_dir,
                                    "async_dump": False}},
        }
        tq = InProcessTQClient()
        V1Trainer(config, tq, prompts_per_step=2 * inner_entries, sync_steps=inner_entries).fit(1)
        SkipManager.reset()
        run = f"{dump_dir}/default_experiment_name_default_project_name/GBS{2 * inner_entries}_N2_in0_out0"
        return Written(config, "rollout_tq", run, dump_dir, {"tq_client": InProcessTQClient()})
    assert writer == "trl"
    from stepskip.integrations import trl as integration

    config = {"skip": {integration.ROLE: {"enable": True, "dump_dir": root, "steps": [1], "action": "record",
                                          "async_dump": False}}}
    identity = _trl_identity()

    @SkipManager.annotate(role=integration.ROLE, bypass=integration._never, prompts=integration._prompts_of_call)
    def generate(owner: Any, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        return [[7, 8], [9]], [[-0.5, -0.25], [-1.0]]

    SkipManager.init(config, identity=identity, rank=0, world_size=1)
    SkipManager.set_step(1)
    with _trl_call(1):
        generate(None, [[1, 2], [3]])
    SkipManager.reset()
    return Written(config, integration.ROLE, f"{root}/grpo_tiny/GBS2_N2_in0_out4/{integration.ROLE}", root,
                   {"rank": 0, "world_size": 1}, identity)


def _fs(path: str) -> tuple[Any, str]:
    return (fsspec.filesystem("memory"), path) if path.startswith("memory://") else (fsspec.filesystem("file"), path)


def _entries_of_step(step_dir: str) -> list[str]:
    """The entry directories of a step as written (those holding a meta.json), as its filesystem names them."""
    fs, _ = _fs(step_dir)
    return sorted(p.rsplit("/", 1)[0] for p in fs.find(step_dir) if p.endswith("/meta.json"))


def _damage(written: Written, damage: str, which: int) -> None:
    """Damage step 1 the way ``damage`` says, in its ``which``-th entry (modulo the entries it has)."""
    step_dir = f"{written.run_dir}/1"
    fs, _ = _fs(step_dir)
    entries = _entries_of_step(step_dir)
    entry = entries[which % len(entries)]
    meta_path = f"{entry}/meta.json"
    if damage == "none":
        return
    if damage == "leftover":
        leftover = f"{written.run_dir}/.tmp-1-{uuid.uuid4().hex[:12]}"
        fs.makedirs(leftover, exist_ok=True)
        fs.pipe(f"{leftover}/meta.json", b"{")
        return
    if damage == "lacking-inner":
        fs.rm(entry, recursive=True)
        return
    if damage == "no-meta":
        fs.rm(meta_path)
        return
    if damage == "garbage-meta":
        fs.pipe(meta_path, b"{not json")
        return
    meta = json.loads(fs.cat(meta_path))
    if damage == "truncated-data":
        listed = meta.get("files") or {}
        name = max(listed, key=lambda n: listed[n]["bytes"])
        stored = f"{entry}/{listed[name].get('object') or name}"  # object stores name each version's object
        data = fs.cat(stored)
        fs.pipe(stored, data[: len(data) // 2])
        return
    if damage == "unknown-format":
        meta["format"] = "safe-from-the-future"
    elif damage == "other-kind-pickle":
        meta["format"] = "verl" if written.role == "rollout_tq" else "verl-tq"
    elif damage == "foreign-role":
        meta["role"] = "someone_else"
    fs.pipe(meta_path, json.dumps(meta).encode())


def _relative(written: Written, path: str) -> str:
    return path.rstrip("/").removeprefix("memory://").rsplit(written.dump_dir.removeprefix("memory://"), 1)[-1]


def _as_role(written: Written) -> tuple[dict[str, str], bool]:
    """Entry (relative path) -> state, and whether step 1 is complete, as a fresh ``cache`` role sees them."""
    config = json.loads(json.dumps(written.config))
    section = next(iter(config["skip"].values()))
    section["action"] = "cache"
    SkipManager.init(config, identity=written.identity, **written.runtime)
    role: Any = SkipManager.skip_instances[written.role]
    try:
        with _trl_call(1) if written.role == "trl_generate" else _nothing():
            probed = role.entries.probed(1)
            present = role.entries.present(1)
    finally:
        SkipManager.reset()
    return {_relative(written, path): probe.state.value for path, probe in probed}, present


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _as_index(written: Written) -> tuple[dict[str, str], bool, list[str]]:
    """Entry (relative path) -> state, whether step 1 is valid, and the leftovers, as the cache index sees them."""
    index = CacheIndex(written.dump_dir)
    (run,) = index.runs()
    steps = [s for s in run.steps if s.role == written.role and s.step == 1]
    if not steps:  # a step directory without a role (half-written, directly in the run directory)
        steps = [s for s in run.steps if s.step == 1]
    (step,) = steps
    states = {_relative(written, e.path): e.state.value for e in step.entries}
    leftovers = [_relative(written, p) for p in run.leftovers + step.leftovers]
    return states, step.valid, leftovers


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(writer=st.sampled_from(WRITERS), damage=st.sampled_from(DAMAGES), inner_entries=st.integers(1, 3),
       which=st.integers(0, 2))
def test_a_role_and_the_cache_index_classify_every_entry_alike(tmp_path_factory, writer, damage, inner_entries,
                                                               which):
    assume(damage != "lacking-inner" or (writer in V1_WRITERS and inner_entries > 1))
    assume(damage != "foreign-role" or writer not in ROLE_FROM_META)
    assume(writer in V1_WRITERS or (inner_entries == 1 and which == 0))
    written = _write(writer, str(tmp_path_factory.mktemp("cache")), inner_entries)
    _damage(written, damage, which)
    role_states, present = _as_role(written)
    index_states, valid, leftovers = _as_index(written)
    shared = set(role_states) & set(index_states)
    assert {p: role_states[p] for p in shared} == {p: index_states[p] for p in shared}, (role_states, index_states)
    assert shared or damage in ("no-meta", "lacking-inner"), (role_states, index_states)
    assert present == valid, (role_states, index_states)
    assert present == (damage in ("none", "leftover")), (role_states, index_states)
    assert bool(leftovers) == (damage == "leftover")
