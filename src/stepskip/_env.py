"""Settings read from the environment at import (byte sizes such as ``STEPSKIP_KEEP_BYTES``)."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("stepskip")


def env_bytes(name: str, default: int, example: str, fallback: str) -> int:
    """The byte count in environment variable ``name`` (``default`` when unset or blank; a negative
    one counts as 0). A value that is not a number is logged, naming ``example`` (how to write it)
    and ``fallback`` (what is done instead), and gives ``default``.

    Example:
        >>> env_bytes("STEPSKIP_UNSET_EXAMPLE", 4096, "e.g. 4096", "using 4 KiB")
        4096
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return max(0, int(text))
    except ValueError:
        logger.warning("%s=%r is not a number of bytes (%s); %s", name, text[:40], example, fallback)
        return default
