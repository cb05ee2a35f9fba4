"""``record_inputs`` and ``stepskip rerun``: a stage's recorded arguments, re-run offline through the CLI."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch
from cli_run import stepskip
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip.rerun import grpo_advantages, rerun_stage
from stepskip.testing import make_rollout_batch

REWARDS = textwrap.dedent('''
    import torch
    from stepskip import Batch

    def compute(batch, scale=1.0):
        responses = batch.batch["responses"].float()
        return Batch.from_dict(tensors={"scores": (responses % 7).mean(dim=1) * scale})

    def changed(batch, scale=1.0):
        scores = compute(batch, scale).batch["scores"].clone()
        scores[5] += 0.25
        return Batch.from_dict(tensors={"scores": scores})

    def broken(batch, scale=1.0):
        raise ValueError("no reward model here")
''')


class RewardManager:
    def __init__(self, scale: float) -> None:
        self.scale = scale

    @SkipManager.annotate(role="reward")
    def compute_reward(self, batch: Batch, *, scale: float = 1.0) -> Batch:
        responses = batch.batch["responses"].float()
        return Batch.from_dict(tensors={"scores": (responses % 7).mean(dim=1) * scale})


class Advantages:
    @SkipManager.annotate(role="advantage")
    def compute(self, scores: torch.Tensor, uids: list[str]) -> torch.Tensor:
        return grpo_advantages(scores, uids)


def batch_for(step: int) -> Batch:
    batch = make_rollout_batch(8, 8, 12, n=4)
    batch.batch["responses"] += step
    return batch


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """A reward stage recorded with its inputs (steps 1-3), a file of reward functions beside it."""
    dump = tmp_path / "dump"
    SkipManager.init(training_config(dump, role="reward", kind="stage", record_inputs=True))
    for step in (1, 2, 3):
        SkipManager.set_step(step)
        RewardManager(2.0).compute_reward(batch_for(step), scale=2.0)
    SkipManager.close()
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    return dump


def test_record_inputs_stores_the_arguments_after_self_beside_the_result(recorded):
    entry = run_path(recorded) / "reward" / "2"
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["inputs"]["args"] == 1 and meta["inputs"]["kwargs"] == ["scale"]
    assert meta["inputs"]["self"] == "RewardManager"
    assert {"inputs.json", "inputs.safetensors"} <= set(meta["files"])  # checksummed with the entry
    from stepskip._index import CacheIndex
    from stepskip.rerun import _read_step

    index = CacheIndex(str(recorded))
    step_dir = [s for s in index.runs()[0].steps if s.role == "reward" and s.step == 2][0]
    output, args, kwargs = _read_step(index, step_dir.entries[0], False)
    assert kwargs == {"scale": 2.0} and len(args) == 1
    assert torch.equal(args[0].batch["responses"], batch_for(2).batch["responses"])
    # replaying the entry reads only its result
    SkipManager.init(training_config(recorded, role="reward", kind="stage", record_inputs=True))
    SkipManager.set_step(2)
    replayed = RewardManager(0.0).compute_reward(batch_for(2), scale=0.0)
    assert torch.equal(replayed.batch["scores"], output.batch["scores"])
    assert SkipManager.stats()["skip/reward/hits"] == 1


def test_the_same_function_passes_from_a_file(recorded, tmp_path):
    result = stepskip("rerun", recorded, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:compute")
    assert result.code == 0, result
    lines = result.out.splitlines()
    assert [line.split()[:3] for line in lines[:3]] == [["step", "1", "pass"], ["step", "2", "pass"],
                                                         ["step", "3", "pass"]]
    assert "all 3 steps of reward match" in result.out


def test_a_changed_function_fails_naming_the_first_divergent_step_row_and_field(recorded, tmp_path):
    result = stepskip("rerun", recorded, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:changed",
                      "--steps", "2-3")
    assert result.code == 1, result
    assert "step 2  DIVERGED" in result.out and "step 1" not in result.out
    assert "first divergence: step 2, row 5, field 'scores'" in result.out
    data = stepskip("rerun", recorded, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:changed",
                    "--json").json()
    assert data["passed"] is False
    assert data["first_divergence"] == {"run": "exp_proj/GBS4_N2_in8_out6", "step": 1, "field": "scores", "row": 5,
                                        "error": None}
    assert data["steps"][0]["record"]["worst_delta"] == pytest.approx(0.25)
    # a tolerance that covers the change passes
    assert stepskip("rerun", recorded, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:changed",
                    "--atol", "0.3").code == 0


@pytest.mark.parametrize(("options", "code"), [
    (["--rtol", "0.05"], 0),  # 0.25 is within 5 % of row 5's score at every step (6.7 to 7.5)
    (["--rtol", "0.02"], 1),
    (["--min-match", "0.85"], 0),  # one score of eight differs: 87.5 % of the field matches
    (["--min-match", "0.9"], 1),
])
def test_rtol_and_min_match_decide_whether_a_changed_function_passes(recorded, tmp_path, options, code):
    result = stepskip("rerun", recorded, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:changed", *options,
                      "--json")
    assert result.code == code, result
    data = result.json()
    assert data["passed"] is (code == 0)
    flag, value = options
    assert {s["record"][flag.removeprefix("--").replace("-", "_")] for s in data["steps"]} == {
        float(value)}


def test_a_function_that_raises_is_a_failed_step(recorded, tmp_path):
    result = stepskip("rerun", recorded, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:broken")
    assert result.code == 1 and "ValueError: no reward model here" in result.out


def test_a_module_function(recorded, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    assert stepskip("rerun", recorded, "--stage", "reward", "--fn", "my_rewards:compute").code == 0


FN_FIX = "pass --fn module:function or --fn path/to/file.py:function"


@pytest.mark.parametrize("args, message, fix", [
    (["--stage", "rewards", "--fn", "my_rewards:compute"], "no stage 'rewards'",
     "(roles recorded there: reward); pass --stage with the name of a stage role"),
    (["--stage", "reward", "--fn", "no_such_module_here:compute"], "importing no_such_module_here failed", FN_FIX),
    (["--stage", "reward", "--fn", "my_rewards"], "names no function", FN_FIX),
    (["--stage", "reward", "--fn", "/nowhere/r.py:compute"], "no file /nowhere/r.py", FN_FIX),
    (["--stage", "reward", "--fn", "stepskip.rerun:nothing"], "has no 'nothing'", FN_FIX),
    (["--stage", "reward", "--fn", "stepskip.rerun:grpo_advantages", "--steps", "7"], "no recorded step in --steps 7",
     "pass steps it recorded"),
])
def test_usage_errors_exit_2_with_one_line_naming_the_fix(recorded, args, message, fix):
    result = stepskip("rerun", recorded, *args)
    assert result.code == 2, result
    assert message in result.err and fix in result.err and len(result.err.strip().splitlines()) == 1, result
    assert result.out == ""  # no step was run


def test_a_stage_recorded_without_inputs_exits_2_with_the_fix(tmp_path):
    SkipManager.init(training_config(tmp_path, role="reward", kind="stage"))
    SkipManager.set_step(1)
    RewardManager(1.0).compute_reward(batch_for(1))
    SkipManager.close()
    result = stepskip("rerun", tmp_path, "--stage", "reward", "--fn", "stepskip.rerun:grpo_advantages")
    assert result.code == 2 and "record_inputs: true" in result.err, result


def test_grpo_advantages_reruns_an_advantage_stage(tmp_path):
    SkipManager.init(training_config(tmp_path, role="advantage", kind="stage", record_inputs=True))
    for step in (1, 2):
        SkipManager.set_step(step)
        Advantages().compute(torch.tensor([1.0, 0.0, 0.5, 0.25]) * step, ["a", "a", "b", "b"])
    SkipManager.close()
    assert stepskip("rerun", tmp_path, "--stage", "advantage", "--fn", "stepskip.rerun:grpo_advantages").code == 0
    centred = rerun_stage(str(tmp_path), "advantage", lambda s, u: grpo_advantages(s, u, norm_by_std=False))
    assert not centred.passed and centred.first_divergence.step == 1


def test_grpo_advantages_of_a_batch():
    batch = Batch.from_dict(tensors={"token_level_rewards": torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.5, 0.0]]),
                                     "response_mask": torch.tensor([[1, 1], [1, 0], [1, 1]])},
                            non_tensors={"uid": ["g", "g", "h"]})
    out = grpo_advantages(batch)
    assert out["advantages"].shape == (3, 2) and torch.equal(out["advantages"], out["returns"])
    assert out["advantages"][1, 1] == 0.0 and out["advantages"][2].abs().sum() == 0.0  # masked; a group of one
    assert out["advantages"][0, 0] > 0 > out["advantages"][1, 0]


def test_an_argument_that_cannot_be_stored_leaves_the_result_recorded(tmp_path, caplog):
    class Opaque:
        pass

    class Stage:
        @SkipManager.annotate(role="reward")
        def score(self, batch: Batch, extra: object) -> torch.Tensor:
            return torch.ones(2)

    SkipManager.init(training_config(tmp_path, role="reward", kind="stage", record_inputs=True))
    SkipManager.set_step(1)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        Stage().score(batch_for(1), Opaque())
    SkipManager.flush()
    meta = json.loads((run_path(tmp_path) / "reward" / "1" / "meta.json").read_text())
    assert "inputs" not in meta and "without its inputs" in caplog.text and "Opaque" in caplog.text


def test_verify_checks_the_inputs_checksums(recorded):
    inputs = run_path(recorded) / "reward" / "1" / "inputs.safetensors"
    raw = bytearray(inputs.read_bytes())
    raw[-1] ^= 0xFF
    inputs.write_bytes(bytes(raw))
    result = stepskip("verify", recorded)
    assert result.code == 1 and "inputs.safetensors" in result.out, result
    rerun = stepskip("rerun", recorded, "--stage", "reward", "--fn", "stepskip.rerun:grpo_advantages", "--steps", "1")
    assert rerun.code == 1 and "not read" in rerun.out


def test_info_and_show_print_a_drift_record(tmp_path):
    SkipManager.init(training_config(tmp_path, role="reward", kind="stage"))
    SkipManager.set_step(1)
    RewardManager(1.0).compute_reward(batch_for(1))
    SkipManager.init(training_config(tmp_path, role="reward", kind="stage", action="compare"))
    SkipManager.set_step(1)
    RewardManager(1.0).compute_reward(batch_for(1), scale=3.0)
    SkipManager.close()
    entry = run_path(tmp_path) / "reward" / "1"
    info = stepskip("info", entry)
    assert info.code == 0 and "drift (action: compare)" in info.out and "drifted from its recording" in info.out
    assert "worst field 'scores'" in info.out
    assert stepskip("info", entry, "--json").json()["drift"][0]["worst_field"] == "scores"
    show = stepskip("show", entry)
    assert "drift (action: compare): step 1 drifted" in show.out
    assert stepskip("show", entry, "--json").json()["drift"][0]["passed"] is False
    assert stepskip("verify", tmp_path).code == 0  # the records are no part of any entry


def test_convert_keeps_the_recorded_inputs_so_rerun_works_on_the_copy(recorded, tmp_path):
    """``stepskip convert`` re-encodes a stage's result; the arguments recorded beside it go along byte for byte
    (checksummed in the copy), so the converted cache can still be re-run."""
    copy = tmp_path / "copy"
    result = stepskip("convert", recorded, copy, "--to", "safe")
    assert result.code == 0, result
    source, converted = run_path(recorded) / "reward" / "2", run_path(copy) / "reward" / "2"
    meta = json.loads((converted / "meta.json").read_text())
    assert meta["inputs"] == json.loads((source / "meta.json").read_text())["inputs"]
    for name in ("inputs.json", "inputs.safetensors"):
        assert (converted / name).read_bytes() == (source / name).read_bytes() and name in meta["files"]
    assert stepskip("verify", copy).code == 0
    rerun = stepskip("rerun", copy, "--stage", "reward", "--fn", f"{tmp_path}/my_rewards.py:compute")
    assert rerun.code == 0 and "all 3 steps of reward match" in rerun.out, rerun
