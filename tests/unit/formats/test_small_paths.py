"""The small-tensor paths of format 'safe' (numpy narrowing, the hand-written safetensors file)
and its big-file paths (the file and the narrowed tensors in recycled pages, zstd reading the
tensor's own bytes) give exactly what the general paths give: same nodes, same parts, same bytes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import stepskip._formats.compact as compact
from stepskip._formats.pages import POOL
from stepskip._formats.safe import SafeFormat
from stepskip._formats.st_small import save_pooled, save_small

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.uint16, torch.uint32, torch.uint64]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    high = 200 if dtype in (torch.uint8, torch.int8) else 5000
    return torch.randint(0, high, shape, generator=gen).to(dtype)


def test_save_small_writes_the_bytes_safetensors_writes():
    tensors = {f"t{i}.{j}": _tensor(dtype, shape, seed=i)
               for i, dtype in enumerate(DTYPES) for j, shape in enumerate([(3,), (2, 5), (), (0,)])}
    tensors["a"] = torch.arange(12).reshape(3, 4).t()  # not contiguous
    tensors["b"] = torch.tensor([7]).expand(1)  # stride 0
    tensors["c"] = torch.arange(10)[2:8:2]  # a strided view
    data = save_small(tensors)
    assert data == st_save({k: v.contiguous() for k, v in tensors.items()})
    loaded = st_load(data)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert save_small({}) == st_save({})


@pytest.mark.parametrize("tensors", [
    {"bad name/": torch.zeros(2)},
    {"big": torch.zeros(1 << 19, dtype=torch.int64)},
    {"complex": torch.zeros(2, dtype=torch.complex64)},
], ids=["name", "size", "dtype"])
def test_save_small_leaves_anything_else_to_safetensors(tensors):
    assert save_small(tensors) is None


def test_save_pooled_writes_the_bytes_safetensors_writes_in_recycled_pages(monkeypatch):
    monkeypatch.setattr(POOL, "released", False)  # as after SkipManager.init (an earlier test may have closed it)
    tensors = {f"t{i}": _tensor(dtype, (3, 5), seed=i) for i, dtype in enumerate(DTYPES)}
    tensors["big"] = torch.arange(3 << 20, dtype=torch.int32).reshape(-1, 1024).t()  # 12 MB, not contiguous
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    expected = st_save({k: v.contiguous() for k, v in tensors.items()})
    mapped, idle = POOL.mapped + POOL.reused, POOL.idle_bytes
    data = save_pooled(tensors)
    assert isinstance(data, memoryview) and data == expected
    assert POOL.mapped + POOL.reused == mapped + 1  # the file's bytes live in a pooled mapping ...
    loaded = st_load(bytes(data))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    del data
    assert POOL.idle_bytes >= idle + len(expected)  # ... given back once the view is dropped
    assert save_pooled({}) == st_save({})
    assert save_pooled({"bad name/": torch.zeros(2)}) is None
    assert save_pooled({"complex": torch.zeros(2, dtype=torch.complex64)}) is None


def test_a_big_entry_of_format_safe_is_written_in_pooled_memory_and_reads_back_exactly():
    fmt = SafeFormat()
    value = {"ids": torch.randint(0, 150_000, (256, 4096)),  # narrowed to int32 (4 MB): a pooled tensor
             "mask": torch.ones(256, 4096, dtype=torch.bool), "logp": torch.randn(256, 4096),
             "flags": (torch.rand(64, 1 << 14) > 0.5)}  # bool, compressed through its own bytes
    files = fmt.encode(fmt.freeze(value, copy=True))
    assert isinstance(files["data.safetensors"], memoryview)
    assert bytes(files["data.safetensors"]) == st_save(st_load(bytes(files["data.safetensors"])))
    out = fmt.decode(dict(files))
    assert out.keys() == value.keys() and all(torch.equal(out[k], v) for k, v in value.items())
    assert all(out[k].dtype == v.dtype for k, v in value.items())


def test_zstd_packs_the_tensors_own_bytes_whatever_their_shape_and_dtype():
    for tensor in (torch.zeros(300, 400, dtype=torch.bool), torch.arange(1 << 17).reshape(64, -1).t(),
                   torch.zeros(200, 300, dtype=torch.bfloat16)):
        stored, info = compact.pack(tensor, "auto")
        assert info is not None and stored.numel() < tensor.numel() * tensor.element_size() // 2
        assert torch.equal(compact.unpack(stored, info), tensor.contiguous())
    noise = torch.randint(0, 256, (1 << 21,), dtype=torch.uint8)  # a sample shows zstd cannot halve it
    assert compact.pack(noise, "auto") == (noise, None)


def _padded(dtype: torch.dtype, rows: int, width: int) -> torch.Tensor:
    values = _tensor(dtype, (rows, width), seed=rows)
    pad = _tensor(dtype, (1,), seed=99)[0]
    out = values.clone()
    for r in range(rows):  # left and right runs of different lengths, as prompts and responses have
        out[r, : r % 4] = pad
        out[r, width - (r * 3) % 7:] = pad
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,width", [(1, 16), (3, 9), (5, 2), (4, 40)])
def test_numpy_paths_match_the_torch_paths(monkeypatch, dtype, rows, width):
    tensor = _padded(dtype, rows, width)

    def encoded() -> tuple[dict, dict]:
        parts: dict[str, torch.Tensor] = {}

        def add(t: torch.Tensor) -> str:
            parts[f"p{len(parts)}"] = t.contiguous()
            return f"p{len(parts) - 1}"

        return compact.encode_tensor(tensor, add), parts

    small_node, small_parts = encoded()
    small_out = compact.decode_tensor(small_node, small_parts.__getitem__)
    monkeypatch.setattr(compact, "SMALL_ELEMENTS", -1)  # every tensor through torch
    node, parts = encoded()
    assert small_node == node
    assert parts.keys() == small_parts.keys()
    for key in parts:
        assert parts[key].dtype == small_parts[key].dtype and torch.equal(parts[key], small_parts[key]), key
    out = compact.decode_tensor(node, parts.__getitem__)
    assert out.dtype == small_out.dtype == tensor.dtype
    assert torch.equal(out.view(torch.uint8), small_out.view(torch.uint8))  # bit-exact (NaN, -0.0)
    assert torch.equal(small_out.view(torch.uint8), tensor.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead,tail", [(3, 5), (0, 7), (4, 0), (6, 6), (0, 12)], ids=str)
def test_one_row_trims_decode_bit_exact(dtype, lead, tail):
    """A single padded row (the async role's one-sample entries, rebuilt by slices), runs of every length."""
    width = 12
    row = _tensor(dtype, (1, width), seed=lead * 31 + tail)
    pad_left, pad_right = _tensor(dtype, (2,), seed=7)
    row[0, :lead] = pad_left
    row[0, width - tail:] = pad_right
    parts: dict[str, torch.Tensor] = {}

    def add(t: torch.Tensor) -> str:
        parts[f"p{len(parts)}"] = t.contiguous()
        return f"p{len(parts) - 1}"

    node = compact.encode_tensor(row, add)
    assert node["enc"] == "trim"  # at least a third of the row is padding
    out = compact.decode_tensor(node, parts.__getitem__)
    assert out.dtype == row.dtype and out.shape == row.shape
    assert torch.equal(out.view(torch.uint8), row.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("row", [[5, 5, 1, 2, 9, 9, 9], [5] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [3, 3, 3, 3, 3, 3, 4],
                                 [0, 1, 1, 1, 1, 1, 1, 1, 1, 1], [7, 7, 7, 7, 7, 7, 7, 8, 8, 8]], ids=str)
def test_the_one_row_trim_gives_the_parts_of_the_general_one(dtype, row):
    """The async role's rows take :func:`compact._trim_row`: the same parts as the row-vectorised trim."""
    tensor = torch.tensor([row]).to(dtype) if dtype != torch.bool else torch.tensor([row]) > 4
    array = compact._bits(tensor).numpy()
    one, general = compact._trim_row(array.reshape(-1).copy()), compact._trim_rows(array.copy())
    assert (one is None) == (general is None)
    if one is not None:
        for a, b in zip(one, general):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
