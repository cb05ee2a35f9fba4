"""Storage formats: how a value becomes the files of an entry and back.

Which formats exist is written once, in :data:`stepskip._entries.FORMATS` (torch-free); this
package holds the codecs and imports each on first use.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from stepskip._entries import FORMATS, FileBytes

__all__ = ["Format", "get_format"]


class Format(Protocol):
    """A codec: what the roles and the store need from a format."""

    @property
    def name(self) -> str: ...

    @property
    def uses_pickle(self) -> bool: ...

    @property
    def files(self) -> tuple[str, ...]: ...

    def freeze(self, value: Any, copy: bool) -> Any: ...

    def encode(self, frozen: Any) -> dict[str, FileBytes]: ...

    def decode(self, files: Any, consume: bool = False, max_bytes: int | None = None) -> Any: ...


_CODECS: dict[str, Format] = {}


def get_format(name: str, compress: str | None = None) -> Format:
    """The codec of the format recorded as ``name``; the error lists the known ones.

    ``compress`` (``auto``, ``none``, ``zstd``) configures how ``safe`` writes; reading never needs it.

    Raises:
        ValueError: no format is registered as ``name``.
    """
    spec = FORMATS.get(name)
    if spec is None:
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
    codec = _CODECS.get(name)
    if codec is None:
        module, _, cls = spec.codec.partition(":")
        codec = _CODECS[name] = getattr(importlib.import_module(module), cls)()
    if compress is not None and getattr(codec, "compress", compress) != compress:
        return type(codec)(compress)  # type: ignore[call-arg]
    return codec
