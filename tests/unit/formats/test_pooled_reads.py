"""Big files read into recycled pages: the same tensors as safetensors' reader, hostile headers refused."""

from __future__ import annotations

import gc
import json
import re
import struct
import warnings
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from skip_configs import training_config
from tensordict import NonTensorData, TensorDict

from stepskip import Batch, CorruptEntryError, SkipManager
from stepskip._storage import EntryStore, LocalBackend
from stepskip._formats import pages
from stepskip._formats.safe import SafeFormat
from stepskip._formats.st_read import load_view
from stepskip.testing import make_rollout_batch

# the trimmed layouts of many rows are what these tests take apart (see the fixture)
pytestmark = pytest.mark.usefixtures("trim_every_size")


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


def test_views_share_the_buffer_where_the_bytes_lie_aligned():
    data, views = bytearray(st_save(tensors())), set()
    expected, got = st_load(bytes(data)), load_view(memoryview(data), views=views)
    assert views == {name for name, tensor in expected.items() if tensor.numel()}
    for name, tensor in expected.items():
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    begin = 8 + struct.unpack("<Q", data[:8])[0]
    data[begin:] = bytes(len(data) - begin)
    for name, tensor in got.items():  # safetensors lays every tensor out aligned: each one read in place
        assert torch.count_nonzero(tensor.reshape(-1).view(torch.uint8)) == 0, name


def test_views_are_copies_where_the_bytes_are_read_only_or_misaligned():
    header = json.dumps({"y": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                         "x": {"dtype": "I64", "shape": [2], "data_offsets": [4, 20]}}).encode()
    header += b" " * (-len(header) % 8)  # the data start 8-aligned, so x's bytes start 4 bytes off
    payload = bytes([1, 2, 3, 4]) + struct.pack("<2q", 7, -7)
    raw = struct.pack("<Q", len(header)) + header + payload
    writable, read_only, views = memoryview(bytearray(raw)), set(), set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when it is given read-only memory
        from_bytes = load_view(memoryview(raw), views=read_only)
    got = load_view(writable, views=views)
    for loaded in (from_bytes, got):
        assert loaded["x"].tolist() == [7, -7] and loaded["y"].tolist() == [1, 2, 3, 4]
    assert (read_only, views) == (set(), {"y"})
    writable[len(raw) - len(payload):] = bytes(len(payload))
    assert got["y"].tolist() == [0, 0, 0, 0]  # aligned (one byte per element): read in place
    assert got["x"].tolist() == [7, -7]  # misaligned for int64: copied out


def test_views_are_aligned_in_memory_not_only_within_the_file():
    """A buffer that starts one byte into its memory: offsets aligned within the file are not in memory."""
    raw = st_save({"x": torch.arange(4), "y": torch.arange(3).to(torch.uint8)})
    views = set()
    got = load_view(memoryview(bytearray(b"\0" + raw))[1:], views=views)
    assert views == {"y"} and got["x"].tolist() == [0, 1, 2, 3] and got["x"].data_ptr() % 8 == 0


def _every_kind_of_part(rows: int = 64) -> dict[str, object]:
    """A value holding a tensor through every kind of node a part can reach the caller by (random
    data where a part must stay raw: zstd would pack anything it can halve)."""
    batch = make_rollout_batch(rows, 32, 64, n=8)
    tensors_column = np.empty(rows, dtype=object)
    tensors_column[:] = [torch.randn(16) for _ in range(rows)]
    return {
        "batch": batch.batch,
        "jagged": TensorDict({"j": torch.nested.as_nested_tensor([torch.arange(i + 1) * 3 for i in range(rows)],
                                                                 layout=torch.jagged)}, batch_size=[rows]),
        "raw": torch.randn(rows, 256), "ids": torch.randint(0, 1000, (rows, 512)),
        "rollout": Batch.from_dict(tensors={"logp": torch.randn(rows, 64)},
                                   non_tensors={"uid": [f"u{i}" for i in range(rows)], "tensors": tensors_column},
                                   meta_info={"weights": torch.randn(4096)}),
        "numbers": np.random.default_rng(0).standard_normal((rows, 128)),
        "flags": np.random.default_rng(1).integers(0, 2, (rows, 256)).astype(bool),
        "wrapped": TensorDict({"nt": NonTensorData(torch.randn(2048))}, batch_size=[]),
        "listed": [torch.randn(1024), {"deep": torch.randn(512)}],
    }


def _same(got: object, want: object) -> bool:
    if isinstance(want, torch.Tensor):
        if want.is_nested:
            return all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))
        return torch.equal(got, want)
    if isinstance(want, np.ndarray):
        return want.dtype == object and all(_same(a, b) for a, b in zip(got, want)) or np.array_equal(got, want)
    if isinstance(want, TensorDict):
        return all(_same(got.get(k), want.get(k)) for k in want.keys())
    if isinstance(want, NonTensorData):
        return _same(got.data, want.data)
    if isinstance(want, (list, dict)):
        pairs = zip(got, want) if isinstance(want, list) else ((got[k], v) for k, v in want.items())
        return type(got) is type(want) and len(got) == len(want) and all(_same(a, b) for a, b in pairs)
    if isinstance(want, Batch):
        return (_same(got.batch, want.batch) and all(_same(got.non_tensor_batch[k], v)
                                                     for k, v in want.non_tensor_batch.items())
                and all(_same(got.meta_info[k], v) for k, v in want.meta_info.items()))
    return got == want


@pytest.mark.parametrize("compress", ["auto", "zstd", "none"])
def test_a_decoded_entry_owns_its_memory_whatever_its_parts_were_read_from(compress):
    """Widened, trimmed, unpacked and raw parts alike, through every kind of node: zeroing the tensor
    file's buffer after the decode changes nothing the caller got, nothing the caller got keeps the
    buffer alive, and a raw tensor's storage holds only its own bytes."""
    value = _every_kind_of_part()
    fmt = SafeFormat(compress)
    encoded = fmt.encode(fmt.freeze(value, copy=True))
    text = bytes(encoded["data.json"]).decode()
    if compress != "none":  # the encoded parts this is about are there
        assert {"trim", "narrow"} <= set(re.findall(r'"enc":"(\w+)"', text))
    if compress == "zstd":
        assert json.loads(text)["packed"]
    for kind in ("array", "object_array", "non_tensor_data", "batch", "value"):
        assert f'"kind":"{kind}"' in text, kind
    buffer = np.frombuffer(bytearray(encoded["data.safetensors"]), dtype=np.uint8).copy()  # weakly referable
    alive = weakref.ref(buffer)
    files = {"data.json": encoded["data.json"], "data.safetensors": memoryview(buffer)}
    out = fmt.decode(files)
    viewed = buffer.ctypes.data, buffer.ctypes.data + buffer.size
    buffer[:] = 0
    for key, want in value.items():
        assert _same(out[key], want), key
    assert out["raw"].untyped_storage().nbytes() == out["raw"].numel() * 4
    del files, buffer
    gc.collect()
    assert alive() is None, f"a decoded tensor still holds the tensor file's buffer at {viewed}"


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
    (memoryview(struct.pack("<Q", 40_000) + b"[" * 20_000 + b"]" * 20_000), "nests too deep"),
    (crafted({"a": {"dtype": "I64", "shape": [1 << 70, 0], "data_offsets": [0, 0]}}), "not a list of sizes"),
    (crafted({"a": {"dtype": "I64", "shape": [1 << 61, 1 << 61, 0], "data_offsets": [0, 0]}}),
     "not a list of sizes"),
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


def test_a_local_read_given_the_page_pool_as_allocator_returns_pooled_pages_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(pages.POOL, "min_bytes", 1024)
    store = EntryStore(LocalBackend())
    path = str(tmp_path / "e")
    store.write_entry(path, {"big": bytes(range(256)) * 64, "small": b"abc"}, {"global_steps": 1})
    _, files = store.read_entry(path, allocator=pages.POOL.buffer)
    assert isinstance(files["big"], memoryview) and bytes(files["big"]) == bytes(range(256)) * 64
    assert files["small"] == b"abc" and isinstance(files["small"], bytes)
    _, plain = store.read_entry(path)
    assert isinstance(plain["big"], bytes)
    with open(tmp_path / "e" / "big", "r+b") as fh:  # same size, other bytes: the checksum still tells
        fh.write(b"\xff")
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.read_entry(path, allocator=pages.POOL.buffer)


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
