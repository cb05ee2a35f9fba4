"""``stepskip._matching.batches``'s row joins: batches join row-wise only when their columns agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from stepskip import Batch
from stepskip._matching.batches import concat_batches, join_problem


def rollout(rows: int, dtype: torch.dtype = torch.int64, **non_tensors) -> Batch:
    return Batch.from_dict(tensors={"responses": torch.arange(rows * 3, dtype=dtype).reshape(rows, 3)},
                           non_tensors={"uid": [f"u{i}" for i in range(rows)], **non_tensors})


def test_batches_of_the_same_columns_join_in_order():
    joined = concat_batches([rollout(2), rollout(1)])
    assert joined.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u0"]
    assert joined.batch["responses"][:, 0].tolist() == [0, 3, 0]
    assert join_problem([rollout(2), rollout(1)]) is None


def test_a_column_only_a_later_part_has_is_refused_not_dropped():
    with pytest.raises(ValueError, match=r"part 1 has the non-tensor columns \['score', 'uid'\], part 0 \['uid'\]"):
        concat_batches([rollout(2), rollout(1, score=[0.5])])
    assert "non-tensor columns" in join_problem([rollout(2), rollout(1, score=[0.5])])


def test_other_tensors_or_dtypes_are_refused_not_converted():
    with pytest.raises(ValueError, match=r"part 1's 'responses' is torch.int32, part 0's torch.int64"):
        concat_batches([rollout(2), rollout(1, dtype=torch.int32)])
    extra = Batch(batch=TensorDict({"responses": torch.zeros(1, 3, dtype=torch.int64), "mask": torch.ones(1, 3)},
                                   batch_size=[1]), non_tensor_batch={"uid": np.array(["x"], dtype=object)})
    with pytest.raises(ValueError, match=r"part 1 has the tensors \['mask', 'responses'\]"):
        concat_batches([rollout(2), extra])


def test_a_join_failing_for_another_reason_is_reported_not_raised():
    wide = Batch.from_dict(tensors={"responses": torch.zeros(1, 5, dtype=torch.int64)}, non_tensors={"uid": ["w"]})
    problem = join_problem([rollout(2), wide])  # another trailing shape: the tensor join itself fails
    assert problem is not None and problem.startswith("its columns cannot be joined with the others'")


def test_forgetting_an_entry_hands_its_prompts_back_to_the_others_recording_them():
    from stepskip._matching.batches import PromptIndex

    index = PromptIndex()
    index.add("run/3", 3, ["d", "d"])
    index.add("run/5", 5, ["d", "d"])  # the latest step serves d
    assert index.groups["d"] == ("run/5", [0, 1])
    index.add("run/5", 5, ["e", "e"])  # re-indexed (a stale hint corrected): d is run/3's again
    assert index.groups == {"d": ("run/3", [0, 1]), "e": ("run/5", [0, 1])}
    index.add("run/7", 7, ["d", "x", "d"])
    index.forget("run/7")
    assert index.groups["d"] == ("run/3", [0, 1]) and "x" not in index.groups
    index.forget("run/3")
    assert "d" not in index.groups and index.groups["e"] == ("run/5", [0, 1])


def test_prompt_index_breaks_a_tie_of_one_step_by_rank_before_the_order_added() -> None:
    from stepskip._matching.batches import PromptIndex

    index = PromptIndex()
    index.add("b/5", 5, ["p"], rank=(1, "b/5"))
    index.add("a/5", 5, ["p"], rank=(1, "a/5"))  # added later, ranked lower: b/5 keeps the prompt
    index.add("a/4", 4, ["p"], rank=(9, "a/4"))  # an earlier step never wins, whatever its rank
    assert index.groups["p"][0] == "b/5"
    index.forget("b/5")
    assert index.groups["p"][0] == "a/5"
    unranked = PromptIndex()
    unranked.add("b/5", 5, ["p"])
    unranked.add("a/5", 5, ["p"])
    assert unranked.groups["p"][0] == "a/5"  # no rank: the last added wins, as ever
