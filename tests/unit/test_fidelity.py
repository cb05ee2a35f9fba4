"""Run fingerprints and prompt digests (replay fidelity)."""

from __future__ import annotations

import numpy as np
import torch
from omegaconf import OmegaConf
from tensordict import NonTensorStack, TensorDict

from stepskip import Batch
from stepskip.fidelity import fingerprint_diff, prompt_digest, run_fingerprint


def test_fingerprint_takes_the_listed_keys_that_are_set_and_user_keys():
    config = OmegaConf.create({
        "actor_rollout_ref": {"model": {"path": "/m"}, "rollout": {"temperature": 0.7, "n": 4}},
        "data": {"train_files": ["a.parquet", "b.parquet"], "seed": 3},
        "trainer": {"experiment_name": "e", "run_id": "r1"},
        "reward": {"version": 2},
    })
    fp = run_fingerprint(config, ["reward.version", "missing.key"])
    assert fp == {
        "actor_rollout_ref.model.path": "/m", "actor_rollout_ref.rollout.temperature": 0.7,
        "actor_rollout_ref.rollout.n": 4, "data.train_files": ["a.parquet", "b.parquet"], "data.seed": 3,
        "reward.version": 2,
    }


def test_fingerprint_diff_names_each_key_with_both_values():
    lines = fingerprint_diff({"a": 1, "b": "x", "c": 3}, {"a": 1, "b": "y", "d": 4})
    assert lines == ["b: recorded 'x', now 'y'", "c: recorded 3, now None", "d: recorded None, now 4"]


def prompts(tokens, uids, raw=("hello", "world")):
    return Batch.from_dict(tensors={"input_ids": torch.tensor(tokens)},
                           non_tensors={"uid": list(uids), "raw_prompt": list(raw)})


def test_prompt_digest_covers_content_and_ignores_identifier_columns():
    base = prompt_digest(prompts([[1, 2], [3, 4]], ["u1", "u2"]), ["uid"])
    assert base == prompt_digest(prompts([[1, 2], [3, 4]], ["v1", "v2"]), ["uid"])
    assert base != prompt_digest(prompts([[1, 2], [3, 5]], ["u1", "u2"]), ["uid"])
    assert base != prompt_digest(prompts([[1, 2], [3, 4]], ["u1", "u2"], raw=("hello", "there")), ["uid"])
    assert base != prompt_digest(prompts([[1, 2], [3, 4]], ["u1", "u2"]), [])  # uid counted when not excluded


def test_prompt_digest_of_tensordicts_with_jagged_and_non_tensor_columns():
    def td(last):
        out = TensorDict({"ids": torch.nested.nested_tensor([torch.arange(2), torch.tensor([5, last])],
                                                            layout=torch.jagged)}, batch_size=[2])
        out.set("uid", NonTensorStack.from_list([str(last), "x"]))
        out.set("msg", NonTensorStack.from_list([{"role": "user"}, "s"]))
        return out

    assert prompt_digest(td(1), ["uid"]) == prompt_digest(td(1), ["uid"])
    assert prompt_digest(td(1), ["uid"]) != prompt_digest(td(2), ["uid"])
    assert prompt_digest(object()) is None


def test_prompt_digest_is_a_bulk_hash():
    big = Batch.from_dict(tensors={"input_ids": torch.randint(0, 50000, (1024, 4096))},
                          non_tensors={"uid": np.array([str(i) for i in range(1024)], dtype=object)})
    digest = prompt_digest(big, ["uid"])
    big.batch["input_ids"][1023, 4095] += 1
    assert prompt_digest(big, ["uid"]) != digest  # the last token of 4M counts
