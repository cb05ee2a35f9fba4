"""format 'verl' (stepskip._formats.verl): verl-compatible pickles, read through an allow-list only."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import pickletools
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from stepskip import Batch, CorruptEntryError
from stepskip.errors import UnstorableValueError
from stepskip._formats import get_format
from stepskip._formats.verl import VerlFormat, dumps_dataproto, loads_dataproto, restricted_loads

Exact = Callable[[Any, Any], None]
FMT = VerlFormat()
FILE = "gen_batch.dp"


def obj(items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


def make_batch(rows: int = 3) -> Batch:
    g = torch.Generator().manual_seed(1)
    td = TensorDict(
        {
            "input_ids": torch.arange(rows * 4).reshape(rows, 4),
            "logp": torch.randn(rows, 4, generator=g),
            "mask": torch.ones(rows, 4, dtype=torch.bool),
            "bf": torch.randn(rows, 2, generator=g).to(torch.bfloat16),
            "responses": torch.nested.nested_tensor([torch.arange(i + 1) for i in range(rows)], layout=torch.jagged),
        },
        batch_size=[rows],
    )
    return Batch(
        batch=td,
        non_tensor_batch={
            "uid": obj([f"u{i}" for i in range(rows)]),
            "raw_prompt": obj([[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": None}]
                               for i in range(rows)]),
            "reward_model": obj([{"ground_truth": str(i), "extra": None} for i in range(rows)]),
            "scores": np.arange(rows, dtype=np.float32),
            "index": np.arange(rows, dtype=np.int64),
            "names": np.array([f"n{i}" for i in range(rows)]),
        },
        meta_info={"global_steps": 4, "timing": {"gen": 1.5}, "pair": (1, "a"), "temperature": np.float32(0.7),
                   "eos": [2, 3], "validate": False},
    )


def encode(value: Any) -> bytes:
    return FMT.encode(FMT.freeze(value, copy=True))[FILE]


# --------------------------------------------------------------------------- round trips


def test_batch_roundtrip(exact: Exact) -> None:
    value = make_batch()
    out = FMT.decode({FILE: encode(value)})
    assert type(out) is Batch  # verl is not installed here
    exact(out, value)


def test_batch_without_tensors(exact: Exact) -> None:
    value = Batch(batch=None, non_tensor_batch={"uid": obj(["a", "b"])}, meta_info={"k": {"v": None}})
    out = FMT.decode({FILE: encode(value)})
    assert out.batch is None
    exact(out, value)


def test_dumps_and_loads_dataproto(exact: Exact) -> None:
    value = make_batch(2)
    data = dumps_dataproto(value.batch, value.non_tensor_batch, value.meta_info)
    batch, non_tensor, meta = loads_dataproto(data)
    exact(batch, value.batch)
    exact(non_tensor, value.non_tensor_batch)
    exact(meta, value.meta_info)


def test_freeze_copy_is_a_snapshot(exact: Exact) -> None:
    value = make_batch()
    frozen = FMT.freeze(value, copy=True)
    value.batch.get("input_ids").add_(100)
    value.non_tensor_batch["raw_prompt"][0][0]["content"] = "changed"
    value.non_tensor_batch["scores"][:] = -1
    value.meta_info["timing"]["gen"] = 9.0
    exact(FMT.decode(FMT.encode(frozen)), make_batch())


def test_format_attributes() -> None:
    assert FMT.uses_pickle is True
    assert FMT.files == (FILE,)
    assert isinstance(get_format("verl"), VerlFormat)


@pytest.mark.parametrize("value", [{"a": torch.zeros(2)}, torch.zeros(2), [1, 2], "text", None,
                                   TensorDict({"a": torch.zeros(2)}, batch_size=[2])],
                         ids=["dict", "tensor", "list", "str", "none", "tensordict"])
def test_freeze_of_non_dataproto_is_unstorable(value: Any) -> None:
    with pytest.raises(UnstorableValueError):
        FMT.freeze(value, copy=True)


class NotData:
    pass


def test_freeze_refuses_what_the_reader_would_refuse() -> None:
    value = Batch(non_tensor_batch={"raw": obj([NotData()])})
    with pytest.raises(UnstorableValueError, match=r"non_tensor_batch\['raw'\]"):
        FMT.freeze(value, copy=True)


# --------------------------------------------------------------------------- what the pickle names


def _globals(data: bytes) -> list[tuple[str, str]]:
    """Every global the pickle loads, from its opcodes (following memo references)."""
    memo: dict[int, Any] = {}
    pushed: list[Any] = []  # what each opcode pushed; strings kept, anything else as None
    found = []
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        if name == "MEMOIZE":
            memo[len(memo)] = pushed[-1]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = pushed[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo[int(arg)])
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            pushed.append(arg)
        elif name == "STACK_GLOBAL":
            found.append((pushed[-2], pushed[-1]))
            pushed.append(None)
        elif name in ("GLOBAL", "INST"):
            module, _, qual = str(arg).partition(" ")
            found.append((module, qual))
            pushed.append(None)
        else:
            pushed.append(None)
    return found


def test_outer_pickle_names_verl_dataproto() -> None:
    data = encode(make_batch())
    ops = list(pickletools.genops(data))
    stack_globals = [i for i, (op, _, _) in enumerate(ops) if op.name == "STACK_GLOBAL"]
    assert stack_globals
    first = stack_globals[0]
    strings = [arg for op, arg, _ in ops[:first] if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    assert strings[-2:] == ["verl.protocol", "DataProto"]
    assert _globals(data)[0] == ("verl.protocol", "DataProto")


def test_outer_pickle_names_only_dataproto_and_numpy_globals() -> None:
    data = encode(make_batch())
    allowed_numpy = {"_reconstruct", "ndarray", "dtype", "scalar"}
    found = _globals(data)
    assert ("verl.protocol", "DataProto") in found
    for module, name in found:
        if (module, name) == ("verl.protocol", "DataProto"):
            continue
        assert module.split(".")[0] == "numpy", (module, name)
        assert name in allowed_numpy or (module == "numpy.dtypes" and name.endswith("DType")), (module, name)


def test_outer_pickle_globals_seen_by_an_unpickler() -> None:
    seen = []

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.append((module, name))
            if (module, name) == ("verl.protocol", "DataProto"):
                return type("DataProto", (), {"__setstate__": lambda self, s: None})
            return super().find_class(module, name)

    data = encode(make_batch())
    Recorder(io.BytesIO(data)).load()
    assert seen and seen[0] == ("verl.protocol", "DataProto")
    assert set(seen) <= set(_globals(data))
    assert {m.split(".")[0] for m, _ in seen} == {"verl", "numpy"}


def test_outer_pickle_protocol_and_state_shape() -> None:
    data = encode(make_batch())
    first = next(pickletools.genops(data))
    assert first[0].name == "PROTO" and first[1] <= 4  # loadable by the Pythons verl 0.9 runs on


# --------------------------------------------------------------------------- malicious pickles


@pytest.fixture
def marker(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / f"pwned_{uuid.uuid4().hex}"
    yield path
    assert not path.exists(), "a malicious pickle ran code"


class SystemCall:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return os.system, (f"touch {self.path}",)


class EvalCall:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return eval, (f"open({str(self.path)!r}, 'w').close()",)


def _reduce_like_dataproto(self: Any, protocol: int) -> Any:
    return copyreg.__newobj__, (type(self),), self.state


def dataproto_pickle(state: Any, monkeypatch: pytest.MonkeyPatch, protocol: int = 4) -> bytes:
    """A pickle naming ``verl.protocol.DataProto`` whose state is ``state``, pickled exactly as verl's
    DataProto pickles (``copyreg.__newobj__`` + state), built with a throw-away stand-in module."""
    fake = type("DataProto", (), {"__module__": "verl.protocol", "__reduce_ex__": _reduce_like_dataproto})
    instance = fake.__new__(fake)
    instance.state = state
    protocol_mod = types.ModuleType("verl.protocol")
    protocol_mod.DataProto = fake  # type: ignore[attr-defined]
    verl = types.ModuleType("verl")
    verl.protocol = protocol_mod  # type: ignore[attr-defined]
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "verl", verl)
        m.setitem(sys.modules, "verl.protocol", protocol_mod)
        data = pickle.dumps(instance, protocol=protocol)
    assert sys.modules.get("verl.protocol") is not protocol_mod  # the stand-in is gone before decoding
    return data


def _assert_refused(data: bytes) -> None:
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(data)
    with pytest.raises(pickle.UnpicklingError):
        loads_dataproto(data)
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data})


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_os_system_pickle_refused(protocol: int, marker: Path) -> None:
    data = pickle.dumps(SystemCall(marker), protocol=protocol)
    _assert_refused(data)


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_builtins_eval_pickle_refused(protocol: int, marker: Path) -> None:
    data = pickle.dumps(EvalCall(marker), protocol=protocol)
    _assert_refused(data)


def test_the_payloads_are_really_malicious(marker: Path) -> None:
    """Control: with a normal unpickler these pickles do run code (so the refusals above mean something)."""
    pickle.loads(pickle.dumps(EvalCall(marker)))
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("where", ["non_tensor_batch", "meta_info", "object_array", "tensor_slot"])
def test_dataproto_state_holding_malicious_object_refused(where: str, marker: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    evil = SystemCall(marker)
    empty_td = io.BytesIO()
    torch.save(None, empty_td)
    state: Any
    if where == "non_tensor_batch":
        state = (empty_td.getvalue(), {"uid": evil}, {})
    elif where == "meta_info":
        state = (empty_td.getvalue(), {}, {"k": [evil]})
    elif where == "object_array":
        state = (empty_td.getvalue(), {"uid": obj(["ok", evil])}, {})
    else:
        state = (evil, {}, {})
    data = dataproto_pickle(state, monkeypatch)
    assert ("verl.protocol", "DataProto") in _globals(data)
    _assert_refused(data)


def test_builtins_eval_inside_dataproto_refused(marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = dataproto_pickle((None, {}, {"x": EvalCall(marker)}), monkeypatch)
    _assert_refused(data)


def test_hand_built_dataproto_state_is_accepted_when_harmless(monkeypatch: pytest.MonkeyPatch, exact: Exact) -> None:
    """Control for the helper: the same construction with harmless state loads fine."""
    buffer = io.BytesIO()
    td = TensorDict({"x": torch.arange(3)}, batch_size=[3])
    torch.save(td, buffer)
    data = dataproto_pickle((buffer.getvalue(), {"uid": obj(["a", "b", "c"])}, {"k": 1}), monkeypatch)
    out = FMT.decode({FILE: data})
    exact(out.batch, td)
    assert out.non_tensor_batch["uid"].tolist() == ["a", "b", "c"]
    assert out.meta_info == {"k": 1}


@pytest.mark.parametrize("payload", ["os.system", "function", "eval"])
def test_inner_torch_payload_with_disallowed_global_refused(payload: str, marker: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    inner: Any
    if payload == "os.system":
        inner = {"x": torch.zeros(1), "evil": SystemCall(marker)}
    elif payload == "function":
        inner = {"fn": os.getcwd}  # a function reference pickled by name
    else:
        inner = [EvalCall(marker)]
    buffer = io.BytesIO()
    torch.save(inner, buffer)
    data = dataproto_pickle((buffer.getvalue(), {}, {}), monkeypatch)
    restricted_loads(data)  # the outer pickle itself is harmless: the inner bytes are just bytes
    with pytest.raises(pickle.UnpicklingError):
        loads_dataproto(data)
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data})


def test_pickle_of_other_data_is_not_a_dataproto() -> None:
    for data in (pickle.dumps([1, 2, 3]), pickle.dumps({"a": 1}), pickle.dumps(None)):
        restricted_loads(data)  # allowed data
        with pytest.raises(pickle.UnpicklingError):
            loads_dataproto(data)
        with pytest.raises(CorruptEntryError):
            FMT.decode({FILE: data})


@pytest.mark.parametrize("state", [(b"x",), "state", None, (None, None)], ids=["1-tuple", "str", "none", "2-tuple"])
def test_dataproto_with_wrong_state_shape_is_corrupt(state: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    data = dataproto_pickle(state, monkeypatch)
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data})


# --------------------------------------------------------------------------- damaged bytes


@pytest.mark.parametrize("keep", [0, 1, 2, 10, 0.25, 0.5, 0.9, -1], ids=lambda k: f"keep={k}")
def test_truncated_bytes_are_corrupt(keep: float) -> None:
    data = encode(make_batch())
    cut = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data[:cut]})


@pytest.mark.parametrize("data", [b"", b"garbage", b"\x00" * 64, b"\x80\x04garbage", b"PK\x03\x04" + b"\x00" * 40,
                                  os.urandom(0) + bytes(range(256))],
                         ids=["empty", "text", "zeros", "proto-garbage", "zip-header", "byte-range"])
def test_garbage_bytes_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data})


def test_garbage_inside_inner_torch_bytes_is_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.BytesIO()
    torch.save(TensorDict({"x": torch.arange(3)}, batch_size=[3]), buffer)
    inner = buffer.getvalue()
    for damaged in (inner[: len(inner) // 2], b"not a torch file", b""):
        data = dataproto_pickle((damaged, {}, {}), monkeypatch)
        with pytest.raises(CorruptEntryError):
            FMT.decode({FILE: data})


def test_missing_file_is_corrupt() -> None:
    with pytest.raises(CorruptEntryError):
        FMT.decode({})


@pytest.mark.parametrize(
    "data",
    [b"\x80\x04\x8d" + b"\xff" * 8, b"\x80\x04\x95" + b"\xff" * 8, b"\x80\x04\x8e" + (2**61).to_bytes(8, "little")],
    ids=["BINUNICODE8-huge", "FRAME-huge", "BINBYTES8-huge"],
)
def test_huge_length_fields_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data})


def test_single_bit_flips_never_escape_as_other_errors() -> None:
    data = encode(Batch.from_dict(tensors={"x": torch.arange(6).reshape(3, 2)}, non_tensors={"uid": ["a", "b", "c"]},
                                  meta_info={"k": 1}))
    escaped = []
    for pos in range(0, len(data), max(1, len(data) // 150)):
        damaged = bytearray(data)
        damaged[pos] ^= 0xFF
        try:
            FMT.decode({FILE: bytes(damaged)})
        except CorruptEntryError:
            pass
        except Exception as err:  # noqa: BLE001 - the point is to see which escape
            escaped.append((pos, type(err).__name__, str(err)[:80]))
    assert not escaped


@pytest.mark.parametrize("inner", [[torch.zeros(2)], torch.zeros(3), {"a": torch.zeros(2)}, 5],
                         ids=["list", "tensor", "dict", "int"])
def test_inner_payload_that_is_not_a_tensordict_is_corrupt(inner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    buffer = io.BytesIO()
    torch.save(inner, buffer)
    data = dataproto_pickle((buffer.getvalue(), {}, {}), monkeypatch)
    with pytest.raises(CorruptEntryError):
        FMT.decode({FILE: data})
