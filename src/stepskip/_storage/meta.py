"""What an entry's ``meta.json`` may hold, checked value by value; the names, bounds and checksums of a cache.

An entry is a directory holding data files and ``meta.json``, which lists every data file with its
size and xxh3-64 checksum. A cache may have been written by someone else, so a reader trusts
nothing in it: ``meta.json`` is bounded in size and depth and checked value by value
(:func:`check_meta`) before anything it says is used; file names are single path components
(:func:`valid_name`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import xxhash

from stepskip._entries import FileBytes

__all__ = [
    "META_FILE", "MANIFEST_FILE", "TMP_PREFIX", "TRASH_PREFIX", "STALE_SECONDS", "META_MAX_BYTES", "META_MAX_DEPTH",
    "MAX_INNER_ENTRIES", "GRACE_SECONDS", "NAME_MAX", "checksum", "nbytes", "contiguous", "valid_name", "show",
    "is_number", "bounded_int", "check_meta", "files_problem", "load_json", "parse_meta", "stored_name",
    "meta_bytes",
]

META_FILE = "meta.json"
#: A V1 step's manifest on object stores (:mod:`stepskip._manifest`): the one object that commits the step.
MANIFEST_FILE = "step.json"
#: Hidden names beside an entry: a writer's staging directory, an entry being deleted.
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
#: Seconds after which what an interrupted writer left counts as abandoned.
STALE_SECONDS = 3600.0
#: ``meta.json`` larger than this is damage (ours are a few KiB): parsing stays cheap and bounded.
META_MAX_BYTES = 1 << 20
#: Nesting deeper than this in ``meta.json`` is damage (ours nest 3 levels).
META_MAX_DEPTH = 32
#: Bound on V1 inner entries a step may claim (``parameter_sync_step``, ``inner_idx``).
MAX_INNER_ENTRIES = 4096
#: Object stores keep a replaced entry's objects this long, for readers holding the old ``meta.json``.
GRACE_SECONDS = 600.0
NAME_MAX = 255  # bytes in one file name on Linux filesystems (ext4, xfs, btrfs, NFS)
_INT64_MAX = 2**63 - 1


def checksum(data: FileBytes) -> str:
    """The checksum ``meta.json`` lists for a file holding ``data``.

    Example:
        >>> checksum(b"")
        'xxh3_64:2d06800538d394c2'
    """
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def nbytes(data: FileBytes) -> int:
    """The bytes a file of ``data`` holds (``len`` counts the items of a memoryview of wider items)."""
    return data.nbytes if isinstance(data, memoryview) else len(data)


def contiguous(data: FileBytes) -> FileBytes:
    """``data`` as one run of bytes: a strided or Fortran-ordered memoryview copied in C order (what
    ``tobytes`` reads, as ``bytes(view)`` would); anything else as it is, uncopied."""
    return data.tobytes() if isinstance(data, memoryview) and not data.c_contiguous else data


def valid_name(name: object) -> bool:
    """True when ``name`` can name an entry's file: one path component that cannot leave the entry.

    Example:
        >>> valid_name("data.json"), valid_name("../other/data.json"), valid_name("/etc/hostname")
        (True, False, False)
    """
    if not isinstance(name, str) or name in ("", ".", "..") or ".." in name:
        return False
    if "/" in name or "\\" in name or "\x00" in name:
        return False
    try:
        return len(name.encode("utf-8")) <= NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate
        return False


def show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Bound on an int where meta.json holds a number (a float can represent it; math.isfinite(10**400) overflows).
_MAX_NUMBER = 2**62


def is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return -_MAX_NUMBER <= value <= _MAX_NUMBER  # no float conversion: a huge int must not overflow
    return isinstance(value, float) and math.isfinite(value)


def _shape_problem(meta: object, strings: bool = True) -> str | None:
    """Depth (and, with ``strings``, string) check over the whole document, iteratively (no recursion
    to exhaust)."""
    stack: list[tuple[object, int]] = [(meta, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if not node.isascii():
                try:
                    node.encode("utf-8")
                except UnicodeEncodeError:
                    return f"{META_FILE} holds a string that is not valid Unicode"
            continue
        if isinstance(node, (dict, list)) and depth > META_MAX_DEPTH:
            return f"{META_FILE} nests deeper than {META_MAX_DEPTH} levels"
        if isinstance(node, dict):
            if strings:
                stack.extend((k, depth) for k in node)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)) or strings)
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)) or strings)
    return None


# a JSON escape of a UTF-16 surrogate: the only way a parsed meta.json can hold a string Python cannot encode
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def bounded_int(meta: Mapping[str, Any], key: str, low: int, high: int, file: str = META_FILE) -> str | None:
    """Why ``meta[key]`` (of the JSON document ``file``) is not an int from ``low`` to ``high``; None when
    it is, or when the key is absent."""
    if key not in meta:
        return None
    value = meta[key]
    if not _is_int(value) or not low <= value <= high:
        return f"{file}: {key} is {show(value)}, expected an int from {low} to {high}"
    return None


def check_meta(meta: object) -> str | None:
    """Why ``meta`` (a parsed ``meta.json``) cannot be trusted, or None when every value it holds
    has the type and range stepskip writes.

    Checked: ``global_steps`` (int >= 0), ``format``/``run_id``/``role``/``stepskip_version`` (str),
    ``prompt_digest`` (str or null), ``generation_seconds``/``created_unix`` (null or a finite
    number >= 0), ``fingerprint`` (object), the V1 fields ``inner_idx``, ``num_trajectories`` and
    ``parameter_sync_step`` (bounded ints), ``files`` (single-component names to ``{bytes: int >= 0,
    checksum: str, object?: name}``), ``retired`` (names to times), nesting depth and strings.

    Returns:
        A reason naming the bad key and value, or None.

    Example:
        >>> check_meta({"global_steps": 3}) is None
        True
        >>> check_meta({"global_steps": 3, "format": ["safe"]})
        "meta.json: format is ['safe'], expected a string"
    """
    return _check_meta(meta, None)


def _check_meta(meta: object, raw: bytes | None) -> str | None:
    """:func:`check_meta`; given the ``raw`` document it skips the walks the bytes show needless."""
    if not isinstance(meta, dict):
        return f"{META_FILE} is not a JSON object"
    if raw is None:
        shape = _shape_problem(meta)
    else:
        shallow = raw.count(b"[") + raw.count(b"{") <= META_MAX_DEPTH  # cannot nest deeper than it has brackets
        strings = _SURROGATE_ESCAPE.search(raw) is not None
        shape = None if shallow and not strings else _shape_problem(meta, strings)
    if shape:
        return shape
    if "global_steps" not in meta:
        return f"{META_FILE} lacks global_steps"
    problem = bounded_int(meta, "global_steps", 0, _INT64_MAX)
    if problem:
        return problem
    for key in ("format", "run_id", "role", "stepskip_version"):
        if key in meta and not isinstance(meta[key], str):
            return f"{META_FILE}: {key} is {show(meta[key])}, expected a string"
    digest = meta.get("prompt_digest")
    if digest is not None and not isinstance(digest, str):
        return f"{META_FILE}: prompt_digest is {show(digest)}, expected a string or null"
    for key in ("generation_seconds", "created_unix"):
        value = meta.get(key)
        if value is not None and not (is_number(value) and value >= 0):
            return f"{META_FILE}: {key} is {show(value)}, expected null or a finite number >= 0"
    if "fingerprint" in meta and meta["fingerprint"] is not None and not isinstance(meta["fingerprint"], dict):
        return f"{META_FILE}: fingerprint is {show(meta['fingerprint'])}, expected an object"
    for key, low, high in (("inner_idx", 0, MAX_INNER_ENTRIES - 1), ("parameter_sync_step", 1, MAX_INNER_ENTRIES),
                           ("num_trajectories", 0, 2**31 - 1)):
        problem = bounded_int(meta, key, low, high)
        if problem:
            return problem
    return files_problem(meta.get("files")) or _retired_problem(meta.get("retired"))


def files_problem(files: object) -> str | None:
    if files is None:
        return None
    if not isinstance(files, dict):
        return f"{META_FILE} has a malformed file list: {show(files)}"
    for name, info in files.items():
        if not valid_name(name) or name == META_FILE:
            return f"{META_FILE} names a file {show(name)}, which is not a single file name inside the entry"
        if not isinstance(info, dict):
            return f"{META_FILE} has a malformed file list: {name} -> {show(info)}"
        size = info.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= _INT64_MAX:
            return f"{META_FILE}: {name} has bytes {show(size)}, expected an int >= 0"
        if not isinstance(info.get("checksum"), str):
            return f"{META_FILE}: {name} has checksum {show(info.get('checksum'))}, expected a string"
        obj = info.get("object")
        if obj is not None and (not valid_name(obj) or obj == META_FILE):
            return f"{META_FILE}: {name} is stored as {show(obj)}, which is not a single file name inside the entry"
    return None


def _retired_problem(retired: object) -> str | None:
    if retired is None:
        return None
    if not isinstance(retired, dict) or not all(valid_name(k) and is_number(v) for k, v in retired.items()):
        return f"{META_FILE} has a malformed list of retired objects: {show(retired)}"
    return None


def load_json(raw: bytes, limit: int, file: str) -> tuple[Any, str]:
    """``(value, "")`` for at most ``limit`` bytes of JSON (the small documents of a cache: ``meta.json``,
    a step manifest), else ``(None, reason)`` naming ``file``; never raises."""
    if len(raw) > limit:
        return None, f"{file} is {len(raw)} bytes, more than the {limit} it may have"
    try:
        return json.loads(raw), ""
    except RecursionError:
        return None, f"{file} nests too deep: it nests deeper than the JSON parser allows"
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        return None, f"unreadable {file}: {err}"


def parse_meta(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """``(meta, "")`` for a trustworthy ``meta.json``, else ``(None, reason)``; never raises."""
    meta, unparsed = load_json(raw, META_MAX_BYTES, META_FILE)
    if unparsed:
        return None, unparsed
    try:
        reason = _check_meta(meta, raw)
    except (ArithmeticError, TypeError, ValueError, RecursionError) as err:  # hostile values a check missed: damage
        return None, f"{META_FILE} holds a value stepskip cannot check ({type(err).__name__}: {err})"
    return (None, reason) if reason else (meta, "")


def stored_name(name: str, info: Mapping[str, Any]) -> str:
    """The name a listed file is stored under: the object an object store's writer named it, else itself."""
    return str(info.get("object") or name)


def meta_bytes(meta: Mapping[str, Any], listing: Mapping[str, Any],
               retired: Mapping[str, float] | None = None) -> bytes:
    """The ``meta.json`` of an entry: the caller's ``meta`` with the file ``listing`` and, on object
    stores, the ``retired`` objects of the version it replaces."""
    body = dict(meta)
    body.pop("retired", None)  # only the store writes it, from the entry it replaces
    body["files"] = dict(listing)
    if retired:
        body["retired"] = dict(retired)
    # one line: json's C encoder writes it (an indented document takes its pure-Python encoder, several times
    # slower: a measurable share of a one-sample entry's write)
    return json.dumps(body, sort_keys=True).encode("utf-8")

