"""Per-token views of a step: the log-prob strip of one trajectory, and the tokenizer a run's fingerprint names.

A strip pairs each response token with its value in a per-token column (``rollout_log_probs``,
``old_log_probs`` ...), padding left out by the same mask that gives the response its length.

The tokenizer is looked for only where the recorded fingerprint names an absolute path of a local
directory holding a ``tokenizer.json``; it is loaded with transformers offline (``local_files_only``)
and never with code from the directory (``trust_remote_code=False``). A name of the Hugging Face Hub,
a relative path, a missing directory or one that fails to load leaves the token ids as they are.

Example:
    >>> strips = TokenStrips.of({"responses": torch.tensor([[5, 6, 0]]), "response_mask": torch.tensor([[1, 1, 0]]),
    ...                          "rollout_log_probs": torch.tensor([[-0.5, -2.0, 0.0]])})  # doctest: +SKIP
    >>> strips.strip(0, "rollout_log_probs")["tokens"]  # doctest: +SKIP
    [{'t': '5', 'v': -0.5}, {'t': '6', 'v': -2.0}]
"""

from __future__ import annotations

import logging
import math
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FINGERPRINT_TOKENIZER_KEYS", "LOGPROB_COLUMNS", "STRIP_LIMIT", "TokenStrips", "fingerprint_tokenizer"]

logger = logging.getLogger(__name__)

#: Per-token columns a strip can show, in the order they are offered.
LOGPROB_COLUMNS = ("rollout_log_probs", "old_log_probs", "ref_log_prob", "log_probs", "entropys")
#: Tokens one strip holds (a longer response is cut, and says so).
STRIP_LIMIT = 4096
#: Characters of one token's text.
TOKEN_TEXT_LIMIT = 64
#: Fingerprint keys that may name the run's tokenizer or model directory, the most specific first.
FINGERPRINT_TOKENIZER_KEYS = ("actor_rollout_ref.model.tokenizer_path", "actor_rollout_ref.model.path", "trl.model")
#: Files of a tokenizer directory transformers reads; each must be a regular file of bounded size.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "config.json", "generation_config.json")
_TOKENIZER_MAX_BYTES = 256 * 2**20
_MAX_DIR_ENTRIES = 10_000


@dataclass
class TokenStrips:
    """The response token ids and per-token columns of one step, row by row (padding removed when asked).

    Args:
        ids: each row's response tokens (a 1-D tensor).
        masks: each row's response mask, or None (every position is a token).
        columns: per-token column name -> each row's values, aligned with ``ids``.
    """

    ids: list[Any]
    masks: list[Any] | None
    columns: dict[str, list[Any]]

    @classmethod
    def of(cls, value: Any) -> TokenStrips | None:
        """The strips of a decoded step, or None when it has no responses or no per-token column."""
        from stepskip.cli.content import _get, _parts, _rows

        tensors, _ = _parts(value)
        ids = _rows(_get(tensors, "responses"))
        if not ids:
            return None
        masks = _rows(_get(tensors, "response_mask"))
        if masks is None and (attention := _rows(_get(tensors, "attention_mask"))) is not None \
                and len(attention) == len(ids) and all(a.shape[0] >= i.shape[0] for a, i in zip(attention, ids)):
            masks = [a[a.shape[0] - i.shape[0]:] for a, i in zip(attention, ids)]  # its response part
        if masks is not None and (len(masks) != len(ids) or any(m.shape != i.shape for m, i in zip(masks, ids))):
            masks = None
        columns = {}
        for name in LOGPROB_COLUMNS:
            rows = _rows(_get(tensors, name))
            if rows is not None and len(rows) == len(ids) and all(r.shape == i.shape for r, i in zip(rows, ids)) \
                    and rows[0].is_floating_point():
                columns[name] = rows
        return cls(ids, masks, columns) if columns else None

    def strip(self, row: int, column: str, tokenizer: Any = None) -> dict[str, Any]:
        """One row's tokens and values: ``tokens`` (``t`` the token's text or id, ``v`` its value or None),
        ``truncated``, and ``min``/``mean``/``max`` of the finite values.

        Raises:
            KeyError: no such column; IndexError: no such row.
        """
        values = self.columns[column]
        if not 0 <= row < len(self.ids):
            raise IndexError(row)
        ids, vals = self.ids[row], values[row]
        if self.masks is not None:
            keep = self.masks[row] != 0
            ids, vals = ids[keep], vals[keep]
        truncated = ids.shape[0] > STRIP_LIMIT
        id_list = [int(i) for i in ids[:STRIP_LIMIT].tolist()]
        numbers = [float(v) for v in vals[:STRIP_LIMIT].float().tolist()]
        tokens = [{"t": _token_text(i, tokenizer), "v": v if math.isfinite(v) else None}
                  for i, v in zip(id_list, numbers)]
        finite = [v for v in numbers if math.isfinite(v)]
        return {"tokens": tokens, "truncated": truncated, "count": int(ids.shape[0]),
                "min": min(finite) if finite else None, "max": max(finite) if finite else None,
                "mean": sum(finite) / len(finite) if finite else None}


def _token_text(token: int, tokenizer: Any) -> str:
    if tokenizer is None:
        return str(token)
    try:
        text = str(tokenizer.decode([token], skip_special_tokens=False))
    except Exception:  # an id outside the tokenizer's vocabulary: the id itself
        return str(token)
    return text if len(text) <= TOKEN_TEXT_LIMIT else text[:TOKEN_TEXT_LIMIT] + "…"


_loaded: dict[str, Any] = {}  # directory -> tokenizer (None: it did not load); loaded once per process
_loading = threading.Lock()


def _usable_dir(path: str) -> bool:
    """A directory with a ``tokenizer.json``, holding only files and directories (no FIFO or device a loader
    could hang on or read forever), whose tokenizer files are of bounded size."""
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            return False
        with os.scandir(path) as entries:
            names = [e.name for _, e in zip(range(_MAX_DIR_ENTRIES + 1), entries)]
        if len(names) > _MAX_DIR_ENTRIES or "tokenizer.json" not in names:
            return False
        total = 0
        for name in names:
            info = os.stat(os.path.join(path, name))  # through a link: what a loader would open
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                return False
            if name in _TOKENIZER_FILES:
                total += info.st_size
        return total <= _TOKENIZER_MAX_BYTES
    except (OSError, ValueError):
        return False


def fingerprint_tokenizer(fingerprint: Mapping[str, Any] | None) -> tuple[str, Any] | None:
    """The tokenizer a recorded fingerprint names as a local directory: ``(directory, tokenizer)``, else None.

    Only an absolute path of an existing directory holding ``tokenizer.json`` is tried, loaded offline
    without remote code; each directory is loaded once (a failure too, and it is logged once).

    Example:
        >>> fingerprint_tokenizer({"actor_rollout_ref.model.path": "Qwen/Qwen2.5-7B"}) is None  # a Hub name
        True
    """
    if not isinstance(fingerprint, Mapping):
        return None
    for key in FINGERPRINT_TOKENIZER_KEYS:
        path = fingerprint.get(key)
        if not isinstance(path, str) or not path.startswith("/") or len(path) > 4096 or "\x00" in path:
            continue
        path = os.path.normpath(path)
        with _loading:
            if path not in _loaded:
                _loaded[path] = _load(path) if _usable_dir(path) else None
            tokenizer = _loaded[path]
        if tokenizer is not None:
            return path, tokenizer
    return None


def _load(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # a third-party loader's boundary: any failure leaves the ids
        logger.warning("the run's fingerprint names the tokenizer %s, which does not load here (%s: %s): "
                       "token ids are shown; pass --tokenizer", path, type(err).__name__, err)
        return None
    logger.info("decoding text with the tokenizer at %s (named by the run's fingerprint)", path)
    return tokenizer
