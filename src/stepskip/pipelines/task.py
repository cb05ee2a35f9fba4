"""The synthetic, verifiable task and its seeded data pipeline.

*Counting*: a prompt is ``BOS`` followed by ``prompt_tokens`` consecutive symbols modulo
``num_symbols`` (``7 8 9 10``); the ideal response keeps counting (``11 12 13 ...``, wrapping
around). The reward of a response is the fraction of its ``response_length`` positions whose
token is the successor of the token before it (the prompt's last symbol for the first one), so
it is checkable exactly, dense enough for GRPO to improve visibly within tens of steps from a
random initialisation, and zero after an early EOS.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stepskip import Batch

__all__ = ["CountTask", "PromptDataset", "PromptLoader"]


@dataclass(frozen=True)
class CountTask:
    """Continue a count modulo ``num_symbols``.

    Args:
        num_symbols: distinct symbols; token ids ``first_symbol .. first_symbol + num_symbols - 1``.
        prompt_tokens: symbols in a prompt (after BOS).
        bos_token_id: prepended to every prompt.
        first_symbol: id of symbol 0 (the ids below are pad, BOS and EOS).

    Example:
        >>> task = CountTask(num_symbols=16, prompt_tokens=4)
        >>> task.prompt(14)
        [1, 17, 18, 3, 4]
        >>> round(float(task.score(torch.tensor([task.prompt(14)]), torch.tensor([[5, 6, 9]]), torch.ones(1, 3))), 4)
        0.6667
    """

    num_symbols: int = 16
    prompt_tokens: int = 4
    bos_token_id: int = 1
    first_symbol: int = 3

    @classmethod
    def from_config(cls, section: Any) -> CountTask:
        """Build from the ``task`` section of a pipeline config."""
        return cls(num_symbols=int(section.num_symbols), prompt_tokens=int(section.prompt_tokens))

    @property
    def vocab_size(self) -> int:
        """Tokens the model needs: pad, BOS, EOS and the symbols."""
        return self.first_symbol + self.num_symbols

    @property
    def prompt_length(self) -> int:
        """Tokens in a prompt, BOS included."""
        return 1 + self.prompt_tokens

    def prompt(self, start: int) -> list[int]:
        """The prompt whose first symbol is ``start``."""
        return [self.bos_token_id] + [self.first_symbol + (start + i) % self.num_symbols
                                      for i in range(self.prompt_tokens)]

    def score(self, prompts: torch.Tensor, responses: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """Fraction of response positions that continue the count correctly, per row.

        Args:
            prompts: ``[rows, prompt_length]`` token ids.
            responses: ``[rows, response_length]`` token ids.
            response_mask: 1 on generated tokens.

        Returns:
            ``[rows]`` float scores in ``[0, 1]``.
        """
        previous = torch.cat([prompts[:, -1:], responses[:, :-1]], dim=1) - self.first_symbol
        current = responses - self.first_symbol
        is_symbol = (current >= 0) & (current < self.num_symbols) & (previous >= 0) & (previous < self.num_symbols)
        correct = is_symbol & (current == (previous + 1) % self.num_symbols) & response_mask.bool()
        return correct.float().sum(dim=1) / responses.size(1)


class PromptDataset:
    """``size`` counting prompts whose start symbols are drawn from ``seed``.

    Example:
        >>> ds = PromptDataset(CountTask(), size=4, seed=0)
        >>> len(ds), ds[0]["input_ids"].shape
        (4, torch.Size([5]))
    """

    def __init__(self, task: CountTask, size: int, seed: int) -> None:
        self.task = task
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, task.num_symbols, (size,), generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": torch.tensor(self.task.prompt(self.starts[index])), "index": int(index)}

    def collate(self, indices: list[int]) -> Batch:
        """A prompt batch: ``input_ids`` plus the ``index`` and ``data_source`` columns."""
        items = [self[i] for i in indices]
        return Batch.from_dict(
            tensors={"input_ids": torch.stack([it["input_ids"] for it in items])},
            non_tensors={"index": np.array([it["index"] for it in items], dtype=object),
                         "data_source": np.array(["count"] * len(items), dtype=object)},
        )


class PromptLoader:
    """A seeded, epoch-shuffled loader of prompt batches (``drop_last``), like verl's StatefulDataLoader.

    The order of epoch ``e`` is a permutation drawn from ``seed + e``: two runs with one seed see
    the same batches in the same order, which is what replay needs.

    Args:
        dataset: the prompts.
        batch_size: prompts per batch.
        seed: shuffling seed.
        shuffle: shuffle each epoch (else dataset order).

    Example:
        >>> loader = PromptLoader(PromptDataset(CountTask(), 8, seed=0), batch_size=4, seed=0)
        >>> len(loader.next_batch()), loader.epoch, loader.position
        (4, 0, 4)
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if batch_size > len(dataset):
            raise ValueError(f"batch_size {batch_size} exceeds the dataset size {len(dataset)}")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        return torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __len__(self) -> int:
        return len(self.dataset) // self.batch_size

    def next_indices(self, count: int | None = None) -> list[int]:
        """The dataset indices of the next ``count`` prompts (default one batch), crossing epochs."""
        count = self.batch_size if count is None else count
        out: list[int] = []
        while len(out) < count:
            if self.position + 1 > len(self) * self.batch_size:
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def next_batch(self, count: int | None = None) -> Batch:
        """The next prompt batch."""
        return self.dataset.collate(self.next_indices(count))

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()
