"""A role's store seen through read-only layers: ``dump_dir`` first, then each layer in order.

A layer is another store holding the same layout (a ``sources`` cache, or another run's directory
for ``replay_from``) mapped onto a prefix of the dump dir's namespace: a path the role builds under
that prefix is read from the dump dir when it is there, else from the first layer holding it. The
role keeps building its own paths and deciding its own calls; only where an entry comes from
changes. Every write goes to the dump dir: a layer is reached through :class:`ReadOnlyStore`, which
has no method that writes.

A layer's entry that is damaged, or that the role cannot use (another role's, an unknown format), is
passed over as missing from that layer, logged and left as it is. An entry read from a layer carries
its :class:`Origin` in its ``meta`` (under :data:`ORIGIN_KEY`, an object no ``meta.json`` can hold),
so that the hit's counters, log line and fidelity messages name where it came from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from stepskip._storage.base import Capabilities, DirItem, EntryState, Probe
from stepskip._storage.entries import EntryStore
from stepskip._storage.meta import MANIFEST_FILE
from stepskip._storage.readonly import ReadOnlyStore
from stepskip.errors import CacheMissError, CorruptEntryError

__all__ = ["Layer", "LayeredStore", "ORIGIN_KEY", "Origin", "origin_of"]

logger = logging.getLogger(__name__)

#: The key of an entry's ``meta`` that holds its :class:`Origin` when a layer served it.
ORIGIN_KEY = "stepskip:origin"
#: Directories below a run directory that belong to the run that wrote them, never read from a layer
#: (another run's drift records are not this run's).
_OWN_DIRS = frozenset({".stepskip-drift"})
#: At most this many passed-over layer entries are remembered, so each is logged once.
_WARNED_MAX = 4096


@dataclass(frozen=True)
class Origin:
    """Where an entry read through a layer came from.

    Args:
        label: the layer, as messages name it (``source 0 (s3://team/cache)``, ``replay_from``).
        counter: the role's counter of hits from this layer (``hits_from/0``, ``hits_from/replay_from``).
        path: the entry's path in that layer's store.
        run_dir: the run directory the entry belongs to, in that store.
    """

    label: str
    counter: str
    path: str
    run_dir: str

    def describe(self, path: str | None = None) -> str:
        """``{path} (from {label}, run directory {run_dir})``, as log lines and errors name the entry
        (``path``: another path in that layer, e.g. the entry's step directory)."""
        return f"{self.path if path is None else path} (from {self.label}, run directory {self.run_dir})"


def origin_of(meta: Mapping[str, Any] | None) -> Origin | None:
    """The :class:`Origin` of an entry's ``meta``; None for an entry read from the dump dir itself."""
    if not meta:
        return None
    found = meta.get(ORIGIN_KEY)
    return found if isinstance(found, Origin) else None


@dataclass(frozen=True)
class Layer:
    """One read-only layer under a dump dir.

    Args:
        store: the layer's store, read-only.
        mapped: the prefix of the dump dir's namespace the layer stands under (the dump dir itself
            for a source; the run's experiment or run directory for ``replay_from``).
        target: what ``mapped`` is in the layer's store.
        label: how messages name the layer.
        counter: the role's counter of hits from the layer.
        run_dir: this run's run directory as the layer holds it (the run entries come from).
    """

    store: ReadOnlyStore
    mapped: str
    target: str
    label: str
    counter: str
    run_dir: str

    def local(self, path: str) -> str | None:
        """``path`` (in the dump dir's namespace) in the layer's store; None when the layer does not cover it."""
        if path == self.mapped:
            return self.target
        if not path.startswith(self.mapped + "/"):
            return None
        rest = path[len(self.mapped):]
        if _OWN_DIRS.intersection(rest.split("/")):
            return None
        return self.target + rest

    def origin(self, path: str) -> Origin:
        return Origin(self.label, self.counter, path, self.run_dir)


#: Judges a layer's present entry for the role reading it: None when usable, else why not.
Judge = Callable[[str, Probe], "str | None"]


class LayeredStore:
    """The dump dir's :class:`~stepskip._storage.entries.EntryStore` with read-only layers below it (see
    the module docstring). Every method it does not define is the dump dir's store's.

    Args:
        primary: the dump dir's store: the only one written.
        layers: the layers, searched in order after ``primary``.
        judge: tells whether a layer's present entry is usable by the role (None) or why not.
        role: the role's name, for log lines.
    """

    def __init__(self, primary: EntryStore, layers: list[Layer], judge: Judge | None = None, role: str = "") -> None:
        self.primary = primary
        self.layers = list(layers)
        self.judge = judge
        self.role = role
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.primary, name)

    def __repr__(self) -> str:
        return f"LayeredStore({self.primary!r}, {[layer.label for layer in self.layers]})"

    @property
    def capabilities(self) -> Capabilities:
        return self.primary.capabilities

    @property
    def root(self) -> str | None:
        return self.primary.root

    def _covering(self, path: str) -> list[tuple[Layer, str]]:
        out = []
        for layer in self.layers:
            local = layer.local(path)
            if local is not None:
                out.append((layer, local))
        return out

    def _pass_over(self, layer: Layer, path: str, reason: str) -> None:
        """A layer's entry that cannot serve: logged once, counted as missing there, left as it is."""
        key = (path, reason)
        with self._lock:
            if key in self._warned:
                return
            if len(self._warned) >= _WARNED_MAX:
                self._warned.clear()
            self._warned.add(key)
        logger.warning("%s: %s: the entry at %s cannot be used (%s); it counts as missing there and is left "
                       "untouched (nothing is ever written to %s)", self.role, layer.label, path, reason, layer.label)

    @staticmethod
    def _mark(meta: dict[str, Any] | None, origin: Origin | None) -> None:
        if meta is None:
            return
        if origin is None:
            meta.pop(ORIGIN_KEY, None)
        else:
            meta[ORIGIN_KEY] = origin

    # ------------------------------------------------------------------ entries

    def probe(self, path: str, legacy_files: Iterable[str] = (), keep: int = 0) -> Probe:
        """The dump dir's probe of ``path``, unless it finds nothing there: then the first layer's present
        and usable entry (damaged or unusable ones passed over), else missing."""
        found = self.primary.probe(path, legacy_files, keep)
        if found.state is not EntryState.MISSING:
            self._mark(found.meta, None)
            return found
        for layer, local in self._covering(path):
            look = layer.store.probe(local, legacy_files, keep)
            if look.state is EntryState.MISSING:
                continue
            reason = look.reason if look.state is not EntryState.PRESENT else (
                self.judge(local, look) if self.judge is not None else None)
            if reason is not None:
                self._pass_over(layer, local, reason or look.state.value)
                continue
            self._mark(look.meta, layer.origin(local))
            return look
        return found

    def read_entry(self, path: str, legacy_files: Iterable[str] = (), names: Any = None, verify: bool = True,
                   allocator: Any = None, probe: Probe | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Read ``path`` from the dump dir, else from the first layer holding a usable version of it; a
        ``probe`` a layer answered is read from that layer (the layers before it had nothing then).

        Raises:
            CacheMissError: neither the dump dir nor any layer holds it (damaged layer entries pass over).
            CorruptEntryError: the dump dir's entry is damaged.
        """
        hinted = origin_of(probe.meta if probe is not None else None)
        if hinted is None:
            try:
                meta, files = self.primary.read_entry(path, legacy_files, self._names(names, None), verify,
                                                      allocator, probe)
                return meta, files
            except CorruptEntryError:
                raise  # the dump dir's own damage: the role reports and regenerates it
            except CacheMissError:
                pass
        covering = self._covering(path)
        if hinted is not None:
            labels = [layer.label for layer, _ in covering]
            covering = covering[labels.index(hinted.label):] if hinted.label in labels else covering
        for layer, local in covering:
            origin = layer.origin(local)
            own = probe if hinted is not None and hinted.path == local else None
            try:
                meta, files = layer.store.read_entry(local, legacy_files, self._names(names, origin), verify,
                                                     allocator, own)
            except CorruptEntryError as err:  # before CacheMissError, its base
                self._pass_over(layer, local, str(err))
                continue
            except CacheMissError:
                continue
            self._mark(meta, origin)
            return meta, files
        raise CacheMissError(f"{path}: no entry there nor in {', '.join(layer.label for layer in self.layers)}")

    @staticmethod
    def _names(names: Any, origin: Origin | None) -> Any:
        """The caller's choice of files, given a ``meta`` marked with where it is read from."""
        if not callable(names):
            return names

        def chosen(meta: dict[str, Any]) -> Any:
            LayeredStore._mark(meta, origin)
            return names(meta)

        return chosen

    def read_files(self, path: str, meta: Mapping[str, Any], names: Iterable[str], verify: bool) -> Any:
        """The files of the entry whose ``meta`` was read, from the store it was read from."""
        origin = origin_of(meta)
        if origin is not None:
            for layer, local in self._covering(path):
                if layer.label == origin.label:
                    return layer.store.read_files(local, meta, names, verify)
        return self.primary.read_files(path, meta, names, verify)

    def read_small(self, path: str, limit: int) -> bytes | None:
        """A small file from the dump dir, else the first layer holding it. A V1 step's manifest comes
        only from the first store holding the step at all: a step written in place (no manifest) in the
        dump dir is not overridden by a layer's manifest."""
        found = self.primary.read_small(path, limit)
        if found is not None:
            return found
        manifest = path.rsplit("/", 1)[-1] == MANIFEST_FILE
        parent = path.rsplit("/", 1)[0]
        if manifest and self.primary.is_dir(parent):
            return None
        for layer, local in self._covering(path):
            try:
                found = layer.store.read_small(local, limit)
            except CorruptEntryError as err:
                self._pass_over(layer, local, str(err))
                continue
            if found is not None:
                return found
            if manifest and layer.store.is_dir(local.rsplit("/", 1)[0]):
                return None
        return None

    # ------------------------------------------------------------------ directories

    def list_dir(self, path: str, dirs_only: bool = False) -> list[str]:
        """The names under ``path`` in the dump dir and in every layer covering it."""
        names = self.primary.list_dir(path, dirs_only)
        covering = self._covering(path)
        if not covering:
            return names
        union = set(names)
        for layer, local in covering:
            union.update(layer.store.list_dir(local, dirs_only))
        return sorted(union)

    def list_items(self, path: str) -> list[DirItem]:
        items = {item.name: item for item in self.primary.list_items(path)}
        for layer, local in self._covering(path):
            for item in layer.store.list_items(local):
                items.setdefault(item.name, item)
        return [items[name] for name in sorted(items)]

    def stat_item(self, path: str) -> DirItem | None:
        found = self.primary.stat_item(path)
        for layer, local in self._covering(path) if found is None else ():
            found = layer.store.stat_item(local)
            if found is not None:
                break
        return found

    def is_dir(self, path: str) -> bool:
        return self.primary.is_dir(path) or any(layer.store.is_dir(local) for layer, local in self._covering(path))

    def dir_version(self, path: str) -> tuple[int, ...] | None:
        """The versions of ``path`` in the dump dir and every layer covering it, joined (its third field the
        newest mtime, as :func:`~stepskip._storage.base.settled` reads it); None when one has none."""
        version = self.primary.dir_version(path)
        covering = self._covering(path)
        if not covering or version is None:
            return version
        parts = [version]
        for layer, local in covering:
            other = layer.store.dir_version(local)
            if other is None:
                return None
            parts.append(other)
        return (0, 0, max(p[2] for p in parts), *(field for part in parts for field in part))

    def forget_listings(self, path: str) -> None:
        self.primary.forget_listings(path)
        for layer, local in self._covering(path):
            layer.store.forget_listings(local)
