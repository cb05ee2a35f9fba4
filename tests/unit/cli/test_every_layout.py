"""Every layout stepskip writes is known to the commands: ``verify --repair`` and ``prune`` never
remove a valid entry of any of them, and ``ls``, ``info``, ``show`` and the viewer show them.

The layouts, each written by stepskip itself: flat role entries (``{run}/{step}/``), a stage role's
(``{run}/reward/{step}/``), V1 steps in place (``{step}/{inner}/``) and committed by a manifest
(``{step}/step.json`` naming ``{step}/rec-{token}/{inner}/``, recorded on ``memory://`` and copied to
disk as a synced object-store cache is), the TRL integration's per-call, per-rank entries
(``{run}/trl_generate/{step}/c{call}-r{rank}/``, tool-loop turns ``c{call}t{turn}-r{rank}``, two ranks)
and the prompt hints beside the run directories (``{experiment}/.stepskip-index/``). Every file is
made three hours old, older than ``verify``'s grace period: what is left is left because it is valid,
not because it may still be being written.

The TRL entries are written by the integration's own role, as ``enable_stepskip`` binds it, without a
trainer (the whole path through the real ``GRPOTrainer`` is ``tests/integration/trl/test_trl_cli.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
import fsspec
import pytest
from cli_caches import V1Trainer
from cli_run import stepskip

from stepskip import SkipManager
from stepskip._identity import RunIdentity
from stepskip.tq import InProcessTQClient

AGE = 3 * 3600.0  # older than verify's default --grace of 1h

#: name -> (run directory, role, its steps)
LAYOUTS = {
    "flat": ("exp_proj/GBS4_N2_in8_out6", "rollout", [1, 2, 3, 4, 5, 6, 8, 10]),
    "stage": ("exp_proj/GBS4_N2_in8_out6", "reward", [1, 2]),
    "v1-in-place": ("exp_v1/GBS4_N2_in0_out0", "rollout_tq", [1, 2, 3]),
    "v1-manifest": ("exp_v1m/GBS4_N2_in0_out0", "rollout_tq", [1, 2, 3]),
    "trl": ("grpo_tiny/GBS2_N2_in0_out4_W2", "trl_generate", [1, 2, 3]),
}
TRL_RUN = LAYOUTS["trl"][0]
TRL_CALLS = [("c0", None), ("c1", None), ("c1t0", 0)]  # two calls (gradient accumulation), a tool-loop turn


def trl_result(step: int, call: str, rank: int) -> tuple[list[list[int]], list[list[float | None]]]:
    """What ``_generate_single_turn`` returned: ragged completion ids, log-probs with a hole."""
    return [[step, rank, 5 + len(call)], [7]], [[-0.5, None, -1.0], [-2.0]]


def record_trl(dump_dir: Path) -> None:
    """Two ranks' calls of steps 1-3, through the ``trl_generate`` role as ``enable_stepskip`` binds it."""
    pytest.importorskip("trl")
    from stepskip.integrations.trl import _CALL, ROLE, CallRecord

    identity = RunIdentity("grpo", "tiny", gbs=2, n=2, response_len=4, world_size=2)
    section = {"enable": True, "dump_dir": str(dump_dir), "steps": [1, 2, 3], "async_dump": False}
    for rank in (0, 1):
        SkipManager.init({"skip": {ROLE: section}}, identity=identity, rank=rank, world_size=2)
        role = SkipManager.skip_instances[ROLE]
        for step in (1, 2, 3):
            for call, turn in TRL_CALLS:
                token = _CALL.set(CallRecord(step, call, rank, eligible=True, turn=turn))
                try:  # the call's arguments as TRL passes them: the trainer, then prompt_ids
                    role.prepare_data(step, trl_result(step, call, rank), None, [[1, 2], [3]])
                finally:
                    _CALL.reset(token)
        SkipManager.reset()


def record_v1_manifest(dump_dir: Path) -> None:
    """V1 steps 1-3 recorded on ``memory://`` (committed by manifests), then copied to ``dump_dir``."""
    root = f"stepskip-layouts-{os.getpid()}-{time.monotonic_ns()}"
    config = {
        "trainer": {"experiment_name": "exp", "project_name": "v1m",
                    "v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": 2}}},
        "data": {"train_batch_size": 4},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout_tq": {"enable": True, "dump_dir": f"memory://{root}/dump", "steps": [1, 2, 3],
                                "async_dump": False}},
    }
    V1Trainer(config, InProcessTQClient(), prompts_per_step=4, n=2, sync_steps=2).fit(3)
    SkipManager.close()
    SkipManager.reset()
    fs = fsspec.filesystem("memory")
    fs.get(f"/{root}/dump/exp_v1m", str(dump_dir / "exp_v1m"), recursive=True)
    fs.rm(f"/{root}", recursive=True)
    assert (dump_dir / "exp_v1m/GBS4_N2_in0_out0/1/step.json").is_file()


def backdate(root: Path, seconds: float = AGE) -> None:
    when = time.time() - seconds
    for path in [root, *root.rglob("*")]:
        os.utime(path, (when, when), follow_symlinks=False)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file's bytes and every directory (None) below ``root``, by relative path."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def all_layouts(pristine_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dump = Path(shutil.copytree(pristine_cache, tmp_path_factory.mktemp("layouts") / "dump"))
    record_v1_manifest(dump)
    record_trl(dump)
    backdate(dump)
    return dump


@pytest.fixture
def layouts(all_layouts: Path, tmp_path: Path) -> Callable[[], Path]:
    def copy() -> Path:
        target = tmp_path / "dump"
        shutil.copytree(all_layouts, target)
        backdate(target)  # copytree keeps file times; the directories it made are new
        return target

    return copy


def test_the_cache_holds_every_layout(all_layouts):
    """The premise of the tests below: each layout is really there, hints included."""
    for run, role, steps in LAYOUTS.values():
        base = all_layouts / run if role in ("rollout", "rollout_tq") else all_layouts / run / role
        assert sorted(int(p.name) for p in base.iterdir() if p.name.isdigit()) == steps, (run, role)
    assert sorted(p.name for p in (all_layouts / TRL_RUN / "trl_generate/2").iterdir()) == [
        "c0-r0", "c0-r1", "c1-r0", "c1-r1", "c1t0-r0", "c1t0-r1"]
    assert list((all_layouts / "exp_v1m/GBS4_N2_in0_out0/2").glob("rec-*/1/meta.json"))
    hints = sorted(p.relative_to(all_layouts).as_posix() for p in all_layouts.glob("*/.stepskip-index/*"))
    assert any(h.startswith("exp_proj/") and h.endswith(".keys") for h in hints), hints
    assert any(h.startswith("exp_v1/") and h.endswith(".json") for h in hints), hints
    assert any(h.startswith("exp_v1m/") and h.endswith(".json") for h in hints), hints


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_verify_repair_keeps_every_valid_entry(layout, layouts):
    dump = layouts()
    run, role, steps = LAYOUTS[layout]
    before = snapshot(dump)
    result = stepskip("verify", dump / run, "--repair", "--json")
    assert result.code == 0, result
    assert result.json()["repaired"] == [] and result.json()["problems"] == []
    assert snapshot(dump) == before
    listed = stepskip("ls", dump / run, "--json").json()["runs"][0]["roles"]
    assert {r["role"]: (r["steps"], r["invalid_steps"]) for r in listed}[role] == (steps, [])


def test_verify_repair_of_the_whole_dump_dir_removes_nothing(layouts):
    """Every layout at once, from the dump dir down: the hints beside the run directories too."""
    dump = layouts()
    before = snapshot(dump)
    result = stepskip("verify", dump, "--repair", "--json")
    assert result.code == 0, result
    assert result.json()["repaired"] == []
    assert snapshot(dump) == before


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prune_removes_the_steps_it_chose_and_nothing_else(layout, layouts):
    dump = layouts()
    run, role, steps = LAYOUTS[layout]
    before = snapshot(dump)
    # recorded minutes ago (their files are three hours old): none is older than an hour; all are the last ones
    for criterion in (["--older-than", "1h"], ["--keep-last", str(len(steps))]):
        result = stepskip("prune", dump / run, "--role", role, *criterion, "--json")
        assert result.code == 0, result
        assert result.json()["removed"] == [], (criterion, result)
        assert snapshot(dump) == before, criterion
    chosen = steps[1]
    result = stepskip("prune", dump / run, "--role", role, "--steps", str(chosen), "--json")
    assert result.code == 0, result
    step_dir = f"{run}/{chosen}" if role in ("rollout", "rollout_tq") else f"{run}/{role}/{chosen}"
    assert result.json()["removed"] == [str(dump / step_dir)]
    assert snapshot(dump) == {k: v for k, v in before.items() if k != step_dir and not k.startswith(step_dir + "/")}


def test_hints_survive_repair_and_prune_of_every_run(layouts):
    dump = layouts()
    hints = {k: v for k, v in snapshot(dump).items() if ".stepskip-index" in k}
    assert hints
    assert stepskip("verify", dump, "--repair").code == 0
    for run in sorted({run for run, _, _ in LAYOUTS.values()}):
        result = stepskip("prune", dump / run, "--steps", "all", "--json")
        assert result.code == 0 and result.json()["removed"], result
    assert {k: v for k, v in snapshot(dump).items() if ".stepskip-index" in k} == hints


def test_the_commands_show_trl_steps_and_their_calls(all_layouts):
    steps_dir = all_layouts / TRL_RUN / "trl_generate"
    info = stepskip("info", steps_dir / "2", "--json")
    assert info.code == 0, info
    data = info.json()
    assert (data["kind"], data["role"], data["step"], data["issues"]) == ("calls", "trl_generate", 2, [])
    assert [Path(e["path"]).name for e in data["entries"]] == ["c0-r0", "c0-r1", "c1-r0", "c1-r1", "c1t0-r0",
                                                               "c1t0-r1"]
    assert {e["state"] for e in data["entries"]} == {"present"} and data["rows"] == 12
    assert {f["name"]: f["kind"] for f in data["fields"]} == {"responses": "jagged", "logprobs": "jagged",
                                                             "call": "non-tensor"}
    text = stepskip("info", steps_dir / "2")
    assert text.code == 0 and "call entries" in text.out and "c1t0-r1" in text.out, text

    one = stepskip("info", steps_dir / "2" / "c1-r1", "--json")
    assert one.code == 0, one
    assert (one.json()["kind"], one.json()["rows"], len(one.json()["entries"])) == ("call", 2, 1)

    shown = stepskip("show", steps_dir, "--step", "3", "--rows", "12", "--json")
    assert shown.code == 0, shown
    expected = [row for call, _ in TRL_CALLS[:2] for rank in (0, 1) for row in trl_result(3, call, rank)[0]]
    expected += [row for rank in (0, 1) for row in trl_result(3, "c1t0", rank)[0]]
    assert [r["response"] for r in shown.json()["rows"]] == expected
    single = stepskip("show", steps_dir / "1" / "c0-r1", "--json")
    assert [r["response"] for r in single.json()["rows"]] == trl_result(1, "c0", 1)[0]

    listed = stepskip("ls", all_layouts, "--json").json()
    trl = [r for run in listed["runs"] if run["name"] == TRL_RUN for r in run["roles"]]
    assert [(r["role"], r["steps"], r["invalid_steps"], r["entries"]) for r in trl] == [
        ("trl_generate", [1, 2, 3], [], 18)]


def test_the_viewer_lists_and_reads_trl_steps(all_layouts):
    from stepskip.view.data import ViewSource

    source = ViewSource(str(all_layouts))
    runs = {run["name"]: run for run in source.listing()["runs"]}
    (role,) = runs[TRL_RUN]["roles"]
    assert (role["role"], role["valid_steps"], role["invalid_steps"]) == ("trl_generate", [1, 2, 3], [])
    assert [c["call"] for c in role["steps"][0]["calls"]] == ["c0-r0", "c0-r1", "c1-r0", "c1-r1", "c1t0-r0",
                                                             "c1t0-r1"]
    page = source.step_page(TRL_RUN, "trl_generate", 1, limit=500)
    assert page["total"] == 12
    assert [r["response"] for r in page["rows"][:2]] == trl_result(1, "c0", 0)[0]
    assert [r["length"] for r in page["rows"][:2]] == [3, 1]


def test_repair_removes_only_the_damaged_call_of_a_trl_step(layouts):
    """A call's entry is replayed on its own: a damaged or half-written one goes, its step's other calls stay."""
    dump = layouts()
    step = dump / TRL_RUN / "trl_generate" / "2"
    data = step / "c1-r0" / "data.safetensors"
    data.write_bytes(data.read_bytes()[:-3])  # truncated
    (step / "c2-r0").mkdir()  # a call whose entry was never finished (no meta.json)
    (step / "c3-r0").mkdir()  # ... and one being written right now
    backdate(dump)
    os.utime(step / "c3-r0")
    before = snapshot(dump)
    found = stepskip("verify", dump / TRL_RUN, "--json")
    assert found.code == 1
    problems = {(Path(p["path"]).name, p["kind"], Path(p["remove"]).name, p["recent"])
                for p in found.json()["problems"]}
    assert problems == {("c1-r0", "damaged", "c1-r0", False), ("c2-r0", "half-written", "c2-r0", False),
                        ("c3-r0", "half-written", "c3-r0", True)}
    repaired = stepskip("verify", dump / TRL_RUN, "--repair", "--json")
    assert repaired.code == 1  # the call being written is kept
    assert sorted(Path(p).name for p in repaired.json()["repaired"]) == ["c1-r0", "c2-r0"]
    gone = (f"{TRL_RUN}/trl_generate/2/c1-r0", f"{TRL_RUN}/trl_generate/2/c2-r0")
    assert snapshot(dump) == {k: v for k, v in before.items() if not k.startswith(gone)}


def test_convert_keeps_each_call_of_a_trl_step(all_layouts, tmp_path):
    result = stepskip("convert", all_layouts / TRL_RUN, tmp_path / "out", "--to", "safe", "--json")
    assert result.code == 0, result
    assert len(result.json()["converted"]) == 18
    for entry in (all_layouts / TRL_RUN / "trl_generate").glob("*/*"):
        copied = tmp_path / "out" / TRL_RUN / "trl_generate" / entry.parent.name / entry.name
        assert json.loads((copied / "meta.json").read_text())["converted_from"] == "safe"
    shown = stepskip("show", tmp_path / "out" / TRL_RUN / "trl_generate" / "1" / "c1t0-r1", "--json")
    assert [r["response"] for r in shown.json()["rows"]] == trl_result(1, "c1t0", 1)[0]


def test_entries_in_the_integrations_own_packing_show_as_rows():
    """Entries written before ``format: safe`` packed ragged rows hold the integration's own packing."""
    pytest.importorskip("trl")
    import torch

    from stepskip._index import generation_rows
    from stepskip.integrations.trl import _PACKED

    packed = {"kind": _PACKED,
              "completion_ids": {"values": torch.tensor([4, 5, 6]), "offsets": torch.tensor([0, 2, 2, 3])},
              "logprobs": {"values": torch.tensor([-1.0, 0.0, -3.0], dtype=torch.float64),
                           "offsets": torch.tensor([0, 2, 2, 3]), "missing": torch.tensor([False, True, False])}}
    rows = generation_rows([("c0-r0", packed), ("c1-r0", ([[9]], None))])
    assert [r.tolist() for r in rows["responses"].unbind()] == [[4, 5], [], [6], [9]]
    logprobs = [r.tolist() for r in rows["logprobs"].unbind()]
    assert logprobs[0][0] == -1.0 and logprobs[0][1] != logprobs[0][1] and logprobs[2] == [-3.0]
    assert list(rows["call"]) == ["c0-r0", "c0-r0", "c0-r0", "c1-r0"]
    broken = {**packed, "completion_ids": {"values": torch.tensor([4]), "offsets": torch.tensor([0, 2])}}
    assert generation_rows([("c0-r0", broken)]) is broken  # not rows: shown as stored, never a crash
