"""Exact round-trips of stepskip._formats.values.encode_value / decode_value."""

from __future__ import annotations

import datetime
import enum
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stepskip.errors import CorruptEntryError, UnstorableValueError
from stepskip._formats.values import decode_object_array, decode_value, encode_object_array, encode_value

Exact = Callable[[Any, Any], None]


def roundtrip(value: Any) -> Any:
    """encode → JSON text → decode, the way format 'safe' stores non-tensor values."""
    encoded = encode_value(value, "value")
    text = json.dumps(encoded, ensure_ascii=False)
    return decode_value(json.loads(text))


class Custom:
    def __init__(self, x: int) -> None:
        self.x = x


class Color(str, enum.Enum):
    RED = "red"


# --------------------------------------------------------------------------- containers


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -1, 3, "", "héllo \u2603 \x00 \n", 1.5, -0.0,
        [], {}, (), [1, [2, [3, [4]]]], {"a": {"b": {"c": [1, {"d": None}]}}},
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "tool_calls": None}],
        (1, "a", None), ((1, 2), (3, (4, 5))), [(1, 2), [3, 4]], ((),), ([],),
        {1: "a", 2: "b"}, {(1, 2): "t", None: 0, 3.5: "f", True: "b", "s": 1},
        {frozenset({1, 2}): "fs"}, {b"k": b"v"},
        {"__t": "dict"}, {"__t": 1, "v": [1, 2]}, {"a": {"__t": "tuple", "v": []}},
        [{"__t": "bytes", "v": "AAAA"}], {"__t": {"__t": "x"}},
        b"", b"\x00\xff\x80\x02binary", [b"a", (b"b",)],
        set(), {1, 2, 3}, {"a", "b"}, frozenset({1, (2, 3)}), {(1, 2), (3, 4)}, [set(), frozenset()],
        10**40, -(10**40), 2**63, 2**64 + 1,
        float("inf"), float("-inf"), 1e308, 5e-324, [0.1, 0.2, 0.30000000000000004],
    ],
    ids=repr,
)
def test_roundtrip_exact(value: Any, exact: Exact) -> None:
    exact(roundtrip(value), value)


def test_nan_roundtrips() -> None:
    out = roundtrip([float("nan"), {"x": float("nan")}, (float("nan"),)])
    assert math.isnan(out[0]) and math.isnan(out[1]["x"]) and math.isnan(out[2][0])
    assert type(out[2]) is tuple


def test_bool_keys_and_values_keep_their_type() -> None:
    out = roundtrip({True: 1, "x": [True, 1, False, 0]})
    assert list(out) == [True, "x"]
    assert [type(v) for v in out["x"]] == [bool, int, bool, int]
    assert type(list(out)[0]) is bool


def test_tagged_dict_keeps_key_order() -> None:
    value = {3: "c", 1: "a", 2: "b", "z": 0}
    assert list(roundtrip(value).keys()) == [3, 1, 2, "z"]


def test_user_dict_with_tag_key_is_not_mistaken_for_a_tagged_value() -> None:
    for value in ({"__t": "tuple", "v": [1, 2]}, {"__t": "bytes", "v": "AAAA"}, {"__t": "ndarray"}):
        out = roundtrip(value)
        assert type(out) is dict and out == value


# --------------------------------------------------------------------------- numpy scalars


@pytest.mark.parametrize(
    "value",
    [
        np.float16(0.1), np.float16(-65504), np.float32(0.1), np.float32(1 / 3), np.float32(-1e-45),
        np.float64(0.1), np.float64(1e308), np.int8(-128), np.int16(-32768), np.int32(2**31 - 1),
        np.int64(-(2**63)), np.uint8(255), np.uint16(65535), np.uint32(2**32 - 1), np.uint64(2**64 - 1),
        np.bool_(True), np.bool_(False), np.complex64(1.5 - 2.25j), np.complex128(1e300 + 1e-300j),
        np.str_("héllo"), np.bytes_(b"ab\x00c"), np.float32("inf"),
    ],
    ids=lambda v: f"{type(v).__name__}({v!r})",
)
def test_numpy_scalars_roundtrip_exact(value: Any, exact: Exact) -> None:
    out = roundtrip(value)
    assert type(out) is type(value)
    exact(out, value)


def test_float32_scalar_comes_back_as_float32_with_same_value() -> None:
    value = np.float32(0.1)
    out = roundtrip(value)
    assert type(out) is np.float32
    assert out == value
    assert float(out) != 0.1  # it really is the float32 value, not a float64 that was rounded
    assert out.tobytes() == value.tobytes()


def test_numpy_nan_scalars() -> None:
    for value in (np.float32("nan"), np.float64("nan"), np.float16("nan")):
        out = roundtrip(value)
        assert type(out) is type(value) and np.isnan(out)


def test_numpy_scalars_inside_containers(exact: Exact) -> None:
    value = {"score": np.float32(0.5), "ids": [np.int64(3), np.int8(4)], "t": (np.bool_(True),),
             np.int64(7): "numpy key"}
    exact(roundtrip(value), value)


@pytest.mark.skipif(np.dtype(np.longdouble).itemsize <= 8, reason="longdouble is float64 on this platform")
@pytest.mark.parametrize(
    "value",
    [np.longdouble(1) / 3, np.clongdouble(1 + 2j) / 3, np.array([np.longdouble(1) / 3]), {"in": [np.longdouble(2)]}],
    ids=["longdouble", "clongdouble", "longdouble-array", "nested"],
)
def test_extended_precision_is_exact_or_refused_by_name(value: Any, exact: Exact) -> None:
    # JSON cannot hold an 80-bit float exactly: either it round-trips exactly or it is refused by name,
    # never a non-JSON object handed on to json.dumps
    try:
        encoded = encode_value(value, "value['x']")
    except UnstorableValueError as err:
        assert "value['x']" in str(err)
        return
    exact(decode_value(json.loads(json.dumps(encoded))), value)


# --------------------------------------------------------------------------- numpy arrays


@pytest.mark.parametrize(
    "value",
    [
        np.arange(6, dtype=np.int64).reshape(2, 3),
        np.array([0.1, -0.0, np.inf, -np.inf], dtype=np.float32),
        np.array([[0.5, 1.5]], dtype=np.float16),
        np.array([2**64 - 1, 0], dtype=np.uint64),
        np.array([True, False]),
        np.array([1 + 2j, -3.5j], dtype=np.complex64),
        np.array([1, 2], dtype=">i4"),
        np.array(5),
        np.array(2.5, dtype=np.float32),
        np.zeros((0,), dtype=np.int32),
        np.zeros((2, 0, 3), dtype=np.float64),
        np.array(["a", "bcd", "", "héllo"]),
        np.array([["x", "y"], ["zz", "w"]]),
        np.array([], dtype="<U4"),
        np.array([b"a", b"xyz", b""]),
        np.arange(12, dtype=np.int16)[::3],
        np.arange(12, dtype=np.int32).reshape(3, 4).T,
    ],
    ids=lambda v: f"{v.dtype}{list(v.shape)}",
)
def test_numeric_and_string_arrays_roundtrip_exact(value: np.ndarray, exact: Exact) -> None:
    exact(roundtrip(value), value)


def test_nan_array_roundtrips_bitwise(exact: Exact) -> None:
    value = np.array([np.nan, 1.0, np.nan], dtype=np.float64)
    exact(roundtrip(value), value)


def _obj(items: list[Any], shape: tuple[int, ...] | None = None) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out if shape is None else out.reshape(shape)


@pytest.mark.parametrize(
    "value",
    [
        _obj(["a", "b", "c"]),
        _obj(["a", 1, None, 2.5, True]),
        _obj([[{"role": "user", "content": "q"}], [{"role": "user", "content": "q2"}, {"role": "assistant",
                                                                                      "content": None}]]),
        _obj([{"a": None, "b": [1, 2]}, {"a": "x", "b": (3,)}]),
        _obj([np.array([1, 2]), np.array(["s"]), np.float32(1.5)]),
        _obj([[1, 2], [3, 4]]),  # items are lists: must not become a 2-D int array
        _obj(["a", "b", "c", "d"], (2, 2)),
        _obj([]),
        _obj([b"x", {1, 2}, (1,)]),
    ],
    ids=lambda v: f"object{list(v.shape)}",
)
def test_object_arrays_roundtrip_exact(value: np.ndarray, exact: Exact) -> None:
    out = roundtrip(value)
    assert out.dtype == object
    exact(out, value)


def test_zero_dim_object_array(exact: Exact) -> None:
    value = np.empty((), dtype=object)
    value[()] = {"k": [1, 2]}
    exact(roundtrip(value), value)


def test_object_array_helpers_roundtrip(exact: Exact) -> None:
    items = _obj(["a", {"b": 1}, [1, 2], None])
    encoded = encode_object_array(items, "col")
    out = decode_object_array(json.loads(json.dumps(encoded)))
    assert out.shape == (4,)
    exact(out, items)


def test_object_array_of_lists_stays_one_dimensional() -> None:
    out = decode_object_array([[1, 2], [3, 4]])
    assert out.shape == (2,) and out.dtype == object
    assert out[0] == [1, 2] and type(out[0]) is list


# --------------------------------------------------------------------------- lists of flat dicts

TAGS = [{"global_steps": 1, "status": "finished", "seq_len": 100 + i, "score": 0.5, "ok": True, "note": None}
        for i in range(64)]


def test_a_list_of_plain_dicts_is_its_own_encoding() -> None:
    """A V1 step's tags (a flat dict per row) need no rebuilding: the list encodes as itself."""
    assert encode_value(TAGS, "tags") is TAGS
    assert roundtrip(TAGS) == TAGS


@pytest.mark.parametrize("odd", [
    {"__t": "tuple", "v": []},  # a user dict holding the tag key
    {1: "int key"},
    {True: "bool key"},
    {"t": (1, 2)},
    {"nested": {"a": 1}},
    {"arr": np.int32(3)},
    {"list": [1, 2]},
    ["not", "a", "dict"],
    "a string",
], ids=repr)
def test_one_item_that_is_not_a_plain_dict_is_encoded_as_it_would_be_alone(odd: Any, exact: Exact) -> None:
    for where in (0, 31, 63):
        value = [*TAGS[:where], odd, *TAGS[where + 1:]]
        encoded = encode_value(value, "tags")
        assert encoded == [encode_value(item, f"tags[{i}]") for i, item in enumerate(value)]
        exact(decode_value(json.loads(json.dumps(encoded))), value)


def test_parsed_lists_of_plain_items_decode_as_themselves() -> None:
    """A V1 step's keys and tags come back from data.json needing no rebuilding: decoded as the parsed lists."""
    for value in (TAGS, [f"uid{i}_{i % 8}_0" for i in range(64)], [1, 2.5, None, True, "s"]):
        parsed = json.loads(json.dumps(value))
        assert decode_value(parsed) is parsed and parsed == value


def test_a_tagged_item_among_plain_ones_is_still_decoded() -> None:
    for plain in (TAGS, ["a"] * 64, [1] * 64):
        for where in (0, 63):
            value = [*plain[:where], (1, b"x"), *plain[where + 1:]]
            out = decode_value(json.loads(json.dumps(encode_value(value, "v"))))
            assert out == value and type(out[where]) is tuple and type(out[where][1]) is bytes


def test_an_unstorable_value_in_a_list_of_dicts_is_named() -> None:
    value = [*TAGS, {"when": datetime.datetime(2024, 1, 1)}]
    with pytest.raises(UnstorableValueError, match=r"tags\[64\]\['when'\]"):
        encode_value(value, "tags")


# --------------------------------------------------------------------------- tensors via callbacks


def test_tensors_go_through_the_callbacks() -> None:
    store: dict[str, torch.Tensor] = {}

    def sink(t: torch.Tensor) -> str:
        ref = f"r{len(store)}"
        store[ref] = t
        return ref

    x, y = torch.arange(3), torch.ones(2, dtype=torch.bfloat16)
    encoded = encode_value({"x": x, "nested": [y, (x,)]}, "meta", sink)
    json.dumps(encoded)
    assert len(store) == 3
    out = decode_value(json.loads(json.dumps(encoded)), store.__getitem__)
    assert out["x"] is x and out["nested"][0] is y and out["nested"][1][0] is x
    assert type(out["nested"][1]) is tuple


def test_tensor_without_a_sink_is_refused() -> None:
    with pytest.raises(UnstorableValueError):
        encode_value({"x": torch.zeros(1)}, "meta")


# --------------------------------------------------------------------------- unstorable values


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": [1, Custom(1)]}, "root['a'][1]"),
        ([np.datetime64("2024-01-01")], "root[0]"),
        ({"when": np.array(["2024-01-01"], dtype="datetime64[D]")}, "root['when']"),
        ({"d": np.timedelta64(3, "s")}, "root['d']"),
        ({"f": lambda x: x}, "root['f']"),
        ((1, (2, Custom(3))), "root[1][1]"),
        ({"c": Color.RED}, "root['c']"),
        ({"o": object()}, "root['o']"),
        ({"dt": datetime.datetime(2024, 1, 1)}, "root['dt']"),
        ({"ba": bytearray(b"x")}, "root['ba']"),
        ({"s": slice(1, 2)}, "root['s']"),
    ],
    ids=["custom", "datetime64", "datetime64-array", "timedelta64", "lambda", "tuple-custom", "str-enum",
         "object", "datetime", "bytearray", "slice"],
)
def test_unstorable_values_raise_naming_the_path(value: Any, path: str) -> None:
    with pytest.raises(UnstorableValueError) as info:
        encode_value(value, "root")
    assert path in str(info.value)


def test_unstorable_in_object_array_names_the_row() -> None:
    with pytest.raises(UnstorableValueError) as info:
        encode_value(_obj(["ok", Custom(2)]), "non_tensor_batch['raw']")
    assert "non_tensor_batch['raw']" in str(info.value)
    assert "[1]" in str(info.value)
    assert "Custom" in str(info.value)


def test_unstorable_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        encode_value(Custom(1), "root")


def test_unknown_tag_is_rejected() -> None:
    # a typed error the readers tell apart by the checksums: unreadable when intact (a newer stepskip), else damage
    with pytest.raises(CorruptEntryError, match="__nope__"):
        decode_value({"__t": "__nope__", "v": 1})


# --------------------------------------------------------------------------- property test

_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8) | st.binary(max_size=8)
)
_hashables = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.binary(max_size=4),
    lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
    max_leaves=4,
)
_keys = st.text(max_size=5) | st.sampled_from(["__t", "v", "dtype"]) | _hashables


def _dicts(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[Any, Any]]:
    return st.dictionaries(_keys, children, max_size=4)


_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | _dicts(children)
        | st.dictionaries(st.text(max_size=5), children, max_size=4)
        | st.sets(_hashables, max_size=3)
    ),
    max_leaves=20,
)


# ``exact`` is a pure function, so sharing the fixture across examples is harmless.
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(value=_values)
def test_property_json_like_values_roundtrip_exactly(value: Any, exact: Exact) -> None:
    encoded = encode_value(value, "value")
    text = json.dumps(encoded, allow_nan=False)  # what is stored is strict JSON for these inputs
    exact(decode_value(json.loads(text)), value)
