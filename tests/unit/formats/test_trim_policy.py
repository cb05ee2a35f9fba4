"""Which tensors the encoder trims, and which entries ``compress: auto`` compresses.

Tensors of a few rows (runs inline) and big ones are trimmed; the tensors of many rows and few
elements in all (a debugging batch) are only narrowed, which decodes by one copy each where a
trimmed one is rebuilt by masked passes. Entries under ``ZSTD_ENTRY_MIN_BYTES`` of stored tensors
are not compressed by ``auto`` (reading their bytes costs less than decompressing them); ``zstd``
compresses them still. Either way every bit comes back, and entries whose small tensors were
trimmed or compressed (by the encoder of before) are still read.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as st_load
from tensordict import TensorDict

import stepskip._formats.compact as compact
import stepskip._formats.safe as safe
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


@pytest.mark.parametrize(("width", "enc"), [(20, "narrow"), (31, "narrow"), (32, "trim"), (64, "trim")])
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


def _compressible() -> Batch:
    """A tensor stored as 512 KiB (int16 once narrowed) that zstd shrinks far below half (a repeating ramp)."""
    tensor = (torch.arange(128 * 2048, dtype=torch.int32) % 4001).reshape(128, 2048)
    return Batch(batch=TensorDict({"x": tensor}, batch_size=[128]), non_tensor_batch={}, meta_info={})


def _encode_with(compress: str, value: Batch) -> dict[str, bytes]:
    fmt = SafeFormat(compress)
    return {name: bytes(data) for name, data in fmt.encode(fmt.freeze(value, copy=True)).items()}


@pytest.mark.parametrize(("compress", "entry_min", "packed"), [
    ("auto", None, False),  # a small entry: its bytes are read, not decompressed
    ("auto", 0, True),  # as big entries are: compressed where it halves a part
    ("zstd", None, True),  # asked for: compressed whatever its size
])
def test_auto_compresses_only_entries_of_many_stored_bytes(monkeypatch, compress, entry_min, packed):
    if entry_min is not None:
        monkeypatch.setattr(safe, "ZSTD_ENTRY_MIN_BYTES", entry_min)
    value = _compressible()
    files = _encode_with(compress, value)
    assert bool(json.loads(files[TREE]).get("packed")) == packed
    assert len(files[TENSORS]) < (1 << 18) if packed else len(files[TENSORS]) > (1 << 18)
    assert _same(SafeFormat().decode(files).batch["x"], value.batch["x"])


def test_a_debugging_batch_decodes_on_the_calling_thread(monkeypatch):
    """Its narrowed tensors are a few copies: rebuilt here, not handed to the codec pool (entries of
    ``DECODE_PARALLEL_MIN_BYTES`` and more are; see test_compact's concatenation test)."""
    import threading

    decoded_on: set[str] = set()
    node = safe._Decoder.node

    def spied(self, *args, **kwargs):
        decoded_on.add(threading.current_thread().name)
        return node(self, *args, **kwargs)

    monkeypatch.setattr(safe._Decoder, "node", spied)
    batch = make_rollout_batch(256, 128, 384, n=8, seed=4)
    files = _encode(batch)
    assert len(files[TENSORS]) >= safe.PARALLEL_MIN_BYTES  # big enough for the pool before
    out = SafeFormat().decode(files)
    assert decoded_on == {threading.current_thread().name}
    assert _same(out.batch["input_ids"], batch.batch["input_ids"])
