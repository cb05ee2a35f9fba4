"""Sharing a cache: steps removed during the run (``max_keep``, ``max_bytes``, ``pin_steps``), and the
start-up of a role that only reads (``read_only``).

Retention runs in the dump pipeline, right after a step is committed (on the dump thread under
``async_dump``, never the caller's), over the role's own directory. It removes whole step
directories the way ``stepskip prune`` does, with the same code
(:func:`stepskip.cli.prune.retire_steps`): a step is renamed away before it is deleted locally, and
loses its commit point first on object stores, so a reader sees it whole or not at all. Steps are
ranked by step number, highest first (as ``prune --keep-last``): the same answer on every node
whatever its clock. Never removed: pinned steps, the step just committed (for ``max_bytes``: a
step bigger than the cap stays alone rather than being recorded in vain), steps this role is
reading or read last (``repeat`` keeps serving the step it found), steps this run is still
writing, half-written directories (another writer may be filling them) and entries this stepskip
cannot read (someone else's data, as ``prune`` protects them).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from stepskip._layout import Layout

if TYPE_CHECKING:
    from stepskip._storage import Tree
    from stepskip._index import CacheIndex, StepDir
    from stepskip.roles.cached import CachedRole

__all__ = ["RETENTION_STAT_NAMES", "Retention", "start_read_only"]

logger = logging.getLogger(__name__)

#: The counters of a role that removes steps: steps removed, and the bytes they held.
RETENTION_STAT_NAMES = ("retired", "retired_bytes")
#: The last steps read stay, besides those being read: a call that found one may read it again.
_RECENT_READS = 2


class Retention:
    """The steps one role removes from its directory after each commit.

    Args:
        role: the role (its config's ``max_keep``, ``max_bytes`` and ``pin_steps``, its store, its counters).

    Example:
        ``skip.rollout: {max_keep: 8, pin_steps: [100]}`` keeps step 100 and the 8 highest others.
    """

    def __init__(self, role: CachedRole) -> None:
        config = role.config
        self.role = role
        self.max_keep: int | None = config.max_keep
        self.max_bytes: int | None = config.max_bytes if isinstance(config.max_bytes, int) else None
        self.pinned = config.pin_set
        self.lock = threading.Lock()
        self._held: collections.Counter[int] = collections.Counter()
        self._recent: collections.deque[int] = collections.deque(maxlen=_RECENT_READS)
        self._index: CacheIndex | None = None
        self._running = threading.Lock()  # one pass at a time (sync dumps from several threads)

    def reset(self) -> None:
        """A new run (the role bound again): its directory is another's, and nothing of it was read yet."""
        self._index = None
        with self.lock:
            self._recent.clear()

    def after_fork(self) -> None:
        """In a forked child: the parent's reads are not this process's; locks are fresh."""
        self.lock = threading.Lock()
        self._running = threading.Lock()
        self._held = collections.Counter()

    # ------------------------------------------------------------------ readers

    def hold(self, step: int) -> None:
        """A read of ``step`` begins: it is not removed until :meth:`release` (nor while it stays among the
        last steps read)."""
        with self.lock:
            self._held[step] += 1
            if step in self._recent:
                self._recent.remove(step)
            self._recent.append(step)

    def release(self, step: int) -> None:
        """The read of ``step`` that :meth:`hold` announced is over."""
        with self.lock:
            self._held[step] -= 1
            if self._held[step] <= 0:
                del self._held[step]

    def in_use(self) -> set[int]:
        """Steps being read, or read last."""
        with self.lock:
            return set(self._held) | set(self._recent)

    # ------------------------------------------------------------------ removing

    def after_commit(self, steps: list[int]) -> None:
        """Apply retention once ``steps`` were committed; a failure is logged, never raised (the dump boundary)."""
        try:
            with self._running:
                self.apply(set(steps))
        except Exception as err:  # the dump boundary: removing old steps must never stop the run
            logger.warning("%s retention: not applied after step(s) %s: %s: %s", self.role.name,
                           ", ".join(map(str, sorted(steps))), type(err).__name__, err)

    def apply(self, committed: set[int]) -> list[str]:
        """Remove the steps beyond ``max_keep`` and ``max_bytes``; returns the paths removed.

        Args:
            committed: the steps just committed (the highest of them is never removed for ``max_bytes``).
        """
        role = self.role
        index = self.index()
        root = index.root
        store = index.store
        store.forget_listings(root)  # a client that caches listings would show the directory of the last pass
        tree = store.scan(root) if self.max_bytes is not None else None
        names = tree.dirs(root) if tree is not None else [i.name for i in store.list_items(root) if i.kind == "dir"]
        steps = sorted(((step, f"{root}/{name}") for name in names if (step := Layout.parse_step(name)) is not None),
                       reverse=True)  # highest first
        ranked = [(step, path) for step, path in steps if step not in self.pinned]
        chosen: list[tuple[int, str]] = []
        if self.max_keep is not None:
            chosen = ranked[self.max_keep:]
        if self.max_bytes is not None:
            sizes = {path: _size(index, tree, path) for _, path in steps}
            total = sum(sizes.values()) - sum(sizes[path] for _, path in chosen)
            newest = max(committed, default=None)
            for step, path in reversed(ranked[:len(ranked) - len(chosen)]):  # lowest first
                if total <= self.max_bytes:
                    break
                if step == newest:
                    continue  # a step bigger than the cap alone stays, or recording it was in vain
                chosen.append((step, path))
                total -= sizes[path]
            if total > self.max_bytes:
                logger.warning("%s retention: %s holds %d bytes, more than max_bytes %d, with nothing more it may "
                               "remove (pinned steps and the step just recorded stay)", role.name, root, total,
                               self.max_bytes)
        if not chosen:
            return []
        busy = self.in_use() | (self._writing() - committed)  # a batch's dumps are queued until it is over
        removed: list[str] = []
        for step, path in sorted(chosen):
            if step in busy:
                continue  # removed by a later pass, once no longer read or written
            found = self._removable(index, path, step)
            if found is None:
                continue
            removed += self._retire(index, found)
        if removed:
            role.listing.wrote()  # the next listing is taken afresh
        return removed

    def index(self) -> CacheIndex:
        """The index over the role's directory that scans and removes its steps (opened on first use)."""
        if self._index is None:
            from stepskip._index import CacheIndex

            self._index = CacheIndex(self.role.project_dump_dir, self.role.config.storage_options)
        return self._index

    def _writing(self) -> set[int]:
        """Steps this role is still writing: queued dumps, and V1 steps not yet published."""
        role = self.role
        steps = {s for name in role.dumper.queued_in(role.project_dump_dir)
                 if (s := Layout.parse_step(name) if not name.startswith(".") else Layout.parse_staging(name))
                 is not None}
        return steps | role.dumper.commit.in_progress()

    def _removable(self, index: CacheIndex, path: str, step: int) -> StepDir | None:
        """The scanned step when it may be removed now; None (with the reason logged) when not."""
        from stepskip.cli.prune import protected_issues
        from stepskip._index import StepKind

        found = index.scan_step(path, step, role=self._role_of_dir())
        if found.kind is StepKind.HALF_WRITTEN:
            logger.debug("%s retention: %s kept: half-written (another writer may be filling it)", self.role.name, path)
            return None
        issues = protected_issues(index, found)
        if issues:
            logger.warning("%s retention: %s kept: %s", self.role.name, path, issues[0].detail)
            return None
        return found

    def _role_of_dir(self) -> str | None:
        return self.role.layout_subdir()

    def _retire(self, index: CacheIndex, step: StepDir) -> list[str]:
        from stepskip.cli.prune import retire_steps

        role = self.role
        removed = retire_steps(index, [step])
        for path in removed:
            role.stats.add(retired=1, retired_bytes=step.bytes)
            logger.info("%s retired: step %d removed from %s (%d bytes; max_keep %s, max_bytes %s, pinned %s)",
                        role.name, step.step, path, step.bytes, self.max_keep, self.max_bytes,
                        self.pinned.spec if self.pinned else "none")
        return removed


def _size(index: CacheIndex, tree: Tree | None, path: str) -> int:
    """The bytes below ``path``: from the one listing taken (object stores), else listed here."""
    if tree is None:
        return index.tree_stats(path)[0]
    total, pending = 0, [path]
    while pending:
        current = pending.pop()
        total += sum(item.size for item in tree.files(current).values())
        pending += [f"{current}/{name}" for name in tree.dirs(current)]
    return total


def start_read_only(role: CachedRole, key: str) -> None:
    """The start-up of a role under ``read_only``: the dump dir is looked at, never created, tried for
    writing or cleaned up.

    A local dump dir that does not exist is a warning (every step is then a miss, generated and not
    recorded); one this process cannot list is a :class:`~stepskip.errors.SkipConfigError`. On an
    object store the first request (a listing) tries the credentials and the endpoint.

    Raises:
        SkipConfigError: the dump dir cannot be read.
    """
    from stepskip._storage import check_dump_dir
    from stepskip._storage.local import local_path
    from stepskip._access import describe_store_access_error, is_store_access_error
    from stepskip.errors import SkipConfigError

    local = local_path(role.dump_dir)
    if local is not None:
        if not os.path.isdir(os.path.expanduser(local)):
            logger.warning("%s = %r does not exist: with read_only nothing is replayed from it, and every step is "
                           "generated (and not recorded)", key, role.dump_dir)
            return
        check_dump_dir(role.dump_dir, role.config.storage_options, key=key, entry_dir=role.layout.project_dir)
        return
    try:
        role.store.list_items(role.layout.project_dir)
    except Exception as err:
        if not is_store_access_error(err):
            raise
        raise SkipConfigError(f"{key} = {describe_store_access_error(role.dump_dir, err)}") from err
