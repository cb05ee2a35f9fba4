"""format 'safe' (stepskip._formats.safe.SafeFormat): exact round-trips, snapshots, errors, no pickle."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip import Batch, CorruptEntryError
from stepskip.errors import UnstorableValueError
from stepskip._formats import get_format
from stepskip._formats.safe import SafeFormat

Exact = Callable[[Any, Any], None]
FMT = SafeFormat()


def roundtrip(value: Any, copy: bool = True) -> Any:
    return FMT.decode(FMT.encode(FMT.freeze(value, copy=copy)))


def obj(items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


class Custom:
    pass


def jagged(*lengths: int, dtype: torch.dtype = torch.int64, inner: tuple[int, ...] = ()) -> torch.Tensor:
    parts = [torch.arange(n * max(1, int(np.prod(inner)))).reshape(n, *inner).to(dtype) + 10 * i
             for i, n in enumerate(lengths)]
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def make_tensordict(rows: int = 3) -> TensorDict:
    g = torch.Generator().manual_seed(0)
    td = TensorDict(
        {
            "input_ids": torch.arange(rows * 5, dtype=torch.int64).reshape(rows, 5),
            "logp": torch.randn(rows, 5, generator=g, dtype=torch.float32),
            "mask": torch.arange(rows * 5).reshape(rows, 5) % 3 == 0,
            "bf": torch.randn(rows, 2, generator=g).to(torch.bfloat16),
            "responses": jagged(*[i + 1 for i in range(rows)]),
            "sub": TensorDict({"x": torch.ones(rows, 1, dtype=torch.float16),
                               "deeper": TensorDict({"y": torch.zeros(rows, dtype=torch.int32)}, batch_size=[rows])},
                              batch_size=[rows]),
        },
        batch_size=[rows],
    )
    td["note"] = "same for every row"
    td["prompt_text"] = NonTensorStack(*[f"prompt {i}" for i in range(rows)])
    td["extra"] = NonTensorStack(*[NonTensorData({"row": i, "tag": None, "vals": [i, i + 1]}) for i in range(rows)])
    return td


def make_batch(rows: int = 3) -> Batch:
    return Batch(
        batch=make_tensordict(rows),
        non_tensor_batch={
            "uid": obj([f"uid-{i}" for i in range(rows)]),
            "raw_prompt": obj([[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}]
                               for i in range(rows)]),
            "reward_model": obj([{"ground_truth": str(i), "style": "rule", "extra": None} for i in range(rows)]),
            "mixed": obj([1, "two", None][:rows] + [2.5] * max(0, rows - 3)),
            "scores": np.arange(rows, dtype=np.float32) / 3,
            "index": np.arange(rows, dtype=np.int64),
            "flags": np.array([True, False, True][:rows]),
            "names": np.array([f"n{i}" for i in range(rows)]),
        },
        meta_info={
            "global_steps": 7,
            "timing": {"gen": 1.25, "nested": {"deep": [1, 2, (3, 4)]}},
            "pair": (1, "a"),
            "temperature": np.float32(0.7),
            "count": np.int64(12),
            "eos": torch.tensor([2, 3]),
            "validate": False,
            None: "none key",
        },
    )


# --------------------------------------------------------------------------- round trips


def test_batch_roundtrip_exact(exact: Exact) -> None:
    value = make_batch()
    out = roundtrip(value)
    assert type(out) is Batch
    exact(out, value)
    assert len(out) == 3


def test_batch_without_tensors(exact: Exact) -> None:
    value = Batch(batch=None, non_tensor_batch={"uid": obj(["a", "b"]), "m": obj([{"x": None}, ["y"]])},
                  meta_info={"k": 1})
    out = roundtrip(value)
    assert type(out) is Batch and out.batch is None
    exact(out, value)


def test_empty_batch(exact: Exact) -> None:
    out = roundtrip(Batch())
    assert type(out) is Batch and out.batch is None and out.non_tensor_batch == {} and out.meta_info == {}
    exact(out, Batch())


def test_batch_from_dict_roundtrip(exact: Exact) -> None:
    value = Batch.from_dict(tensors={"ids": torch.arange(6).reshape(2, 3)},
                            non_tensors={"uid": ["a", "b"], "msgs": [[{"role": "user"}], []]},
                            meta_info={"m": 1})
    exact(roundtrip(value), value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.float32,
                                   torch.float64, torch.float16, torch.bfloat16, torch.bool])
def test_tensor_dtypes(dtype: torch.dtype, exact: Exact) -> None:
    value = (torch.arange(-6, 6, dtype=torch.float64) / 4).reshape(3, 4).to(dtype)
    out = roundtrip(value)
    assert out.dtype == dtype
    exact(out, value)


def test_special_float_values_bitwise(exact: Exact) -> None:
    value = {"f32": torch.tensor([float("nan"), float("inf"), -0.0, 1e-45]),
             "bf16": torch.tensor([float("nan"), float("-inf"), 3.0]).to(torch.bfloat16)}
    exact(roundtrip(value), value)


def test_plain_tensordict(exact: Exact) -> None:
    value = make_tensordict(4)
    out = roundtrip(value)
    assert type(out) is TensorDict
    exact(out, value)


def test_tensordict_non_tensor_entries(exact: Exact) -> None:
    value = make_tensordict(3)
    out = roundtrip(value)
    assert isinstance(out.get("note"), NonTensorData)
    assert out.get("note").data == "same for every row"
    assert isinstance(out.get("prompt_text"), NonTensorStack)
    assert out.get("prompt_text").tolist() == ["prompt 0", "prompt 1", "prompt 2"]
    assert out.get("extra").tolist()[2] == {"row": 2, "tag": None, "vals": [2, 3]}
    exact(out, value)


def test_multi_dim_and_zero_dim_tensordicts(exact: Exact) -> None:
    for value in (TensorDict({"a": torch.arange(24).reshape(2, 3, 4)}, batch_size=[2, 3]),
                  TensorDict({"a": torch.zeros(2), "s": torch.tensor(1.0)}, batch_size=[])):
        exact(roundtrip(value), value)


@pytest.mark.parametrize(
    "value",
    [
        jagged(1, 4, 2),
        jagged(3, 0, 2),
        jagged(2, 5, inner=(4,), dtype=torch.float32),
        jagged(2, 3, dtype=torch.bfloat16),
        jagged(1, 2, dtype=torch.bool),
    ],
    ids=["int64", "with-empty-row", "2d-components", "bf16", "bool"],
)
def test_jagged_nested_tensors(value: torch.Tensor, exact: Exact) -> None:
    out = roundtrip(value)
    assert out.is_nested and out.layout == torch.jagged
    exact(out, value)


def test_jagged_with_lengths_holes(exact: Exact) -> None:
    value = torch.nested.nested_tensor_from_jagged(torch.arange(10.0), torch.tensor([0, 4, 7, 10]),
                                                   lengths=torch.tensor([2, 3, 1]))
    out = roundtrip(value)
    assert [p.tolist() for p in out.unbind()] == [[0.0, 1.0], [4.0, 5.0, 6.0], [7.0]]
    exact(out, value)


def test_jagged_transposed_ragged_dim(exact: Exact) -> None:
    value = jagged(2, 3, inner=(4,), dtype=torch.float32).transpose(1, 2)
    out = roundtrip(value)
    assert out._ragged_idx == value._ragged_idx
    exact(out, value)


def test_strided_nested_tensor(exact: Exact) -> None:
    value = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)])
    out = roundtrip(value)
    assert out.is_nested and out.layout == torch.strided
    exact(out, value)


def test_jagged_inside_batch_tensordict(exact: Exact) -> None:
    td = TensorDict({"responses": jagged(2, 1, 4), "ids": torch.zeros(3, 2)}, batch_size=[3])
    value = Batch(batch=td, non_tensor_batch={"uid": obj(["a", "b", "c"])})
    out = roundtrip(value)
    assert out.batch.get("responses").layout == torch.jagged
    exact(out, value)


def test_dict_of_tensors(exact: Exact) -> None:
    value = {"a": torch.arange(3), "b": {"c": torch.ones(2, 2, dtype=torch.bfloat16), "d": jagged(1, 2)},
             "e": [torch.zeros(1)], "s": "text", "n": None}
    out = roundtrip(value)
    assert type(out) is dict
    exact(out, value)


def test_dict_with_non_str_keys(exact: Exact) -> None:
    value = {1: torch.arange(2), (2, 3): "x", "k": np.float32(1.5)}
    exact(roundtrip(value), value)


def test_single_tensor(exact: Exact) -> None:
    value = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    out = roundtrip(value)
    assert type(out) is torch.Tensor
    exact(out, value)


def test_zero_dim_tensor(exact: Exact) -> None:
    value = torch.tensor(3.5)
    exact(roundtrip(value), value)


@pytest.mark.parametrize(
    "value",
    [torch.empty(0), torch.empty(0, 3, dtype=torch.bfloat16), torch.empty(2, 0, dtype=torch.int64),
     torch.empty(0, dtype=torch.bool)],
    ids=["f32[0]", "bf16[0,3]", "i64[2,0]", "bool[0]"],
)
def test_empty_tensors(value: torch.Tensor, exact: Exact) -> None:
    exact(roundtrip(value), value)


def test_several_empty_tensors_together(exact: Exact) -> None:
    value = {"a": torch.empty(0), "b": torch.empty(0, 3), "c": torch.empty(0, dtype=torch.int64),
             "td": TensorDict({"x": torch.empty(0, 2)}, batch_size=[0])}
    exact(roundtrip(value), value)


@dataclass
class FakeDataProto:
    """A DataProto-like duck type (no stepskip or verl base class)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def test_dataproto_like_comes_back_as_batch(exact: Exact) -> None:
    ref = make_batch()
    value = FakeDataProto(batch=ref.batch, non_tensor_batch=ref.non_tensor_batch, meta_info=ref.meta_info)
    out = roundtrip(value)
    assert type(out) is Batch
    exact(out.batch, value.batch)
    exact(out.non_tensor_batch, value.non_tensor_batch)
    exact(out.meta_info, value.meta_info)


def test_dataproto_like_with_list_columns() -> None:
    value = FakeDataProto(batch=None, non_tensor_batch={"uid": ["a", "b"]})  # type: ignore[dict-item]
    out = roundtrip(value)
    assert type(out) is Batch
    assert isinstance(out.non_tensor_batch["uid"], np.ndarray)
    assert out.non_tensor_batch["uid"].tolist() == ["a", "b"]


# --------------------------------------------------------------------------- non_tensor_batch columns


@pytest.mark.parametrize(
    "column",
    [
        obj(["a", "b", "c"]),
        obj([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a"}, {"role": "assistant",
                                                                                       "content": "b"}], []]),
        obj([{"a": None}, {"a": {"b": None}}, {}]),
        obj([1, "x", None, 2.5, True, [1], {"k": (1, 2)}, b"raw", np.float32(1.5), np.array([1, 2])]),
        obj([[1, 2], [3, 4]]),
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([0.1, np.nan, -np.inf], dtype=np.float32),
        np.array([0.5, 1.5], dtype=np.float16),
        np.array([1, 2], dtype=np.uint16),
        np.array([2**32 - 1], dtype=np.uint32),
        np.array([2**64 - 1], dtype=np.uint64),
        np.array([-1, 2], dtype=np.int8),
        np.array([True, False]),
        np.array([1 + 2j], dtype=np.complex64),
        np.array([1, 2], dtype=">i4"),
        np.arange(10)[::3],
        np.array(["a", "bb", "héllo"]),
        np.array([b"x", b"yz"]),
        np.zeros(0, dtype=np.float32),
    ],
    ids=["str", "chat", "dict-none", "mixed", "lists", "int64-2d", "f32-special", "f16", "u16", "u32", "u64",
         "i8", "bool", "complex", "big-endian", "non-contiguous", "unicode", "bytes", "empty"],
)
def test_non_tensor_batch_columns(column: np.ndarray, exact: Exact) -> None:
    value = Batch(batch=None, non_tensor_batch={"col": column})
    out = roundtrip(value)
    assert isinstance(out.non_tensor_batch["col"], np.ndarray)
    exact(out, value)


def test_zero_dim_numeric_array(exact: Exact) -> None:
    value = Batch(non_tensor_batch={"scalar": np.array(3.5)})
    exact(roundtrip(value), value)


def test_decoded_numeric_columns_are_writable() -> None:
    out = roundtrip(Batch(non_tensor_batch={"a": np.arange(3, dtype=np.float32)}))
    out.non_tensor_batch["a"][0] = 9.0
    assert out.non_tensor_batch["a"][0] == 9.0


# --------------------------------------------------------------------------- shared storage, layout


@pytest.mark.parametrize("copy", [True, False])
def test_tensors_sharing_storage(copy: bool, exact: Exact) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    value = {"a": x, "view": x[1:], "flat": x.view(-1), "same": x, "col": x[:, 1]}
    out = roundtrip(value, copy=copy)
    exact(out, value)
    out["a"][0, 0] = 100.0  # decoded fields do not alias each other
    assert out["same"][0, 0] == 0.0 and out["flat"][0] == 0.0


@pytest.mark.parametrize("copy", [True, False])
def test_view_first_then_base(copy: bool, exact: Exact) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    value = TensorDict({"tail": x[1:], "all": x}, batch_size=[])
    exact(roundtrip(value, copy=copy), value)


@pytest.mark.parametrize("copy", [True, False])
def test_non_contiguous_tensors(copy: bool, exact: Exact) -> None:
    x = torch.arange(24, dtype=torch.int64).reshape(2, 3, 4)
    value = {"t": x.transpose(0, 2), "step": x[:, :, ::2], "expand": torch.ones(1, 3).expand(4, 3)}
    assert not value["t"].is_contiguous()
    exact(roundtrip(value, copy=copy), value)


# --------------------------------------------------------------------------- snapshot semantics


def test_freeze_copy_snapshots_tensors_and_non_tensors(exact: Exact) -> None:
    value = make_batch()
    frozen = FMT.freeze(value, copy=True)

    td = value.batch
    td.get("input_ids").add_(1000)
    td.get("logp").mul_(-1)
    td.get("mask").logical_not_()
    td.get("bf").zero_()
    td.get("responses").values().add_(7)
    td.get(("sub", "x")).fill_(5)
    td.get("extra").tolist()  # reading is harmless
    value.non_tensor_batch["raw_prompt"][0].append({"role": "assistant", "content": "later"})
    value.non_tensor_batch["raw_prompt"][1][0]["content"] = "changed"
    value.non_tensor_batch["reward_model"][0]["ground_truth"] = "changed"
    value.non_tensor_batch["uid"][0] = "changed"
    value.non_tensor_batch["scores"][:] = -1
    value.non_tensor_batch["index"] += 5
    value.non_tensor_batch["names"][0] = "zz"
    value.meta_info["timing"]["gen"] = 99.0
    value.meta_info["timing"]["nested"]["deep"].append("x")
    value.meta_info["eos"].add_(1)
    value.meta_info["new"] = 1

    out = FMT.decode(FMT.encode(frozen))
    exact(out, make_batch())


def test_freeze_copy_snapshots_a_plain_dict_of_tensors(exact: Exact) -> None:
    x = torch.arange(4.0)
    value = {"x": x, "lst": [1, 2], "nt": jagged(1, 2)}
    frozen = FMT.freeze(value, copy=True)
    x.add_(1)
    value["lst"].append(3)
    value["nt"].values().add_(1)
    exact(FMT.decode(FMT.encode(frozen)), {"x": torch.arange(4.0), "lst": [1, 2], "nt": jagged(1, 2)})


def test_freeze_copy_snapshots_numeric_numpy(exact: Exact) -> None:
    col = np.arange(4, dtype=np.float64)
    value = Batch(non_tensor_batch={"col": col})
    frozen = FMT.freeze(value, copy=True)
    col[:] = 0
    exact(FMT.decode(FMT.encode(frozen)), Batch(non_tensor_batch={"col": np.arange(4, dtype=np.float64)}))


# --------------------------------------------------------------------------- unstorable values


@pytest.mark.parametrize(
    ("column", "needle"),
    [
        (obj(["ok", Custom()]), "non_tensor_batch['raw']"),
        (obj([torch.tensor([1 + 1j])]), "non_tensor_batch['raw']"),
        (obj([{"when": np.datetime64("2024-01-01")}]), "non_tensor_batch['raw']"),
        (obj([lambda: 1]), "non_tensor_batch['raw']"),
    ],
    ids=["custom-class", "complex-tensor", "datetime64", "lambda"],
)
def test_unstorable_in_non_tensor_batch_names_the_field(column: np.ndarray, needle: str) -> None:
    value = Batch(non_tensor_batch={"uid": obj(["a"] * len(column)), "raw": column})
    with pytest.raises(UnstorableValueError) as info:
        FMT.freeze(value, copy=True)
    assert needle in str(info.value)


def test_unstorable_in_meta_info_names_the_field() -> None:
    with pytest.raises(UnstorableValueError) as info:
        FMT.freeze(Batch(meta_info={"cb": Custom()}), copy=True)
    assert "meta_info['cb']" in str(info.value)


def test_complex_tensor_in_batch_names_the_field() -> None:
    td = TensorDict({"ok": torch.zeros(2), "cplx": torch.zeros(2, dtype=torch.complex64)}, batch_size=[2])
    with pytest.raises(UnstorableValueError) as info:
        FMT.freeze(Batch(batch=td), copy=True)
    assert "cplx" in str(info.value)
    assert "complex64" in str(info.value)


def test_unstorable_in_non_tensor_data_names_the_field() -> None:
    td = TensorDict({"ok": torch.zeros(2)}, batch_size=[2])
    td["obj"] = NonTensorStack(NonTensorData(Custom()), NonTensorData(Custom()))
    with pytest.raises(UnstorableValueError) as info:
        FMT.freeze(td, copy=True)
    assert "obj" in str(info.value)


def test_unstorable_top_level_value() -> None:
    with pytest.raises(UnstorableValueError):
        FMT.freeze(Custom(), copy=False)


# --------------------------------------------------------------------------- damaged files


def _files() -> dict[str, bytes]:
    return FMT.encode(FMT.freeze(make_batch(), copy=True))


@pytest.mark.parametrize("keep", [0, 4, 8, 20, 0.5, -1], ids=["empty", "4", "8", "20", "half", "minus-one"])
def test_truncated_safetensors_is_corrupt(keep: float) -> None:
    files = _files()
    data = files["data.safetensors"]
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    files["data.safetensors"] = data[:cut]
    with pytest.raises(CorruptEntryError):
        FMT.decode(files)


@pytest.mark.parametrize("tree", [b"", b"{", b"\xff\xfe\x00", b"not json", b"[]", b"{}", b'{"root": 5}', b"null"],
                         ids=["empty", "open-brace", "bad-utf8", "text", "list", "no-root", "root-int", "null"])
def test_invalid_json_tree_is_corrupt(tree: bytes) -> None:
    files = _files()
    files["data.json"] = tree
    with pytest.raises(CorruptEntryError):
        FMT.decode(files)


def test_truncated_json_tree_is_corrupt() -> None:
    files = _files()
    files["data.json"] = files["data.json"][: len(files["data.json"]) // 2]
    with pytest.raises(CorruptEntryError):
        FMT.decode(files)


def test_missing_file_is_corrupt() -> None:
    files = _files()
    with pytest.raises(CorruptEntryError):
        FMT.decode({"data.json": files["data.json"]})
    with pytest.raises(CorruptEntryError):
        FMT.decode({"data.safetensors": files["data.safetensors"]})


def test_tree_referencing_a_missing_tensor_is_corrupt() -> None:
    files = _files()
    tree = {"format": "safe", "version": 1, "root": {"kind": "tensor", "ref": "t999"}}
    files["data.json"] = json.dumps(tree).encode()
    with pytest.raises(CorruptEntryError):
        FMT.decode(files)


def test_structurally_wrong_tree_is_corrupt() -> None:
    files = _files()
    files["data.json"] = json.dumps({"root": {"kind": "batch", "cls": "x", "batch": None,
                                              "non_tensor_batch": [], "meta_info": {}}}).encode()
    with pytest.raises(CorruptEntryError):
        FMT.decode(files)


# --------------------------------------------------------------------------- no pickle


def test_files_are_json_and_safetensors() -> None:
    files = _files()
    assert set(files) == {"data.safetensors", "data.json"} == set(FMT.files)
    tree = json.loads(files["data.json"].decode("utf-8"))
    assert tree["format"] == "safe"
    tensors = st_load(files["data.safetensors"])
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert FMT.uses_pickle is False
    assert get_format("safe").name == "safe"


def test_no_pickle_involved(monkeypatch: pytest.MonkeyPatch, exact: Exact) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle was used")

    class RefusingUnpickler:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("pickle.Unpickler was used")

    class RefusingPickler:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("pickle.Pickler was used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "dumps", refuse)
    monkeypatch.setattr(pickle, "dump", refuse)
    monkeypatch.setattr(pickle, "Unpickler", RefusingUnpickler)
    monkeypatch.setattr(pickle, "Pickler", RefusingPickler)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch, "save", refuse)
    value = make_batch()
    exact(roundtrip(value), make_batch())


def test_written_bytes_hold_no_pickle_stream() -> None:
    files = _files()
    for name, data in files.items():
        # every pickle of protocol >= 2 starts with PROTO (0x80) and the protocol number
        assert not data.startswith(b"\x80"), name
