"""How ``trl_generate`` stores a generation call's result: ragged token ids and log-probs (``None``
holes included) as packed tensors through ``format: safe``, back bit for bit; hostile packs refused."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")

from stepskip.errors import UnreadableEntryError  # noqa: E402
from stepskip.formats import get_format  # noqa: E402
from stepskip.integrations.trl import _pack_generation, _pack_prompts, _unpack_generation  # noqa: E402


def through_safe(value):
    codec = get_format("safe", compress="auto")
    return codec.decode(codec.encode(codec.freeze(value, copy=True)))


@pytest.mark.parametrize("result", [
    ([[5, 6, 7], [], [2**40]], None),
    ([[1, 2], [3]], [[-0.5, None], [float.fromhex("0x1.fffffffffffffp-1")]]),
    ([], None),
    ([[0]], [[-0.0]]),
])
def test_a_call_result_comes_back_bit_for_bit(result):
    stored = through_safe(_pack_generation(result))
    assert isinstance(stored["completion_ids"]["values"], torch.Tensor)  # tensors, not JSON lists
    back = _unpack_generation(stored, "entry")
    assert back == result
    if result[1]:
        assert [[math.copysign(1, v) if v is not None else None for v in row] for row in back[1]] == \
            [[math.copysign(1, v) if v is not None else None for v in row] for row in result[1]]


def test_values_that_are_not_a_generation_result_are_stored_as_they_are():
    for value in ({"x": 1}, ([1, 2], None), ([[1]], "not logprobs")):
        assert _pack_generation(value) is value
        assert _unpack_generation(value, "entry") is value


@pytest.mark.parametrize("damage", [
    lambda p: p["completion_ids"].update(offsets=torch.tensor([0, 5, 2, 3])),   # out of order
    lambda p: p["completion_ids"].update(offsets=torch.tensor([0, 1, 2, 99])),  # past the values
    lambda p: p["completion_ids"].update(offsets=torch.tensor([0.0, 3.0])),     # wrong dtype
    lambda p: p["completion_ids"].pop("values"),
    lambda p: p["logprobs"].update(missing=torch.zeros(1, dtype=torch.bool)),   # mask of another shape
    lambda p: p.update(completion_ids=[1, 2, 3]),
])
def test_a_pack_that_does_not_describe_rows_is_unreadable_not_a_crash(damage):
    packed = _pack_generation(([[1, 2], [3], []], [[0.1, None], [0.2], []]))
    damage(packed)
    with pytest.raises(UnreadableEntryError, match="cannot unpack"):
        _unpack_generation(packed, "entry")


def test_prompt_digest_input_covers_row_boundaries():
    assert not torch.equal(_pack_prompts([[1, 2], [3]]), _pack_prompts([[1], [2, 3]]))
    assert _pack_prompts("not rows") is None
