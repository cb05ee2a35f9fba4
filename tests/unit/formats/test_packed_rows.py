"""``format: safe`` stores ragged number rows (``list[list[int]]``, ``list[list[float | None]]``: TRL's
token ids and log-probs, or any role's) as packed tensors, and gives back the very same lists.

Round trips are compared with the strict comparison of ``conftest.py`` (types, float bits, key
order). Hostile entries are real entries whose ``data.json`` node or stored tensors were edited:
each must end in :class:`CorruptEntryError` / :class:`DecodeLimitError` naming the field.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from tensordict import NonTensorData, TensorDict

from stepskip import Batch, CorruptEntryError
from stepskip.errors import DecodeLimitError
from stepskip._formats.safe import SafeFormat
from stepskip._formats.values import PACK_MIN_ITEMS

TREE, TENSORS = "data.json", "data.safetensors"
Files = dict[str, bytes]
NAN_PAYLOAD = struct.unpack("<d", bytes.fromhex("0100000000f8ff7f"))[0]


def entry(value: Any, compress: str = "auto") -> Files:
    fmt = SafeFormat(compress)
    return fmt.encode(fmt.freeze(value, copy=True))


def through(value: Any, compress: str = "auto") -> Any:
    return SafeFormat(compress).decode(entry(value, compress))


def rows_nodes(files: Files) -> list[dict[str, Any]]:
    """Every packed-rows node in an entry's tree."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("__t") == "rows":
                found.append(node)
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(json.loads(files[TREE]))
    return found


def ids(rows: int = 8, width: int = 16, start: int = 0) -> list[list[int]]:
    return [[start + 1000 * r + c for c in range(width - r)] for r in range(rows)]


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("rows", [
    ids(),                                                            # token ids
    [[5, 6, 7], [], [2**62, -(2**63)], list(range(100))],             # empty rows, int64 extremes
    [[], [], list(range(70)), []],                                    # empty rows around one
    [[-0.5, None, 0.25] * 30, [], [None], [1e300, -0.0, math.inf]],   # log-probs with holes
    [[0.1 * i for i in range(80)]],                                   # one row
    [[1, None, 3] * 30, [None, 7]],                                   # int rows with holes
    [list(range(1000)) for _ in range(3)],                            # wide ids (narrowed to int16)
])
def test_ragged_rows_come_back_exactly_and_are_stored_as_tensors(rows, exact):
    files = entry({"rows": rows})
    (node,) = rows_nodes(files)
    assert isinstance(node["values"], str) and isinstance(node["offsets"], str)  # references, not JSON items
    assert len(files[TREE]) < 400  # the items are not in the JSON tree
    back = SafeFormat().decode(files)["rows"]
    exact(back, rows)
    for got, want in zip(back, rows):
        assert [type(v) for v in got] == [type(v) for v in want]  # int stays int, float float, None None


def test_float_bits_survive_nan_payloads_signed_zeros_and_infinities():
    row = [NAN_PAYLOAD, -0.0, 0.0, math.inf, -math.inf, 5e-324, float.fromhex("0x1.fffffffffffffp-1")] * 10
    (back,) = through([row])
    assert [bits(v) for v in back] == [bits(v) for v in row]
    holed = [NAN_PAYLOAD, None, -0.0, math.nan, None] * 20  # a NaN item next to holes stays a NaN
    (back,) = through([holed])
    assert [None if v is None else bits(v) for v in back] == [None if v is None else bits(v) for v in holed]


@pytest.mark.parametrize("where", ["dict", "tuple", "meta_info", "non_tensor_data", "object_item"])
def test_rows_are_packed_wherever_a_value_lives(where, exact):
    rows = ids()
    logprobs = [[-0.5 - i for i in range(len(r))] for r in rows]
    if where == "dict":
        value: Any = {"completion_ids": rows, "logprobs": logprobs, "n": 3}
    elif where == "tuple":
        value = (rows, logprobs)  # what TRL's _generate_single_turn returns
    elif where == "meta_info":
        value = Batch(batch=TensorDict({"x": torch.zeros(2)}, batch_size=[2]), non_tensor_batch={},
                      meta_info={"ids": rows, "logprobs": logprobs})
    elif where == "non_tensor_data":
        value = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
        value.set("extra", NonTensorData(data={"ids": rows, "logprobs": logprobs}, batch_size=[2]))
    else:
        column = np.empty(2, dtype=object)
        column[0], column[1] = {"ids": rows}, {"logprobs": logprobs}
        value = Batch(batch=None, non_tensor_batch={"turns": column}, meta_info={})
    files = entry(value)
    assert len(rows_nodes(files)) == 2
    exact(SafeFormat().decode(files), value)


@pytest.mark.parametrize("rows", [
    [[1, 2.0] * 40],                       # ints and floats mixed: packing would change a type
    [[True, False] * 40],                  # bools are not ints here
    [[1, 2] * 40, [True]],
    [[2**64] + list(range(80))],           # outside int64
    [list(range(PACK_MIN_ITEMS - 1))],     # too few items to be worth a tensor
    [[None] * 80],                         # holes only: no type to pack
    [(1, 2)] * 40,                         # tuples are not rows
    [[np.int64(1)] * 80],                  # numpy scalars keep their own tag
    [[1] * 80, "not a row"],
    [["a", "b"] * 40],
])
def test_other_lists_stay_json_and_still_round_trip(rows, exact):
    files = entry({"v": rows})
    assert rows_nodes(files) == []
    exact(SafeFormat().decode(files)["v"], rows)


def test_rows_one_level_down_are_packed_where_they_are_rows(exact):
    value = [ids(), ids(start=7), [[1]]]  # a batch of turns, each a list of token-id rows
    files = entry(value)
    assert len(rows_nodes(files)) == 2  # the small third one stays JSON
    exact(SafeFormat().decode(files), value)


@pytest.mark.parametrize("value", [[], [[]], [[], []], {"a": []}])
def test_empty_lists_round_trip(value, exact):
    exact(through(value), value)


def test_packing_does_not_depend_on_compression(exact):
    rows = ids(32, 64)
    for compress in ("auto", "none", "zstd"):
        files = entry({"rows": rows}, compress)
        assert len(rows_nodes(files)) == 1
        exact(SafeFormat(compress).decode(files)["rows"], rows)


def test_rows_shared_between_fields_are_each_stored_and_come_back_equal(exact):
    rows = ids()
    value = {"a": rows, "b": rows, "c": [rows[0]] * 10}
    exact(through(value), value)


def test_the_snapshot_is_taken_at_freeze_time():
    rows = ids()
    fmt = SafeFormat()
    frozen = fmt.freeze({"rows": rows}, copy=True)
    rows[0][0] = -1
    rows.append([1, 2, 3])
    assert fmt.decode(fmt.encode(frozen))["rows"] == ids()


def test_entries_written_as_json_lists_are_still_read(exact):
    """Before rows were packed the same value was written item by item; such entries stay readable."""
    rows = ids()
    files = entry({"rows": rows})
    (node,) = rows_nodes(files)
    tree = json.loads(files[TREE])
    tree["root"]["entries"]["rows"]["v"] = rows  # the old encoding: the JSON lists themselves
    tensors = {k: v for k, v in st_load(files[TENSORS]).items() if k not in (node["values"], node["offsets"])}
    old = {TREE: json.dumps(tree).encode(), TENSORS: st_save(tensors)}
    exact(SafeFormat().decode(old)["rows"], rows)


# --------------------------------------------------------------------------- hostile entries


def rows_entry() -> Files:
    return entry({"rows": [[1, None, 3] * 30, [], [4, 5]]})


def edit_node(files: Files, edit: Callable[[dict[str, Any]], None]) -> Files:
    tree = json.loads(files[TREE])
    edit(tree["root"]["entries"]["rows"]["v"])
    return dict(files, **{TREE: json.dumps(tree).encode()})


def edit_tensor(files: Files, part: str, replacement: torch.Tensor) -> Files:
    (node,) = rows_nodes(files)
    tensors = st_load(files[TENSORS])
    tensors[node[part]] = replacement
    tree = json.loads(files[TREE])
    tree.get("packed", {}).pop(node[part], None)  # stored as given, not as a zstd frame
    return {TREE: json.dumps(tree).encode(), TENSORS: st_save(tensors)}


@pytest.mark.parametrize("damage, needle", [
    (lambda f: edit_tensor(f, "offsets", torch.tensor([0, 90, 2, 92])), "offsets decrease"),
    (lambda f: edit_tensor(f, "offsets", torch.tensor([0, 90, 90, 99])), "offsets end at 99"),
    (lambda f: edit_tensor(f, "offsets", torch.tensor([1, 90, 90, 92])), "offsets start at 1"),
    (lambda f: edit_tensor(f, "offsets", torch.tensor([0.0, 90.0, 92.0])), "int32/int64"),
    (lambda f: edit_tensor(f, "offsets", torch.zeros(0, dtype=torch.int64)), "non-empty"),
    (lambda f: edit_tensor(f, "offsets", torch.tensor([[0, 92]])), "1-D"),
    (lambda f: edit_tensor(f, "values", torch.zeros(92, dtype=torch.float64)), "not a 1-D integer tensor"),
    (lambda f: edit_tensor(f, "values", torch.zeros(92, dtype=torch.bool)), "not a 1-D integer tensor"),
    (lambda f: edit_tensor(f, "values", torch.zeros(46, 2, dtype=torch.int64)), "not a 1-D integer tensor"),
    (lambda f: edit_tensor(f, "values", torch.zeros(10, dtype=torch.int64)), "offsets end at 92"),
    (lambda f: edit_tensor(f, "holes", torch.zeros(91, dtype=torch.bool)), "not a bool mask"),
    (lambda f: edit_tensor(f, "holes", torch.zeros(92, dtype=torch.uint8)), "not a bool mask"),
    (lambda f: edit_node(f, lambda n: n.update(kind="complex")), "kind 'complex'"),
    (lambda f: edit_node(f, lambda n: n.update(kind="float")), "not a 1-D float64 tensor"),
    (lambda f: edit_node(f, lambda n: n.pop("offsets")), "packed rows"),
    (lambda f: edit_node(f, lambda n: n.update(values="t99")), "not in data.safetensors"),
    (lambda f: edit_node(f, lambda n: n.update(offsets=n["values"])), "already used it"),
    (lambda f: edit_node(f, lambda n: n.update(values=[1, 2])), "not in data.safetensors"),
    (lambda f: edit_node(f, lambda n: n.update(holes={"__t": "rows"})), "not in data.safetensors"),
])
def test_a_rows_node_that_does_not_describe_rows_is_refused(damage, needle):
    files = damage(rows_entry())
    with pytest.raises(CorruptEntryError) as info:
        SafeFormat().decode(files)
    assert needle in str(info.value)


def test_many_empty_rows_are_charged_before_they_are_built():
    """A few bytes of zstd frame can say 10**8 offsets of rows with nothing in them: each would be a
    Python list, so the decoder counts them against the decode bound before building one."""
    files = entry({"rows": [[1] * 70]})
    (node,) = rows_nodes(files)
    tensors = st_load(files[TENSORS])
    tensors[node["values"]] = torch.zeros(0, dtype=torch.int64)
    tensors[node["offsets"]] = torch.zeros(1_000_001, dtype=torch.int64)  # a million empty rows
    tree = json.loads(files[TREE])
    tree.pop("packed", None)
    hostile = {TREE: json.dumps(tree).encode(), TENSORS: st_save(tensors)}
    with pytest.raises(DecodeLimitError, match="rows"):
        SafeFormat().decode(hostile, max_bytes=32 << 20)
    assert len(SafeFormat().decode(hostile)["rows"]) == 1_000_000  # within the default bound: real rows


def test_a_tree_with_packed_rows_says_so_in_its_version_and_others_keep_theirs():
    """Readers before packed rows meet a tag they do not know: such trees carry the version that has them."""
    from stepskip._formats.safe import ROWS_VERSION, VERSION

    assert json.loads(entry({"rows": ids()})[TREE])["version"] == ROWS_VERSION > VERSION
    assert json.loads(entry({"rows": [[1, 2]], "x": torch.ones(2)})[TREE])["version"] == VERSION  # not packed


def test_a_newer_tree_version_is_unreadable_not_damage():
    from stepskip import UnreadableEntryError

    files = entry({"rows": ids()})
    tree = json.loads(files[TREE])
    for version, error in ((99, UnreadableEntryError), ("2", CorruptEntryError), (0, CorruptEntryError)):
        edited = dict(files, **{TREE: json.dumps(dict(tree, version=version)).encode()})
        with pytest.raises(error, match="version"):
            SafeFormat().decode(edited)


def test_an_unknown_value_tag_is_a_typed_error_naming_it():
    files = edit_node(rows_entry(), lambda n: n.update({"__t": "rows9"}))
    with pytest.raises(CorruptEntryError, match="unknown value tag 'rows9'"):
        SafeFormat().decode(files)


def test_the_positions_of_holes_are_charged_to_the_decode_budget(monkeypatch):
    from stepskip._formats import bounds

    charged: list[int] = []
    charge = bounds.DecodeBudget.charge

    def counting(self: Any, nbytes: int, file: str, field: str) -> None:
        charged.append(nbytes)
        charge(self, nbytes, file, field)

    monkeypatch.setattr(bounds.DecodeBudget, "charge", counting)
    holes = 100_000
    totals = []
    for row in ([1.5] * (holes + 1), [1.5] + [None] * holes):
        charged.clear()
        assert through({"rows": [row]})["rows"] == [row]
        totals.append(sum(charged))
    assert totals[1] - totals[0] >= 8 * holes
