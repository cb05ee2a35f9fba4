"""How ``trl_generate`` stores a generation call's result and digests its prompts.

The result, ``(completion_ids, logprobs)`` (ragged token ids, log-probs with ``None`` holes), is
stored as it is: ``format: safe`` packs such rows into tensors itself. Entries written before
that hold the integration's own packing (a dict of values / offsets / missing tensors); they are
still read, and such a pack that does not describe rows is unreadable, never a crash. The prompt
digest of a call's ``prompt_ids`` is the one those older entries recorded.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

pytest.importorskip("trl")

from stepskip.errors import UnreadableEntryError  # noqa: E402
from stepskip._fidelity import prompt_digest  # noqa: E402
from stepskip._formats import get_format  # noqa: E402
from stepskip.integrations.trl import _PACKED, _prompts_of_call, _unpack_generation  # noqa: E402


def through_safe(value):
    codec = get_format("safe", compress="auto")
    files = codec.encode(codec.freeze(value, copy=True))
    return codec.decode(files), json.loads(files["data.json"])


def legacy_rows(rows, dtype, holes):
    """The integration's own packing of ragged rows, as entries written before format safe packed rows hold it."""
    offsets = torch.tensor([0, *itertools.accumulate(map(len, rows))], dtype=torch.int64)
    flat = list(itertools.chain.from_iterable(rows))
    packed = {"offsets": offsets}
    if holes:
        packed["missing"] = torch.tensor([v is None for v in flat], dtype=torch.bool)
        flat = [0.0 if v is None else v for v in flat]
    packed["values"] = torch.tensor(flat, dtype=dtype)
    return packed


def legacy_generation(ids, logprobs):
    return {"kind": _PACKED, "completion_ids": legacy_rows(ids, torch.int64, False),
            "logprobs": None if logprobs is None else legacy_rows(logprobs, torch.float64, True)}


RESULTS = [
    ([[5, 6, 7] * 30, [], [2**40]], None),
    ([list(range(50)), list(range(40))], [[-0.5, None] * 25, [float.fromhex("0x1.fffffffffffffp-1")] * 40]),
    ([], None),
    ([[0]], [[-0.0]]),
]


def signs(rows):
    return [[math.copysign(1, v) if v is not None else None for v in row] for row in rows]


@pytest.mark.parametrize("result", RESULTS)
def test_a_call_result_is_stored_as_it_is_and_comes_back_bit_for_bit(result):
    back, tree = through_safe(result)
    assert _unpack_generation(back, "entry") == result
    assert type(back) is tuple
    if result[1]:
        assert signs(back[1]) == signs(result[1])
    if sum(map(len, result[0])) >= 64:
        assert '"__t": "rows"' in json.dumps(tree)  # packed by format safe, not JSON lists


@pytest.mark.parametrize("result", RESULTS)
def test_entries_with_the_integrations_own_packing_are_still_read(result):
    back, _ = through_safe(legacy_generation(*result))
    assert isinstance(back["completion_ids"]["values"], torch.Tensor)
    unpacked = _unpack_generation(back, "entry")
    assert unpacked == result
    if result[1]:
        assert signs(unpacked[1]) == signs(result[1])


def test_values_that_are_not_the_old_packing_are_returned_as_they_are():
    for value in ({"x": 1}, ([1, 2], None), ([[1]], "not logprobs"), {"kind": "other"}):
        assert _unpack_generation(value, "entry") is value


@pytest.mark.parametrize("damage", [
    lambda p: p["completion_ids"].update(offsets=torch.tensor([0, 5, 2, 3])),   # out of order
    lambda p: p["completion_ids"].update(offsets=torch.tensor([0, 1, 2, 99])),  # past the values
    lambda p: p["completion_ids"].update(offsets=torch.tensor([0.0, 3.0])),     # wrong dtype
    lambda p: p["completion_ids"].pop("values"),
    lambda p: p["logprobs"].update(missing=torch.zeros(1, dtype=torch.bool)),   # mask of another shape
    lambda p: p.update(completion_ids=[1, 2, 3]),
])
def test_an_old_pack_that_does_not_describe_rows_is_unreadable_not_a_crash(damage):
    packed = legacy_generation([[1, 2], [3], []], [[0.1, None], [0.2], []])
    damage(packed)
    with pytest.raises(UnreadableEntryError, match="cannot unpack"):
        _unpack_generation(packed, "entry")


def test_the_prompt_digest_of_a_call_covers_row_boundaries_and_matches_older_entries():
    """Older entries recorded the digest of ``[rows, row lengths..., ids...]`` as an int64 tensor; the
    digest of the call's rows themselves is that one, so their prompt check keeps working."""
    prompt_ids = [[1, 2], [3], [], [4, 5, 6]]
    digest = prompt_digest(_prompts_of_call(object(), prompt_ids, None, None, 4))
    older = torch.tensor([4, 2, 1, 0, 3, 1, 2, 3, 4, 5, 6], dtype=torch.int64)
    assert digest == prompt_digest(older)
    assert digest == prompt_digest(_prompts_of_call(object(), prompt_ids=prompt_ids))
    assert prompt_digest([[1, 2], [3]]) != prompt_digest([[1], [2, 3]])
    assert prompt_digest([[1, 2], [3]]) != prompt_digest([[1, 2], [4]])
