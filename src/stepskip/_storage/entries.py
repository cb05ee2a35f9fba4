"""Entries over any backend: atomic commit, checksums, validity checks, race retries, leftovers.

An entry is a directory holding data files and ``meta.json``, which lists every data file with its
size and xxh3-64 checksum; readers check both. :class:`EntryStore` holds everything about entries,
written once over every :class:`~stepskip._storage.base.Backend`: how an entry is committed (staged
and published whole where the backend publishes a directory atomically, else data objects first and
``meta.json`` last), how one version of it is read even while writers replace it, when it counts
as missing, present or damaged, and what interrupted writers leave behind and when it goes.

A cache may have been written by someone else, so readers trust nothing in it (README, "Sharing a
cache safely"): ``meta.json`` is bounded and checked value by value
(:func:`~stepskip._storage.meta.check_meta`); file names are single path components; files are
read for exactly their recorded size; deletions stay inside the entry being replaced.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from stepskip._storage import objects
from stepskip._storage.base import (
    Allocator,
    Backend,
    BadFile,
    Capabilities,
    DirItem,
    EntryState,
    NotAnEntry,
    PinnedEntry,
    Probe,
    Raced,
    Staging,
    Tree,
)
from stepskip._storage.meta import (
    GRACE_SECONDS,
    META_FILE,
    STALE_SECONDS,
    TMP_PREFIX,
    TRASH_PREFIX,
    checksum,
    contiguous,
    files_problem,
    meta_bytes,
    nbytes,
    parse_meta,
    stored_name,
    valid_name,
)
from stepskip._storage.outages import StoreOutage
from stepskip._entries import FileBytes
from stepskip.errors import CacheMissError, CorruptEntryError, StoreUnavailableError

__all__ = ["EntryStore", "Names"]

_MAX_ATTEMPTS = 32  # reads of an entry that writers keep replacing, before it counts as damaged

#: What a read wants: names, every file (None), or a function choosing names from the version read.
Names = list[str] | Callable[[dict[str, Any]], Iterable[str]] | None
#: A data file's contents: bytes, or a memoryview of the caller's memory where its allocator gave it.
_Data = TypeVar("_Data", bytes, memoryview, bytes | memoryview)
_Found = tuple[Probe, Mapping[str, bytes | memoryview]]


class EntryStore:
    """Entries on one backend (see the module): what the roles, the index and the tools read and write.

    Args:
        backend: where the bytes are.
        grace_seconds: on backends without atomic directory publish, how long a replaced entry's
            objects stay readable for readers holding its old ``meta.json``.
        clock: the time grace periods and staleness are judged by (the wall clock,
            :func:`~stepskip._storage.objects.wall_time`), injectable for tests.

    Example:
        >>> from stepskip._storage.memory import MemoryBackend
        >>> store = EntryStore(MemoryBackend())
        >>> store.write_entry("/run/3", {"data.json": b"{}"}, {"global_steps": 3}) > 0
        True
        >>> store.probe("/run/3").state.value, store.read_entry("/run/3")[1]
        ('present', {'data.json': b'{}'})
    """

    def __init__(self, backend: Backend, grace_seconds: float = GRACE_SECONDS,
                 clock: Callable[[], float] | None = None) -> None:
        self.backend = backend
        self.grace_seconds = float(grace_seconds)
        self.clock: Callable[[], float] = objects.wall_time if clock is None else clock

    def __repr__(self) -> str:
        return f"EntryStore({type(self.backend).__name__}, root={self.root!r})"

    @property
    def capabilities(self) -> Capabilities:
        """What the backend can do (ask these, never the backend's type)."""
        return self.backend.capabilities

    @property
    def root(self) -> str | None:
        """The dump dir, as the backend spells it."""
        return self.backend.root

    # ------------------------------------------------------------------ reading

    def probe(self, path: str, legacy_files: Iterable[str] = (), keep: int = 0) -> Probe:
        """Classify the entry at ``path`` as missing, present, damaged or unavailable (the store did not answer)
        without reading its data.

        An entry written by verl itself has a ``meta.json`` without a file list; it is present when
        one of ``legacy_files`` (verl's data file names) exists beside it. Never raises.

        ``keep``: a present entry whose listed files hold at most this many bytes together is read
        whole instead, through the same pinned version, its files kept in the probe
        (:attr:`Probe.files`), so that a :meth:`read_entry` given the probe needs no second look at
        the storage (the async role's one-sample hits).
        """
        return self._look(path, tuple(legacy_files), None, verify=False, read=False, keep=keep)[0]

    def read_entry(self, path: str, legacy_files: Iterable[str] = (),
                   names: Iterable[str] | Callable[[dict[str, Any]], Iterable[str]] | None = None,
                   verify: bool = True, allocator: Allocator | None = None,
                   probe: Probe | None = None) -> tuple[dict[str, Any], dict[str, bytes | memoryview]]:
        """Check and read one entry as one version: its ``meta.json`` and the named data files.

        Unlike :meth:`probe` followed by :meth:`read_files`, the files read are those of the
        ``meta.json`` returned even while other writers replace the entry; a read that meets a
        newer version reads that version instead.

        Args:
            path: the entry directory.
            legacy_files: verl's data file names, for entries verl wrote (no file list).
            names: the data files to read; None for every listed one (every legacy file present);
                or a function given the checked ``meta`` of the version being read that returns
                them — it may also raise (a format or fidelity refusal, say) to stop the read
                before any data is read; it is called again should a newer version be read.
            verify: check each file's checksum (sizes are always checked).
            allocator: where a backend that reads into memory it is given (local files) puts a listed
                data file: asked with each file's size once ``names`` has chosen the files, it gives
                a writable buffer of that size (recycled pages, for a decoder that reads buffers), or
                None for ordinary bytes.
            probe: a :meth:`probe` of ``path`` just taken: where the backend can tell that
                ``meta.json`` is still the very file that probe parsed
                (:attr:`~stepskip._storage.base.Capabilities.version_stamps`), and ``verify`` is on,
                its ``meta`` is used without parsing the file again. A probe that kept the entry's
                files (``keep``) is read from them: that version, as it was when probed. Any other
                case, and a kept file that does not match its checksum, reads ``meta.json`` afresh.

        Returns:
            ``(meta, {name: bytes})`` (memoryviews among them where the allocator gave memory).

        Raises:
            CacheMissError: there is no entry (never written, or removed meanwhile).
            CorruptEntryError: the entry is damaged: the message says how.
            StoreUnavailableError: the store did not answer (a timeout, a connection error, a 5xx): nothing
                is known of the entry.

        Example:
            >>> meta, files = store.read_entry(path, names=["data.json"])  # doctest: +SKIP
        """
        wanted: Names = names if names is None or callable(names) else list(names)
        if probe is not None and probe.files is not None and probe.path == path and probe.meta \
                and probe.state is EntryState.PRESENT:
            try:
                kept = _from_kept(probe.meta, probe.files, _resolve(wanted, probe.meta), verify)
            except OSError:  # from ``names``: the read below reports it as a read of the entry always did
                kept = None
            if kept is not None:
                return probe.meta, kept
        known = probe if verify and probe is not None and probe.state is EntryState.PRESENT and probe.stamp else None
        legacy = tuple(legacy_files)
        found, files = self._look(path, legacy, wanted, verify, read=True, allocator=allocator, known=known)
        if found.state is EntryState.DAMAGED and known is not None:
            # the reused meta.json may be stale (rewritten in place within the timestamps' granularity):
            # damage is only what a read of meta.json itself still finds
            found, files = self._look(path, legacy, wanted, verify, read=True, allocator=allocator)
        if found.state is EntryState.MISSING:
            raise CacheMissError(f"{path}: no entry there (never written, or removed meanwhile)")
        if found.state is EntryState.UNAVAILABLE:
            raise StoreUnavailableError(found.reason)  # it names the object the store did not answer for
        if found.state is EntryState.DAMAGED:
            raise CorruptEntryError(f"{path}: {found.reason}")
        return found.meta or {}, dict(files)

    def read_files(self, path: str, meta: Mapping[str, Any], names: Iterable[str], verify: bool
                   ) -> dict[str, bytes | memoryview]:
        """Read the named data files of a present entry, checking sizes and (``verify``) checksums.

        Prefer :meth:`read_entry`, which cannot mix two versions of an entry being replaced.

        Raises:
            CorruptEntryError: a file is missing, truncated or does not match its checksum, or
                ``meta`` itself is ill-typed.
            StoreUnavailableError: the store did not answer.
        """
        reason = files_problem(meta.get("files"))  # the names and sizes this read trusts
        if reason:
            raise CorruptEntryError(f"{path}: {reason}")
        try:
            entry = self.backend.open_entry(path)
        except (OSError, NotAnEntry) as err:
            raise CorruptEntryError(f"{path} cannot be read: {err}") from err
        try:
            listed = meta.get("files")
            out: dict[str, bytes | memoryview] = {}
            for name in names:
                if listed is None:
                    if not valid_name(name):
                        raise BadFile(f"{name!r} is not a file name inside the entry")
                    try:
                        out[name] = entry.read(name, None)
                    except FileNotFoundError:
                        pass
                    continue
                info = listed.get(name)
                if info is None:
                    raise BadFile(f"{name} is not listed in {META_FILE}")
                try:
                    data = entry.read(stored_name(name, info), info["bytes"])
                except FileNotFoundError:
                    raise BadFile(f"{path}/{name} is missing") from None
                out[name] = _verified(name, data, info, verify)
            return out
        except BadFile as err:
            raise CorruptEntryError(f"{path}: {err}") from None
        except StoreOutage as err:
            raise StoreUnavailableError(str(err.strerror)) from err
        finally:
            entry.close()

    def read_small(self, path: str, limit: int) -> bytes | None:
        """The bytes of one small regular file (a step manifest), or None when there is none.

        Nothing is followed through a symbolic link and never more than ``limit + 1`` bytes are read.

        Raises:
            CorruptEntryError: ``path`` is a link, a directory or a special file, is larger than
                ``limit``, or cannot be read (the message says which).
        """
        try:
            return self.backend.read_file(path, limit)
        except BadFile as err:
            raise CorruptEntryError(str(err)) from None

    def _look(self, path: str, legacy: tuple[str, ...], names: Names, verify: bool, read: bool,
              allocator: Allocator | None = None, known: Probe | None = None, keep: int = 0) -> _Found:
        """One version of the entry at ``path``, looked at (``read``: and its files read), retried while
        writers replace it under the read."""
        entry: PinnedEntry | None = None
        try:
            for _ in range(_MAX_ATTEMPTS):
                try:
                    if entry is None:
                        entry = self.backend.open_entry(path)
                    else:
                        old, entry = entry, None
                        try:
                            entry = old.reopen()
                        finally:
                            old.close()
                except FileNotFoundError:
                    return Probe(EntryState.MISSING), {}
                except NotAnEntry as err:  # a link, a file, a path below a file
                    return (Probe(EntryState.DAMAGED, reason=err.reason) if err.damaged
                            else Probe(EntryState.MISSING)), {}
                except StoreOutage as err:
                    return _unavailable(err), {}
                except OSError as err:
                    return Probe(EntryState.DAMAGED, reason=f"cannot open {path}: {err}"), {}
                try:
                    return self._look_at(entry, legacy, names, verify, read, allocator, known, keep)
                except Raced:
                    known = None  # whatever that probe saw was replaced: read meta.json itself
                except NotAnEntry:  # removed while it was read
                    return Probe(EntryState.MISSING), {}
                except StoreOutage as err:  # no answer: nothing is known of the entry, least of all damage
                    return _unavailable(err), {}
                except OSError as err:  # e.g. a permission denied on one file: never an exception from a probe
                    return Probe(EntryState.DAMAGED, reason=f"cannot read {path}: {err}"), {}
            return Probe(EntryState.DAMAGED, reason=f"kept changing while read ({_MAX_ATTEMPTS} attempts)"), {}
        finally:
            if entry is not None:
                entry.close()

    def _look_at(self, entry: PinnedEntry, legacy: tuple[str, ...], names: Names, verify: bool, read: bool,
                 allocator: Allocator | None, known: Probe | None, keep: int) -> _Found:
        meta: dict[str, Any] | None = None
        stamp = None
        if known is not None and known.meta is not None and known.meta.get("files") is not None:
            # only for a probe of an entry that lists its files: each file read is still checked against
            # that listing (its size always, its checksum because reuse requires verify)
            stamp = entry.meta_stamp()
            meta = known.meta if stamp is not None and stamp == known.stamp else None
        if meta is None:
            try:
                raw, stamp = entry.read_meta()
            except FileNotFoundError:
                reason = entry.absent()
                return (Probe(EntryState.DAMAGED, reason=reason) if reason else Probe(EntryState.MISSING)), {}
            except BadFile as err:
                return Probe(EntryState.DAMAGED, reason=str(err)), {}
            except StoreOutage:
                raise
            except OSError as err:
                return Probe(EntryState.DAMAGED, reason=f"cannot read {entry.path}/{META_FILE}: {err}"), {}
            meta, reason = parse_meta(raw)
            if meta is None:
                return Probe(EntryState.DAMAGED, reason=reason), {}
        chosen = _resolve(names, meta) if read else None
        try:
            if meta.get("files") is None:
                return self._look_legacy(entry, meta, legacy, chosen, read)
            wanted = _check_files(meta, chosen) if read else []
            listed = meta["files"]
            if not read and keep and 0 < sum(info["bytes"] for info in listed.values()) <= keep:
                # a small entry read whole, through this version: no second look
                files = {name: entry.read(stored_name(name, info), info["bytes"]) for name, info in listed.items()}
                return Probe(EntryState.PRESENT, meta, stamp=stamp, files=files, path=entry.path), {}
            for name, info in listed.items():
                if name not in wanted:
                    entry.check(stored_name(name, info), info["bytes"])
            out: dict[str, bytes | memoryview] = {}
            for name in wanted:
                info = listed[name]
                out[name] = _verified(name, entry.read(stored_name(name, info), info["bytes"], allocator), info,
                                      verify)
            return Probe(EntryState.PRESENT, meta, stamp=stamp), out
        except (FileNotFoundError, BadFile) as err:
            if entry.replaced():
                raise Raced() from None  # replaced or removed while we read: look again
            if isinstance(err, FileNotFoundError):
                missing = str(err.filename or err).rsplit("/", 1)[-1]
                return Probe(EntryState.DAMAGED, meta, reason=f"missing data file {missing}"), {}
            return Probe(EntryState.DAMAGED, meta, reason=str(err)), {}
        except StoreOutage:
            raise
        except OSError as err:  # a permission error: never an exception from a probe
            return Probe(EntryState.DAMAGED, meta, reason=f"cannot read {entry.path}: {err}"), {}

    @staticmethod
    def _look_legacy(entry: PinnedEntry, meta: dict[str, Any], legacy: tuple[str, ...], names: list[str] | None,
                     read: bool) -> _Found:
        present = [n for n in legacy if valid_name(n) and entry.has_file(n)]
        if not present:
            if entry.replaced():
                raise Raced()
            return Probe(EntryState.DAMAGED, meta, reason="no data file beside meta.json"), {}
        out = {}
        if read:
            for name in (present if names is None else names):
                if not valid_name(name):
                    raise BadFile(f"{name!r} is not a file name inside the entry")
                try:
                    out[name] = entry.read(name, None)
                except FileNotFoundError:
                    continue  # verl's entries hold one of their formats' files, not all of them
        return Probe(EntryState.PRESENT, meta), out

    # ------------------------------------------------------------------ writing

    def write_entry(self, path: str, files: Mapping[str, FileBytes], meta: Mapping[str, Any],
                    overwrite: bool = True) -> int:
        """Publish an entry atomically; returns the bytes written (0 if one is there and ``overwrite`` is
        False).

        Raises:
            OSError: the entry could not be written (a bad file name, a link in the way, a full
                disk ...); nothing partial is left behind.
        """
        _check_names(path, files)
        if not self.capabilities.atomic_dir_publish:
            return objects.write_entry(self, path, files, meta, overwrite)
        staging = self.backend.stage(path)
        try:
            total = _fill(staging, files, meta)
            staging.sync()
            return total if staging.publish(overwrite) else 0
        finally:
            staging.discard()

    def write_entries(self, entries: Iterable[tuple[str, Mapping[str, FileBytes], Mapping[str, Any]]]
                      ) -> list[int | Exception]:
        """Publish several entries, each whole and durable before it is visible, their syncs batched where
        the backend can (:attr:`~stepskip._storage.base.Capabilities.batched_fsync`: many small entries).

        Returns:
            Per entry, in order: the bytes written, or the exception that kept it from being written
            (nothing partial of it is left behind); one entry's failure does not stop the others.
        """
        if not self.capabilities.atomic_dir_publish:
            results: list[int | Exception] = []
            for path, files, meta in entries:
                try:
                    results.append(self.write_entry(path, files, meta))
                except Exception as err:  # reported for this entry alone
                    results.append(err)
            return results
        batch = self.backend.batch()
        staged: list[tuple[Staging, int] | Exception] = []
        try:
            for i, (path, files, meta) in enumerate(entries):
                try:
                    _check_names(path, files)
                    staging = batch.stage(path)
                except Exception as err:  # reported for this entry alone
                    staged.append(err)
                    continue
                try:
                    total = _fill(staging, files, meta)
                except Exception as err:
                    staging.discard()
                    staged.append(err)
                    continue
                staged.append((staging, total))
                batch.staged(i, staging)
            failed = batch.sync()  # every entry durable: then the renames
            results = []
            for i, item in enumerate(staged):
                if isinstance(item, Exception):
                    results.append(item)
                    continue
                try:
                    if i in failed:
                        raise failed[i]
                    item[0].publish(True)
                    results.append(item[1])
                except Exception as err:  # reported for this entry alone, as when staging
                    item[0].discard()
                    results.append(err)
            batch.published()
            return results
        finally:
            batch.close()

    def put_small(self, path: str, data: bytes) -> None:
        """Write one small file so that readers see the old bytes or the new ones, never a mix
        (a rename locally, one PUT on object stores); the last writer wins.

        Raises:
            OSError: it could not be written.
        """
        self.backend.put_file(path, data)

    def publish_dir(self, staging: str, path: str) -> None:
        """Publish the directory ``staging`` (a ``.tmp-`` sibling of ``path`` holding complete entries) as
        ``path`` in one step (:attr:`~stepskip._storage.base.Capabilities.atomic_dir_publish`).

        Raises:
            OSError: ``staging`` is not a hidden temporary beside ``path``, or cannot be published.
        """
        self.backend.publish_dir(staging, path)

    # ------------------------------------------------------------------ deleting

    def remove(self, path: str) -> None:
        """Delete a file or a whole directory; a missing path is fine. A symbolic link is removed
        itself, never its target; nothing inside a removed directory is followed either.

        Raises:
            OSError: ``path`` is spelled with ``..``, lies outside the root or is the root (object
                stores, which have no links to refuse instead), or reaching it would follow a
                symbolic link below the root; nothing is deleted then.
        """
        self.backend.remove(path)

    def retire_entry(self, path: str) -> bool:
        """Remove one entry so that readers see it whole or not at all; returns False when none was there.

        Locally the entry is renamed to a ``.trash-`` sibling, then deleted without following any
        link; on object stores its ``meta.json`` goes first, then its objects.

        Raises:
            OSError: as :meth:`remove`.
        """
        return self.backend.retire(path)

    def remove_leftovers(self, path: str, older_than: float = STALE_SECONDS, tree: Tree | None = None,
                         listed: list[str] | None = None) -> list[str]:
        """Delete what interrupted writes left in the entries under ``path`` once stale.

        Where directories are published atomically: the ``.tmp-`` and ``.trash-`` names directly under
        ``path`` (one listing, and a look at each of those). Elsewhere: objects no ``meta.json`` names
        and replaced ones past their grace period (:func:`~stepskip._storage.objects.remove_leftovers`).

        Args:
            path: the directory holding the entries.
            older_than: seconds since a leftover was last written before it counts as stale.
            tree: a :meth:`scan` covering ``path``, taken by the caller (listed here otherwise).
            listed: where ``path`` itself is listed (atomic-publish backends), every name seen there is
                appended to this list, for a caller that needs the listing too; left alone elsewhere.

        Returns:
            The paths deleted.
        """
        if not self.capabilities.atomic_dir_publish:
            return objects.remove_leftovers(self, path, older_than, tree)
        seen = self.backend.names(path)
        if listed is not None:
            listed.extend(seen)
        removed: list[str] = []
        now = self.clock()
        for name in seen:
            if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                where = f"{path.rstrip('/')}/{name}"
                item = self.backend.stat(where)
                if item is None or item.mtime is None or now - item.mtime < older_than:
                    continue
                self.backend.remove(where)
                removed.append(where)
        return removed

    def may_hold_leftovers(self, path: str, tree: Tree | None, older_than: float = STALE_SECONDS) -> bool:
        """False only when ``tree`` shows that :meth:`remove_leftovers` would delete nothing under ``path``."""
        if tree is None or not tree.covers(path) or self.capabilities.atomic_dir_publish:
            return True
        return objects.entries_may_hold_leftovers(self, path, tree, older_than)

    # ------------------------------------------------------------------ looking at directories

    def scan(self, path: str) -> Tree | None:
        """Every file below ``path`` in one listing, where the backend lists a whole tree cheaply (object
        stores: one request per 1,000 objects); None where it does not (local directories are listed
        one by one, which costs no requests)."""
        return self.backend.scan(path)

    def list_dir(self, path: str, dirs_only: bool = False) -> list[str]:
        """Names (not paths) directly under ``path``; empty when it does not exist or is a link.

        Args:
            path: the directory to list.
            dirs_only: only real subdirectories (symbolic links to directories are left out).
        """
        return self.backend.names(path, dirs_only)

    def list_items(self, path: str) -> list[DirItem]:
        """What is directly under ``path`` with kind, size and time, links reported as links (never
        followed); empty when ``path`` is not a directory reached without following a link."""
        return self.backend.items(path)

    def stat_item(self, path: str) -> DirItem | None:
        """``path`` itself, not followed if it is a link; None when it does not exist."""
        return self.backend.stat(path)

    def is_dir(self, path: str) -> bool:
        """True when ``path`` is a directory reached without following a symbolic link in the store."""
        return self.backend.is_dir(path)

    def dir_version(self, path: str) -> tuple[int, ...] | None:
        """A value that changes whenever the names in directory ``path`` change; None where the backend has
        none (object stores): listings are then never reused (see :func:`~stepskip._storage.base.settled`)."""
        return self.backend.dir_version(path)

    def forget_listings(self, path: str) -> None:
        """Drop any listing cached for ``path`` and below, so the next listing shows what others wrote since
        (object stores' clients cache listings; local directories are always listed afresh)."""
        self.backend.forget_listings(path)


def _unavailable(err: StoreOutage) -> Probe:
    return Probe(EntryState.UNAVAILABLE, reason=str(err.strerror))


def _check_names(path: str, files: Mapping[str, FileBytes]) -> None:
    for name in files:
        if not valid_name(name) or name == META_FILE:
            raise OSError(errno.EINVAL, f"cannot store a data file named {name!r}: "
                                        "it must be one file name (no '/', '..', NUL)", path)


def _fill(staging: Staging, files: Mapping[str, FileBytes], meta: Mapping[str, Any]) -> int:
    """Write an entry's files and its ``meta.json`` (their sizes and checksums listed); the bytes written."""
    listing: dict[str, dict[str, Any]] = {}
    total = 0
    for name, data in files.items():
        data = contiguous(data)  # the bytes written and checksummed are the same ones
        staging.write(name, data)
        size = nbytes(data)
        listing[name] = {"bytes": size, "checksum": checksum(data)}
        total += size
    body = meta_bytes(meta, listing)
    staging.write(META_FILE, body)
    return total + len(body)


def _resolve(names: Names, meta: dict[str, Any]) -> list[str] | None:
    return list(names(meta)) if callable(names) else names


def _check_files(meta: Mapping[str, Any], names: list[str] | None) -> list[str]:
    """The listed files to read; raises BadFile for a name the entry does not list."""
    listed = meta["files"]
    wanted = list(listed) if names is None else names
    for name in wanted:
        if name not in listed:
            raise BadFile(f"{name} is not listed in {META_FILE}")
    return wanted


def _from_kept(meta: dict[str, Any], kept: Mapping[str, bytes | memoryview], names: list[str] | None,
               verify: bool) -> dict[str, bytes | memoryview] | None:
    """The files ``names`` chose, from those a probe kept (every listed file, its size checked then),
    each checked against its checksum with ``verify``; None when one is not listed or does not match
    (the caller then reads the entry afresh, which tells damage from a stale look)."""
    try:
        wanted = _check_files(meta, names)
        return {name: _verified(name, kept[name], meta["files"][name], verify) for name in wanted}
    except BadFile:
        return None


def _verified(name: str, data: _Data, info: Mapping[str, Any], verify: bool) -> _Data:
    if verify and checksum(data) != info.get("checksum"):
        raise BadFile(f"{name} does not match its checksum in {META_FILE}")
    return data
