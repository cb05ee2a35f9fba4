"""The comparison behind ``action: compare`` and ``stepskip rerun`` (stepskip._compare): pure, field by field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from stepskip import Batch
from stepskip._compare import Tolerance, columns_of, compare_values
from stepskip.testing import make_rollout_batch


def rollout(responses: list[list[int]], mask: list[list[int]]) -> Batch:
    return Batch.from_dict(tensors={"responses": torch.tensor(responses), "response_mask": torch.tensor(mask)},
                           non_tensors={"uid": [f"u{i}" for i in range(len(responses))]})


def test_identical_batches_match_everywhere():
    batch = make_rollout_batch(8, 16, 24, n=4)
    drift = compare_values(batch, make_rollout_batch(8, 16, 24, n=4), exclude=["uid"])
    assert drift.passed and drift.token_match == 1.0 and drift.prompts_equal is None
    assert {"responses", "input_ids", "rollout_log_probs", "messages"} <= set(drift.fields)
    assert all(f.match == 1.0 and f.first_row is None for f in drift.fields.values())
    assert drift.fields["rollout_log_probs"].kind == "float" and drift.fields["responses"].kind == "tokens"
    assert drift.fields["messages"].kind == "values"


def test_token_match_is_per_row_over_the_valid_positions_then_the_batch_mean():
    recorded = rollout([[5, 6, 7, 0], [5, 5, 0, 0]], [[1, 1, 1, 0], [1, 1, 0, 0]])
    # padding differs (a position no mask marks): not counted; row 0 differs in 1 of its 3 tokens
    live = rollout([[5, 6, 8, 9], [5, 5, 0, 3]], [[1, 1, 1, 0], [1, 1, 0, 0]])
    drift = compare_values(recorded, live, exclude=["uid"])
    responses = drift.fields["responses"]
    assert responses.row_match == pytest.approx([2 / 3, 1.0])
    assert responses.match == pytest.approx((2 / 3 + 1.0) / 2)
    assert drift.token_match == pytest.approx(5 / 6)
    assert drift.row_token_match == pytest.approx([2 / 3, 1.0])
    assert responses.first_row == 0 and responses.examples[0] == {"row": 0, "recorded": [5, 6, 7], "live": [5, 6, 8]}
    assert drift.worst.name == "responses" and not drift.passed  # 0.833 < 0.9


def test_a_position_valid_on_one_side_only_is_a_mismatch():
    recorded = rollout([[5, 6, 0, 0]], [[1, 1, 0, 0]])
    live = rollout([[5, 6, 7, 8]], [[1, 1, 1, 1]])  # the live response ran on: 2 of 4 valid positions agree
    assert compare_values(recorded, live, exclude=["uid"]).fields["responses"].match == pytest.approx(0.5)


def test_min_match_decides_passing():
    recorded = rollout([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], [[1] * 10])
    live = rollout([[1, 2, 3, 4, 5, 6, 7, 8, 9, 0]], [[1] * 10])
    assert compare_values(recorded, live, exclude=["uid"]).passed  # 0.9 reaches the default 0.9
    assert not compare_values(recorded, live, Tolerance(min_match=0.95), exclude=["uid"]).passed


def test_float_fields_count_the_share_within_tolerance_and_the_deltas():
    recorded = {"old_log_probs": torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])}
    live = {"old_log_probs": torch.tensor([[-1.0, -2.0 + 1e-7], [-3.5, -4.0]])}
    f = compare_values(recorded, live).fields["old_log_probs"]
    assert f.kind == "float" and f.match == 0.75 and f.first_row == 1
    assert f.max_delta == pytest.approx(0.5) and f.mean_delta == pytest.approx(0.5 / 4, rel=1e-3)
    loose = compare_values(recorded, live, Tolerance(atol=0.6)).fields["old_log_probs"]
    assert loose.match == 1.0 and loose.first_row is None


def test_nan_equals_nan_and_differs_from_a_number():
    drift = compare_values(torch.tensor([math.nan, 1.0, math.nan]), torch.tensor([math.nan, 1.0, 0.0]))
    f = drift.fields["value"]
    assert f.match == pytest.approx(2 / 3) and f.first_row == 2  # the NaN row 0 is equal, row 2 is not
    assert f.max_delta is not None and math.isinf(f.max_delta)  # a number against NaN: as far off as can be
    record = drift.as_record()
    json.dumps(record, allow_nan=False)  # no NaN or infinity in a record
    assert record["fields"]["value"]["max_delta"] is None and record["fields"]["value"]["row_match"] == [1.0, 1.0, 0.0]


def test_non_tensor_columns_count_equal_rows():
    a = Batch.from_dict(non_tensors={"text": ["x", "y", "z", "w"], "uid": ["a", "b", "c", "d"]})
    b = Batch.from_dict(non_tensors={"text": ["x", "y", "q", "w"], "uid": ["1", "2", "3", "4"]})
    drift = compare_values(a, b, exclude=["uid"])
    assert set(drift.fields) == {"text"}  # identity columns differ by design: left out
    assert drift.fields["text"].match == 0.75 and drift.fields["text"].first_row == 2
    assert compare_values(a, b).fields["uid"].match == 0.0


def test_jagged_rows_and_ragged_lists_compare_row_by_row():
    nested = torch.nested.as_nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4])], layout=torch.jagged)
    other = torch.nested.as_nested_tensor([torch.tensor([1, 2, 9]), torch.tensor([4])], layout=torch.jagged)
    recorded = TensorDict({"responses": nested}, batch_size=[2])
    live = TensorDict({"responses": other}, batch_size=[2])
    assert compare_values(recorded, live).fields["responses"].row_match == pytest.approx([2 / 3, 1.0])
    # TRL's (completion_ids, logprobs): ragged lists of numbers
    drift = compare_values(([[1, 2, 3], [4]], [[-0.1, -0.2, -0.3], [-0.4]]),
                           ([[1, 2, 3], [4, 5]], [[-0.1, -0.2, -0.3], [-0.4, -0.5]]))
    assert drift.fields["0"].kind == "tokens" and drift.fields["0"].row_match == pytest.approx([1.0, 0.5])
    assert drift.fields["1"].kind == "float" and drift.fields["1"].match == pytest.approx(4 / 5)


def test_other_row_counts_are_noted_and_count_against_the_field():
    drift = compare_values({"x": torch.tensor([1, 2, 3])}, {"x": torch.tensor([1, 2])})
    assert drift.fields["x"].match == pytest.approx(2 / 3) and "3 recorded rows, 2 live" in drift.fields["x"].note


def test_columns_on_one_side_are_listed_not_judged():
    drift = compare_values({"a": torch.tensor([1]), "b": torch.tensor([2])}, {"a": torch.tensor([1]), "c": [3]})
    assert drift.only_recorded == ["b"] and drift.only_live == ["c"] and drift.passed


def test_a_prompt_mismatch_fails_without_any_field_drifting():
    drift = compare_values(torch.tensor([1, 2]), torch.tensor([1, 2]), prompts_equal=False)
    assert not drift.passed and drift.drifted == [] and drift.as_record()["prompts_equal"] is False


def test_columns_of_opens_batches_tensordicts_and_mappings():
    td = TensorDict({"a": torch.zeros(2), "inner": TensorDict({"b": torch.ones(2)}, batch_size=[2])}, batch_size=[2])
    td.set("tags", NonTensorStack(NonTensorData(data="x", batch_size=[]), NonTensorData(data="y", batch_size=[]),
                                  batch_size=[2]))
    cols = columns_of({"tensordict": td, "keys": ["k0", "k1"]})
    assert set(cols) == {"tensordict.a", "tensordict.inner.b", "tensordict.tags", "keys"}
    assert cols["tensordict.tags"] == ["x", "y"]
    batch = Batch.from_dict(tensors={"t": torch.zeros(2)}, non_tensors={"n": ["p", "q"]}, meta_info={"timing": 1})
    assert set(columns_of(batch)) == {"t", "n"}  # meta_info (timings) is not a result


def test_the_record_is_json_ready_and_names_the_worst_field():
    a = make_rollout_batch(4, 8, 8, n=2)
    b = make_rollout_batch(4, 8, 8, n=2)
    b.batch["rollout_log_probs"][1, 0] += 3.0
    record = compare_values(a, b, exclude=["uid"]).as_record()
    json.dumps(record, allow_nan=False)
    assert record["worst_field"] == "rollout_log_probs" and record["worst_kind"] == "float"
    assert record["worst_delta"] == pytest.approx(3.0) and record["first_row"] == 1
    mask = a.batch["response_mask"]
    assert mask[1, 0] == 1  # a valid position: one of the response_mask's elements differs
    assert np.isclose(record["worst_match"], 1 - 1 / int(mask.sum()))
    assert record["drifted_fields"] == [] and record["passed"]
