"""Content fingerprints through the public config: a verl-shaped training config names the model,
tokenizer and data files; what they hold is recorded with each entry, and a change meets the
role's ``on_mismatch`` (``error`` / ``warn`` / ``regenerate``) with a message naming what changed."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip.errors import FingerprintMismatchError
from stepskip._identity import RunIdentity

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


class Trainer:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict(tensors={"responses": prompts.batch["input_ids"] * 10 + self.calls},
                               non_tensors={"uid": prompts.non_tensor_batch["uid"]})


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0, "b": 1}}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (path / "config.json").write_text(json.dumps({"hidden_size": 32}))
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    return path


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"p" * 1234)
    return path


def config(tmp_path, model_dir, data, **skip) -> dict:
    return {
        "trainer": {"experiment_name": "exp", "project_name": "proj"},
        "actor_rollout_ref": {"model": {"path": str(model_dir)}, "rollout": {"n": 1, "temperature": 1.0}},
        "data": {"train_files": [str(data)], "train_batch_size": 2},
        "skip": {"rollout": {"enable": True, "dump_dir": str(tmp_path / "dump"), "steps": [1], "async_dump": False,
                             **skip}},
    }


def call(cfg, identity=None) -> tuple[Batch, int]:
    SkipManager.init(cfg, identity=identity)
    SkipManager.set_step(1)
    trainer = Trainer()
    prompts = Batch.from_dict(tensors={"input_ids": torch.arange(6).reshape(2, 3)}, non_tensors={"uid": ["a", "b"]})
    out = trainer.generate_sequences(prompts)
    SkipManager.flush()
    return out, trainer.calls


def recorded_fingerprint(tmp_path) -> dict:
    (meta,) = (tmp_path / "dump").rglob("meta.json")
    return json.loads(meta.read_text())["fingerprint"]


def test_the_entry_records_what_the_config_names(tmp_path, model_dir, data):
    _, calls = call(config(tmp_path, model_dir, data))
    fingerprint = recorded_fingerprint(tmp_path)
    assert calls == 1
    assert set(fingerprint["content.tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert fingerprint["content.chat_template"] != "none"
    assert set(fingerprint["content.model_config"]) == {"config.json"}
    assert fingerprint["content.data"][str(data)]["size"] == 1234
    assert "content.model_weights" not in fingerprint  # fingerprint_weights is off by default
    _, calls = call(config(tmp_path, model_dir, data, on_mismatch="error"))
    assert calls == 0  # nothing changed: replayed


def test_a_rewritten_data_file_under_error_stops_naming_it(tmp_path, model_dir, data):
    call(config(tmp_path, model_dir, data))
    data.write_bytes(b"q" * 1300)
    with pytest.raises(FingerprintMismatchError, match=r"data file .*train.parquet changed \(size 1234 -> 1300\)"):
        call(config(tmp_path, model_dir, data, on_mismatch="error"))


def test_a_changed_chat_template_under_warn_replays_and_says_so(tmp_path, model_dir, data, caplog):
    first, _ = call(config(tmp_path, model_dir, data))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE + "!"}))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        again, calls = call(config(tmp_path, model_dir, data, on_mismatch="warn"))
    assert calls == 0 and torch.equal(first.batch["responses"], again.batch["responses"])
    assert any("tokenizer chat template changed" in r.getMessage() and "replaying it anyway" in r.getMessage()
               for r in caplog.records)


def test_a_re_saved_model_config_under_regenerate_records_again(tmp_path, model_dir, data):
    call(config(tmp_path, model_dir, data))
    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 64}))
    _, calls = call(config(tmp_path, model_dir, data, on_mismatch="regenerate"))
    assert calls == 1  # generated again, and recorded over the stale entry
    _, calls = call(config(tmp_path, model_dir, data, on_mismatch="error"))
    assert calls == 0


def test_weights_count_only_with_fingerprint_weights(tmp_path, model_dir, data):
    call(config(tmp_path, model_dir, data, fingerprint_weights=True))
    assert set(recorded_fingerprint(tmp_path)["content.model_weights"]) == {"model.safetensors"}
    (model_dir / "model.safetensors").write_bytes(b"\1" * 4096)
    _, calls = call(config(tmp_path, model_dir, data, on_mismatch="error"))
    assert calls == 0  # this run does not digest weights: not compared
    with pytest.raises(FingerprintMismatchError, match=r"model weight file model.safetensors changed"):
        call(config(tmp_path, model_dir, data, on_mismatch="error", fingerprint_weights=True))


@pytest.mark.parametrize("key", ["fingerprint_weights", "fingerprint_code"])
def test_a_bad_option_value_is_a_start_up_error(tmp_path, model_dir, data, key):
    with pytest.raises(SkipConfigError, match=rf"skip.rollout.{key} = 'yes' \(str\) is not valid; allowed values: "
                                               "true, false"):
        SkipManager.init(config(tmp_path, model_dir, data, **{key: "yes"}))


def test_entries_recorded_before_content_digests_still_replay(tmp_path, model_dir, data):
    cfg = config(tmp_path, model_dir, data)
    call(cfg, identity=dataclasses.replace(RunIdentity.from_config(cfg), content=None))
    assert not any(key.startswith("content.") for key in recorded_fingerprint(tmp_path))
    data.write_bytes(b"q" * 1300)
    _, calls = call(config(tmp_path, model_dir, data, on_mismatch="error"))
    assert calls == 0


def test_missing_paths_are_recorded_not_fatal(tmp_path, data):
    cfg = config(tmp_path, tmp_path / "no-model", tmp_path / "no-data.parquet", on_mismatch="error")
    _, calls = call(cfg)
    fingerprint = recorded_fingerprint(tmp_path)
    assert calls == 1 and fingerprint["content.data"][str(tmp_path / "no-data.parquet")] == {"missing": True}
    assert fingerprint["content.model_config"] == {"missing": str(tmp_path / "no-model")}
    (tmp_path / "no-data.parquet").write_bytes(b"x")
    with pytest.raises(FingerprintMismatchError, match=r"no-data.parquet changed \(missing -> size 1\)"):
        call(cfg)


def git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def test_a_new_commit_of_the_code_is_named_and_fingerprint_code_leaves_it_out(tmp_path, model_dir, data,
                                                                              monkeypatch):
    repo = tmp_path / "code"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "train.py").write_text("v1\n")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "v1")
    monkeypatch.chdir(repo)  # the run starts in its work tree
    call(config(tmp_path, model_dir, data))
    assert recorded_fingerprint(tmp_path)["content.code"]["dirty"] is False
    (repo / "train.py").write_text("v2\n")
    git(repo, "commit", "-q", "-am", "v2")
    with pytest.raises(FingerprintMismatchError, match=r"code revision changed \([0-9a-f]{12} -> [0-9a-f]{12}\)"):
        call(config(tmp_path, model_dir, data, on_mismatch="error"))
    _, calls = call(config(tmp_path, model_dir, data, on_mismatch="error", fingerprint_code=False))
    assert calls == 0


def test_an_explicit_identity_carries_its_own_sources(tmp_path, data):
    identity = RunIdentity("grpo", "tiny", fingerprint={"model": "tiny"},
                           content={"data_files": [str(data)], "code": False})
    skip = {"skip": {"rollout": {"enable": True, "dump_dir": str(tmp_path / "dump"), "steps": [1],
                                 "async_dump": False, "on_mismatch": "error"}}}
    _, calls = call(skip, identity=identity)
    assert calls == 1 and set(recorded_fingerprint(tmp_path)) == {"model", "content.data"}
    data.write_bytes(b"z" * 1234)
    with pytest.raises(FingerprintMismatchError, match=r"train.parquet changed \(same size, other content\)"):
        call(skip, identity=identity)
