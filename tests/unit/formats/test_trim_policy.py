"""Which tensors the encoder trims: tensors of a few rows (runs inline) and big ones; the tensors of
many rows and few elements in all (a debugging batch) are only narrowed, which decodes by one copy
each where a trimmed one is rebuilt by masked passes. Either way every bit comes back, and entries
whose small tensors were trimmed (by the encoder of before) are still read.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from tensordict import TensorDict

import stepskip._formats.compact as compact
from stepskip import Batch
from stepskip._formats.safe import SafeFormat
from stepskip.testing import make_rollout_batch

TREE, TENSORS = "data.json", "data.safetensors"


def _encode(value: object) -> dict[str, bytes]:
    fmt = SafeFormat()
    return {name: bytes(data) for name, data in fmt.encode(fmt.freeze(value, copy=True)).items()}


def _encodings(files: dict[str, bytes]) -> dict[str, str | None]:
    entries = json.loads(files[TREE])["root"]["batch"]["entries"]
    return {key: node.get("enc") for key, node in entries.items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_a_debugging_batch_is_narrowed_not_trimmed_one_part_a_tensor_and_exact():
    batch = make_rollout_batch(32, 128, 256, n=8, seed=1)
    files = _encode(batch)
    encodings = _encodings(files)
    assert "trim" not in encodings.values()
    assert encodings["input_ids"] == "concat" and encodings["attention_mask"] == "narrow"
    assert len(st_load(files[TENSORS])) == len(encodings) - 1  # input_ids names its two parts
    out = SafeFormat().decode(files)
    for key in batch.batch.keys():
        assert _same(out.batch[key], batch.batch[key]), key


def test_a_few_rows_stay_trimmed_with_their_runs_inline():
    batch = make_rollout_batch(compact.INLINE_MAX_ROWS, 128, 256, n=8, seed=2)
    files = _encode(batch)
    assert _encodings(files)["attention_mask"] == "trim"
    out = SafeFormat().decode(files)
    for key in batch.batch.keys():
        assert _same(out.batch[key], batch.batch[key]), key


@pytest.mark.parametrize(("width", "enc"), [(20, "narrow"), (64, "trim")])
def test_many_rows_are_trimmed_above_the_element_bound_only(monkeypatch, width, enc):
    monkeypatch.setattr(compact, "TRIM_MIN_ELEMENTS", 40 * 32)
    tensor = torch.zeros(40, width, dtype=torch.int64)
    for row in range(40):
        tensor[row, : 2 + row % 5] = row + 1
    files = _encode(Batch(batch=TensorDict({"x": tensor}, batch_size=[40]), non_tensor_batch={}, meta_info={}))
    assert _encodings(files)["x"] == enc
    assert _same(SafeFormat().decode(files).batch["x"], tensor)


def test_a_debugging_batch_trimmed_by_the_encoder_of_before_is_still_read(trim_every_size):
    batch = make_rollout_batch(32, 128, 256, n=8, seed=3)
    files = _encode(batch)
    assert _encodings(files)["attention_mask"] == "trim"
    out = SafeFormat().decode(files)
    for key in batch.batch.keys():
        assert _same(out.batch[key], batch.batch[key]), key
