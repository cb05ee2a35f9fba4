"""The compact encodings are exact to the bit and actually compact on rollout-shaped data."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stepskip._formats import get_format
from stepskip._formats.compact import decode_tensor, encode_tensor, find_concat, host_view, narrow, pack, unpack
from stepskip.testing import make_rollout_batch

# the trimmed layouts of many rows are what these tests take apart (see the fixture)
pytestmark = pytest.mark.usefixtures("trim_every_size")

DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
          torch.float32, torch.float64, torch.float16, torch.bfloat16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return {torch.float32: lambda: t.view(torch.int32), torch.float64: lambda: t.view(torch.int64),
            torch.float16: lambda: t.view(torch.int16), torch.bfloat16: lambda: t.view(torch.int16),
            torch.bool: lambda: t.view(torch.uint8)}.get(t.dtype, lambda: t)()


def round_trip(t: torch.Tensor) -> tuple[torch.Tensor, dict]:
    table: dict[str, torch.Tensor] = {}

    def add(part):
        table[f"r{len(table)}"] = part
        return f"r{len(table) - 1}"

    node = encode_tensor(t, add)
    return decode_tensor(json.loads(json.dumps(node)), table.__getitem__, None), node


def padded(rows, width, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    left = torch.randint(0, width + 1, (rows,), generator=gen)
    right = torch.minimum(torch.randint(0, width + 1, (rows,), generator=gen), width - left)
    columns = torch.arange(width)
    body = torch.randint(-100, 100, (rows, width), generator=gen)
    out = torch.where(columns < left[:, None], 7, torch.where(columns >= (width - right)[:, None], -3, body))
    if dtype == torch.bool:
        return out > 0
    if dtype.is_floating_point:
        out = out.to(dtype) / 3
        out[out == 0] = -0.0  # the sign of zero must survive
        return out
    return out.clamp(torch.iinfo(dtype).min, torch.iinfo(dtype).max).to(dtype)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 12), width=st.integers(0, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 10**6))
def test_round_trip_is_bit_exact(rows, width, dtype, seed):
    t = padded(rows, width, dtype, seed)
    out, _ = round_trip(t)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(bits(out), bits(t))


@pytest.mark.parametrize("threshold", [1, 10**9], ids=["row-copy", "vectorised"])
def test_both_trim_rebuilds_are_bit_exact(monkeypatch, threshold):
    """Wide rows' middles are gathered row by row, narrow ones' with masks: both give the tensor back."""
    from stepskip._formats import compact

    monkeypatch.setattr(compact, "ROW_COPY_MIN_WIDTH", threshold)
    shapes = [(0, 5), (1, 2), (3, 7), (12, 40), (5, 300), (64, 513)]
    for seed, (rows, width) in enumerate(shapes):
        for dtype in DTYPES:
            t = padded(rows, width, dtype, seed)
            out, node = round_trip(t)
            assert out.dtype == t.dtype and out.shape == t.shape
            assert torch.equal(bits(out), bits(t)), (rows, width, dtype, node.get("enc"))
    # every row of a wide, mostly padded tensor takes the row path at the real threshold
    monkeypatch.setattr(compact, "ROW_COPY_MIN_WIDTH", 256)
    t = padded(32, 1024, torch.int64, 5)
    out, node = round_trip(t)
    assert node["enc"] == "trim" and torch.equal(out, t)


def position_like(rows: int, width: int, own_runs: int, seed: int) -> torch.Tensor:
    """Left-padded rows of 0 whose right runs repeat each row's last position, as position ids do;
    ``own_runs`` rows get left runs of their own value too."""
    gen = torch.Generator().manual_seed(seed)
    left = torch.randint(0, width // 2, (rows,), generator=gen)
    right = torch.randint(0, width // 2, (rows,), generator=gen)
    out = torch.zeros(rows, width, dtype=torch.int64)
    for i in range(rows):
        middle = width - int(left[i]) - int(right[i])
        out[i, int(left[i]):width - int(right[i])] = torch.arange(middle) + 1
        out[i, width - int(right[i]):] = middle + i  # a value of the row's own
        if i < own_runs:
            out[i, :int(left[i])] = -1 - i
    return out


@pytest.mark.parametrize("mask_elements", [None, 1000], ids=["one-block", "blocks-of-rows"])
@pytest.mark.parametrize("odd_run_elements", [None, 1, 10**9], ids=["real", "row-by-row-runs", "masked-runs"])
@pytest.mark.parametrize("rows,width,own_runs", [(2, 3, 2), (64, 513, 0), (64, 513, 5), (300, 6, 300),
                                                 (40, 1024, 40)])
def test_many_rows_rebuild_every_run_value(monkeypatch, mask_elements, odd_run_elements, rows, width, own_runs):
    """Rows decode by masked passes, a block of rows at a time: the runs that differ from the block's
    first left run are written after the middles, one row at a time or by a second mask, and every
    way gives the tensor back."""
    from stepskip._formats import compact

    monkeypatch.setattr(compact, "SMALL_FILL_ELEMENTS", 0)  # every size through the blocks
    if odd_run_elements is not None:
        monkeypatch.setattr(compact, "_ODD_RUN_ELEMENTS", odd_run_elements)
    if mask_elements is not None:
        monkeypatch.setattr(compact, "_MASK_ELEMENTS", mask_elements)
    t = position_like(rows, width, own_runs, seed=rows + width)
    for dtype in (torch.int64, torch.int16, torch.float32):
        tensor = t.to(dtype)
        out, node = round_trip(tensor)
        assert node["enc"] == "trim", node
        assert out.dtype == dtype and torch.equal(bits(out), bits(tensor)), (rows, width, own_runs, dtype)


@pytest.mark.parametrize("rows,width,own_runs", [(2, 3, 2), (64, 513, 0), (64, 513, 5), (300, 6, 300),
                                                 (40, 1024, 40), (5, 2, 0)])
def test_small_tensor_fill_rebuilds_every_run_value(monkeypatch, rows, width, own_runs):
    """The whole-tensor fill small tensors take (each row's left value, its right run, the middles by
    one mask) gives back every run value and middle, at any size it is allowed."""
    from stepskip._formats import compact

    monkeypatch.setattr(compact, "SMALL_FILL_ELEMENTS", 1 << 40)
    calls: list[int] = []
    real = compact._fill_small
    monkeypatch.setattr(compact, "_fill_small", lambda out, *rest: calls.append(out.size) or real(out, *rest))
    t = position_like(rows, width, own_runs, seed=rows + width)
    for dtype in (torch.int64, torch.int16, torch.float32):
        tensor = t.to(dtype)
        out, node = round_trip(tensor)
        assert node["enc"] == "trim", node
        assert out.dtype == dtype and torch.equal(bits(out), bits(tensor)), (rows, width, own_runs, dtype)
    assert calls == [rows * width] * 3


def test_small_tensor_fill_charges_its_masks():
    """A small trimmed tensor's fill charges its two extra masks to the decode budget before making them."""
    from stepskip.errors import DecodeLimitError
    from stepskip._formats import compact
    from stepskip._formats.bounds import DecodeBudget

    t = position_like(16, 200, 16, seed=3)
    table: dict[str, torch.Tensor] = {}

    def add(part):
        table[f"r{len(table)}"] = part
        return f"r{len(table) - 1}"

    node = encode_tensor(t, add)
    first = 16 * 200 * (8 + 1) + 16 * compact._RUN_ROW_BYTES
    with pytest.raises(DecodeLimitError):
        decode_tensor(node, dict(table).__getitem__, None, DecodeBudget(first + 2 * 16 * 200 - 1, "test"))
    assert torch.equal(decode_tensor(node, dict(table).__getitem__, None,
                                     DecodeBudget(first + 2 * 16 * 200, "test")), t)


def test_masked_runs_are_charged_before_they_are_listed(monkeypatch):
    """The second masked pass lists every run value: the decode budget is charged for them first."""
    from stepskip.errors import DecodeLimitError
    from stepskip._formats import compact
    from stepskip._formats.bounds import DecodeBudget

    monkeypatch.setattr(compact, "_ODD_RUN_ELEMENTS", 10**9)
    monkeypatch.setattr(compact, "SMALL_FILL_ELEMENTS", 0)  # the block fill, whose second pass lists the runs
    t = position_like(16, 200, 16, seed=3)
    table: dict[str, torch.Tensor] = {}

    def add(part):
        table[f"r{len(table)}"] = part
        return f"r{len(table) - 1}"

    node = encode_tensor(t, add)
    before_runs = 16 * 200 * (8 + 1) + 16 * compact._RUN_ROW_BYTES
    with pytest.raises(DecodeLimitError):
        decode_tensor(node, dict(table).__getitem__, None, DecodeBudget(before_runs + 8, "test"))
    assert torch.equal(decode_tensor(node, dict(table).__getitem__, None, DecodeBudget(before_runs * 2, "test")), t)


def test_nan_payloads_and_negative_zero_survive():
    t = torch.zeros(3, 6)
    t[0, 2:] = float("nan")
    t[1] = -0.0
    t[2, :3] = torch.tensor([1.0, -0.0, 0.0])
    nan_payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    t[0, 0] = nan_payload
    out, _ = round_trip(t)
    assert torch.equal(bits(out), bits(t))


def test_padded_rows_are_trimmed_and_narrowed():
    t = torch.full((4, 100), 151643, dtype=torch.int64)
    t[:, 60:] = torch.arange(40) + 1000
    out, node = round_trip(t)
    assert node["enc"] == "trim" and torch.equal(out, t)
    masks = (torch.arange(100)[None, :] < torch.tensor([[10], [50], [99], [100]])).to(torch.int64)
    out, node = round_trip(masks)
    assert node["enc"] == "trim" and torch.equal(out, masks)


def test_narrow_keeps_values_and_picks_the_smallest_dtype():
    assert narrow(torch.tensor([0, 255], dtype=torch.int64)).dtype == torch.uint8
    assert narrow(torch.tensor([-1, 100], dtype=torch.int64)).dtype == torch.int8
    assert narrow(torch.tensor([0, 151_936], dtype=torch.int64)).dtype == torch.int32
    big = torch.tensor([0, 2**40])
    assert narrow(big) is big
    floats = torch.tensor([1.5])
    assert narrow(floats) is floats


def test_find_concat_names_the_two_sides_and_never_chains():
    a, b = torch.arange(6).reshape(2, 3), torch.arange(4).reshape(2, 2) + 10
    found = find_concat({"a": a, "b": b, "ab": torch.cat([a, b], 1), "other": torch.cat([b, a], 1)})
    assert found["ab"] == ["a", "b"] and found["other"] == ["b", "a"]
    assert find_concat({"a": a, "b": b, "ab": torch.cat([a, b + 1], 1)}) == {}


def test_find_concat_compares_values_on_every_call_of_one_shape():
    """The pairs worth comparing are kept per set of shapes; whether they match is decided per call."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        a = torch.from_numpy(rng.integers(0, 5, (1, 3)))
        b = torch.from_numpy(rng.integers(0, 5, (1, 4)))
        c = torch.from_numpy(rng.integers(0, 5, (1, 4)))
        joined = torch.cat([a, c if trial % 3 else b], 1)
        tensors = {"a": a, "b": b, "joined": joined if trial % 2 else joined + 7, "c": c}
        expected = {} if trial % 2 == 0 else {"joined": ["a", "c" if trial % 3 else "b"]}
        if trial % 2 and trial % 3 and torch.equal(b, c):
            expected = {"joined": ["a", "b"]}  # the first sibling that fits wins
        assert find_concat(tensors) == expected, trial


def test_find_concat_takes_each_tensor_as_a_part_or_a_whole_never_both():
    a, b = torch.arange(3).reshape(1, 3), torch.arange(2).reshape(1, 2) + 10
    ab = torch.cat([a, b], 1)
    abb = torch.cat([ab, b], 1)  # ab + b: but ab is a part of nothing once it is a concatenation
    for _ in range(2):  # the second call runs on the kept plan
        assert find_concat({"a": a, "b": b, "ab": ab, "abb": abb}) == {"ab": ["a", "b"]}
        assert find_concat({"abb": abb, "ab": ab, "a": a, "b": b}) == {"abb": ["ab", "b"]}


@pytest.mark.parametrize("mode", ["auto", "zstd"])
def test_pack_round_trip(mode):
    t = torch.arange(100_000, dtype=torch.int64) % 7
    stored, info = pack(t, mode)
    assert info is not None and stored.numel() < t.numel()
    assert torch.equal(unpack(stored, json.loads(json.dumps(info))), t)
    random = torch.randint(0, 2**31 - 1, (40_000,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    assert pack(random, "auto")[1] is None  # does not halve: kept raw, loads faster
    assert pack(t, "none")[1] is None


@pytest.mark.parametrize("compress", ["auto", "zstd", "none"])
def test_rollout_batch_round_trip_and_size(compress):
    batch = make_rollout_batch(64, 96, 160, n=8, seed=3)
    fmt = get_format("safe", compress=compress)
    files = fmt.encode(fmt.freeze(batch, copy=True))
    out = fmt.decode(files)
    for key in batch.batch.keys():
        assert out.batch[key].dtype == batch.batch[key].dtype
        assert torch.equal(bits(out.batch[key]), bits(batch.batch[key])), key
    assert out.non_tensor_batch["messages"].tolist() == batch.non_tensor_batch["messages"].tolist()
    assert out.meta_info == batch.meta_info
    size = sum(len(v) for v in files.values())
    in_memory = sum(t.numel() * t.element_size() for t in batch.batch.values())
    if compress == "none":
        assert size > in_memory
    else:
        assert size < 0.2 * in_memory


def jagged_step(rows: int = 512) -> Any:
    """What a V1 step reads back from the queue: unpadded rows as jagged columns (about 3 MB)."""
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(200, 400, (rows,), generator=gen).tolist()

    def column(make: Any) -> torch.Tensor:
        return torch.nested.as_nested_tensor([make(n) for n in lengths], layout=torch.jagged)

    return TensorDict({
        "responses": column(lambda n: torch.randint(0, 151_000, (n,), generator=gen)),
        "response_mask": column(lambda n: torch.ones(n, dtype=torch.int64)),
        "rollout_log_probs": column(lambda n: -5 * torch.rand(n, generator=gen)),
    }, batch_size=[rows])


def test_jagged_columns_are_narrowed_side_by_side_into_the_same_bytes(monkeypatch):
    """The columns of a V1 step are encoded on the codec pool together; the bytes do not depend on it."""
    import stepskip._formats.safe as safe

    step = {"tensordict": jagged_step(), "tags": [{"seq_len": i} for i in range(512)]}
    fmt = get_format("safe")
    calls: list[list[Any]] = []
    real = safe._parallel_map

    def recording(fn, items, pool="codec", nbytes=None):
        calls.append(list(items))
        return real(fn, items, pool=pool, nbytes=nbytes)

    monkeypatch.setattr(safe, "_parallel_map", recording)
    side_by_side = fmt.encode(fmt.freeze(step, copy=True))
    assert ["responses", "response_mask", "rollout_log_probs"] in calls
    monkeypatch.setattr(safe, "PARALLEL_MIN_BYTES", 1 << 62)  # every item on the calling thread
    one_by_one = fmt.encode(fmt.freeze(step, copy=True))
    assert {k: bytes(v) for k, v in side_by_side.items()} == {k: bytes(v) for k, v in one_by_one.items()}
    out = fmt.decode(side_by_side)
    for key, column in step["tensordict"].items():
        assert out["tensordict"][key].dtype == column.dtype
        assert torch.equal(bits(out["tensordict"][key].values()), bits(column.values())), key
        assert torch.equal(out["tensordict"][key].offsets(), column.offsets()), key
    assert out["tags"] == step["tags"]


@pytest.mark.parametrize("make", [lambda: make_rollout_batch(256, 256, 512, n=8, seed=1),
                                  lambda: {"tensordict": jagged_step()}], ids=["rollout", "v1-step"])
def test_the_files_do_not_depend_on_which_pool_item_finishes_first(monkeypatch, make):
    """The pool's threads add the encoded parts in any order; the entry's bytes stay the same."""
    import stepskip._formats.safe as safe

    value, fmt = make(), get_format("safe")
    monkeypatch.setattr(safe, "PARALLEL_MIN_BYTES", 1 << 62)  # in order, on the calling thread
    in_order = fmt.encode(fmt.freeze(value, copy=True))

    def last_first(fn, items, pool="codec", nbytes=None):
        done = {i: fn(item) for i, item in reversed(list(enumerate(items)))}
        return [done[i] for i in range(len(items))]

    monkeypatch.setattr(safe, "_parallel_map", last_first)
    reversed_order = fmt.encode(fmt.freeze(value, copy=True))
    assert {k: bytes(v) for k, v in reversed_order.items()} == {k: bytes(v) for k, v in in_order.items()}


def test_a_concatenation_decodes_beside_its_parts_and_a_damaged_part_fails_without_a_hang(monkeypatch):
    """input_ids (prompts | responses) is copied on the pool once its parts exist; a part that does
    not decode must surface as a damaged entry, never leave the concatenation waiting forever."""
    import threading

    from stepskip.errors import CorruptEntryError
    from stepskip._formats import safe

    monkeypatch.setattr(safe, "PARALLEL_MIN_BYTES", 0)  # this small entry decodes on the pool too
    monkeypatch.setattr(safe, "DECODE_PARALLEL_MIN_BYTES", 0)
    decoded_on: set[str] = set()
    node = safe._Decoder.node

    def spied(self, *args, **kwargs):
        decoded_on.add(threading.current_thread().name)
        return node(self, *args, **kwargs)

    monkeypatch.setattr(safe._Decoder, "node", spied)
    batch = make_rollout_batch(16, 300, 400, n=4, seed=2)  # rows wide enough for the row-copy rebuild
    fmt = get_format("safe", compress="auto")
    files = fmt.encode(fmt.freeze(batch, copy=True))
    tree = json.loads(files["data.json"])
    entries = tree["root"]["batch"]["entries"]
    assert entries["input_ids"]["enc"] == "concat" and entries["responses"]["enc"] == "trim"
    out = fmt.decode(dict(files))
    assert torch.equal(out.batch["input_ids"], batch.batch["input_ids"])
    assert decoded_on - {threading.current_thread().name}  # the pool decoded (the path under test)
    entries["responses"]["shape"] = [16, 10**6]  # the runs and values no longer fit this width
    damaged = dict(files, **{"data.json": json.dumps(tree).encode()})
    for _ in range(3):  # more than the pool has workers: none may be left blocked by a failed decode
        with pytest.raises(CorruptEntryError, match="responses"):
            fmt.decode(damaged)
    assert torch.equal(fmt.decode(dict(files)).batch["input_ids"], batch.batch["input_ids"])


# --------------------------------------------------------------------------- numpy's view of small tensors


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.int64, torch.uint32, torch.float16,
                                   torch.float32, torch.float64])
def test_host_view_is_numpys_view_of_the_same_bytes(dtype: torch.dtype) -> None:
    tensor = (torch.arange(12) % 3).to(dtype).reshape(3, 4).t()  # strided too
    view = host_view(tensor)
    assert view is not None and view.shape == (4, 3)
    assert np.array_equal(view, tensor.numpy())
    tensor[0, 0] = 1
    assert view[0, 0] == 1  # a view, not a copy


@pytest.mark.parametrize("make", [
    lambda: torch.ones(3, dtype=torch.bfloat16),  # no numpy dtype
    lambda: torch.ones(3, dtype=torch.complex64),  # conjugate views numpy would not see
    lambda: torch.ones(3, requires_grad=True),
    lambda: torch.ones(3, device="meta"),
    lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
    lambda: torch.ones(4).to_sparse(),
    lambda: torch.nn.Parameter(torch.ones(3), requires_grad=False),  # a subclass: torch handles it
], ids=["bfloat16", "complex", "grad", "meta", "jagged", "sparse", "subclass"])
def test_host_view_leaves_other_tensors_to_torch(make: Any) -> None:
    assert host_view(make()) is None
