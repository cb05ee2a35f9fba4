"""Layered caches: the ``sources`` a role reads after its dump dir, and the run ``replay_from`` names.

Both are read-only layers of the role's store (:mod:`stepskip._storage.layered`): the role builds
its paths in its dump dir as always; a path its dump dir does not hold is looked up in the
``replay_from`` run, then in each source in order. The dump dir stays the only place written.

- A source is laid out as a dump dir: the entries of this run are in this run's run directory under
  it. The whole source stands under the dump dir, so ``action: match`` finds its prompt hints and
  its other run shapes too.
- ``replay_from: {experiment_name, project_name}`` reads that experiment of the dump dir (this
  run's shape); ``replay_from: RUN_DIR`` (a path or URL) reads that one run directory.

Everything is opened and checked when the role starts: a bad URL, a local source that does not
exist, a store that cannot be reached, a ``replay_from`` run that does not exist (the error lists
those that do, closest first) are :class:`~stepskip.errors.SkipConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from stepskip._reading.classify import EntryStatus
from stepskip._storage import EntryStore, Probe, open_store
from stepskip._storage.layered import Layer, LayeredStore
from stepskip._storage.readonly import ReadOnlyStore
from stepskip._access import describe_store_access_error, is_store_access_error
from stepskip.errors import SkipConfigError
from stepskip._layout import RUN_DIR, Layout, is_url, normalize_location
from stepskip._policies import SkipAction

if TYPE_CHECKING:
    from stepskip.roles.cached import CachedRole

__all__ = ["REPLAY_FROM_COUNTER", "check_layer_options", "open_layers", "source_counter"]

logger = logging.getLogger(__name__)

#: The counter of hits read from the ``replay_from`` run.
REPLAY_FROM_COUNTER = "hits_from/replay_from"
#: At most this many run directories are named by the error of a ``replay_from`` run that does not exist.
_RUNS_SHOWN = 12
#: At most this many experiment directories are listed to find them.
_EXPERIMENTS_LISTED = 200
_REPLAY_KEYS = ("experiment_name", "project_name")
_SOURCE_KEYS = ("url", "storage_options")


def source_counter(index: int) -> str:
    """The counter of hits read from source ``index`` (``hits_from/0``)."""
    return f"hits_from/{index}"


# --------------------------------------------------------------------------- validation (no I/O)


def check_layer_options(config: Any, where: str) -> None:
    """Check ``sources`` and ``replay_from`` of a role's config; raise :class:`SkipConfigError` naming the key."""
    sources = config.sources
    if not isinstance(sources, (list, tuple)):
        raise SkipConfigError(f"{where}.sources = {sources!r} is not valid; expected a list of paths or URLs "
                              "(each laid out as a dump dir), e.g. [s3://team-cache/rollouts]")
    for i, item in enumerate(sources):
        _source_spec(item, f"{where}.sources[{i}]")
    replay_from = config.replay_from
    if replay_from is None:
        return
    key = f"{where}.replay_from"
    if isinstance(replay_from, str):
        if not replay_from.strip():
            raise SkipConfigError(f"{key} = {replay_from!r} is not valid; expected a run directory's path or URL "
                                  "or {experiment_name: ..., project_name: ...}")
        return
    if not isinstance(replay_from, Mapping):
        raise SkipConfigError(f"{key} = {replay_from!r} is not valid; expected {{experiment_name: ..., "
                              "project_name: ...}} or the path or URL of a run directory")
    unknown = sorted(set(map(str, replay_from)) - set(_REPLAY_KEYS))
    if unknown:
        raise SkipConfigError(f"{key} has unknown key(s) {', '.join(map(repr, unknown))}; known keys: "
                              f"{', '.join(_REPLAY_KEYS)} (or give a run directory's path or URL instead)")
    if not replay_from:
        raise SkipConfigError(f"{key} = {{}} names no run; give experiment_name and project_name")
    for name, value in replay_from.items():
        if not isinstance(value, str) or not value.strip():
            raise SkipConfigError(f"{key}.{name} = {value!r} is not valid; expected a non-empty string")


def _source_spec(item: Any, key: str) -> tuple[str, dict[str, Any] | None]:
    """``(url, storage options or None for the role's)`` of one ``sources`` item."""
    options: Any = None
    url = item
    if isinstance(item, Mapping):
        unknown = sorted(set(map(str, item)) - set(_SOURCE_KEYS))
        if unknown or "url" not in item:
            raise SkipConfigError(f"{key} = {dict(item)!r} is not valid; a source given as a mapping has the keys "
                                  f"url (required) and storage_options")
        url, options = item["url"], item.get("storage_options")
        if options is not None and (not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options)):
            raise SkipConfigError(f"{key}.storage_options = {options!r} is not valid; expected a mapping of fsspec "
                                  "filesystem options")
    if not isinstance(url, str) or not url.strip():
        raise SkipConfigError(f"{key} = {item!r} is not valid; expected a path or fsspec URL (laid out as a dump dir) "
                              "or {url: ..., storage_options: {...}}")
    if is_url(url):
        scheme, _, rest = url.partition("://")
        if not scheme or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum() \
                or not rest.strip("/"):
            raise SkipConfigError(f"{key} = {url!r} is not a URL stepskip can open: expected scheme://location "
                                  "(e.g. s3://bucket/prefix) or a local path")
    return url, None if options is None else dict(options)


# --------------------------------------------------------------------------- opening (at start-up)


def open_layers(role: CachedRole, primary: EntryStore) -> LayeredStore | None:
    """The role's store with its ``replay_from`` run and ``sources`` below the dump dir; None when it has
    neither (the dump dir's store is then used as it is: nothing is added to a call).

    Raises:
        SkipConfigError: a layer cannot be opened, reached or found (the message names the key).
    """
    config = role.config
    if not config.sources and config.replay_from is None:
        return None
    where = f"skip.{role.name}"
    layout = role.layout
    layers: list[Layer] = []
    if config.replay_from is not None:
        if role.action is SkipAction.MATCH and isinstance(config.replay_from, str):
            raise SkipConfigError(
                f"{where}.replay_from = {config.replay_from!r}: action 'match' looks prompts up across an "
                "experiment's run directories, which a single run directory does not give; name the run as "
                f"{where}.replay_from = {{experiment_name: ..., project_name: ...}} instead, or choose another action")
        layers.append(_replay_layer(role, primary, f"{where}.replay_from"))
    seen = {layout.dump_dir}
    for i, item in enumerate(config.sources):
        key = f"{where}.sources[{i}]"
        url, options = _source_spec(item, key)
        root = normalize_location(url)
        if root in seen:
            what = "the dump_dir" if root == layout.dump_dir else "listed twice"
            raise SkipConfigError(f"{key} = {url!r} is {what}; each source is searched once, after dump_dir: remove it")
        seen.add(root)
        store = _open(url, config.storage_options if options is None else options, key, must_exist=True)
        run_dir = root + layout.run_dir_of(layout.run_name)[len(layout.dump_dir):]
        layers.append(Layer(ReadOnlyStore(store, f"{key} is a read-only source"), layout.dump_dir, root,
                            f"source {i} ({url})", source_counter(i),
                            run_dir))
    role.stats.declare(*(layer.counter for layer in layers))
    reader = role.reader

    def judge(path: str, probe: Probe) -> str | None:
        look = reader.classify(path, probe)
        return None if look.state is EntryStatus.PRESENT else (look.reason or look.state.value)

    logger.info("%s: reading %s after %s (never written)", role.name, ", ".join(layer.label for layer in layers),
                layout.dump_dir)
    return LayeredStore(primary, layers, judge, role.name)


def _open(url: str, options: Mapping[str, Any], key: str, must_exist: bool) -> EntryStore:
    """A store for a layer at ``url``, with one request made now (an unreachable store fails here)."""
    root = normalize_location(url)
    if not is_url(root) and must_exist and not os.path.isdir(root):
        raise SkipConfigError(f"{key} = {url!r}: {root} does not exist or is not a directory; a source is read, "
                              "never created: give an existing cache's path")
    try:
        store = open_store(url, options)
    except SkipConfigError as err:
        raise SkipConfigError(f"{key}: {err}") from err
    except Exception as err:  # a URL its filesystem refuses (a bad bucket name, options it does not take)
        raise SkipConfigError(f"{key} = {url!r}: cannot open it ({type(err).__name__}: {err})") from err
    try:
        store.list_dir(root)
    except Exception as err:
        if not is_store_access_error(err):
            raise
        raise SkipConfigError(f"{key} = {describe_store_access_error(url, err)}") from err
    return store


def _replay_layer(role: CachedRole, primary: EntryStore, key: str) -> Layer:
    layout = role.layout
    spec = role.config.replay_from
    own_run = layout.run_dir_of(layout.run_name)
    if isinstance(spec, str):
        run_dir = normalize_location(spec)
        if run_dir == own_run:
            raise SkipConfigError(f"{key} = {spec!r} is this run's own run directory; name another run")
        # opened at its dump dir (two levels up), so that the runs beside it can be named when it is missing
        dump_root = run_dir.rsplit("/", 2)[0] if run_dir.count("/") >= 3 else run_dir
        store = _open(dump_root, role.config.storage_options, key, must_exist=False)
        if not store.is_dir(run_dir):
            raise SkipConfigError(_missing_run(key, repr(spec), run_dir, store, run_dir.rpartition("/")[0], [run_dir]))
        return Layer(ReadOnlyStore(store, f"{key} is read only"), own_run, run_dir, "replay_from",
                     REPLAY_FROM_COUNTER,
                     run_dir)
    values = dict(spec)
    identity = dataclasses.replace(layout.identity, experiment_name=values.get("experiment_name",
                                                                                 layout.experiment_name),
                                   project_name=values.get("project_name", layout.project_name))
    other = Layout.for_identity(layout.dump_dir, identity, layout.subdir)
    if other.experiment_dir == layout.experiment_dir:
        raise SkipConfigError(f"{key} = {values!r} names this run's own experiment ({layout.experiment_dir}); "
                              "name another experiment_name or project_name")
    run_dir = other.run_dir_of(layout.run_name)
    try:
        found = primary.is_dir(run_dir)
    except Exception as err:  # pragma: no cover - the dump dir was reached a moment ago
        if not is_store_access_error(err):
            raise
        raise SkipConfigError(f"{key}: {describe_store_access_error(layout.dump_dir, err)}") from err
    if not found:
        raise SkipConfigError(_missing_run(key, repr(values), run_dir, primary, layout.dump_dir,
                                           _runs_under(primary, layout.dump_dir)))
    return Layer(ReadOnlyStore(primary, f"{key} is read only"), layout.experiment_dir, other.experiment_dir,
                 "replay_from",
                 REPLAY_FROM_COUNTER, run_dir)


def _runs_under(store: EntryStore, dump_dir: str) -> list[str]:
    """Every run directory of a dump dir (``{dump_dir}/{experiment}/{run}``), at most
    :data:`_EXPERIMENTS_LISTED` experiments looked into."""
    runs: list[str] = []
    for experiment in store.list_dir(dump_dir, dirs_only=True)[:_EXPERIMENTS_LISTED]:
        names = store.list_dir(f"{dump_dir}/{experiment}", dirs_only=True)
        runs.extend(f"{dump_dir}/{experiment}/{run}" for run in names if RUN_DIR.match(run))
    return runs


def _missing_run(key: str, given: str, run_dir: str, store: EntryStore, parent: str, runs: list[str]) -> str:
    """The error of a ``replay_from`` run that does not exist: the runs that do, closest first."""
    if len(runs) == 1 and runs[0] == run_dir:  # a run directory given: the runs beside it
        runs = [f"{parent}/{name}" for name in store.list_dir(parent, dirs_only=True) if RUN_DIR.match(name)]
        if not runs:  # the experiment directory itself, perhaps: the runs in it
            runs = [f"{run_dir}/{name}" for name in store.list_dir(run_dir, dirs_only=True) if RUN_DIR.match(name)]
    target = run_dir.rsplit("/", 2)[-2] + "/" + run_dir.rsplit("/", 1)[-1]
    ranked = sorted(runs, key=lambda r: (-difflib.SequenceMatcher(None, target, r.rsplit("/", 2)[-2] + "/"
                                                                   + r.rsplit("/", 1)[-1]).ratio(), r))
    shown = ", ".join(ranked[:_RUNS_SHOWN]) + (f" (and {len(ranked) - _RUNS_SHOWN} more)"
                                               if len(ranked) > _RUNS_SHOWN else "")
    there = f"the runs there: {shown}" if ranked else f"no run directory was found under {parent}"
    return (f"{key} = {given}: the run directory {run_dir} does not exist; {there}. Name one of them "
            "(replay_from: {experiment_name: ..., project_name: ...} reads that experiment's run of this run's "
            "shape GBS/N/in/out; a run directory's path reads that run whatever its shape)")
