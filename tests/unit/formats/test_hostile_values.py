"""Hostile non-tensor values and run parts found by a review: each is refused with a typed error
before it can cost more memory or time than the entry's budget allows.

Entries are written by format ``safe`` and then edited as an attacker would. The memory cases are
refused by a check made before numpy allocates (the error is the proof: without the check, numpy
would have built the oversized array).
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save

from stepskip import Batch, CorruptEntryError
from stepskip.errors import DecodeLimitError
from stepskip._formats.bounds import jagged_problem
from stepskip._formats.safe import SafeFormat

FMT = SafeFormat()
TREE = "data.json"
Files = dict[str, bytes]


def entry(value: Any) -> Files:
    return FMT.encode(FMT.freeze(Batch(batch=None, non_tensor_batch={}, meta_info={"x": value}), copy=True))


def with_value(files: Files, value: Any) -> Files:
    """``files`` with meta_info['x'] recorded as ``value`` (the encoded form, as data.json holds it)."""
    tree = json.loads(files[TREE])
    tree["root"]["meta_info"]["x"] = value
    return dict(files, **{TREE: json.dumps(tree).encode()})


def decoded_x(files: Files) -> Any:
    return FMT.decode(files).meta_info["x"]


@pytest.fixture
def base() -> Files:
    files = entry(np.str_("a"))
    assert decoded_x(files) == np.str_("a")
    return files


def test_empty_text_scalars_and_arrays_still_round_trip() -> None:
    """What the checks below allow: the unsized dtypes an empty numpy string records, and text arrays."""
    for value in (np.str_(""), np.bytes_(b""), np.array(["", "ab"]), np.array([b"xy"]), {1, 2, 3},
                  frozenset({"a", (1, 2)}), np.array([1.5, 2.0], dtype=np.float16)):
        out = decoded_x(entry(value))
        assert type(out) is type(value)
        if isinstance(value, np.ndarray):
            assert out.dtype == value.dtype and np.array_equal(out, value)
        else:
            assert out == value


TEXT_BOMBS = {
    "unsized text dtype, one long item": {"__t": "ndarray", "dtype": "<U", "shape": [2000],
                                          "v": ["x" * 1000] + [""] * 1999},
    "unsized scalar of long text": {"__t": "np", "dtype": "<U0", "v": "x" * 1000},
    "scalar whose item is a list": {"__t": "np", "dtype": "<U600", "v": ["a"] * 12},
    "numbers whose items are lists": {"__t": "ndarray", "dtype": "<i8", "shape": [2], "v": [[1] * 100, [2] * 100]},
    "bytes dtype unsized": {"__t": "ndarray", "dtype": "|S", "shape": [2], "v": ["eHh4", ""]},
}


@pytest.mark.parametrize("value", TEXT_BOMBS.values(), ids=TEXT_BOMBS.keys())
def test_items_that_would_make_numpy_allocate_more_than_charged_are_refused(base, value) -> None:
    """numpy sizes an array by its items: an unsized text dtype widens every item to the longest one,
    a list among the items adds a dimension. Each costs far beyond the count x itemsize charged."""
    with pytest.raises(CorruptEntryError, match="something other than|without a length"):
        decoded_x(with_value(base, value))


def test_text_bytes_past_the_last_code_point_are_refused(base) -> None:
    """numpy holds such UCS4 values but fails (SystemError) when anything reads one back."""
    raw = base64.b64encode(b"\xff\xff\xff\xff").decode()
    with pytest.raises(CorruptEntryError, match="U\\+10FFFF"):
        decoded_x(with_value(base, {"__t": "ndarray", "dtype": "<U1", "shape": [1], "b64": raw}))


@pytest.mark.parametrize("tag", ["set", "frozenset", "dict"])
def test_keys_built_to_share_one_hash_are_refused_before_any_set_is_built(base, tag) -> None:
    """Multiples of 2**61 - 1 all hash to 0: inserting n of them takes time quadratic in n (20,000
    took seconds, 80,000 forty). Refused after one pass over the keys, before the set is built."""
    keys = [i * (2**61 - 1) for i in range(20_000)]
    value = {"__t": tag, "v": [[k, 0] for k in keys] if tag == "dict" else keys}
    with pytest.raises(CorruptEntryError, match="share a hash"):  # raised by the check, before any insertion
        decoded_x(with_value(base, value))


def _trim_entry(rows: int, width: int) -> Files:
    """A stored-run trim of ``rows`` rows of ``width``, its run parts zstd-packed zeros: a few KiB on disk."""
    zero = zstandard.ZstdCompressor().compress(bytes(rows))
    tensors = {name: torch.frombuffer(bytearray(zero), dtype=torch.uint8) for name in ("left", "right", "lval", "rval")}
    packed = {name: {"codec": "zstd", "dtype": "uint8", "shape": [rows]} for name in tensors}
    tensors["values"] = torch.zeros(rows * width, dtype=torch.uint8)
    node = {"kind": "tensor", "enc": "trim", "dtype": "int64", "shape": [rows, width], "bits": "int64",
            "values": "values", "left": "left", "right": "right", "lval": "lval", "rval": "rval"}
    tree = {"format": "safe", "version": 1, "packed": packed, "root": node}
    return {TREE: json.dumps(tree).encode(), "data.safetensors": save(tensors)}


def test_a_trim_of_many_empty_rows_is_charged_for_its_run_arrays() -> None:
    """Width 0: the output is empty, but the decoder widens and lists every row's runs (some 180
    bytes a row). 10 million rows in a 2 KiB entry are charged for that before it is built."""
    files = _trim_entry(10_000_000, 0)
    assert sum(map(len, files.values())) < 64 << 10
    with pytest.raises(DecodeLimitError):
        FMT.decode(files)
    small = FMT.decode(_trim_entry(1000, 0))  # the same shape at a size the budget allows
    assert small.shape == (1000, 0)


def test_jagged_lengths_that_wrap_the_int64_sum_are_refused() -> None:
    values = torch.arange(10.0)
    assert jagged_problem(values, torch.tensor([0, 2**63 - 1, 2**63 - 1]), torch.tensor([1, 1]), 1) is not None
    assert jagged_problem(values, torch.tensor([0, 3, 5]), torch.tensor([2**63 - 1, 1]), 1) is not None
    assert jagged_problem(values, torch.tensor([0, 3, 8]), torch.tensor([2, 2]), 1) is None



def test_bool_bytes_other_than_0_and_1_are_refused(base) -> None:
    """A bool is the byte 0 or 1; kernels handed any other byte give undefined results. Refused in a
    stored tensor and in a numpy array's recorded bytes."""
    files = FMT.encode(FMT.freeze({"mask": torch.tensor([True, False, True])}, copy=True))
    raw = bytearray(files["data.safetensors"])
    raw[raw.rindex(b"\x01\x00\x01")] = 7  # the tensor's first byte
    with pytest.raises(CorruptEntryError, match="bytes other than 0 and 1"):
        FMT.decode(dict(files, **{"data.safetensors": bytes(raw)}))
    assert FMT.decode(files)["mask"].tolist() == [True, False, True]
    raw = base64.b64encode(b"\x00\x02").decode()
    with pytest.raises(CorruptEntryError, match="bytes other than 0 and 1"):
        decoded_x(with_value(base, {"__t": "ndarray", "dtype": "|b1", "shape": [2], "b64": raw}))


def test_bool_bytes_other_than_0_and_1_are_refused_in_a_numeric_array() -> None:
    """A numpy array ("array" node) whose recorded dtype is bool over a part stored as bytes: its bytes
    are checked as a bool tensor's are (numpy would count the byte 7 as 7 in a sum)."""
    files = FMT.encode(FMT.freeze({"flags": np.array([1, 0, 7, 1], dtype=np.uint8)}, copy=True))
    assert b'"kind":"array","dtype":"|u1"' in files[TREE]
    as_bool = dict(files, **{TREE: files[TREE].replace(b'"dtype":"|u1"', b'"dtype":"|b1"')})
    with pytest.raises(CorruptEntryError, match="a bool array holds bytes other than 0 and 1"):
        FMT.decode(as_bool)
    files = FMT.encode(FMT.freeze({"flags": np.array([1, 0, 1, 1], dtype=np.uint8)}, copy=True))
    as_bool = dict(files, **{TREE: files[TREE].replace(b'"dtype":"|u1"', b'"dtype":"|b1"')})
    assert FMT.decode(as_bool)["flags"].tolist() == [True, False, True, True]


def shared_column_entry() -> Files:
    """An entry whose object column's 6 rows share 2 dicts, as verl's repeat leaves them."""
    column = np.empty(2, dtype=object)
    column[:] = [{"gt": "1"}, {"gt": "2"}]
    files = FMT.encode(FMT.freeze(Batch(batch=None, non_tensor_batch={"rm": np.repeat(column, 3)}, meta_info={}),
                                  copy=True))
    node = json.loads(files[TREE])["root"]["non_tensor_batch"]["rm"]
    assert node["rows"] == [0, 0, 0, 1, 1, 1] and len(node["v"]) == 2
    return files


def with_rows(files: Files, rows: Any) -> Files:
    tree = json.loads(files[TREE])
    tree["root"]["non_tensor_batch"]["rm"]["rows"] = rows
    return dict(files, **{TREE: json.dumps(tree).encode()})


def test_shared_rows_round_trip_and_share_their_items() -> None:
    column = FMT.decode(shared_column_entry()).non_tensor_batch["rm"]
    assert column.tolist() == [{"gt": "1"}] * 3 + [{"gt": "2"}] * 3
    assert column[0] is column[2] and column[3] is column[5] and column[0] is not column[3]


@pytest.mark.parametrize("rows", [
    "000111",  # not a list
    [0, 0, 1, 1],  # fewer rows than the shape
    [0, 0, 0, 1, 1, 1, 1],  # more
    [0, 0, False, 1, 1, 1],  # a bool is no index
    [0, 0, 0.0, 1, 1, 1],
    [0, 0, [0], 1, 1, 1],
    [0, 0, -1, 1, 1, 1],  # numpy would read -1 as the last item
    [0, 0, 2, 1, 1, 1],  # past the items
    [0, 0, 2**70, 1, 1, 1],  # past int64
])
def test_shared_rows_that_do_not_name_an_item_are_damage(rows: Any) -> None:
    with pytest.raises(CorruptEntryError, match=r"rows"):
        FMT.decode(with_rows(shared_column_entry(), rows))


def test_shared_rows_are_charged_before_the_column_is_built() -> None:
    """A million rows naming one item: 16 bytes a row are charged before the index and column exist."""
    files = with_rows(shared_column_entry(), [0] * 10**6)
    tree = json.loads(files[TREE])
    tree["root"]["non_tensor_batch"]["rm"]["shape"] = [10**6]
    files = dict(files, **{TREE: json.dumps(tree).encode()})
    with pytest.raises(DecodeLimitError):
        FMT.decode(files, max_bytes=10**6)
    assert len(FMT.decode(files, max_bytes=10**8).non_tensor_batch["rm"]) == 10**6


def test_a_reader_of_version_3_reports_shared_rows_unreadable(monkeypatch) -> None:
    """The tree says which readers can read it: one that reads up to version 3 keeps the entry."""
    from stepskip.errors import UnreadableEntryError
    from stepskip._formats import safe

    files = shared_column_entry()
    assert json.loads(files[TREE])["version"] == safe.SHARED_VERSION == 4
    monkeypatch.setattr(safe, "READ_VERSION", 3)
    with pytest.raises(UnreadableEntryError, match="version 4"):
        FMT.decode(files)
    unshared = FMT.encode(FMT.freeze(Batch(batch=None, non_tensor_batch={"rm": np.array(["a", "b"], dtype=object)},
                                           meta_info={}), copy=True))
    assert json.loads(unshared[TREE])["version"] == safe.VERSION  # no shared rows: readable by every stepskip
    empty = FMT.encode(FMT.freeze(Batch(batch=None, non_tensor_batch={"rm": np.empty(0, dtype=object)},
                                        meta_info={}), copy=True))
    assert json.loads(empty[TREE])["version"] == safe.VERSION
    assert FMT.decode(empty).non_tensor_batch["rm"].shape == (0,)
