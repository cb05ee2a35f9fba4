"""The reference pipelines' tokenizer: one character per token, built in code (nothing read, nothing downloaded).

The counting task's symbols are written as the digits and letters ``0 1 … 9 a b …``, so with the
default 16 symbols a prompt reads ``<s>789a`` and the ideal response ``bcdef0123…`` (counting in
hexadecimal). ``stepskip view``, ``report`` and ``show`` use it, without ``--tokenizer``, for entries
whose recorded fingerprint names the pipelines' model (:data:`MODEL_NAME`): a cache of
``stepskip demo`` reads as text.

Example:
    >>> tok = CharTokenizer()
    >>> tok.decode([1, 10, 11, 12, 13])
    '<s>789a'
    >>> tok.encode("<s>789a") == [1, 10, 11, 12, 13]
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ALPHABET", "MODEL_NAME", "CharTokenizer", "tokenizer_for"]

#: ``actor_rollout_ref.model.path`` of the reference pipelines (a name: no model is read from it).
MODEL_NAME = "stepskip/tiny-llama-random"
#: The characters of symbols 0, 1, 2 … (a task of more symbols than characters shows the rest as ``<id>``).
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class CharTokenizer:
    """Token ids to characters and back: special tokens as ``<pad>``, ``<s>``, ``</s>``, symbols as characters.

    It has the part of a Hugging Face tokenizer's interface that ``stepskip view`` and ``show`` use
    (:meth:`decode`), and :meth:`encode` for the other way.

    Args:
        pad_token_id, bos_token_id, eos_token_id: the special ids (the pipelines' model config).
        first_symbol: the id of symbol 0 (the counting task's ``first_symbol``).
        num_symbols: symbols in the vocabulary (at most ``len(ALPHABET)`` get a character).
    """

    def __init__(self, pad_token_id: int = 0, bos_token_id: int = 1, eos_token_id: int = 2, first_symbol: int = 3,
                 num_symbols: int = 16) -> None:
        self.pad_token_id, self.bos_token_id, self.eos_token_id = pad_token_id, bos_token_id, eos_token_id
        self.first_symbol, self.num_symbols = first_symbol, num_symbols
        self.special = {pad_token_id: "<pad>", bos_token_id: "<s>", eos_token_id: "</s>"}
        self._ids = {text: i for i, text in self.special.items()}
        self._ids.update({ALPHABET[k]: first_symbol + k for k in range(min(num_symbols, len(ALPHABET)))})

    @classmethod
    def from_config(cls, config: Any) -> CharTokenizer:
        """The tokenizer of a pipeline config (``actor_rollout_ref.model`` and ``task``)."""
        model = config.actor_rollout_ref.model
        return cls(int(model.pad_token_id), int(model.bos_token_id), int(model.eos_token_id),
                   num_symbols=int(config.task.num_symbols))

    @property
    def vocab_size(self) -> int:
        """Ids with a text of their own: the special tokens and the symbols."""
        return len(self._ids)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """One string per id; an id outside the vocabulary is written ``<id>``."""
        out = []
        for i in ids:
            i = int(i)
            k = i - self.first_symbol
            if i in self.special:
                out.append(self.special[i])
            elif 0 <= k < min(self.num_symbols, len(ALPHABET)):
                out.append(ALPHABET[k])
            else:
                out.append(f"<{i}>")
        return out

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (without ``<pad>``, ``<s>`` and ``</s>`` when ``skip_special_tokens``)."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special]
        return "".join(self.convert_ids_to_tokens(ids))

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``: special tokens by name, every other character on its own.

        Raises:
            ValueError: a character that is no symbol of the vocabulary.
        """
        out: list[int] = []
        pos = 0
        while pos < len(text):
            special = next((s for s in self.special.values() if text.startswith(s, pos)), None)
            piece = special or text[pos]
            if piece not in self._ids:
                raise ValueError(f"{piece!r} (position {pos}) is not in the vocabulary: "
                                 f"{''.join(ALPHABET[:self.num_symbols])} and {', '.join(self.special.values())}")
            out.append(self._ids[piece])
            pos += len(piece)
        return out


def tokenizer_for(fingerprint: Mapping[str, Any] | None) -> CharTokenizer | None:
    """The tokenizer of an entry recorded by the reference pipelines (its fingerprint names :data:`MODEL_NAME`),
    else None: other models' tokenizers are never guessed here (``stepskip view`` loads one only from a local
    directory the fingerprint names, offline and without its code: :mod:`stepskip.view.tokens`).

    Example:
        >>> tokenizer_for({"actor_rollout_ref.model.path": MODEL_NAME}).decode([13, 14, 2])
        'ab</s>'
        >>> tokenizer_for({"actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B"}) is None
        True
    """
    if not isinstance(fingerprint, Mapping) or fingerprint.get("actor_rollout_ref.model.path") != MODEL_NAME:
        return None
    return CharTokenizer(num_symbols=len(ALPHABET))  # the recorded task's size is not known: every symbol
