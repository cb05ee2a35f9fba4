"""What every part of stepskip agrees on about entries: data file names and the format registry.

Free of heavy imports, so tools that only list, verify or prune caches start without torch; the
codecs themselves (:mod:`stepskip._formats`) are imported only when an entry is encoded or decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FileBytes", "GEN_BATCH_FILE", "TQ_BATCH_FILE", "FormatSpec", "FORMATS", "CONFIG_FORMATS", "format_spec",
    "storage_format", "legacy_format", "unsupported_format_message",
]

GEN_BATCH_FILE = "gen_batch.dp"  # rollout / async_rollout entries written by verl (a DataProto pickle)
TQ_BATCH_FILE = "tq_batch.pt"  # rollout_tq inner entries written by verl (torch.save of a V1 payload)

#: The bytes of one file of an entry as a format encodes it: ``bytes``, or a ``memoryview`` of
#: recycled memory (format ``safe``'s big tensor files, see :func:`stepskip._formats.st_small.save_pooled`).
FileBytes = bytes | memoryview


@dataclass(frozen=True)
class FormatSpec:
    """One storage format as recorded in an entry's ``meta.json`` (``"format": name``).

    Args:
        name: the name written into ``meta.json``.
        option: the value of the role option ``format`` that selects it.
        v1: True for the variant written for V1 (``rollout_tq``) inner entries.
        uses_pickle: its files are pickles, read only with ``allow_pickle: true``.
        files: its data files.
        codec: ``module:Class`` of the codec, imported on first use.
    """

    name: str
    option: str
    v1: bool
    uses_pickle: bool
    files: tuple[str, ...]
    codec: str


#: Every format this stepskip reads and writes, by the name entries record.
FORMATS: dict[str, FormatSpec] = {
    spec.name: spec
    for spec in (
        FormatSpec("safe", "safe", False, False, ("data.safetensors", "data.json"), "stepskip._formats.safe:SafeFormat"),
        FormatSpec("verl", "verl", False, True, (GEN_BATCH_FILE,), "stepskip._formats.verl:VerlFormat"),
        FormatSpec("verl-tq", "verl", True, True, (TQ_BATCH_FILE,), "stepskip._formats.verl:VerlTqFormat"),
    )
}

#: The values the role option ``format`` accepts.
CONFIG_FORMATS: tuple[str, ...] = tuple(dict.fromkeys(spec.option for spec in FORMATS.values()))


def format_spec(name: object) -> FormatSpec | None:
    """The registered format recorded as ``name``, or None when this stepskip does not know it."""
    return FORMATS.get(name) if isinstance(name, str) else None


def storage_format(option: str, v1: bool) -> FormatSpec:
    """The format written for the role option ``format: option`` (``v1``: for V1 inner entries).

    Raises:
        ValueError: no format answers to ``option``.

    Example:
        >>> storage_format("verl", v1=True).name
        'verl-tq'
    """
    for spec in FORMATS.values():
        if spec.option == option and spec.v1 == v1:
            return spec
    for spec in FORMATS.values():
        if spec.option == option and not spec.uses_pickle:
            return spec  # formats without a V1 variant store V1 payloads as they are
    raise ValueError(f"unknown format {option!r}; known formats: {', '.join(CONFIG_FORMATS)}")


def legacy_format(v1: bool) -> FormatSpec:
    """The format of entries verl itself wrote (their ``meta.json`` names none)."""
    return storage_format("verl", v1)


def unsupported_format_message(path: str, name: object) -> str:
    """Why an entry of an unknown format is left alone, and what to do about it."""
    return (
        f"{path} is in format {name!r}, which this stepskip does not support (written by a newer stepskip?); "
        f"known formats: {', '.join(FORMATS)}. Upgrade stepskip to read it, or re-record the step with "
        "action: record; the entry was left untouched"
    )
