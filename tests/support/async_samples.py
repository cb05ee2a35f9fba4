"""One-sample calls of the fully async role, as the async tests make them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from stepskip import Batch, SkipManager


def sample_prompts(index: int) -> Batch:
    """The prompts of feed index ``index`` (its uid names it)."""
    return Batch.from_dict(tensors={"input_ids": torch.arange(8).reshape(1, 8)},
                           non_tensors={"uid": [f"uid_sample_0_{index}"]})


def rollouter(output: Callable[[int], Batch]) -> Callable[[Batch], Batch]:
    """A decorated ``generate_sequences_single`` whose result for feed index ``i`` is ``output(i)``."""

    class Rollouter:
        @SkipManager.annotate(role="async_rollout")
        def generate_sequences_single(self, prompts: Batch) -> Batch:
            return output(int(str(prompts.non_tensor_batch["uid"][0]).rsplit("_", 1)[1]))

    return Rollouter().generate_sequences_single
