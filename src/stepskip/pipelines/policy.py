"""The policy: a tiny causal LM built from a ``transformers`` config, sampling with per-token log-probs.

The model is a randomly initialised ``LlamaForCausalLM`` (no download: nothing is read from the
Hugging Face hub). :meth:`TinyPolicy.generate` decodes with a KV cache and an explicit
``torch.Generator``, so a rollout is reproducible from its seed alone — whatever other rollouts
were skipped, replayed or run in other threads — and returns the log-probability of every
sampled token under the sampling distribution. :meth:`TinyPolicy.log_probs` recomputes them
teacher-forced, with gradients, for the policy update.
"""

from __future__ import annotations

import copy
import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ModelSpec", "Rollout", "TinyPolicy"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the tiny model (``actor_rollout_ref.model`` in the pipelines' config).

    Args:
        vocab_size: tokens in the vocabulary (special ids included).
        hidden_size: width of the residual stream.
        num_hidden_layers: transformer blocks.
        num_attention_heads: attention heads per block.
        intermediate_size: MLP width.
        max_position_embeddings: longest prompt + response.
        pad_token_id: padding id (inside the vocabulary).
        bos_token_id: beginning-of-sequence id.
        eos_token_id: end-of-sequence id; a sampled EOS ends the response.
        init_seed: seed of the random initialisation.

    Example:
        >>> ModelSpec(vocab_size=19).hidden_size
        128
    """

    vocab_size: int
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    init_seed: int = 0

    @classmethod
    def from_config(cls, section: Any) -> ModelSpec:
        """Build from ``actor_rollout_ref.model`` (a mapping or OmegaConf node); unknown keys are ignored."""
        names = {f for f in cls.__dataclass_fields__}
        values = {k: section[k] for k in section.keys() if k in names}
        return cls(**{k: int(v) for k, v in values.items()})


@dataclass
class Rollout:
    """What :meth:`TinyPolicy.generate` returns, one row per prompt row.

    Attributes:
        responses: sampled token ids ``[rows, max_new_tokens]``; ``pad_token_id`` after an EOS.
        response_mask: 1 for generated tokens (the EOS included), 0 for padding.
        log_probs: log-probability of each sampled token under the sampling distribution (0 on padding).
    """

    responses: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor


class TinyPolicy:
    """A randomly initialised ``LlamaForCausalLM`` that samples and scores responses.

    Args:
        spec: the model shape.

    Example:
        >>> policy = TinyPolicy(ModelSpec(vocab_size=19, hidden_size=32, intermediate_size=64))
        >>> prompts = torch.tensor([[1, 3, 4, 5]])
        >>> out = policy.generate(prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
        >>> out.responses.shape, out.log_probs.shape
        (torch.Size([1, 6]), torch.Size([1, 6]))
    """

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        self.spec = spec
        hf_config = LlamaConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_attention_heads,
            max_position_embeddings=spec.max_position_embeddings,
            pad_token_id=spec.pad_token_id,
            bos_token_id=spec.bos_token_id,
            eos_token_id=spec.eos_token_id,
            tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):  # a seeded init that leaves the caller's RNG alone
            torch.manual_seed(spec.init_seed)
            self.model = LlamaForCausalLM(hf_config)
        self.model.eval()
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`; accept both generations of the API.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @classmethod
    def from_config(cls, section: Any) -> TinyPolicy:
        """Build from ``actor_rollout_ref.model``."""
        return cls(ModelSpec.from_config(section))

    def clone(self) -> TinyPolicy:
        """An independent copy (an inference engine holding its own weights)."""
        twin = copy.copy(self)
        twin.model = copy.deepcopy(self.model)
        return twin

    def state_dict(self) -> dict[str, torch.Tensor]:
        """A detached copy of the weights, safe to ship to another process."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load weights produced by :meth:`state_dict`."""
        self.model.load_state_dict(state)

    def _forward(self, input_ids: torch.Tensor, cache: Any = None, last_only: bool = False) -> Any:
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True, self._cache_kwarg: cache}
        if last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return out.logits[:, -1].float(), new_cache

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float,
                 generator: torch.Generator | None = None) -> Rollout:
        """Sample up to ``max_new_tokens`` tokens per row with a KV cache.

        Args:
            input_ids: prompts ``[rows, prompt_len]`` (equal lengths, no padding).
            max_new_tokens: response length; rows stop early at EOS.
            temperature: sampling temperature; ``0`` means greedy.
            generator: the random source of the sampling (reproducible rollouts).

        Returns:
            The responses, their mask and per-token log-probs.
        """
        rows = input_ids.size(0)
        eos, pad = self.spec.eos_token_id, self.spec.pad_token_id
        responses = torch.full((rows, max_new_tokens), pad, dtype=torch.long)
        log_probs = torch.zeros(rows, max_new_tokens)
        mask = torch.zeros(rows, max_new_tokens, dtype=torch.long)
        alive = torch.ones(rows, dtype=torch.bool)
        logits, cache = self._forward(input_ids, last_only=True)
        for t in range(max_new_tokens):
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, dim=-1)
                token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
            else:
                logp = torch.log_softmax(logits, dim=-1)
                token = logp.argmax(dim=-1)
            token = torch.where(alive, token, torch.full_like(token, pad))
            responses[:, t] = token
            log_probs[:, t] = torch.where(alive, logp.gather(1, token.unsqueeze(1)).squeeze(1), 0.0)
            mask[:, t] = alive.long()
            alive = alive & (token != eos)
            if not bool(alive.any()) or t == max_new_tokens - 1:
                break
            logits, cache = self._forward(token.unsqueeze(1), cache)
        return Rollout(responses=responses, response_mask=mask, log_probs=log_probs)

    def log_probs(self, input_ids: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Teacher-forced log-probs of ``responses`` given ``input_ids``, with gradients.

        Returns:
            ``[rows, response_len]`` log-probabilities (values on padding are meaningless: mask them).
        """
        sequence = torch.cat([input_ids, responses], dim=1)
        logits = self.model(input_ids=sequence, use_cache=False).logits
        logits = logits[:, input_ids.size(1) - 1:-1].float()
        if temperature > 0:
            logits = logits / temperature
        return torch.log_softmax(logits, dim=-1).gather(2, responses.unsqueeze(-1)).squeeze(-1)
