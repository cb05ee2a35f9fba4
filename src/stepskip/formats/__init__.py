"""Storage formats: how a value becomes the files of an entry and back."""

from __future__ import annotations

from typing import Any, Protocol

from stepskip.formats.safe import SafeFormat
from stepskip.formats.verl import VerlFormat, VerlTqFormat

__all__ = ["Format", "get_format", "SafeFormat", "VerlFormat", "VerlTqFormat"]


class Format(Protocol):
    """What the store needs from a format."""

    name: str
    uses_pickle: bool
    files: tuple[str, ...]

    def freeze(self, value: Any, copy: bool) -> Any: ...

    def encode(self, frozen: Any) -> dict[str, bytes]: ...

    def decode(self, files: Any, consume: bool = False) -> Any: ...


_FORMATS: dict[str, Format] = {"safe": SafeFormat(), "verl": VerlFormat(), "verl-tq": VerlTqFormat()}


def get_format(name: str, compress: str | None = None) -> Format:
    """The format registered as ``name``; the error lists the known ones.

    ``compress`` (``auto``, ``none``, ``zstd``) configures how ``safe`` writes; reading never needs it.
    """
    try:
        fmt = _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r}; known formats: {', '.join(_FORMATS)}") from None
    if compress is not None and isinstance(fmt, SafeFormat) and compress != fmt.compress:
        return SafeFormat(compress)
    return fmt
