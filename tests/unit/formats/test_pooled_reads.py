"""Big files read into recycled pages: the same tensors as safetensors' reader, hostile headers refused."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from skip_configs import training_config

from stepskip import Batch, CorruptEntryError, SkipManager
from stepskip.formats import pages
from stepskip.formats.st_read import load_view
from stepskip.store import LocalStore


def tensors():
    return {"i64": torch.arange(12).reshape(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
            "u16": torch.arange(7).to(torch.uint16), "f64": torch.randn(2, 2, dtype=torch.float64)}


def test_load_view_reads_what_safetensors_reads():
    data = st_save(tensors())
    expected, got = st_load(data), load_view(memoryview(data))
    assert set(got) == set(expected)
    for name, tensor in expected.items():  # compared bit for bit
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


def test_loaded_tensors_never_view_the_buffer():
    data = bytearray(st_save({"x": torch.arange(4)}))
    loaded = load_view(memoryview(data))
    data[-32:] = bytes(32)  # the buffer goes back to the pool and is reused: the tensors must not change
    assert loaded["x"].tolist() == [0, 1, 2, 3]


def crafted(header: object, data: bytes = b"", size: int | None = None) -> memoryview:
    text = json.dumps(header).encode()
    return memoryview(struct.pack("<Q", len(text) if size is None else size) + text + data)


@pytest.mark.parametrize("buffer, message", [
    (memoryview(b"\x01\x00"), "too short"),
    (crafted({}, size=1 << 40), "a header of"),
    (memoryview(struct.pack("<Q", 3) + b"{x]"), "not JSON"),
    (crafted([1, 2]), "not a JSON object"),
    (crafted({"a": 5}), "not an object"),
    (crafted({"a": {"dtype": "I128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16)), "not a safetensors dtype"),
    (crafted({"a": {"dtype": "I64", "shape": [-1], "data_offsets": [0, 8]}}, bytes(8)), "not a list of sizes"),
    (crafted({"a": {"dtype": "I64", "shape": [True], "data_offsets": [0, 8]}}, bytes(8)), "not a list of sizes"),
    (crafted({"a": {"dtype": "I64", "shape": [1], "data_offsets": [0, 16]}}, bytes(8)), "not a range inside"),
    (crafted({"a": {"dtype": "I64", "shape": [1], "data_offsets": [8, 0]}}, bytes(8)), "not a range inside"),
    (crafted({"a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "8 bytes for shape"),
    (crafted({"a": {"dtype": "I64", "shape": [1 << 40], "data_offsets": [0, 8]}}, bytes(8)), "8 bytes for shape"),
    # the same bytes under many names: each would be a copy, more memory than the file holds
    (crafted({f"a{i}": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]} for i in range(3)}, bytes(64)),
     "overlap"),
])
def test_a_hostile_header_is_damage_naming_what_is_wrong(buffer, message):
    with pytest.raises(CorruptEntryError, match=message):
        load_view(buffer)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_damaged_bytes_load_or_raise_only_corrupt_entry(data):
    raw = bytearray(st_save(tensors()))
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        out = load_view(memoryview(bytes(raw[:cut])))
    except CorruptEntryError:
        return
    assert sum(t.numel() * t.element_size() for t in out.values()) <= cut


def test_a_local_read_asked_for_pooled_pages_returns_them_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(pages.POOL, "min_bytes", 1024)
    store = LocalStore()
    path = str(tmp_path / "e")
    store.write_entry(path, {"big": bytes(range(256)) * 64, "small": b"abc"}, {"global_steps": 1})
    _, files = store.read_entry(path, pooled=True)
    assert isinstance(files["big"], memoryview) and bytes(files["big"]) == bytes(range(256)) * 64
    assert files["small"] == b"abc" and isinstance(files["small"], bytes)
    _, plain = store.read_entry(path)
    assert isinstance(plain["big"], bytes)
    with open(tmp_path / "e" / "big", "r+b") as fh:  # same size, other bytes: the checksum still tells
        fh.write(b"\xff")
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.read_entry(path, pooled=True)


class Loop:
    def __init__(self, result):
        self.result, self.calls = result, 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        self.calls += 1
        return self.result


@pytest.mark.parametrize("fmt", ["safe", "verl"])
def test_hits_read_through_recycled_pages_in_every_format(tmp_path, monkeypatch, fmt):
    """Every data file goes through the pages here; the pickle format gets its bytes back as bytes."""
    monkeypatch.setattr(pages.POOL, "min_bytes", 1)
    result = Batch.from_dict({"responses": torch.arange(4096).reshape(64, 64), "logp": torch.randn(64, 8)},
                             non_tensors={"uid": [f"u{i // 2}" for i in range(64)]})
    prompts = Batch.from_dict(non_tensors={"uid": [f"u{i // 2}" for i in range(64)]})
    SkipManager.init(training_config(tmp_path, format=fmt, allow_pickle=True))
    SkipManager.set_step(1)
    Loop(result).generate_sequences(prompts)
    SkipManager.reset()
    SkipManager.init(training_config(tmp_path, format=fmt, allow_pickle=True, action="replay"))
    SkipManager.set_step(1)
    loop = Loop(None)
    out = loop.generate_sequences(prompts)
    assert loop.calls == 0
    assert torch.equal(out.batch["responses"], result.batch["responses"])
    assert torch.equal(out.batch["logp"], result.batch["logp"])
    SkipManager.reset()
