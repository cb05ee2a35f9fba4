"""Content fingerprints on every backend: the digests travel in ``meta.json`` wherever the cache lives
(local files, memory://, the moto S3 server), and a changed data file or template meets ``on_mismatch``."""

from __future__ import annotations

import json

import pytest
import torch

from stepskip import Batch, SkipManager
from stepskip.cache import CacheIndex
from stepskip.errors import FingerprintMismatchError


class Trainer:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return Batch.from_dict(tensors={"responses": prompts.batch["input_ids"] + self.calls})


def run(backend, tokenizer_dir, data, **skip) -> int:
    SkipManager.init({
        "actor_rollout_ref": {"model": {"path": str(tokenizer_dir)}},
        "data": {"train_files": str(data)},
        "skip": {"rollout": {"enable": True, "dump_dir": backend.dump_dir, "storage_options": backend.storage_options,
                             "steps": [1], "async_dump": False, **skip}},
    })
    SkipManager.set_step(1)
    trainer = Trainer()
    trainer.generate_sequences(Batch.from_dict(tensors={"input_ids": torch.arange(4).reshape(2, 2)}))
    SkipManager.flush()
    return trainer.calls


@pytest.mark.parametrize("change", ["data", "template"])
def test_a_content_change_is_a_mismatch_on_every_store(backend, tmp_path, change):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ a }}"}))
    data = tmp_path / "train.parquet"
    data.write_bytes(b"x" * 100)
    assert run(backend, model, data) == 1
    ((entry,),) = [[e for step in r.steps for e in step.entries]
                   for r in CacheIndex(backend.dump_dir, backend.storage_options).runs()]
    fingerprint = entry.fingerprint
    assert fingerprint["content.data"][str(data)]["size"] == 100 and "content.chat_template" in fingerprint
    assert run(backend, model, data, on_mismatch="error") == 0
    if change == "data":
        data.write_bytes(b"y" * 100)
        expected = r"train.parquet changed \(same size, other content\)"
    else:
        (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ b }}"}))
        expected = "tokenizer chat template changed"
    with pytest.raises(FingerprintMismatchError, match=expected):
        run(backend, model, data, on_mismatch="error")
    assert run(backend, model, data, on_mismatch="regenerate") == 1
    assert run(backend, model, data, on_mismatch="error") == 0
