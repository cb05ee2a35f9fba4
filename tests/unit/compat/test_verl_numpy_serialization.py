"""``gen_batch.dp`` files verl 0.9.1 wrote under ``VERL_DATAPROTO_SERIALIZATION_METHOD=numpy``, read without verl.

The fixture (``tests/fixtures/verl/cache_numpy``, made by ``generate_numpy.py`` with verl's own
``SkipManager`` and ``DataProto``) holds the same steps as ``cache``: ``expected/`` describes both.
"""

from __future__ import annotations

import io
import json
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner
from verl_fixtures import FIXTURES, RUN, EchoLoop, check_load_module, comparable, copy_fixture, expected_summary
from verl_fixtures import fixture_config as config

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip.cli.app import app
from stepskip.errors import CorruptEntryError, DecodeLimitError
from stepskip._formats import verl as verl_format

NUMPY_RUN = FIXTURES / "cache_numpy" / RUN


@pytest.fixture
def numpy_cache(tmp_path):
    return copy_fixture("cache_numpy", tmp_path)


def test_the_fixture_is_verls_numpy_serialization():
    data = (NUMPY_RUN / "1" / "gen_batch.dp").read_bytes()
    state = verl_format.restricted_loads(data).state
    assert isinstance(state[0], tuple) and isinstance(state[0][2], dict)  # (batch_size, device, fields), not bytes


@pytest.mark.parametrize("step", [1, 2])
def test_numpy_serialized_verl_cache_replays_exactly_and_needs_no_engine(numpy_cache, step):
    settings = config(numpy_cache, allow_pickle=True, action="replay")
    assert SkipManager.engine_plan("rollout", [1, 2], config=settings).start is False
    SkipManager.init(settings)
    SkipManager.set_step(step)
    loop = EchoLoop()
    out = loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["x"] * 8}))
    assert loop.calls == 0 and isinstance(out, Batch)
    assert comparable(check_load_module().summarise(out)) == comparable(expected_summary(f"gen_batch_step{step}"))
    for key, tensor in load_file(str(FIXTURES / "expected" / f"gen_batch_step{step}.safetensors")).items():
        assert out.batch[key].dtype == tensor.dtype and torch.equal(out.batch[key], tensor), key


def test_numpy_serialized_entries_are_refused_without_allow_pickle_and_left_untouched(numpy_cache):
    data = numpy_cache / RUN / "1" / "gen_batch.dp"
    before = data.read_bytes()
    SkipManager.init(config(numpy_cache, action="cache"))
    assert SkipManager.engine_plan("rollout", [1]).start is True  # an entry it may not read serves no step
    SkipManager.set_step(1)
    loop = EchoLoop()
    with pytest.raises(SkipConfigError) as err:
        loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["x"] * 8}))
    assert "allow_pickle" in str(err.value) and "stepskip convert" in str(err.value)
    SkipManager.flush()
    assert loop.calls == 0 and data.read_bytes() == before


def test_convert_turns_numpy_serialized_entries_into_safe_ones(numpy_cache, tmp_path):
    out = tmp_path / "converted"
    result = CliRunner().invoke(app, ["convert", str(numpy_cache / "fx_verl"), str(out), "--to", "safe",
                                      "--allow-pickle", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ok"] and {c["source_format"] for c in report["converted"]} == {"verl"}
    for step in (1, 2):
        meta = json.loads((out / RUN / str(step) / "meta.json").read_text())
        assert meta["format"] == "safe" and meta["converted_from"] == "verl"
    SkipManager.init(config(out, action="replay"))  # no pickle allowed: the converted cache is safe
    SkipManager.set_step(1)
    loop = EchoLoop()
    replayed = loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["x"] * 8}))
    assert loop.calls == 0
    assert comparable(check_load_module().summarise(replayed)) == comparable(expected_summary("gen_batch_step1"))


# --------------------------------------------------------------------------- hostile numpy-serialized batches


def numpy_pickle(fields: dict, batch_size=(2,), device=None) -> bytes:
    """A gen_batch.dp in verl's numpy serialization, written without verl (tensors' bytes as uint8 arrays)."""
    state = ((tuple(batch_size), device, fields), {}, {})
    out = io.BytesIO()
    verl_format._VerlPickler(out, protocol=verl_format.PICKLE_PROTOCOL).dump(verl_format._DataProtoStandIn(state))
    return out.getvalue()


def encoded(tensor: torch.Tensor) -> tuple:
    return (str(tensor.dtype).removeprefix("torch."), torch.Size(tensor.shape),
            tensor.flatten().contiguous().view(torch.uint8).numpy())


def decode(data: bytes):
    return verl_format.VerlFormat().decode({"gen_batch.dp": data})


def test_a_numpy_serialized_batch_written_here_reads_back():
    ids = torch.arange(6).reshape(2, 3)
    jagged = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3) * 2], layout=torch.jagged)
    out = decode(numpy_pickle({"ids": encoded(ids), "mask": encoded(torch.tensor([True, False])),
                               "j": ("jagged", [encoded(t) for t in jagged.unbind()])}, device="cuda:0"))
    assert torch.equal(out.batch["ids"], ids) and out.batch["mask"].tolist() == [True, False]
    assert [t.tolist() for t in out.batch["j"].unbind()] == [[1.0, 1.0], [2.0, 2.0, 2.0]]
    assert out.batch["ids"].device.type == "cpu"


@pytest.mark.parametrize(("fields", "why"), [
    ({"a": ("int64", torch.Size([2]), np.zeros(15, np.uint8))}, "bytes"),  # 15 bytes for 2 int64
    ({"a": ("os.system", torch.Size([2]), np.zeros(16, np.uint8))}, "not a torch dtype"),
    ({"a": ("int64", torch.Size([2]), np.zeros((2, 8), np.uint8))}, "1-D uint8"),
    ({"a": ("int64", torch.Size([2]), np.zeros(2, np.int64))}, "1-D uint8"),
    ({"a": ("coo", [("int64", torch.Size([1]), np.zeros(8, np.uint8))])}, "nested"),
    ({"a": ("jagged", [])}, "nested"),
    ({"a": ("int64", torch.Size([3]), np.zeros(24, np.uint8))}, "batch dimension"),  # 3 rows in a batch of 2
    ({"a": ["int64", [2], b"\0" * 16]}, "encoded"),
])
def test_a_forged_numpy_serialized_batch_is_refused(fields, why):
    with pytest.raises(CorruptEntryError) as err:
        decode(numpy_pickle(fields))
    assert why in str(err.value), err.value


class _Forged:
    def __init__(self, dims):
        self.dims = dims

    def __reduce__(self):
        return torch.Size, (self.dims,)


def test_a_torch_size_global_is_only_a_checked_shape():
    assert verl_format.restricted_loads(pickle.dumps(torch.Size([2, 3]), protocol=4)) == (2, 3)
    for dims in (("1",), (-1,), [2.0]):
        with pytest.raises(pickle.UnpicklingError, match="torch.Size"):
            verl_format.restricted_loads(pickle.dumps(_Forged(dims), protocol=4))


def test_one_tensors_bytes_named_by_many_fields_are_charged_to_the_decode_bound():
    """The pickle memo lets a 1 MiB tensor be named by 64 fields for a few bytes each: 64 MiB to rebuild."""
    shared = encoded(torch.zeros(2, 1 << 17, dtype=torch.float32))  # 1 MiB
    data = numpy_pickle({f"f{i}": shared for i in range(64)})
    assert len(data) < 2 << 20
    with pytest.raises(DecodeLimitError, match="decode bound"):
        verl_format.VerlFormat().decode({"gen_batch.dp": data}, max_bytes=16 << 20)


def test_a_genuine_numpy_serialized_batch_fits_the_decode_bound_of_its_own_size():
    data = numpy_pickle({"ids": encoded(torch.arange(1 << 16).reshape(2, -1)),
                         "j": ("jagged", [encoded(torch.ones(1 << 14)), encoded(torch.ones(1 << 15))])})
    out = verl_format.VerlFormat().decode({"gen_batch.dp": data}, max_bytes=4 * len(data))
    assert out.batch["ids"].shape == (2, 1 << 15)



@pytest.mark.parametrize("dtype", ["qint8", "quint4x2", "bits8", "uint4", "int1"])
def test_a_tensor_of_a_dtype_without_values_is_refused(dtype):
    """Quantized, opaque-bit and sub-byte dtypes viewed from raw bytes make tensors that no copy or print survives."""
    with pytest.raises(CorruptEntryError, match="not a torch dtype"):
        decode(numpy_pickle({"a": (dtype, torch.Size([2]), np.zeros(2, np.uint8))}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.uint16, torch.complex64, torch.bool])
def test_tensors_of_every_value_dtype_read_back(dtype):
    tensor = torch.zeros(2, 3, dtype=dtype)
    out = decode(numpy_pickle({"a": encoded(tensor)}))
    assert out.batch["a"].dtype == dtype and out.batch["a"].clone().view(torch.uint8).sum() == 0
