"""Fuzzing the decoders: every generated entry ends in a value or a typed error, never a crash, hang or MemoryError.

Hypothesis generates, deterministically (``derandomize=True``, fixed example counts):

- ``data.json`` trees: real entries (trimmed, narrowed, concatenated, jagged, zstd-packed tensors,
  object columns, tagged values, packed ragged rows) with one to three fields replaced by arbitrary JSON (huge and
  negative numbers, dtype names, nested lists and dicts);
- packed-tensor descriptors: arbitrary codec/dtype/shape records over real, truncated and
  foreign zstd frames;
- pickle streams: random opcode programs over the allow-listed globals (REDUCE, BUILD, memo
  opcodes, containers) and byte-level damage of a real ``gen_batch.dp`` and V1 ``tq_batch.pt``.

Generating is fast and happens here; decoding happens in one child process under ``RLIMIT_AS``
and a per-case alarm (``tests/support/isolated_decode.py``), since a segfault or a hang cannot
be caught in-process.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from isolated_decode import decode_isolated
from tensordict import TensorDict

from stepskip import Batch
from stepskip._formats.bounds import DECODE_FLOOR
from stepskip._formats.safe import SafeFormat
from stepskip._formats.verl import VerlFormat, VerlTqFormat

ACCEPTED = {"value", "CorruptEntryError", "TruncatedEntryError", "DecodeLimitError", "UnreadableEntryError"}
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=150,
                suppress_health_check=list(HealthCheck))


def _obj(items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    for i, v in enumerate(items):
        out[i] = v
    return out


def _seed_value() -> Batch:
    prompts = torch.zeros(4, 16, dtype=torch.int64)
    responses = torch.zeros(4, 24, dtype=torch.int64)
    for r in range(4):
        prompts[r, 16 - r - 3:] = torch.arange(r + 3) + 150_000
        responses[r, : r + 5] = torch.arange(r + 5) + 7
    td = TensorDict({
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "mask": (torch.cat([prompts, responses], 1) != 0).to(torch.int64),
        "logp": -torch.rand(4, 24),
        "small": torch.arange(4, dtype=torch.int64),
        "pattern": (torch.arange(40_000) % 5).float().reshape(4, 10_000),  # 160 KB that zstd packs
        "jag": torch.nested.nested_tensor([torch.arange(i + 1) for i in range(4)], layout=torch.jagged),
    }, batch_size=[4])
    return Batch(batch=td, non_tensor_batch={"uid": _obj(["a", "b", "c", "d"]),
                                             "msgs": _obj([[{"role": "user", "content": str(i)}] for i in range(4)]),
                                             "score": np.arange(4, dtype=np.float32)},
                 meta_info={"step": 3, "arr": np.array([np.nan, 1.0]), "t": (1, b"x"), "s": {2, 3},
                            "ids": [[i] * 30 for i in range(3)], "lp": [[-0.5, None] * 40, []]})  # packed rows


SAFE = SafeFormat("zstd")
SEED_FILES = SAFE.encode(SAFE.freeze(_seed_value(), copy=True))
SEED_TREE = json.loads(SEED_FILES["data.json"])
VERL = VerlFormat()
SEED_DP = VERL.encode(VERL.freeze(_seed_value(), copy=True))["gen_batch.dp"]
V1 = VerlTqFormat()
SEED_V1 = V1.encode(V1.freeze({"tensordict": _seed_value().batch, "tags": [{"uid": "a", "n": 1}] * 4,
                               "keys": ["k0", "k1", "k2", "k3"], "global_steps": 3}, copy=True))["tq_batch.pt"]

_numbers = st.one_of(st.integers(-3, 70), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2**31, 2**62, -1]),
                     st.floats(allow_nan=True))
_names = st.sampled_from(["tensor", "trim", "narrow", "concat", "jagged", "array", "object_array", "value", "dict",
                          "tensordict", "batch", "int64", "uint8", "float32", "bool", "bfloat16", "|O", "<U9",
                          "<U1000000000", "i4,O", "t0", "t1", "t3.0", "zstd", "__t", "ndarray", "b64", "kind", "enc",
                          "shape", "parts", "ref", "v", "prompts", "responses", "rows", "holes", "offsets",
                          "values", "int", "float"])
_json = st.recursive(
    st.none() | st.booleans() | _numbers | _names | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_names | st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def _replace(tree: Any, path: list[int], value: Any) -> Any:
    """Replace the node reached by following ``path`` (child index modulo the children) with ``value``."""
    if not path or not isinstance(tree, (dict, list)) or not tree:
        return value
    keys = list(tree) if isinstance(tree, dict) else list(range(len(tree)))
    key = keys[path[0] % len(keys)]
    tree[key] = _replace(tree[key], path[1:], value)
    return tree


@st.composite
def mutated_trees(draw: st.DrawFn) -> dict[str, bytes]:
    tree = copy.deepcopy(SEED_TREE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.lists(st.integers(0, 40), min_size=1, max_size=9))
        tree = _replace(tree, path, draw(_json))
    return dict(SEED_FILES, **{"data.json": json.dumps(tree).encode()})


_FRAME = zstandard.ZstdCompressor().compress(bytes(1 << 16))


@st.composite
def packed_descriptors(draw: st.DrawFn) -> dict[str, bytes]:
    from safetensors.torch import load, save

    tree = copy.deepcopy(SEED_TREE)
    tensors = load(SEED_FILES["data.safetensors"])
    ref = draw(st.sampled_from(sorted(tensors)))
    info = {"codec": draw(st.sampled_from(["zstd", "zstd", "lz4", 3])),
            "dtype": draw(st.sampled_from(["uint8", "int32", "int64", "bool", "float16", "complex64", "nn"])),
            "shape": draw(st.lists(st.integers(-2, 2**40) | st.integers(0, 70_000), max_size=3))}
    tree.setdefault("packed", {})[ref] = info
    frame = draw(st.sampled_from(["real", "truncated", "flipped", "foreign", "garbage"]))
    raw = tensors[ref].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes() if tensors[ref].numel() else b""
    if frame == "truncated":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif frame == "flipped" and raw:
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:]
    elif frame == "foreign":
        raw = _FRAME
    elif frame == "garbage":
        raw = draw(st.binary(max_size=64))
    tensors[ref] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return {"data.safetensors": save(tensors), "data.json": json.dumps(tree).encode()}


def _text(s: str) -> bytes:
    raw = s.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


_GLOBALS = [("numpy", "dtype"), ("numpy", "ndarray"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "scalar"), ("numpy._core.numeric", "_frombuffer"),
            ("verl.protocol", "DataProto"), ("collections", "OrderedDict"), ("builtins", "complex")]
_TOKENS = st.one_of(
    st.sampled_from([b"N", b"\x88", b"\x89", b")", b"]", b"}", b"(", b"t", b"\x85", b"\x86", b"\x87", b"R", b"b",
                     b"\x94", b"a", b"e", b"s", b"u", b"\x81", b"0", b"2", b"l", b"d"]),
    st.integers(0, 255).map(lambda i: b"K" + bytes([i])),
    st.integers(-(2**31), 2**31 - 1).map(lambda i: b"J" + i.to_bytes(4, "little", signed=True)),
    st.integers(0, 40).map(lambda i: b"h" + bytes([i])),
    st.integers(0, 2**32 - 1).map(lambda i: b"r" + i.to_bytes(4, "little")),
    st.sampled_from(["i8", "O8", "U3", "S2", "b1", "f4", "c16", "V8", "M8", "<", ">", "|", "O", "C"]).map(_text),
    st.binary(max_size=24).map(lambda b: b"C" + bytes([len(b)]) + b),
    st.sampled_from(_GLOBALS).map(lambda g: _text(g[0]) + _text(g[1]) + b"\x93"),
)


@st.composite
def pickle_programs(draw: st.DrawFn) -> dict[str, bytes]:
    body = b"".join(draw(st.lists(_TOKENS, max_size=40)))
    return {"gen_batch.dp": b"\x80\x04" + body + b"."}


def _damaged(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at: at + draw(st.integers(1, 16))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@st.composite
def damaged_dataprotos(draw: st.DrawFn) -> dict[str, bytes]:
    return {"gen_batch.dp": _damaged(draw, SEED_DP)}


@st.composite
def damaged_v1_payloads(draw: st.DrawFn) -> dict[str, bytes]:
    return {"tq_batch.pt": _damaged(draw, SEED_V1)}


def _collect(strategy: st.SearchStrategy[dict[str, bytes]], examples: int) -> list[dict[str, bytes]]:
    found: list[dict[str, bytes]] = []

    @settings(FUZZ, max_examples=examples)
    @given(files=strategy)
    def collect(files: dict[str, bytes]) -> None:
        found.append(files)

    collect()
    return found


def test_seed_entries_decode() -> None:
    assert SafeFormat().decode(dict(SEED_FILES)).batch["input_ids"].shape == (4, 40)
    assert VerlFormat().decode({"gen_batch.dp": SEED_DP}).batch["input_ids"].shape == (4, 40)
    assert VerlTqFormat().decode({"tq_batch.pt": SEED_V1})["tensordict"]["input_ids"].shape == (4, 40)
    assert set(SEED_TREE.get("packed", {})), "the seed must exercise zstd packing"


def test_fuzzed_entries_end_in_a_value_or_a_typed_error() -> None:
    groups = {
        "data.json trees": ("safe", _collect(mutated_trees(), 250)),
        "packed descriptors": ("safe", _collect(packed_descriptors(), 120)),
        "pickle programs": ("verl", _collect(pickle_programs(), 250)),
        "damaged gen_batch.dp": ("verl", _collect(damaged_dataprotos(), 120)),
        "damaged tq_batch.pt": ("verl-tq", _collect(damaged_v1_payloads(), 100)),
    }
    cases: list[tuple[str, dict[str, bytes]]] = []
    labels: list[str] = []
    for label, (fmt, found) in groups.items():
        assert len(found) >= 50, (label, len(found))
        cases += [(fmt, files) for files in found]
        labels += [label] * len(found)
    report = decode_isolated(cases, headroom=DECODE_FLOOR + (768 << 20), timeout=20)
    crashed = None if report.crashed_on is None else (labels[report.crashed_on], cases[report.crashed_on])
    assert report.returncode == 0, (report.returncode, crashed, report.stderr)
    assert len(report.outcomes) == len(cases)
    bad = [(labels[i], o) for i, o in enumerate(report.outcomes) if o.outcome not in ACCEPTED]
    assert not bad, bad[:5]
    # every entry here is under 200 KB: the bound allows 256 MiB + 256 x its size; none comes near it
    assert max(o.peak for o in report.outcomes) < DECODE_FLOOR + (64 << 20)
    seen = {o.outcome for o in report.outcomes}
    assert {"value", "CorruptEntryError"} <= seen, seen  # the fuzzing reaches both ends
