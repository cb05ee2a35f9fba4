"""Synthetic rollout batches shaped like verl's, for tests and benchmarks.

``make_rollout_batch`` builds what ``generate_sequences`` returns in a GRPO run: left-padded
prompts, right-padded responses, their concatenation as ``input_ids``, the matching attention and
response masks, position ids that stop counting in the padding, masked float32 log-probs, and
per-row uids and chat messages. Real lengths are drawn between ``min_fill`` and 100 % of the
maximum, as in real rollouts.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from stepskip._batch import Batch

__all__ = ["make_rollout_batch"]


def make_rollout_batch(rows: int, prompt_len: int, response_len: int, n: int = 8, vocab: int = 151_936,
                       pad_id: int = 151_643, min_fill: float = 0.2, seed: int = 0) -> Batch:
    """A rollout batch of ``rows`` trajectories (``rows / n`` prompts, ``n`` samples each).

    Example:
        >>> batch = make_rollout_batch(16, 8, 12, n=4)
        >>> batch.batch["input_ids"].shape, batch.non_tensor_batch["uid"][:2].tolist() == [batch["uid"][0]] * 2
        (torch.Size([16, 20]), True)

    Raises:
        ValueError: a size below 1, or ``min_fill`` outside (0, 1].
    """
    for name, value in (("rows", rows), ("prompt_len", prompt_len), ("response_len", response_len), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"make_rollout_batch: {name} = {value!r}; expected an int of at least 1")
    if not 0 < min_fill <= 1:
        raise ValueError(f"make_rollout_batch: min_fill = {min_fill!r}; expected a share in (0, 1]")
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    prompt_real = torch.randint(max(1, int(min_fill * prompt_len)), prompt_len + 1, (rows // n + 1,), generator=gen)
    prompt_real = prompt_real.repeat_interleave(n)[:rows]  # the n samples of a prompt share it
    response_real = torch.randint(max(1, int(min_fill * response_len)), response_len + 1, (rows,), generator=gen)
    columns = torch.arange(prompt_len)
    prompt_mask = columns[None, :] >= (prompt_len - prompt_real)[:, None]
    response_mask = torch.arange(response_len)[None, :] < response_real[:, None]
    prompt_tokens = torch.randint(0, vocab - 1000, (rows // n + 1, prompt_len), generator=gen).repeat_interleave(n, 0)
    prompts = torch.where(prompt_mask, prompt_tokens[:rows], pad_id)
    responses = torch.where(response_mask, torch.randint(0, vocab - 1000, (rows, response_len), generator=gen), pad_id)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).to(torch.int64)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    log_probs = -torch.rand(rows, response_len, generator=gen) * 5 * response_mask
    groups = [uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | i).hex for i in range(rows // n + 1)]
    uids = np.array([groups[i // n] for i in range(rows)], dtype=object)
    messages = np.empty(rows, dtype=object)
    for i in range(rows):
        messages[i] = [{"role": "system", "content": "Solve the task."},
                       {"role": "user", "content": f"Question {i // n}: what is {i // n} + {2 * (i // n)}?"}]
    return Batch.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask.to(torch.int64),
            "rollout_log_probs": log_probs,
        },
        non_tensors={"uid": uids, "messages": messages,
                     "data_source": np.array(["synthetic/arith"] * rows, dtype=object)},
        meta_info={"timing": {"generate_sequences": 12.5}, "global_token_num": int(attention_mask.sum())},
    )
