"""Prompt hints: per-writer files that let ``action: match`` find recorded prompts without reading every entry.

Every entry a row-wise role writes records one prompt digest per row in its ``meta.json``
(``row_prompts``); the prompt index of ``action: match`` is built from those. Read entry by entry,
the first ``match`` call of a run costs one ``meta.json`` read per entry: seconds at 10,000 entries
on a local disk, one request each on an object store. So each writing role also keeps hints of its
own, one file per writer (a role in one process, a fresh token per run; a writer starts another
once its current one reaches its roll size), rewritten whole — atomically, with the store's
small-object put — after each entry it wrote. The hints of every run directory of an experiment lie
in one directory beside those run directories, named for the run directory (and role
subdirectory) whose entries they describe, so that run directories hold only steps and one listing
finds the hints of every run directory ``match`` spans::

    {experiment}/.stepskip-index/GBS4_N2_in8_out6+{token}.keys          digest table: {experiment}/GBS4_N2_in8_out6/
    {experiment}/.stepskip-index/GBS4_N2_in8_out6+reward+{token}.keys   digest table: .../GBS4_N2_in8_out6/reward/
    {experiment}/.stepskip-index/GBS4_N2_in8_out6+{token}.json          hint document: rollout_tq's V1 steps

**Digest tables** (row-wise roles' entries: :class:`DigestTable`, :func:`parse_table`) are binary,
little-endian: a 32-byte header (magic :data:`TABLE_MAGIC`, :data:`TABLE_VERSION`, the entry and
key counts, a CRC-32 of the body), then the step names of the entries the writer wrote (ascending)
and a 64-bit key of each one's identity (:func:`identity_key`: ``run_id`` and ``created_unix`` of
its ``meta.json``), then the 64-bit keys of their row digests (:func:`digest_key`, one per distinct
digest of an entry), ascending, the latest entry first among equal keys, with the index of the entry
holding each. A reader (:class:`~stepskip._matching.tables.DigestTables`) reads each table once,
with ``np.frombuffer``: no parsing per entry. A ``match`` call looks its live prompts' keys up
(``np.searchsorted``) and indexes, from their own ``meta.json``, only the entries they point at, the
latest step first and only while a table names one that would beat the entry the index already
serves the prompt from (a later step, or the same step where reading every entry in path order would
have let it win the tie) — so the index is what reading every entry would have built ("the latest
step wins") for the prompts asked.

**Hint documents** (``rollout_tq``'s V1 steps: :class:`HintDocument`, :func:`parse_hints`) are JSON::

    {"stepskip_hints": 1, "run_id": "...", "role": "rollout_tq", "entries": {"12": {...}, ...}}

per step: the recording its manifest named, and per inner entry its identity and row digests,
run-length coded. The first submit phase lists and reads them instead of every step's manifest and
inner entries, and reads a step it chooses as without hints before injecting anything.

Both are hints, never the truth: someone else may have written them. Reads are bounded
(:data:`TABLE_MAX_BYTES`, :data:`HINTS_MAX_BYTES`, a budget over all of them); anything malformed
— another magic or version, sizes that do not add up (truncated, padded), a checksum mismatch,
keys out of order, entries that are not step names, JSON of other types or sizes — makes the whole
file ignored, with a warning, and the entries it covers read directly. A hint only counts for an
entry the directory's listing shows. A file is used only once what it says of its two lowest listed
entries (of the version it names; those no other file names first, since an entry another run
recorded again is named by that run's file too) matches their ``meta.json``. What the index holds always comes
from an entry's own ``meta.json``: a key two digests share costs one more read; an entry rewritten
since its table was written (another identity) is indexed from what it holds now; a table whose
entry, of the version it names, holds no key the table files under it is ignored from then on (the
entries it covered are read directly); and a call that reads more than a bounded number of entries
for what the tables claim stops using them (every entry they cover is then read directly). Entries
no hint covers (written by verl, an older stepskip, or a writer that stopped before its hints) are
indexed from their ``meta.json`` as before.

What a hint cannot tell: an entry rewritten by a writer that died between publishing it and
rewriting its hints (or by an older stepskip) stays described by the earlier writer's, so the
prompts it holds now are found only when a call looks it up for the prompts it held before (it is
then indexed from its ``meta.json``), or once the hints are deleted, which is always safe. A table
that omits prompts an entry holds can only make them generated, or served from an earlier step.

Example:
    >>> table = DigestTable()
    >>> table.add("12", {"global_steps": 12, "run_id": "r1", "created_unix": 1.5, "row_prompts": ["a", "a", "b"]})
    True
    >>> parsed, problem = parse_table(table.to_bytes(), "w.keys")
    >>> parsed.names.tolist(), sorted(parsed.keys.tolist()) == sorted({digest_key("a"), digest_key("b")})
    ([12], True)
    >>> doc = HintDocument(run_id="r1", role="rollout_tq")
    >>> doc.add_step("12", None, [{"global_steps": 12, "run_id": "r1", "created_unix": 1.5, "row_prompts": ["a"]}])
    True
    >>> parse_hints(doc.to_bytes(), "w.json")[0]["12"].inner[0].digests
    ['a']
"""

from __future__ import annotations

import json
import re
import struct
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from stepskip._storage.meta import META_MAX_BYTES, is_number, load_json
from stepskip._layout import HINTS_DIR

__all__ = ["HINTS_DIR", "HINTS_MAX_BYTES", "HINTS_ROLL_BYTES", "HINTS_VERSION", "Hint", "HintDocument", "StepHint",
           "TABLE_MAGIC", "TABLE_MAX_BYTES", "TABLE_ROLL_BYTES", "TABLE_SUFFIX", "TABLE_VERSION", "DigestTable",
           "KeyTable", "TableWriter", "digest_key", "digest_keys", "document_name",
           "document_of", "identity_key", "new_writer_token", "parse_hints", "parse_table", "rows_of",
           "same_version", "table_name", "table_of"]

#: The directory (in an experiment's directory, beside its run directories) holding the hint documents.
HINTS_VERSION = 1
#: A hint document larger than this is ignored (the entries it covers are read directly).
HINTS_MAX_BYTES = 4 << 20
#: A writer starts another document once its current one is larger than this.
HINTS_ROLL_BYTES = 256 << 10  # small: a writer rewrites its current document whole after each dump
#: Bounds on what one document may describe: rows in all, rows of one entry, one digest's length.
_MAX_ROWS = 1 << 24
# no more than a meta.json can list: its row_prompts (each digest a JSON string of at least 16 bytes)
# fit in META_MAX_BYTES, so a hint claiming more can never match the entry
_MAX_ENTRY_ROWS = META_MAX_BYTES // 16
_MAX_DIGEST = 256
_TOKEN = re.compile(r"[0-9a-f]{16}(?:-[0-9]{1,6})?")
_ENTRY = re.compile(r"[0-9]{1,19}")
_RECORDING = re.compile(r"rec-[0-9a-f]{12}")
#: Inner entries a V1 step's hint may list (``stepskip._storage.meta.MAX_INNER_ENTRIES``).
_MAX_INNER = 4096

#: Digest tables (see the module docstring): their name's suffix, magic and version.
TABLE_SUFFIX = ".keys"
TABLE_MAGIC = b"stpskeys"
TABLE_VERSION = 1
#: magic, version, entries, key rows, CRC-32 of the body, zero (little-endian, 32 bytes: the arrays stay aligned)
_TABLE_HEADER = struct.Struct("<8sIIQII")
#: A digest table larger than this is ignored (the entries it covers are read directly).
TABLE_MAX_BYTES = 16 << 20
#: A writer starts another table once its current one is larger than this: it rewrites (and sorts) it whole
#: after each dump, about a millisecond at this size.
TABLE_ROLL_BYTES = 256 << 10
_MAX_TABLE_ENTRIES = 1 << 24
_MAX_STEP_NAME = 10**19  # a step directory's name has at most 19 digits (_ENTRY)


def document_name(run_name: str, subdir: str | None, token: str) -> str:
    """The name of a writer's document describing the entries of ``run_name`` (and role ``subdir``).

    Example:
        >>> document_name("GBS4_N2_in8_out6", None, "0123456789abcdef")
        'GBS4_N2_in8_out6+0123456789abcdef.json'
    """
    return "+".join([run_name, *([subdir] if subdir else []), token]) + ".json"


def document_of(name: object) -> tuple[str, str | None] | None:
    """``(run directory name, role subdirectory or None)`` a document name describes; None for a name
    a writer does not give (a temporary, a planted file).

    Example:
        >>> document_of("GBS4_N2_in8_out6+reward+0123456789abcdef-2.json")
        ('GBS4_N2_in8_out6', 'reward')
    """
    return _described(name, ".json")


def table_name(run_name: str, subdir: str | None, token: str) -> str:
    """The name of a writer's digest table describing the entries of ``run_name`` (and role ``subdir``).

    Example:
        >>> table_name("GBS4_N2_in8_out6", "reward", "0123456789abcdef")
        'GBS4_N2_in8_out6+reward+0123456789abcdef.keys'
    """
    return "+".join([run_name, *([subdir] if subdir else []), token]) + TABLE_SUFFIX


def table_of(name: object) -> tuple[str, str | None] | None:
    """``(run directory name, role subdirectory or None)`` a digest table's name describes; None for a
    name a writer does not give.

    Example:
        >>> table_of("GBS4_N2_in8_out6+0123456789abcdef.keys")
        ('GBS4_N2_in8_out6', None)
    """
    return _described(name, TABLE_SUFFIX)


def _described(name: object, suffix: str) -> tuple[str, str | None] | None:
    if not isinstance(name, str) or not name.endswith(suffix) or name.startswith("."):
        return None
    head, _, token = name[:-len(suffix)].rpartition("+")
    if not head or not _TOKEN.fullmatch(token):
        return None
    run_name, _, subdir = head.partition("+")
    return (run_name, subdir or None) if run_name else None


def new_writer_token() -> str:
    """A fresh writer token: the stem of a writer's document names."""
    return uuid.uuid4().hex[:16]


@dataclass(slots=True)
class Hint:
    """What a hint document says about one entry.

    Args:
        step: the entry's ``global_steps``.
        run_id: the ``run_id`` of the ``meta.json`` it describes.
        created: that ``meta.json``'s ``created_unix``.
        runs: its ``row_prompts`` run-length coded: ``(digest, rows)`` in row order.
        document: the name of the document it comes from.
    """

    step: int
    run_id: str | None
    created: float | None
    runs: tuple[tuple[str, int], ...]
    document: str = ""

    @property
    def digests(self) -> list[str]:
        """The entry's ``row_prompts`` (one digest per row), expanded."""
        return [digest for digest, count in self.runs for _ in range(count)]

    def describes(self, meta: Mapping[str, Any]) -> bool:
        """True when ``meta`` is the version of the entry this hint was written for (same identity)."""
        return same_version(meta, self.run_id, self.created)


@dataclass(slots=True)
class StepHint:
    """What a hint document says about one V1 step (``rollout_tq``): where its inner entries are and
    what each of them is.

    Args:
        step: the step's ``global_steps``.
        recording: the recording directory its manifest named (object stores), None for inner
            entries directly in the step directory.
        inner: one hint per inner entry, in order.
        document: the name of the document it comes from.
    """

    step: int
    recording: str | None
    inner: tuple[Hint, ...]
    document: str = ""


def same_version(meta: Mapping[str, Any], run_id: str | None, created: float | None) -> bool:
    """True when ``meta`` carries this identity (``run_id`` and ``created_unix``), and it is one."""
    return created is not None and meta.get("run_id") == run_id and meta.get("created_unix") == created


def rows_of(hints: Mapping[str, Hint | StepHint]) -> int:
    """The rows ``hints`` describe in all."""
    return sum(count for hint in hints.values() for part in (hint.inner if isinstance(hint, StepHint) else (hint,))
               for _, count in part.runs)


def _run_length(digests: list[str]) -> list[list[Any]]:
    runs: list[list[Any]] = []
    for digest in digests:
        if runs and runs[-1][0] == digest:
            runs[-1][1] += 1
        else:
            runs.append([digest, 1])
    return runs


class HintDocument:
    """The hint document one writer keeps (its entries, each as :meth:`add` was last given it).

    Args:
        run_id: the writer's run.
        role: the writer's role.
    """

    def __init__(self, run_id: str, role: str) -> None:
        self.run_id, self.role = run_id, role
        self.entries: dict[str, dict[str, Any]] = {}
        self._sizes: dict[str, int] = {}  # entry -> the bytes it adds to the document

    @property
    def size(self) -> int:
        """The bytes :meth:`to_bytes` returns, near enough (without encoding the document)."""
        return 96 + len(self.run_id) + len(self.role) + sum(self._sizes.values())

    def remove(self, name: str) -> None:
        self.entries.pop(name, None)
        self._sizes.pop(name, None)

    def add(self, name: str, meta: Mapping[str, Any]) -> bool:
        """Describe the entry ``name`` (its step directory's name) as ``meta`` (its ``meta.json``) says;
        False (nothing added) when it records no row digests or identity to hint."""
        digests = meta.get("row_prompts")
        created = meta.get("created_unix")
        if (not _ENTRY.fullmatch(name) or not isinstance(digests, list) or not is_number(created)
                or not all(isinstance(d, str) and len(d) <= _MAX_DIGEST for d in digests)
                or len(digests) > _MAX_ENTRY_ROWS):
            self.remove(name)
            return False
        record = {"step": meta.get("global_steps"), "run_id": meta.get("run_id"), "created_unix": created,
                  "rows": _run_length(digests)}
        self.entries[name] = record
        self._sizes[name] = len(name) + 4 + len(json.dumps(record, separators=(",", ":")))
        return True

    def add_step(self, name: str, recording: str | None, metas: list[Mapping[str, Any]]) -> bool:
        """Describe the V1 step ``name`` whose inner entries (``metas``, their ``meta.json`` in order) are in
        ``recording`` (None: in the step directory); False (nothing added) when one records no row
        digests or identity to hint (a trajectory without a prompt digest is recorded as ``""``)."""
        inner: list[dict[str, Any]] = []
        for meta in metas:
            digests = meta.get("row_prompts")
            created = meta.get("created_unix")
            if (not isinstance(digests, list) or not is_number(created) or len(digests) > _MAX_ENTRY_ROWS
                    or not all(d is None or (isinstance(d, str) and len(d) <= _MAX_DIGEST) for d in digests)):
                inner = []
                break
            inner.append({"run_id": meta.get("run_id"), "created_unix": created,
                          "rows": _run_length([d or "" for d in digests])})
        if not _ENTRY.fullmatch(name) or not inner or (recording is not None and not _RECORDING.fullmatch(recording)):
            self.remove(name)
            return False
        record = {"step": metas[0].get("global_steps"), "recording": recording, "inner": inner}
        self.entries[name] = record
        self._sizes[name] = len(name) + 4 + len(json.dumps(record, separators=(",", ":")))
        return True

    def to_bytes(self) -> bytes:
        body = {"stepskip_hints": HINTS_VERSION, "run_id": self.run_id, "role": self.role, "entries": self.entries}
        return json.dumps(body, separators=(",", ":")).encode("utf-8")


def _parse_rows(rows: Any) -> tuple[tuple[tuple[str, int], ...], int] | None:
    """The run-length coded rows of one entry and their count; None when malformed or unbounded."""
    if type(rows) is not list:
        return None
    runs: list[tuple[str, int]] = []
    count = 0
    for run in rows:
        if type(run) is not list or len(run) != 2:
            return None
        digest, repeat = run
        if type(digest) is not str or len(digest) > _MAX_DIGEST or type(repeat) is not int or repeat < 1:
            return None
        count += repeat
        runs.append((digest, repeat))
    return (tuple(runs), count) if count <= _MAX_ENTRY_ROWS else None


def _parse_step(name: str, info: dict[str, Any], step: int, document: str) -> tuple[StepHint | None, int]:
    """A V1 step's hint and its rows; ``(None, 0)`` when malformed."""
    recording, inner = info.get("recording"), info.get("inner")
    if (recording is not None and (type(recording) is not str or not _RECORDING.fullmatch(recording))) \
            or type(inner) is not list or not 1 <= len(inner) <= _MAX_INNER:
        return None, 0
    hints, total = [], 0
    for part in inner:
        if type(part) is not dict:
            return None, 0
        run_id, created = part.get("run_id"), part.get("created_unix")
        parsed = _parse_rows(part.get("rows"))
        if (run_id is not None and type(run_id) is not str) or not is_number(created) or parsed is None:
            return None, 0
        hints.append(Hint(step, run_id, float(created), parsed[0], document))  # type: ignore[arg-type]
        total += parsed[1]
    return StepHint(step, recording, tuple(hints), document), total


def parse_hints(raw: bytes, document: str,
                max_rows: int = _MAX_ROWS) -> tuple[dict[str, Hint | StepHint], str]:
    """``(entry name -> hint, "")`` for a well-formed hint document, else ``({}, reason)``; never raises.

    Every value is checked for its type and bound before it is used: a document of another version,
    shape or size is ignored whole (its entries are then read directly), and so is one describing
    more than ``max_rows`` rows (at most :data:`_MAX_ROWS`; a reader of many documents passes what
    is left of its budget).
    """
    max_rows = min(max_rows, _MAX_ROWS)
    body, problem = load_json(raw, HINTS_MAX_BYTES, document)
    if problem:
        return {}, problem
    if not isinstance(body, dict) or body.get("stepskip_hints") != HINTS_VERSION:
        version = body.get("stepskip_hints") if isinstance(body, dict) else None
        return {}, f"{document} is not a hint document of version {HINTS_VERSION} (found {str(version)[:40]!r})"
    entries = body.get("entries")
    if not isinstance(entries, dict):
        return {}, f"{document}: entries is not an object"
    hints: dict[str, Hint | StepHint] = {}
    total = 0
    # one pass, exact types only (``type(x) is int`` also refuses bools): 10,000 entries parse in milliseconds
    for name, info in entries.items():
        if not (name.isdigit() and name.isascii() and len(name) <= 19):
            return {}, f"{document} names the entry {name[:60]!r}, which is not a step directory's name"
        if type(info) is not dict:
            return {}, f"{document}: entry {name} is not an object"
        step = info.get("step")
        if type(step) is not int or not 0 <= step < 2**63:
            return {}, f"{document}: entry {name} has an ill-typed step"
        if "inner" in info:  # a V1 step
            hint, entry_rows = _parse_step(name, info, step, document)
            if hint is None:
                return {}, f"{document}: step {name} has an ill-typed recording or inner entries"
            total += entry_rows
            hints[name] = hint
        else:
            run_id, created = info.get("run_id"), info.get("created_unix")
            parsed = _parse_rows(info.get("rows"))
            if (run_id is not None and type(run_id) is not str) or not is_number(created):
                return {}, f"{document}: entry {name} has an ill-typed run_id or created_unix"
            if parsed is None:
                return {}, f"{document}: entry {name} has a malformed row list, or more than {_MAX_ENTRY_ROWS} rows"
            total += parsed[1]
            hints[name] = Hint(step, run_id, float(created), parsed[0], document)  # type: ignore[arg-type]
        if total > max_rows:
            return {}, f"{document} describes more than {max_rows} rows"
    return hints, ""


# --------------------------------------------------------------------------- digest tables


def digest_key(digest: str) -> int:
    """The 64-bit key a digest table files a row digest under (two digests may share one: a reader
    always checks the entry's own ``meta.json``).

    Example:
        >>> digest_key("a") == digest_key("a") != digest_key("b")
        True
    """
    return xxhash.xxh3_64_intdigest(digest.encode("utf-8", "surrogatepass"))


def digest_keys(digests: Iterable[str]) -> np.ndarray:
    """The distinct keys of ``digests``, sorted (``uint64``)."""
    return np.unique(np.fromiter((digest_key(d) for d in set(digests)), dtype=np.uint64))


def identity_key(meta: Mapping[str, Any]) -> int | None:
    """The 64-bit key of the identity of the entry version ``meta`` describes (its ``run_id`` and
    ``created_unix``, as :func:`same_version` compares them); None when it carries none."""
    run_id, created = meta.get("run_id"), meta.get("created_unix")
    if not isinstance(created, (int, float)) or not is_number(created) or (run_id is not None
                                                                           and not isinstance(run_id, str)):
        return None
    return xxhash.xxh3_64_intdigest(f"{run_id}\0{float(created)!r}".encode("utf-8", "surrogatepass"))


class DigestTable:
    """The digest table one writer keeps: for each entry it wrote (as :meth:`add` was last given it),
    the entry's identity key and the keys of its row digests.

    Example:
        >>> table = DigestTable()
        >>> table.add("12", {"run_id": "r1", "created_unix": 1.5, "row_prompts": ["a", "a", "b"]})
        True
        >>> parsed, _ = parse_table(table.to_bytes(), "t.keys")
        >>> parsed.names.tolist(), len(parsed.keys)
        ([12], 2)
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[int, np.ndarray]] = {}  # step name -> (identity key, its digest keys)
        self._size = _TABLE_HEADER.size

    @property
    def size(self) -> int:
        """The bytes :meth:`to_bytes` returns."""
        return self._size

    def __len__(self) -> int:
        return len(self._entries)

    def remove(self, name: str) -> None:
        old = self._entries.pop(int(name), None) if _ENTRY.fullmatch(name) else None
        if old is not None:
            self._size -= 16 + 12 * len(old[1])

    def add(self, name: str, meta: Mapping[str, Any]) -> bool:
        """Describe the entry ``name`` (its step directory's name) as ``meta`` (its ``meta.json``) says;
        False (nothing added) when it records no row digests or identity to check them by."""
        self.remove(name)
        digests = meta.get("row_prompts")
        identity = identity_key(meta)
        if (not _ENTRY.fullmatch(name) or identity is None or not isinstance(digests, list)
                or len(digests) > _MAX_ENTRY_ROWS or not all(isinstance(d, str) for d in digests)):
            return False
        keys = digest_keys(digests)
        self._entries[int(name)] = (identity, keys)
        self._size += 16 + 12 * len(keys)
        return True

    def to_bytes(self) -> bytes:
        """The table as written: header, entry names (ascending), their identity keys, then the digest
        keys (ascending; among equal keys the latest entry first) and the index of the entry of each."""
        ordered = sorted(self._entries)
        names = np.array(ordered, dtype=np.uint64)
        identities = np.array([self._entries[n][0] for n in ordered], dtype=np.uint64)
        parts = [self._entries[n][1] for n in ordered]
        keys = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
        owners = np.repeat(np.arange(len(ordered), dtype=np.uint32), [len(p) for p in parts])
        order = np.lexsort((~names[owners], keys))  # ~: a later step sorts first among equal keys
        body = b"".join([names.astype("<u8").tobytes(), identities.astype("<u8").tobytes(),
                         keys[order].astype("<u8").tobytes(), owners[order].astype("<u4").tobytes()])
        return _TABLE_HEADER.pack(TABLE_MAGIC, TABLE_VERSION, len(ordered), len(keys), zlib.crc32(body), 0) + body


class TableWriter:
    """The digest tables of one writer: the current :class:`DigestTable` and the token naming it. Once
    the current table grows past :data:`TABLE_ROLL_BYTES` it is written as it was and the next one starts
    (``{token}-1``, ``{token}-2`` ...), so that rewriting the current table after each dump stays cheap.

    Args:
        token: the writer's token (a fresh one by default).

    Example:
        >>> writer = TableWriter("0123456789abcdef")
        >>> [token for token, _ in writer.add([("3", {"run_id": "r", "created_unix": 1.0, "row_prompts": ["a"]})])]
        ['0123456789abcdef']
    """

    def __init__(self, token: str | None = None) -> None:
        self.token = token or new_writer_token()
        self.table = DigestTable()

    def add(self, records: Iterable[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, bytes]]:
        """Describe each ``(entry name, its meta.json)`` of ``records`` (one it cannot describe is dropped
        from the table: it is read directly); returns ``(token, bytes)`` of each table to write now, in
        order: the ones that filled up, then the current one."""
        out: list[tuple[str, bytes]] = []
        for name, meta in records:
            self.table.add(name, meta)
            if len(self.table) > 1 and self.table.size > TABLE_ROLL_BYTES:
                self.table.remove(name)  # full: written as it was, the next one starts with this entry
                out.append((self.token, self.table.to_bytes()))
                stem, _, shard = self.token.partition("-")
                self.token = f"{stem}-{int(shard or 0) + 1}"
                self.table = DigestTable()
                self.table.add(name, meta)
        out.append((self.token, self.table.to_bytes()))
        return out


@dataclass(slots=True, eq=False)
class KeyTable:
    """A digest table as read (:func:`parse_table`): read-only arrays over its bytes.

    Args:
        names: the step names of the entries it covers, ascending (``uint64``).
        identities: the identity key of each (:func:`identity_key`).
        keys: the digest keys, ascending; among equal keys the latest entry first.
        owners: for each key, the index in ``names`` of the entry holding it.
        document: where it was read from.
    """

    names: np.ndarray
    identities: np.ndarray
    keys: np.ndarray
    owners: np.ndarray
    document: str = ""

    def keys_of(self, entry: int) -> np.ndarray:
        """The digest keys the table files under its entry ``entry`` (an index in ``names``), sorted."""
        return np.unique(self.keys[self.owners == entry])


def parse_table(raw: bytes, document: str, max_rows: int = _MAX_ROWS) -> tuple[KeyTable | None, str]:
    """``(table, "")`` for a well-formed digest table, else ``(None, reason)``; never raises.

    Its sizes must add up to its length exactly (a truncated or padded table is refused), its body must
    match its CRC-32, its entries be step names in ascending order, its keys ascending, each naming
    one of its entries, the latest first among equal keys; and it may hold at most ``max_rows`` keys
    (a reader of many tables passes what is left of its budget). Checking costs a few vectorised
    passes over the arrays, no Python loop over its entries.
    """
    header = _TABLE_HEADER.size
    if len(raw) > TABLE_MAX_BYTES:
        return None, f"{document} is {len(raw)} bytes, more than the {TABLE_MAX_BYTES} a digest table may have"
    if len(raw) < header or raw[:8] != TABLE_MAGIC:
        return None, f"{document} is not a digest table (no {TABLE_MAGIC!r} header)"
    _, version, entries, rows, crc, _ = _TABLE_HEADER.unpack_from(raw)
    if version != TABLE_VERSION:
        return None, f"{document} is a digest table of version {version}, not {TABLE_VERSION}"
    if entries > _MAX_TABLE_ENTRIES or rows > min(max_rows, _MAX_ROWS):
        return None, f"{document} describes {entries} entries and {rows} digest keys, more than a reader takes"
    expected = header + 16 * entries + 12 * rows
    if len(raw) != expected:
        return None, f"{document} is {len(raw)} bytes but its header says {expected} (truncated or padded)"
    if zlib.crc32(memoryview(raw)[header:]) != crc:
        return None, f"{document} does not match its checksum (damaged)"
    names = np.frombuffer(raw, dtype="<u8", count=entries, offset=header)
    identities = np.frombuffer(raw, dtype="<u8", count=entries, offset=header + 8 * entries)
    keys = np.frombuffer(raw, dtype="<u8", count=rows, offset=header + 16 * entries)
    owners = np.frombuffer(raw, dtype="<u4", count=rows, offset=header + 16 * entries + 8 * rows)
    if entries and (bool(np.any(names[1:] <= names[:-1])) or int(names[-1]) >= _MAX_STEP_NAME):
        return None, f"{document}: its entries are not step names in ascending order"
    if rows and int(owners.max()) >= entries:
        return None, f"{document}: a digest key names an entry it does not list"
    if rows > 1:
        steps = names[owners]
        if bool(np.any(keys[1:] < keys[:-1])) or bool(np.any((keys[1:] == keys[:-1]) & (steps[1:] > steps[:-1]))):
            return None, f"{document}: its digest keys are not in order"
    return KeyTable(names, identities, keys, owners, document), ""
