"""Decoders with bounds: every shape, width, offset and size in an entry is checked before it is allocated.

Entries are written by the real encoders and then edited the way an attacker (or bit rot) would:
``data.json`` fields rewritten, jagged offsets that do not describe the values, zstd frames that
expand far beyond the entry, torch payloads that are compressed or in the legacy format. Each
must end in :class:`CorruptEntryError` (or :class:`DecodeLimitError`) naming the file and the
field, before anything large is allocated; the bomb cases run in a memory-limited child process.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from isolated_decode import decode_isolated
from tensordict import TensorDict

from stepskip import Batch, CorruptEntryError
from stepskip.errors import DecodeLimitError
from stepskip._formats.bounds import DECODE_FLOOR, DECODE_RATIO, DecodeBudget, check_torch_zip, jagged_problem
from stepskip._formats.safe import SafeFormat
from stepskip._formats.verl import VerlFormat, VerlTqFormat
from stepskip.testing import make_rollout_batch
from stepskip.tq.rows import concat_rows, select_rows

# the trimmed layouts of many rows are what these tests take apart (see the fixture)
pytestmark = pytest.mark.usefixtures("trim_every_size")

FMT = SafeFormat()
TREE = "data.json"
Files = dict[str, bytes]


def entry(value: Any, compress: str = "auto") -> Files:
    fmt = SafeFormat(compress)
    return fmt.encode(fmt.freeze(value, copy=True))


def edited(files: Files, edit: Callable[[dict[str, Any]], None]) -> Files:
    tree = json.loads(files[TREE])
    edit(tree)
    return dict(files, **{TREE: json.dumps(tree).encode()})


def padded(rows: int = 4, width: int = 64, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A right-padded [rows, width] tensor: what compact encodes as ``trim``."""
    out = torch.zeros(rows, width, dtype=dtype)
    for r in range(rows):
        out[r, : r + 2] = torch.arange(1, r + 3, dtype=dtype) * 1000
    return out


def td_entry(**tensors: torch.Tensor) -> Files:
    rows = next(iter(tensors.values())).shape[0]
    return entry(Batch(batch=TensorDict(tensors, batch_size=[rows]), non_tensor_batch={}, meta_info={}))


def batch_entries(tree: dict[str, Any]) -> dict[str, Any]:
    return tree["root"]["batch"]["entries"]


def assert_refused(files: Files, *fields: str, error: type[Exception] = CorruptEntryError,
                   max_bytes: int | None = None) -> None:
    with pytest.raises(error) as info:
        FMT.decode(files, max_bytes=max_bytes)
    message = str(info.value)
    for field in fields:
        assert field in message, message


# --------------------------------------------------------------------------- the rule


def test_the_budget_is_the_stated_rule() -> None:
    files = {"a": b"x" * 1000, "b": b"y" * 24}
    assert DecodeBudget.for_files(files).limit == DECODE_RATIO * 1024 + DECODE_FLOOR
    assert DecodeBudget.for_files(files, max_bytes=5).limit == 5
    budget = DecodeBudget(10, "test")
    budget.charge(10, "f", "x")
    with pytest.raises(DecodeLimitError, match="f: y"):
        budget.charge(1, "f", "y")


@pytest.mark.parametrize("fill", [0.02, 0.2, 1.0])
def test_real_rollouts_decode_well_inside_the_bound(fill: float) -> None:
    """Even mostly-padding rollouts (2 % real tokens) decode without touching the bound."""
    batch = make_rollout_batch(64, 256, 1024, n=4, min_fill=fill)
    files = entry(batch)
    budget = DecodeBudget.for_files(files)
    out = SafeFormat().decode(dict(files))
    assert torch.equal(out.batch["input_ids"], batch.batch["input_ids"])
    decoded = sum(t.numel() * t.element_size() for t in batch.batch.values())
    assert decoded < budget.limit


def test_max_bytes_refuses_by_name() -> None:
    files = td_entry(x=padded())
    assert_refused(files, "max_decode_bytes=100", error=DecodeLimitError, max_bytes=100)


# --------------------------------------------------------------------------- trim / narrow / concat


# 4 rows keep their runs inline in data.json, 20 as stored parts (compact.INLINE_MAX_ROWS is 16)
LAYOUTS = pytest.mark.parametrize("rows", [4, 20], ids=["inline-runs", "stored-runs"])


@LAYOUTS
def test_trim_width_beyond_the_bound_is_refused_before_allocation(rows: int) -> None:
    files = edited(td_entry(x=padded(rows=rows)), lambda t: batch_entries(t)["x"].update(shape=[rows, 10**9]))
    assert_refused(files, TREE, "root.batch['x']", error=DecodeLimitError)


@LAYOUTS
@pytest.mark.parametrize("change", ["rows", "width", "bits", "dtype", "left", "negative", "not-2d", "huge-dims"])
def test_trim_fields_that_do_not_fit_the_stored_parts(change: str, rows: int) -> None:
    files = td_entry(x=padded(rows=rows))
    tree = json.loads(files[TREE])
    node = batch_entries(tree)["x"]
    assert node["enc"] == "trim" and isinstance(node["left"], list) == (rows == 4)
    if change == "rows":
        node["shape"] = [rows + 1, 64]
    elif change == "width":
        node["shape"] = [rows, 65]  # one more kept position per row than there are values
    elif change == "bits":
        node["bits"] = "int8"
    elif change == "dtype":
        node["dtype"] = "Tensor"
    elif change == "left":
        node["left"], node["values"] = node["values"], node["left"]
    elif change == "negative":
        node["shape"] = [rows, -64]
    elif change == "not-2d":
        node["shape"] = [rows, 8, 8]
    else:
        node["shape"] = [2**62, 2**62]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root.batch['x']")


@LAYOUTS
def test_trim_run_lengths_outside_the_row_are_refused(rows: int) -> None:
    files = td_entry(x=padded(rows=rows, width=8 if rows < 8 else 24))
    tree = json.loads(files[TREE])
    node = batch_entries(tree)["x"]
    node["shape"] = [rows, 2]  # the stored run lengths (up to 6, or 22) no longer fit a row of 2
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root.batch['x']")


def test_narrow_to_a_float_is_refused() -> None:
    files = td_entry(x=torch.arange(100) * 3)
    tree = json.loads(files[TREE])
    node = batch_entries(tree)["x"]
    assert node["enc"] == "narrow"
    node["dtype"] = "float64"
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root.batch['x']")


@pytest.mark.parametrize("parts", [["prompts"], ["prompts", "responses", "prompts"], ["input_ids", "responses"],
                                   ["nope", "responses"], ["uid", "responses"]])
def test_concat_parts_that_are_not_two_2d_siblings(parts: list[str]) -> None:
    prompts, responses = padded(3, 8), padded(3, 12) + 7
    files = td_entry(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                     flat=torch.arange(3))
    tree = json.loads(files[TREE])
    assert batch_entries(tree)["input_ids"]["enc"] == "concat"
    batch_entries(tree)["input_ids"]["parts"] = [p if p != "uid" else "flat" for p in parts]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE)


def test_a_stored_part_used_twice_is_refused() -> None:
    files = entry({"a": torch.arange(5), "b": torch.arange(3)})
    tree = json.loads(files[TREE])
    tree["root"]["entries"]["b"]["ref"] = tree["root"]["entries"]["a"]["ref"]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root['b']")


# --------------------------------------------------------------------------- zstd


def zeros_entry(nbytes: int) -> Files:
    return entry({"z": torch.zeros(nbytes, dtype=torch.uint8)}, compress="zstd")


def test_zstd_shape_beyond_the_bound_is_refused() -> None:
    files = zeros_entry(1 << 20)
    tree = json.loads(files[TREE])
    (ref, info), = tree["packed"].items()
    info["shape"] = [1 << 40]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, f"packed[{ref!r}]", error=DecodeLimitError)


@pytest.mark.parametrize("change", ["smaller", "larger", "dtype", "codec", "no-content-size", "truncated"])
def test_zstd_info_that_does_not_match_the_frame(change: str) -> None:
    files = zeros_entry(1 << 20)
    tree = json.loads(files[TREE])
    (ref, info), = tree["packed"].items()
    tensors = None
    if change == "smaller":
        info["shape"] = [1 << 19]
    elif change == "larger":
        info["shape"] = [1 << 21]
    elif change == "dtype":
        info["dtype"] = "object"
    elif change == "codec":
        info["codec"] = "lz4"
    else:
        from safetensors.torch import load, save

        tensors = load(files["data.safetensors"])
        raw = bytes(1 << 20)
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(raw) if change == "no-content-size" \
            else tensors[ref].numpy().tobytes()[:-10]
        tensors[ref] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
        files = dict(files, **{"data.safetensors": save(tensors)})
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, f"packed[{ref!r}]")


def zstd_bomb(content: int) -> Files:
    """A real zstd frame of ``content`` zero bytes (a few KB on disk), recorded as a uint8 tensor of that size."""
    small = zeros_entry(1 << 17)
    tree = json.loads(small[TREE])
    (ref, info), = tree["packed"].items()
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(out, size=content, closefd=False) as writer:
        chunk = bytes(1 << 20)
        for _ in range(content // len(chunk)):
            writer.write(chunk)
    from safetensors.torch import load, save

    tensors = load(small["data.safetensors"])
    tensors[ref] = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
    info["shape"] = [content]
    return {"data.safetensors": save(tensors), TREE: json.dumps(tree).encode()}


def test_a_real_zstd_bomb_is_refused_without_allocating() -> None:
    files = zstd_bomb(1 << 30)  # 1 GiB of zeros in ~40 KB
    assert sum(map(len, files.values())) < 200_000
    assert_refused(files, "packed", error=DecodeLimitError)


# --------------------------------------------------------------------------- arrays and values


@pytest.mark.parametrize("dtype", ["|O", "|O8", "<i4", "|V8", "<M8[ns]", "i8,O", "float32"])
def test_array_node_views_only_as_a_numeric_dtype_of_the_same_width(dtype: str) -> None:
    files = entry({"a": np.arange(4, dtype=np.int64)})
    tree = json.loads(files[TREE])
    assert tree["root"]["entries"]["a"]["kind"] == "array"
    tree["root"]["entries"]["a"]["dtype"] = dtype
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root['a'].dtype")


@pytest.mark.parametrize("case", ["unicode-width", "huge-shape", "items-vs-shape", "structured", "void", "datetime",
                                  "bad-b64", "b64-length", "np-object", "negative-shape"])
def test_tagged_arrays_in_values_are_checked(case: str) -> None:
    files = entry({"m": [{"arr": np.array(["ab", "c"]), "f": np.array([np.nan, 1.0]), "s": np.float32(2)}]})
    tree = json.loads(files[TREE])
    meta = tree["root"]["entries"]["m"]["v"][0]
    arr, floats, scalar = meta["arr"], meta["f"], meta["s"]
    error: type[Exception] = CorruptEntryError
    if case == "unicode-width":
        arr["dtype"], error = "<U100000000", DecodeLimitError
    elif case == "huge-shape":
        arr["shape"], error = [10**12], DecodeLimitError
    elif case == "items-vs-shape":
        arr["shape"] = [3]
    elif case == "structured":
        arr["dtype"] = "i4,O"
    elif case == "void":
        arr["dtype"] = "|V8"
    elif case == "datetime":
        arr["dtype"] = "<M8[ns]"
    elif case == "bad-b64":
        floats["b64"] = "!!!!"
    elif case == "b64-length":
        floats["shape"] = [3]
    elif case == "np-object":
        scalar["dtype"] = "|O"
    else:
        arr["shape"] = [-2]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root['m']", error=error)


def test_batch_size_beyond_the_bound_is_refused() -> None:
    files = entry(TensorDict({"x": torch.arange(3)}, batch_size=[3]))
    tree = json.loads(files[TREE])
    tree["root"]["batch_size"] = [10**15]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root.batch_size", error=DecodeLimitError)


def test_non_tensor_stack_rows_must_match_its_batch_size() -> None:
    td = TensorDict({"x": torch.arange(2)}, batch_size=[2])
    td.set_non_tensor("tag", "a")
    from tensordict import NonTensorData, NonTensorStack

    td.set("rows", NonTensorStack(NonTensorData("p"), NonTensorData("q")))
    files = entry(td)
    tree = json.loads(files[TREE])
    tree["root"]["entries"]["rows"]["batch_size"] = [5]
    assert_refused(dict(files, **{TREE: json.dumps(tree).encode()}), TREE, "root['rows']")


@pytest.mark.parametrize("tree", [b"[]", b"{}", b'{"root": 3}', b'{"root": {"kind": "warp"}}',
                                  b'{"root": {"kind": "dict", "entries": []}}',
                                  b'{"root": {"kind": "tensor", "ref": "t0"}, "packed": []}',
                                  b'{"root": {"kind": "tensor", "ref": ["t0"]}}'])
def test_malformed_trees_are_corrupt(tree: bytes) -> None:
    files = entry(torch.arange(3))
    with pytest.raises(CorruptEntryError):
        FMT.decode(dict(files, **{TREE: tree}))


# --------------------------------------------------------------------------- jagged tensors


def bad_jagged(offsets: list[int], values: int = 5, lengths: list[int] | None = None) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(torch.arange(values), torch.tensor(offsets),
                                                  lengths=None if lengths is None else torch.tensor(lengths))


BAD_OFFSETS = {
    "decreasing": ([0, 4, 2, 5], None),
    "not-from-zero": ([1, 3, 5], None),
    "short-of-the-end": ([0, 2, 4], None),
    "past-the-end": ([0, 2, 9], None),
    "lengths-past-the-end": ([0, 2, 4], [2, 4]),
    "negative-lengths": ([0, 2, 4], [2, -1]),
}


@pytest.mark.parametrize("name", sorted(BAD_OFFSETS))
def test_invalid_jagged_offsets_are_never_replayed(name: str) -> None:
    offsets, lengths = BAD_OFFSETS[name]
    files = entry(TensorDict({"r": bad_jagged(offsets, lengths=lengths)}, batch_size=[len(offsets) - 1]))
    assert_refused(files, TREE, "root['r']", "invalid jagged tensor")


@pytest.mark.parametrize("ragged_idx", [0, 2, "1", None])
def test_jagged_dim_must_be_a_dimension_of_the_rows(ragged_idx: Any) -> None:
    nt = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    files = entry(TensorDict({"r": nt}, batch_size=[2]))
    files = edited(files, lambda t: t["root"]["entries"]["r"].update(ragged_idx=ragged_idx))
    assert_refused(files, TREE, "root['r']")


def test_valid_jagged_tensors_pass_the_check() -> None:
    nt = torch.nested.nested_tensor([torch.arange(2), torch.arange(0), torch.arange(3)], layout=torch.jagged)
    assert jagged_problem(nt.values(), nt.offsets(), nt.lengths(), nt._ragged_idx) is None
    narrow = bad_jagged([0, 2, 4], 5, [1, 1])  # rows 0:1 and 2:3 of five values, as narrow() makes
    assert jagged_problem(narrow.values(), narrow.offsets(), narrow.lengths(), narrow._ragged_idx) is None


# verl's writer makes jagged tensors with lengths contiguous, which needs valid ones: those are tested for 'safe'
@pytest.mark.parametrize("name", sorted(k for k, (_, lengths) in BAD_OFFSETS.items() if lengths is None))
def test_invalid_jagged_tensors_in_verl_files_are_corrupt(name: str) -> None:
    offsets, lengths = BAD_OFFSETS[name]
    td = TensorDict({"responses": bad_jagged(offsets, lengths=lengths)}, batch_size=[len(offsets) - 1])
    fmt = VerlFormat()
    files = fmt.encode(fmt.freeze(Batch(batch=td, non_tensor_batch={}, meta_info={}), copy=False))
    with pytest.raises(CorruptEntryError, match=r"gen_batch.dp: batch\['responses'\]: invalid jagged"):
        fmt.decode(files)


def test_invalid_jagged_tensors_in_v1_payloads_are_corrupt() -> None:
    td = TensorDict({"responses": bad_jagged([0, 4, 2, 5])}, batch_size=[3])
    fmt = VerlTqFormat()
    files = fmt.encode(fmt.freeze({"tensordict": td, "tags": [{}] * 3, "keys": ["a", "b", "c"], "global_steps": 1},
                                  copy=False))
    with pytest.raises(CorruptEntryError, match=r"tq_batch.pt: tensordict\['responses'\]: invalid jagged"):
        fmt.decode(files)


def test_forged_max_seqlen_is_corrupt() -> None:
    nt = torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)
    nt._metadata_cache["max_seqlen"] = torch.empty(10**9, 0)  # what kernels and padding would trust
    fmt = VerlTqFormat()
    files = fmt.encode(fmt.freeze({"tensordict": TensorDict({"r": nt}, batch_size=[2]), "tags": [], "keys": [],
                                   "global_steps": 1}, copy=False))
    with pytest.raises(CorruptEntryError, match="max_seqlen"):
        fmt.decode(files)


def test_row_operations_refuse_invalid_jagged_tensors() -> None:
    bad = TensorDict({"r": bad_jagged([0, 4, 2, 5])}, batch_size=[3])
    with pytest.raises(ValueError, match="invalid jagged"):
        select_rows(bad, [0, 1])
    with pytest.raises(ValueError, match="invalid jagged"):
        concat_rows([bad, bad])
    good = TensorDict({"r": torch.nested.nested_tensor([torch.arange(2), torch.arange(3)], layout=torch.jagged)},
                      batch_size=[2])
    assert [t.tolist() for t in select_rows(good, [-1, 0])["r"].unbind()] == [[0, 1, 2], [0, 1]]
    with pytest.raises(IndexError):
        select_rows(good, [2])


# --------------------------------------------------------------------------- torch payloads


def _torch_bytes(value: Any, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer, **kwargs)
    return buffer.getvalue()


def test_torch_zip_must_be_stored_uncompressed() -> None:
    data = _torch_bytes({"tensordict": TensorDict({"x": torch.zeros(1000)}, batch_size=[1000])})
    check_torch_zip(data, "tq_batch.pt")  # what torch.save writes passes
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for member in src.infolist():
            dst.writestr(member.filename, src.read(member))
    with pytest.raises(CorruptEntryError, match="compressed"):
        VerlTqFormat().decode({"tq_batch.pt": out.getvalue()})


def test_legacy_torch_format_is_refused() -> None:
    data = _torch_bytes({"tensordict": None, "tags": [], "keys": []}, _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptEntryError, match="zip"):
        VerlTqFormat().decode({"tq_batch.pt": data})


# --------------------------------------------------------------------------- in a memory-limited child


def test_bombs_end_as_corrupt_in_a_memory_limited_child() -> None:
    """A 1 GiB zstd bomb, a 10**9-wide trim, a 2 GB unicode array: refused, no allocation near their sizes."""
    unicode_bomb = edited(entry({"m": np.array(["a"])}),
                          lambda t: t["root"]["entries"]["m"]["v"].update(dtype="<U500000000"))
    trim_bomb = edited(td_entry(x=padded()), lambda t: batch_entries(t)["x"].update(shape=[4, 10**9]))
    jagged = entry(TensorDict({"r": bad_jagged([0, 4, 2, 5])}, batch_size=[3]))
    cases = [("safe", zstd_bomb(1 << 30)), ("safe", trim_bomb), ("safe", unicode_bomb), ("safe", jagged),
             ("safe", td_entry(x=padded()))]
    report = decode_isolated(cases, headroom=DECODE_FLOOR + (512 << 20))
    assert report.returncode == 0, (report.crashed_on, report.stderr)
    outcomes = [o.outcome for o in report.outcomes]
    assert outcomes == ["DecodeLimitError", "DecodeLimitError", "DecodeLimitError", "CorruptEntryError", "value"]
    assert all(o.peak < 128 << 20 for o in report.outcomes), report.outcomes


class _Call:
    """Pickles as ``fn(*args)``: what a hostile torch payload holds (torch.save pickles it as is)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return self.fn, self.args


SIZED_BOMBS = {
    "bytearray-2GiB": lambda: _Call(bytearray, 1 << 31),
    "tensor-legacy-10e9": lambda: _Call(torch.Tensor, 10**9),
    "sparse-huge": lambda: torch.sparse_coo_tensor(torch.zeros(2, 1, dtype=torch.long), torch.ones(1), (10**6, 10**6)),
}


@pytest.mark.parametrize("name", sorted(SIZED_BOMBS))
def test_torch_payloads_that_allocate_by_argument_are_refused(name: str) -> None:
    """torch.load(weights_only=True) admits bytearray(n) and torch.Tensor(n): a 1 KB file could take gigabytes."""
    data = _torch_bytes({"tensordict": SIZED_BOMBS[name](), "tags": [], "keys": []})
    with pytest.raises(CorruptEntryError, match="tq_batch.pt"):
        VerlTqFormat().decode({"tq_batch.pt": data})


def _dataproto(state: Any) -> bytes:
    """A gen_batch.dp holding ``state``, pickled as verl's DataProto pickles, via a throw-away class."""
    import copyreg
    import pickle
    import sys
    import types

    fake = type("DataProto", (), {"__module__": "verl.protocol",
                                  "__reduce_ex__": lambda self, p: (copyreg.__newobj__, (type(self),), self.state)})
    instance = fake.__new__(fake)
    instance.state = state
    module = types.ModuleType("verl.protocol")
    module.DataProto = fake  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("verl", "verl.protocol")}
    sys.modules["verl.protocol"] = module
    sys.modules.setdefault("verl", types.ModuleType("verl"))
    try:
        return pickle.dumps(instance, protocol=4)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def test_a_bytearray_bomb_inside_a_gen_batch_is_refused() -> None:
    harmless = _torch_bytes(TensorDict({"x": torch.arange(2)}, batch_size=[2]))
    VerlFormat().decode({"gen_batch.dp": _dataproto((harmless, {}, {}))})
    bomb = _torch_bytes({"a": _Call(bytearray, 1 << 31)})
    with pytest.raises(CorruptEntryError, match="bytearray"):
        VerlFormat().decode({"gen_batch.dp": _dataproto((bomb, {}, {}))})


def test_legit_bytearrays_in_a_torch_payload_still_load() -> None:
    data = _torch_bytes({"tensordict": TensorDict({"x": torch.arange(2)}, batch_size=[2]), "tags": [bytearray(b"ok")],
                         "keys": ["k"]})
    assert VerlTqFormat().decode({"tq_batch.pt": data})["tags"] == [bytearray(b"ok")]


# --------------------------------------------------------------------------- trim run lengths near 2**63


def _trim_entry(rows: int, width: int) -> Files:
    """A ``trim`` node whose left runs are 2**63-1 and right runs 1: their int64 sum wraps to -2**63,
    and an even number of rows sums to 0, so the values look like they fill every position."""
    parts = {"values": torch.arange(rows * width, dtype=torch.int64),
             "left": torch.full((rows,), 2**63 - 1, dtype=torch.int64),
             "right": torch.ones(rows, dtype=torch.int64),
             "lval": torch.zeros(rows, dtype=torch.int64), "rval": torch.zeros(rows, dtype=torch.int64)}
    files = entry(parts, compress="none")
    tree = json.loads(files[TREE])
    refs = {name: node["ref"] for name, node in tree["root"]["entries"].items()}
    node = {"kind": "tensor", "enc": "trim", "dtype": "int64", "shape": [rows, width], "bits": "int64", **refs}
    tree["root"] = {"kind": "dict", "entries": {"x": node}}
    return dict(files, **{TREE: json.dumps(tree).encode()})


@pytest.mark.parametrize("rows", [230, 200], ids=["row-copy-rebuild", "small-numpy-rebuild"])
def test_trim_run_lengths_that_overflow_when_summed_are_refused(rows: int) -> None:
    assert_refused(_trim_entry(rows, 300), "root['x']", "run lengths outside the row width 300")
