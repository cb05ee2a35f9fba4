"""``stepskip ls``, ``info`` and ``show`` on real caches, and the errors every command gives for bad paths."""

from __future__ import annotations

import re
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from cli_caches import FIXTURE_RUN, ROLLOUT_STEPS, SAFE_RUN, V1_RUN, VERL_FMT_RUN, rollout_batch
from cli_run import stepskip

from stepskip.cli import main


def test_ls_lists_every_run_role_format_and_step_range(pristine_cache):
    as_json, table = stepskip("ls", pristine_cache, "--json"), stepskip("ls", pristine_cache)

    result = as_json
    assert result.code == 0, result
    runs = {r["name"]: r for r in result.json()["runs"]}
    assert list(runs) == sorted([SAFE_RUN, V1_RUN, VERL_FMT_RUN, FIXTURE_RUN])
    roles = {name: {r["role"]: r for r in run["roles"]} for name, run in runs.items()}
    assert roles[SAFE_RUN]["rollout"]["steps"] == ROLLOUT_STEPS
    assert roles[SAFE_RUN]["rollout"]["steps_spec"] == "1-6,8,10"
    assert roles[SAFE_RUN]["rollout"]["formats"] == ["safe"]
    assert roles[SAFE_RUN]["rollout"]["entries"] == len(ROLLOUT_STEPS)
    assert roles[SAFE_RUN]["reward"]["steps"] == [1, 2]  # the stage role's subdirectory
    assert roles[V1_RUN]["rollout_tq"]["steps"] == [1, 2, 3]
    assert roles[V1_RUN]["rollout_tq"]["entries"] == 6  # parameter_sync_step 2: two inner entries per step
    assert roles[VERL_FMT_RUN]["rollout"]["formats"] == ["verl"]
    assert roles[FIXTURE_RUN]["rollout"]["formats"] == ["verl"]  # written by verl itself
    v1_fixture = roles[FIXTURE_RUN]["rollout_tq"]
    assert (v1_fixture["formats"], v1_fixture["steps"], v1_fixture["entries"]) == (["verl-tq"], [3], 1)
    assert runs[SAFE_RUN]["shape"] == {"gbs": 4, "n": 2, "prompt_len": 8, "response_len": 6}
    for run in runs.values():
        assert run["problems"] == 0 and run["bytes"] > 0 and run["newest"]
        for role in run["roles"]:
            assert role["bytes"] > 0 and role["newest"] and role["invalid_steps"] == []

    result = table
    assert result.code == 0, result
    lines = result.out.splitlines()
    assert lines[0].split() == ["RUN", "ROLE", "FORMAT", "STEPS", "ENTRIES", "SIZE", "NEWEST"]
    row = next(line for line in lines if line.startswith(SAFE_RUN)).split()
    assert row[1:5] == ["rollout", "safe", "1-6,8,10", "8"]
    assert any(line.split()[:4] == ["rollout_tq", "verl-tq", "3", "1"] for line in lines)
    assert "4 runs, 21 entries" in result.out


def test_info_shows_meta_fields_statistics_and_fingerprint(pristine_cache):
    safe, v1, fixture = (pristine_cache / SAFE_RUN, pristine_cache / V1_RUN, pristine_cache / FIXTURE_RUN)
    as_json = stepskip("info", "--json", safe / "3", v1 / "2", safe / "reward" / "1", fixture / "1")
    text = stepskip("info", fixture, safe, "--step", "3", "--allow-pickle")

    result = as_json
    assert result.code == 0, result
    rollout, v1_step, stage, verl_entry = result.json()

    expected = rollout_batch(3)
    assert (rollout["role"], rollout["kind"], rollout["rows"]) == ("rollout", "entry", 8)
    fields = {f["name"]: f for f in rollout["fields"]}
    assert fields["responses"] == {"name": "responses", "kind": "tensor", "dtype": "int64", "shape": [8, 6],
                                   "bytes": 8 * 6 * 8}
    assert fields["uid"]["kind"] == "non-tensor" and fields["uid"]["shape"] == [8]
    stats = {s["name"]: s for s in rollout["stats"]}
    lengths = expected.batch["response_mask"].sum(-1).float()
    assert stats["response_length"]["mean"] == pytest.approx(float(lengths.mean()))
    assert stats["response_length"]["max"] == float(lengths.max())
    assert stats["reward"]["source"] == "token_level_scores" and stats["reward"]["mean"] == pytest.approx(0.5)
    assert rollout["fingerprint"]["actor_rollout_ref.model.path"] == "Qwen/Qwen2.5-0.5B"
    assert isinstance(rollout["generation_seconds"], float)
    assert rollout["meta"]["global_steps"] == 3 and rollout["meta"]["format"] == "safe"
    assert rollout["meta_info"]["timing"] == {"gen": 0.25}
    assert rollout["entries"][0]["written_by"].startswith("stepskip")

    assert (v1_step["role"], v1_step["kind"], v1_step["rows"]) == ("rollout_tq", "v1", 8)
    assert [e["inner"] for e in v1_step["entries"]] == [0, 1]
    assert len({e["run_id"] for e in v1_step["entries"]}) == 1
    assert {f["name"]: f["kind"] for f in v1_step["fields"]}["responses"] == "jagged"
    assert sum(e["meta"]["num_trajectories"] for e in v1_step["entries"]) == 8

    assert (stage["role"], stage["rows"]) == ("reward", 8)
    assert {f["name"] for f in stage["fields"]} == {"reward", "acc"}
    assert {s["name"]: s["source"] for s in stage["stats"]}["reward"] == "reward"

    assert verl_entry["entries"][0]["written_by"] == "verl" and verl_entry["entries"][0]["format"] == "verl"
    assert verl_entry["fields"] is None and "--allow-pickle" in verl_entry["note"]
    assert verl_entry["issues"] == []

    result = text
    assert result.code == 0, result
    fixture_part, safe_part = result.out.split("\n\n", 1)
    assert "rollout_tq" in fixture_part and "written by" in fixture_part and "verl" in fixture_part
    assert "reward_score" in fixture_part and "jagged" in fixture_part
    assert "actor_rollout_ref.model.path = 'Qwen/Qwen2.5-0.5B'" in safe_part
    assert "data.safetensors" in safe_part and "response_length (response_mask)" in safe_part


def test_show_prints_trajectories_as_token_ids_and_decoded_text(pristine_cache, tmp_path):
    tokenizer = _tiny_tokenizer(tmp_path / "tokenizer")
    decoded = stepskip("show", pristine_cache / SAFE_RUN / "3", "--rows", "2", "--tokenizer", tokenizer, "--json")
    v1 = stepskip("show", pristine_cache / V1_RUN, "--step", "1", "--rows", "8")

    result = decoded
    assert result.code == 0, result
    expected = rollout_batch(3)
    rows = result.json()["rows"]
    assert len(rows) == 2
    for row in rows:
        i = row["index"]
        mask = expected.batch["attention_mask"][i]
        prompt = expected.batch["prompts"][i][mask[:8].bool()].tolist()
        response = expected.batch["responses"][i][mask[8:].bool()].tolist()
        assert (row["prompt"], row["response"]) == (prompt, response)  # token ids, padding removed
        assert row["prompt_decoded"] == " ".join(f"t{t}" for t in prompt)
        assert row["response_decoded"] == " ".join(f"t{t}" for t in response)
        assert row["id"] == expected.non_tensor_batch["uid"][i]
        assert row["reward"] == float(expected.batch["token_level_scores"][i].sum())

    result = v1
    assert result.code == 0, result
    shown = re.findall(r"^row \d+\s+id (\S+)\s+reward \S+\n\s+prompt \(\d+ tokens\): \[([\d, ]+)\]\n"
                       r"\s+response \(\d+ tokens\): \[([\d, ]+)\]", result.out, flags=re.M)
    assert len(shown) == 8  # both inner entries of the V1 step, merged
    for key, prompt, response in shown:  # the V1 harness: response = arange(1 + (p + s) % 4) + 100p + 10s + 1000 step
        p, s = int(prompt.split(",")[0]), int(key.split("_")[1])
        assert [int(x) for x in response.split(",")] == [x + 100 * p + 10 * s + 1000 for x in range((p + s) % 4 + 1)]


def _tiny_tokenizer(path: Path) -> Path:
    """A word-level Hugging Face tokenizer saved locally: id i <-> "t{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


def test_wrong_paths_and_non_cache_directories_are_clear_errors(tmp_path):
    not_cache = tmp_path / "not_a_cache"
    not_cache.mkdir()
    (not_cache / "notes.txt").write_text("hello")
    calls = {"no such file or directory": stepskip("ls", tmp_path / "does_not_exist"),
             "is not a rollout cache": stepskip("verify", not_cache)}
    for message, call in calls.items():
        result = call
        assert result.code == 2, result
        assert message in " ".join(result.err.split()) and "Traceback" not in result.err, result


def test_console_script_is_installed_and_lists_every_command(capsys):
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["stepskip"] == "stepskip.cli:main"
    assert Path(sys.executable).with_name("stepskip").exists()
    assert main(["--help"]) == 0  # what the script runs (python -m stepskip: test_ls and the others)
    text = capsys.readouterr().out
    for command in ("ls", "info", "verify", "prune", "convert", "show", "demo"):
        assert f" {command} " in text


@pytest.mark.parametrize("args, message", [
    (["info", SAFE_RUN], "is a run directory"),
    (["info", SAFE_RUN, "--step", "99"], "has no step 99"),
    (["show", f"{FIXTURE_RUN}/1"], "--allow-pickle"),
    (["prune", ".", "--keep-last", "1"], "is not a run directory"),
    (["prune", SAFE_RUN], "exactly one of --keep-last N, --older-than AGE, --steps SPEC"),
    (["verify", ".", "--grace", "soon"], "--grace 'soon' is not a duration"),
    (["convert", ".", "out", "--to", "parquet"], "parquet"),
])
def test_bad_arguments_exit_2_with_a_message(pristine_cache, args, message, capsys, monkeypatch):
    # The same entry point as the console script, in process: these need no fresh interpreter.
    monkeypatch.chdir(pristine_cache)
    assert main(args) == 2
    assert message in " ".join(capsys.readouterr().err.split())
