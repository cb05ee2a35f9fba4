"""Trimmed tensors of a few rows keep their runs inline in ``data.json`` (tree version 3).

The new layout round-trips bit for bit, older trees (runs as stored parts, versions 1 and 2) are
still read, readers of version 2 are told the entry is newer, and every inline field is checked as
strictly as a stored part: a crafted value is a CorruptEntryError naming the field, never a crash.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from tensordict import TensorDict

import stepskip._formats.compact as compact
import stepskip._formats.safe as safe
from stepskip import Batch, CorruptEntryError, UnreadableEntryError
from stepskip._formats.safe import INLINE_VERSION, VERSION, SafeFormat
from stepskip.testing import make_rollout_batch

# the trimmed layouts of many rows are what these tests take apart (see the fixture)
pytestmark = pytest.mark.usefixtures("trim_every_size")

TREE, TENSORS = "data.json", "data.safetensors"
DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float32,
          torch.float64, torch.float16, torch.bfloat16, torch.uint16, torch.uint32, torch.uint64]


def _encode(value: Any) -> dict[str, bytes]:
    fmt = SafeFormat()
    return fmt.encode(fmt.freeze(value, copy=True))


def _padded(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    body = torch.randint(1, 100, (rows, width), generator=gen)
    for r in range(rows):  # a left run and a right run of different lengths per row (a third of it or more)
        body[r, : width // 6 + (r * 3) % 5] = 7
        body[r, width - width // 6 - (r * 5) % 7:] = 0
    if dtype == torch.bool:
        return body > 50
    out = body.to(dtype)
    return out / 3 if dtype.is_floating_point else out


def _entry(tensors: dict[str, torch.Tensor]) -> dict[str, bytes]:
    rows = next(iter(tensors.values())).shape[0]
    return _encode(Batch(batch=TensorDict(tensors, batch_size=[rows]), non_tensor_batch={}, meta_info={}))


def _nodes(files: dict[str, bytes]) -> dict[str, Any]:
    return json.loads(files[TREE])["root"]["batch"]["entries"]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_a_one_sample_rollout_stores_one_part_per_trimmed_tensor_and_round_trips():
    batch = make_rollout_batch(1, 64, 128, n=1, seed=3)
    files = _encode(batch)
    tree = json.loads(files[TREE])
    assert tree["version"] == INLINE_VERSION
    trims = {k: n for k, n in tree["root"]["batch"]["entries"].items() if n.get("enc") == "trim"}
    assert trims and all(isinstance(n[f], list) for n in trims.values() for f in ("left", "right", "lval", "rval"))
    assert len(st_load(files[TENSORS])) == len(tree["root"]["batch"]["entries"]) - 1  # input_ids is a concat
    out = SafeFormat().decode(files)
    for key in batch.batch.keys():
        assert _bits_equal(out.batch[key], batch.batch[key]), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, compact.INLINE_ROW_WRITES_MAX + 1, compact.INLINE_MAX_ROWS,
                                  compact.INLINE_MAX_ROWS + 1])
def test_inline_up_to_the_row_bound_stored_parts_beyond_both_exact(dtype, rows):
    tensor = _padded(rows, 40, dtype, seed=rows)
    files = _entry({"x": tensor})
    node = _nodes(files)["x"]
    assert node["enc"] == "trim"
    assert isinstance(node["left"], list) == (rows <= compact.INLINE_MAX_ROWS)
    assert json.loads(files[TREE])["version"] == (INLINE_VERSION if rows <= compact.INLINE_MAX_ROWS else VERSION)
    assert _bits_equal(SafeFormat().decode(files).batch["x"], tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_old_layout_is_still_read(monkeypatch, dtype):
    """Trees written before inline runs (their four run parts stored) decode as before."""
    tensor = _padded(2, 30, dtype, seed=5)
    monkeypatch.setattr(compact, "INLINE_MAX_ROWS", 0)  # the encoder of before: runs as stored parts
    files = _entry({"x": tensor, "y": _padded(2, 20, torch.int64)})
    monkeypatch.undo()
    tree = json.loads(files[TREE])
    assert tree["version"] == VERSION and all(isinstance(n["left"], str) for n in _nodes(files).values())
    out = SafeFormat().decode(files)
    assert _bits_equal(out.batch["x"], tensor) and _bits_equal(out.batch["y"], _padded(2, 20, torch.int64))


def test_a_reader_of_version_2_reports_the_new_layout_unreadable(monkeypatch):
    files = _entry({"x": _padded(1, 30, torch.int64)})
    monkeypatch.setattr(safe, "READ_VERSION", 2)
    with pytest.raises(UnreadableEntryError, match="version 3"):
        SafeFormat().decode(files)


def _edited(files: dict[str, bytes], field: str, value: Any, key: str = "x") -> dict[str, bytes]:
    tree = json.loads(files[TREE])
    tree["root"]["batch"]["entries"][key][field] = value
    return dict(files, **{TREE: json.dumps(tree).encode()})


HOSTILE = [
    ("left", "not a list"), ("left", [1, 2]), ("left", [True]), ("left", [1.0]), ("left", ["1"]), ("left", [-1]),
    ("left", [31]), ("left", [[1]]), ("left", [None]), ("left", [10**30]), ("right", [31]), ("right", [-5]),
    ("right", [29]),  # left + right beyond the width
    ("lval", [2**63]), ("lval", [-(2**63) - 1]), ("lval", [1.5]), ("lval", []), ("rval", [False]),
    ("rval", {"a": 1}), ("values", [1, 2]), ("values", "t999"), ("shape", [17, 30]), ("shape", [0, 30]),
    ("shape", [1, 10**12]), ("bits", "int8"),
]


@pytest.mark.parametrize("field,value", HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v in HOSTILE])
def test_hostile_inline_fields_are_corrupt_entries(field, value):
    tensor = torch.full((1, 30), 5, dtype=torch.int64)
    tensor[0, 3:20] = torch.arange(17)
    files = _entry({"x": tensor})
    assert isinstance(_nodes(files)["x"]["left"], list)
    with pytest.raises(CorruptEntryError, match=r"root\.batch\['x'\]"):
        SafeFormat().decode(_edited(files, field, value), max_bytes=1 << 30)


ROW_HOSTILE = [("left", True), ("left", 1.0), ("left", "1"), ("left", -1), ("left", 41), ("left", None),
               ("left", [1]), ("left", 10**30), ("right", 41), ("right", -5), ("right", 39), ("lval", 2**63),
               ("lval", -(2**63) - 1), ("lval", 1.5), ("rval", False), ("rval", {"a": 1})]


@pytest.mark.parametrize("field,item", ROW_HOSTILE, ids=[f"{f}={str(v)[:12]}" for f, v in ROW_HOSTILE])
def test_one_hostile_item_among_many_rows_of_inline_runs_is_a_corrupt_entry(field, item):
    """One row's inline item replaced among 16 (checked as a whole list, rebuilt by whole-tensor passes):
    a right run of 39 in a row of 40 overlaps its left run."""
    files = _entry({"x": _padded(compact.INLINE_MAX_ROWS, 40, torch.int64, seed=6)})
    items = list(_nodes(files)["x"][field])
    items[11] = item
    with pytest.raises(CorruptEntryError, match=r"root\.batch\['x'\]"):
        SafeFormat().decode(_edited(files, field, items), max_bytes=1 << 30)


def test_inline_runs_wider_than_the_small_fill_are_rebuilt_by_blocks_exactly():
    """Inline runs of a tensor above ``SMALL_FILL_ELEMENTS`` take the masked block fill, run values of
    each row's own included (position ids' right runs)."""
    rows = compact.INLINE_MAX_ROWS
    tensor = _padded(rows, compact.SMALL_FILL_ELEMENTS // rows + 64, torch.int64, seed=9)
    tensor[:, -5:] = torch.arange(rows)[:, None]
    files = _entry({"x": tensor})
    assert isinstance(_nodes(files)["x"]["left"], list)
    assert _bits_equal(SafeFormat().decode(files).batch["x"], tensor)


def test_a_bool_tensor_with_run_values_or_middle_values_other_than_0_or_1_is_corrupt():
    tensor = torch.zeros(1, 30, dtype=torch.bool)
    tensor[0, 10:14] = torch.tensor([True, False, True, True])
    files = _entry({"x": tensor})
    assert _bits_equal(SafeFormat().decode(files).batch["x"], tensor)
    with pytest.raises(CorruptEntryError, match="lval"):
        SafeFormat().decode(_edited(files, "lval", [2]))
    node = _nodes(files)["x"]
    tensors = st_load(files[TENSORS])
    tensors[node["values"]] = torch.full_like(tensors[node["values"]], 3)
    from safetensors.torch import save as st_save

    with pytest.raises(CorruptEntryError, match="0 or 1"):
        SafeFormat().decode(dict(files, **{TENSORS: st_save(tensors)}))


def test_the_stored_values_must_fill_the_kept_positions_exactly():
    tensor = torch.full((1, 30), 5, dtype=torch.int64)
    tensor[0, 3:20] = torch.arange(17)
    files = _entry({"x": tensor})
    node = _nodes(files)["x"]
    with pytest.raises(CorruptEntryError, match="kept positions"):
        SafeFormat().decode(_edited(files, "left", [node["left"][0] + 1]))


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
                     max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(["left", "right", "lval", "rval", "shape", "values", "bits"]), value=_JSON)
def test_any_json_in_an_inline_field_decodes_exactly_or_is_a_corrupt_entry(field, value):
    tensor = torch.full((2, 30), 5, dtype=torch.int32)
    tensor[:, 4:18] = torch.arange(14, dtype=torch.int32)
    files = _entry({"x": tensor})
    try:
        out = SafeFormat().decode(_edited(files, field, value), max_bytes=1 << 28)
    except CorruptEntryError:
        return
    # accepted: then it is a valid description of some tensor of the declared dtype and shape
    assert out.batch["x"].dtype == torch.int32 and out.batch["x"].dim() == 2


@pytest.mark.parametrize("rows", [1, 3, 17])  # 17 rows: the runs are stored parts, not inline
def test_a_bool_tensor_whose_stored_values_are_not_0_or_1_is_damage(rows):
    from safetensors.torch import save as st_save

    files = _entry({"x": _padded(rows, 40, torch.bool, seed=1)})
    node = json.loads(files[TREE])["root"]["batch"]["entries"]["x"]
    tensors = st_load(files[TENSORS])
    tensors[node["values"]] = torch.full_like(tensors[node["values"]], -1, dtype=torch.int8)  # byte 255
    with pytest.raises(CorruptEntryError, match="a bool tensor's values are 0 or 1"):
        SafeFormat().decode(dict(files, **{TENSORS: st_save(tensors)}))
