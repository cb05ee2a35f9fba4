"""The verl allow-list reader against pickles that use only allowed names to break memory safety.

Each hostile pickle names nothing but ``numpy.dtype``, ``numpy.ndarray``, ``_reconstruct``,
``scalar``, ``_frombuffer`` and ``verl.protocol.DataProto``, as a real ``gen_batch.dp`` does, and
abuses them the way numpy's own pickle support allows: forged dtype flags and fields, raw bytes
read as object pointers, ``ndarray(shape, 'O')`` called directly, a memo index that makes the C
unpickler allocate gigabytes. The decoding runs in a child process under a memory limit
(``tests/support/isolated_decode.py``), so a segfault or an allocation beyond the bound fails the
test instead of killing it. Legitimate numpy values, written by numpy under every protocol, must
come back exactly as ``pickle.loads`` gives them.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import subprocess
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch
from isolated_decode import decode_isolated
from tensordict import TensorDict

from stepskip import Batch, CorruptEntryError
from stepskip._formats.bounds import DECODE_FLOOR
from stepskip._formats.verl import VerlFormat, loads_dataproto, restricted_loads

FILE = "gen_batch.dp"
_reconstruct = np._core.multiarray._reconstruct  # type: ignore[attr-defined]
_scalar = np._core.multiarray.scalar  # type: ignore[attr-defined]


class Forged:
    """Pickles as ``fn(*args)`` followed, when ``state`` is given, by BUILD ``state``: any reduction at all."""

    def __init__(self, fn: Any, args: tuple[Any, ...], state: Any = None) -> None:
        self.reduction = (fn, args) if state is None else (fn, args, state)

    def __reduce__(self) -> Any:
        return self.reduction


def forged_dtype(spec: str, state: tuple[Any, ...]) -> Forged:
    return Forged(np.dtype, (spec, False, True), state)


OBJECT_NO_REFS = forged_dtype("O8", (3, "|", None, None, None, -1, -1, 0))  # "holds no references"


def array(dtype: Any, shape: tuple[int, ...], data: Any) -> Forged:
    return Forged(_reconstruct, (np.ndarray, (0,), b"b"), (1, shape, dtype, False, data))


def dataproto_bytes(non_tensor: dict[str, Any], meta: dict[str, Any] | None = None, protocol: int = 4) -> bytes:
    """A gen_batch.dp whose DataProto state holds the given (possibly forged) values, as verl pickles it."""
    buffer = io.BytesIO()
    torch.save(TensorDict({"x": torch.arange(2)}, batch_size=[2]), buffer)
    return _pickle_state((buffer.getvalue(), non_tensor, meta or {}), protocol)


def _reduce_like_dataproto(self: Any, protocol: int) -> Any:
    return copyreg.__newobj__, (type(self),), self.state


def _pickle_state(state: Any, protocol: int) -> bytes:
    """Pickle ``state`` as verl's DataProto pickles its own (``__newobj__`` + state), via a throw-away class."""
    fake = type("DataProto", (), {"__module__": "verl.protocol", "__reduce_ex__": _reduce_like_dataproto})
    instance = fake.__new__(fake)
    instance.state = state
    module = types.ModuleType("verl.protocol")
    module.DataProto = fake  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("verl", "verl.protocol")}
    sys.modules["verl.protocol"] = module
    sys.modules.setdefault("verl", types.ModuleType("verl"))
    try:
        return pickle.dumps(instance, protocol=protocol)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


# --------------------------------------------------------------------------- hand-assembled opcodes


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL


_DTYPE_STATE_O = b"(K\x03" + _text("|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x3ft"  # (3,'|',...,63)
_DTYPE_STATE_O_FORGED = b"(K\x03" + _text("|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00t"  # flags 0
_OBJECT_DTYPE = _global("numpy", "dtype") + _text("O8") + b"\x89\x88\x87R"  # dtype('O8', False, True)
_RECONSTRUCT = (_global("numpy._core.multiarray", "_reconstruct") + _global("numpy", "ndarray")
                + b"K\x00\x85C\x01b\x87R")  # _reconstruct(ndarray, (0,), b'b')

RAW_PICKLES = {
    # BUILD twice on one dtype: the second would set forged flags on an already valid dtype
    "dtype-built-twice": b"\x80\x04" + _OBJECT_DTYPE + _DTYPE_STATE_O + b"b" + _DTYPE_STATE_O_FORGED + b"b.",
    # the array placeholder put in a list before its state arrives: the list would keep the placeholder
    "array-used-before-build": (b"\x80\x04]\x94" + _RECONSTRUCT + b"\x94a" + b"h\x01"
                                + b"(K\x01K\x01\x85" + _OBJECT_DTYPE + _DTYPE_STATE_O + b"b\x89]N\x85t" + b"b."),
    # an array placeholder that never gets its state
    "array-without-state": b"\x80\x04" + _RECONSTRUCT + b".",
    # ndarray called directly through REDUCE, then through INST (protocol 0)
    "ndarray-reduce": b"\x80\x04" + _global("numpy", "ndarray") + b"J\x00\xc2\xeb\x0b\x85" + _text("O") + b"\x86R.",
    "ndarray-inst": b"(J\x00\xc2\xeb\x0b\x85" + b"inumpy\nndarray\n.",
    # LONG_BINPUT 2**29: the C unpickler would grow its memo to 2**30 slots (8 GiB) for these 9 bytes
    "memo-index-bomb": b"\x80\x04Nr\x00\x00\x00\x20.",
    "memo-put-bomb": b"\x80\x02Np536870912\n.",
    # BYTEARRAY8 of 2**33 bytes: the pure-Python unpickler would allocate 8 GiB before reading them
    "bytearray8-bomb": b"\x80\x05\x96" + (1 << 33).to_bytes(8, "little") + b"x.",
}


def hostile_values() -> dict[str, Any]:
    object_dtype = np.dtype("O")
    return {
        "object-dtype-flags-forged": array(OBJECT_NO_REFS, (2,), b"\x41" * 16),
        "object-array-from-bytes": array(object_dtype, (2,), b"\x41" * 16),
        "structured-object-field": array(
            forged_dtype("V16", (3, "|", None, ("a", "b"), {"a": (object_dtype, 0), "b": (np.dtype("i8"), 8)},
                                 16, 8, 0x3F)), (1,), b"\x41" * 16),
        "structured-spec-with-object-fields": forged_dtype("i8", (3, "<", None, ("a",), {"a": (object_dtype, 0)},
                                                                  8, 8, 0)),
        "subarray-dtype": forged_dtype("i8", (3, "<", (object_dtype, (4,)), None, None, 32, 8, 0x3F)),
        "datetime-dtype": forged_dtype("M8", (4, "<", None, None, None, -1, -1, 0, None)),
        "dtype-with-align": Forged(np.dtype, ("O8", True, True), (3, "|", None, None, None, -1, -1, 0)),
        "direct-ndarray-2e8-objects": Forged(np.ndarray, ((200_000_000,), "O")),
        "numpy-dtypes-class": Forged(np.dtypes.ObjectDType, ()),
        "object-scalar-from-bytes": Forged(_scalar, (object_dtype, b"\x41" * 8)),
        "object-scalar-forged-dtype": Forged(_scalar, (OBJECT_NO_REFS, b"\x41" * 8)),
        "shape-beyond-data": array(np.dtype("i8"), (1_000_000_000,), b"\x00" * 8),
        "object-shape-beyond-items": array(object_dtype, (200_000_000,), [None]),
        "negative-shape": array(np.dtype("i8"), (-1,), b""),
        "unicode-size-beyond-data": array(forged_dtype("U1", (3, "<", None, None, None, 1 << 30, 4, 8)), (1,), b"ab"),
        "frombuffer-object": Forged(np._core.numeric._frombuffer, (b"\x41" * 16, object_dtype, (2,), "C")),
        "frombuffer-shape-beyond-data": Forged(np._core.numeric._frombuffer,
                                               (b"\x00" * 8, np.dtype("i8"), (10**9,), "C")),
        "reconstruct-other-arguments": Forged(_reconstruct, (np.ndarray, (10**9,), b"b")),
    }


def _crashes_plain_numpy(data: bytes) -> int:
    """The exit status of a child that unpickles ``data`` with plain pickle and touches the result."""
    code = "import pickle, sys; v = pickle.loads(sys.stdin.buffer.read()); print(repr(v)[:100])"
    return subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, timeout=120).returncode


def test_the_pointer_payload_really_crashes_plain_pickle() -> None:
    """The main payload is real: unrestricted pickle + numpy dies of SIGSEGV on it."""
    data = pickle.dumps(array(OBJECT_NO_REFS, (2,), b"\x41" * 16), protocol=4)
    assert _crashes_plain_numpy(data) < 0


@pytest.mark.parametrize("name", sorted(hostile_values()))
def test_hostile_numpy_values_are_refused_in_process(name: str) -> None:
    data = pickle.dumps(hostile_values()[name], protocol=4)
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(data)


@pytest.mark.parametrize("name", sorted(RAW_PICKLES))
def test_hand_assembled_pickles_are_refused_or_harmless(name: str) -> None:
    data = RAW_PICKLES[name]
    if name.startswith("memo"):
        assert restricted_loads(data) is None  # legal pickle data: it just must not cost gigabytes
        return
    with pytest.raises((pickle.UnpicklingError, EOFError)):  # EOFError: declared sizes beyond the bytes
        restricted_loads(data)


def test_every_hostile_gen_batch_ends_as_corrupt_in_a_memory_limited_child() -> None:
    """Inside a DataProto, under every pickle protocol: no crash, no MemoryError, no allocation past the bound."""
    cases: list[tuple[str, dict[str, bytes]]] = []
    names = []
    for name, value in sorted(hostile_values().items()):
        for protocol in (3, 4, 5):
            for where in ("non_tensor", "meta"):
                data = dataproto_bytes({"col": value}, protocol=protocol) if where == "non_tensor" else \
                    dataproto_bytes({}, {"k": [value]}, protocol=protocol)
                cases.append(("verl", {FILE: data}))
                names.append(f"{name}/p{protocol}/{where}")
    for name, data in sorted(RAW_PICKLES.items()):
        cases.append(("verl", {FILE: data}))
        names.append(name)
    report = decode_isolated(cases, headroom=DECODE_FLOOR + (512 << 20))
    assert report.returncode == 0, (report.returncode, report.crashed_on and names[report.crashed_on], report.stderr)
    assert len(report.outcomes) == len(cases)
    for name, outcome in zip(names, report.outcomes):
        assert outcome.outcome in ("CorruptEntryError", "TruncatedEntryError"), (name, outcome)
        assert outcome.peak < 64 << 20, (name, outcome)  # these files are a few hundred bytes


# --------------------------------------------------------------------------- legitimate values, exactly


def _object(items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


LEGIT = {
    "int64": np.arange(6, dtype=np.int64).reshape(2, 3),
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
    "big-endian-f4": np.array([1.5, -0.0, np.inf], dtype=">f4"),
    "f2": np.array([np.nan, 1], dtype=np.float16),
    "bool": np.array([True, False]),
    "u1": np.arange(3, dtype=np.uint8),
    "c16": np.array([1 + 2j, np.nan]),
    "c8-big": np.array([1 - 1j], dtype=">c8"),
    "unicode": np.array(["ab", "ĉ", ""]),
    "big-endian-unicode": np.array(["xy"], dtype=">U2"),
    "bytes": np.array([b"x", b"yz"]),
    "empty-2d": np.zeros((0, 4), dtype=np.float32),
    "zero-d": np.array(3.25),
    "object": _object(["a", None, [1, 2], {"k": np.arange(2)}, np.float32(0.5), (1, "b")]),
    "object-2d": _object([1, "x", None, 2.5]).reshape(2, 2),
    "nested-object": _object([_object(["in", 1]), np.array([1.0, 2.0])]),
    "scalar-f8": np.float64(-1.25),
    "scalar-f4": np.float32(np.nan),
    "scalar-i2": np.int16(-7),
    "scalar-bool": np.bool_(True),
    "scalar-str": np.str_("héllo"),
    "scalar-empty-str": np.str_(""),
    "scalar-bytes": np.bytes_(b"\x00q"),
    "scalar-empty-bytes": np.bytes_(b""),
    "scalar-c16": np.complex128(1 - 3j),
    "dtype-alone": np.dtype(">i4"),
    "shared-array": [np.arange(3)] * 2,
    "shared-dtype": [np.arange(2, dtype=np.int16), np.ones(2, dtype=np.int16), np.int16(4)],
}


def _same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.dtype.str == expected.dtype.str
        assert actual.shape == expected.shape and actual.strides == expected.strides
        assert actual.flags.writeable == expected.flags.writeable
        if expected.dtype.hasobject:
            for a, e in zip(actual.reshape(-1, order="A"), expected.reshape(-1, order="A")):
                _same(a, e)
        else:
            assert actual.tobytes(order="A") == expected.tobytes(order="A")
    elif isinstance(expected, np.generic):
        assert actual.dtype == expected.dtype and actual.tobytes() == expected.tobytes()
    elif isinstance(expected, np.dtype):
        assert actual == expected and actual.str == expected.str and actual.flags == expected.flags
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _same(a, e)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            _same(actual[k], expected[k])
    else:
        assert actual == expected


@pytest.mark.parametrize("protocol", [3, 4, 5])
@pytest.mark.parametrize("name", sorted(LEGIT))
def test_numpy_values_load_exactly_as_numpy_loads_them(name: str, protocol: int) -> None:
    data = pickle.dumps(LEGIT[name], protocol=protocol)
    _same(restricted_loads(data), pickle.loads(data))


def test_shared_values_stay_shared() -> None:
    shared = np.arange(3)
    out = restricted_loads(pickle.dumps([shared, shared, {"again": shared}], protocol=4))
    assert out[0] is out[1] is out[2]["again"]


def test_dataproto_with_every_legit_value_decodes() -> None:
    """All the values at once, sharing dtypes and memo entries, as numpy itself reads them back."""
    non_tensor = {k: v for k, v in LEGIT.items() if isinstance(v, np.ndarray)}
    meta = {k: v for k, v in LEGIT.items() if not isinstance(v, np.ndarray)}
    for protocol in (3, 4, 5):
        expected = pickle.loads(pickle.dumps((non_tensor, meta), protocol=protocol))  # numpy's own reading
        _, got_non_tensor, got_meta = loads_dataproto(dataproto_bytes(non_tensor, meta, protocol=protocol))
        _same((got_non_tensor, got_meta), expected)


def test_what_format_verl_writes_still_loads() -> None:
    fmt = VerlFormat()
    value = Batch(batch=TensorDict({"x": torch.arange(4).reshape(2, 2)}, batch_size=[2]),
                  non_tensor_batch={"uid": _object(["a", "b"]), "score": np.array([0.5, np.nan], dtype=np.float32)},
                  meta_info={"t": np.float32(0.7), "s": np.str_("x")})
    out = fmt.decode(fmt.encode(fmt.freeze(value, copy=True)))
    _same(out.non_tensor_batch, value.non_tensor_batch)
    _same(out.meta_info, value.meta_info)


def test_max_bytes_caps_a_verl_decode() -> None:
    data = dataproto_bytes({"col": np.arange(10)})
    with pytest.raises(CorruptEntryError, match="decode bound"):
        VerlFormat().decode({FILE: data}, max_bytes=len(data) // 2)
