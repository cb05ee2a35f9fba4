"""GRPO: group-normalised advantages and a clipped policy-gradient update.

Each prompt is sampled ``n`` times; a response's advantage is its score minus the mean score of
its group (the rows sharing its ``uid``), divided by the group's standard deviation. The actor
minimises PPO's clipped surrogate over mini-batches, token-mean aggregated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stepskip.pipelines.policy import TinyPolicy

__all__ = ["grpo_advantages", "clipped_policy_loss", "ActorConfig", "Actor"]


def grpo_advantages(scores: torch.Tensor, group_ids: Sequence[Any], norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Per-row advantages normalised within each group of rows sharing a group id.

    Args:
        scores: ``[rows]`` sequence scores.
        group_ids: one id per row (the prompt's ``uid``).
        norm_by_std: divide by the group's standard deviation (GRPO); else only centre (Dr. GRPO).
        eps: added to the standard deviation.

    Returns:
        ``[rows]`` advantages; 0 for a group of one.

    Example:
        >>> [round(a, 4) for a in grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), ["a", "a", "b", "b"]).tolist()]
        [0.7071, -0.7071, 0.0, 0.0]
    """
    groups: dict[Any, list[int]] = {}
    for row, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(row)
    advantages = torch.zeros_like(scores, dtype=torch.float32)
    for rows in groups.values():
        index = torch.tensor(rows)
        group = scores[index].float()
        if len(rows) < 2:
            continue
        centred = group - group.mean()
        advantages[index] = centred / (group.std() + eps) if norm_by_std else centred
    return advantages


def clipped_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, clip_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, token-mean over ``mask``.

    Args:
        log_probs: ``[rows, T]`` current log-probs (with gradients).
        old_log_probs: ``[rows, T]`` log-probs of the policy that sampled the responses.
        advantages: ``[rows]`` sequence advantages, broadcast over tokens.
        mask: ``[rows, T]`` 1 on response tokens.
        clip_ratio: epsilon of the clip.

    Returns:
        The loss and the fraction of tokens whose ratio was clipped.
    """
    mask = mask.float()
    ratio = torch.exp(log_probs - old_log_probs)
    adv = advantages.unsqueeze(1)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    per_token = torch.maximum(unclipped, clipped)
    tokens = mask.sum().clamp_min(1.0)
    loss = (per_token * mask).sum() / tokens
    clipfrac = ((clipped > unclipped).float() * mask).sum() / tokens
    return loss, clipfrac.detach()


@dataclass(frozen=True)
class ActorConfig:
    """``actor_rollout_ref.actor``: optimiser and PPO settings.

    Args:
        lr: AdamW learning rate.
        clip_ratio: PPO clip epsilon.
        ppo_mini_batch_size: prompts per mini-batch (each prompt contributes ``n`` rows).
        ppo_epochs: passes over the batch.
        grad_clip: max gradient norm.
    """

    lr: float = 1e-3
    clip_ratio: float = 0.2
    ppo_mini_batch_size: int = 2
    ppo_epochs: int = 1
    grad_clip: float = 1.0

    @classmethod
    def from_config(cls, section: Any) -> ActorConfig:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: section[k] for k in section.keys() if k in names})


class Actor:
    """Updates a :class:`TinyPolicy` with the clipped policy gradient.

    Args:
        policy: the trained policy.
        config: optimiser and PPO settings.
        n: responses per prompt (mini-batches hold ``ppo_mini_batch_size * n`` rows).
        temperature: the rollout temperature (log-probs are computed at it).
    """

    def __init__(self, policy: TinyPolicy, config: ActorConfig, n: int, temperature: float = 1.0) -> None:
        self.policy, self.config, self.n, self.temperature = policy, config, n, temperature
        self.optimizer = torch.optim.AdamW(policy.model.parameters(), lr=config.lr, weight_decay=0.0)

    def update(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor,
               old_log_probs: torch.Tensor, advantages: torch.Tensor) -> dict[str, float]:
        """One PPO update over the batch, mini-batch by mini-batch, in row order.

        Returns:
            ``loss`` (mean over mini-batches), ``clipfrac`` and ``grad_norm``.
        """
        rows = prompts.size(0)
        step_rows = max(1, self.config.ppo_mini_batch_size * self.n)
        losses, clipfracs, norms = [], [], []
        self.policy.model.train()
        for _ in range(self.config.ppo_epochs):
            for start in range(0, rows, step_rows):
                part = slice(start, start + step_rows)
                log_probs = self.policy.log_probs(prompts[part], responses[part], self.temperature)
                loss, clipfrac = clipped_policy_loss(log_probs, old_log_probs[part], advantages[part],
                                                     response_mask[part], self.config.clip_ratio)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(self.policy.model.parameters(), self.config.grad_clip)
                self.optimizer.step()
                losses.append(float(loss.detach()))
                clipfracs.append(float(clipfrac))
                norms.append(float(norm))
        self.policy.model.eval()
        return {"loss": sum(losses) / len(losses), "clipfrac": sum(clipfracs) / len(clipfracs),
                "grad_norm": sum(norms) / len(norms)}
