"""The start-up clean-up of object stores decides from one recursive listing (``EntryStore.scan``)
which entries may hold a leftover, and looks only at those: its cost does not grow with the number
of clean entries, and it still removes what it removed before — never an object a ``meta.json``
names, never anything a writer of this class did not name, never a leftover still in its grace
period or written less than ``older_than`` ago. On fsspec's ``memory://``."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from stepskip._storage import (
    GRACE_SECONDS,
    META_FILE,
    STALE_SECONDS,
    DirItem,
    EntryState,
    EntryStore,
    FsspecBackend,
    Tree,
    may_hold_leftovers,
)
from stepskip._storage import objects as store_module
from stepskip._storage.base import newest_below
from stepskip._manifest import MANIFEST_FILE, may_need_clean_up

FILES = {"data.json": b'{"x": 1}', "data.safetensors": b"0123456789"}
LATER = 2 * STALE_SECONDS  # far enough ahead for every leftover to be stale and out of its grace period


def memory_store(grace: float = GRACE_SECONDS) -> EntryStore:
    root = f"memory://bounded-{uuid.uuid4().hex[:8]}/dump"
    return EntryStore(FsspecBackend(MemoryFileSystem(), root=root), grace_seconds=grace)


def run_with(store: EntryStore, count: int) -> tuple[str, list[str]]:
    """``count`` clean entries, one replaced entry (its old objects retired) and one entry holding a crashed
    writer's object: ``(run directory, the two leftovers)``."""
    run = f"{store.root}/exp/GBS1_N1_in1_out1"
    for step in range(count):
        store.write_entry(f"{run}/{step}", FILES, {"global_steps": step})
    replaced = f"{run}/{count}"
    store.write_entry(replaced, FILES, {"global_steps": count})
    old = {info["object"] for info in store.probe(replaced).meta["files"].values()}
    store.write_entry(replaced, FILES, {"global_steps": count})
    orphan = f"{run}/0/data.deadbeef0000.json"
    store.backend.fs.pipe_file(store.backend.key(orphan), b"a crashed writer's object")
    return run, sorted([orphan, *(f"{replaced}/{o}" for o in old)])


def counting_probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    probed: list[str] = []
    probe = EntryStore.probe
    monkeypatch.setattr(EntryStore, "probe", lambda self, path, *a: probed.append(path) or probe(self, path, *a))
    return probed


# --------------------------------------------------------------------------- the tree


def test_tree_lists_dirs_files_and_newest_times() -> None:
    tree = Tree("s3://b/run/", {"3/meta.json": DirItem("meta.json", "file", 5, 10.0),
                                "3/rec-0123456789ab/0/meta.json": DirItem("meta.json", "file", 5, 30.0),
                                "3/rec-0123456789ab/0/x.json": DirItem("x.json", "file", 5, 20.0),
                                "4/../../etc/passwd": DirItem("passwd", "file", 5, 1.0),
                                "4//meta.json": DirItem("meta.json", "file", 5, 1.0)})
    assert tree.dirs("s3://b/run") == ["3"]  # names with "..", "." or "" components are never listed
    assert sorted(tree.files("s3://b/run/3")) == ["meta.json"]
    assert tree.dirs("s3://b/run/3") == ["rec-0123456789ab"]
    assert tree.newest("s3://b/run/3") == 30.0 and tree.newest("s3://b/run/3/rec-0123456789ab") == 30.0
    assert tree.newest("s3://b/run/9") is None
    assert tree.covers("s3://b/run/3") and not tree.covers("s3://b/other") and not tree.covers("s3://b/runner")
    assert tree.files("s3://b/other/3") == {} and tree.dirs("s3://b/runner") == []
    unknown = Tree("r", {"1/a.json": DirItem("a.json", "file", 1, None), "1/b.json": DirItem("b.json", "file", 1, 5.0)})
    assert unknown.newest("r/1") is None  # a file of unknown age: the directory's age is unknown


def test_the_newest_walk_enters_only_plain_directory_names() -> None:
    """A listing naming a directory ``..`` (an object key holding ``/../``) or ``.`` would lead the walk
    above the directory, or round in a loop: such a name is never entered."""
    listing = {"r/1": [DirItem("..", "dir"), DirItem(".", "dir"), DirItem("", "dir"), DirItem("a/b", "dir"),
                       DirItem("rec", "dir"), DirItem("x.json", "file", 1, 5.0)],
               "r/1/rec": [DirItem("..", "dir"), DirItem("y.json", "file", 1, 7.0)],
               "r": [DirItem("1", "dir"), DirItem("old.json", "file", 1, 99.0)]}
    seen: list[str] = []

    def items(path: str) -> list[DirItem]:
        seen.append(path)
        assert len(seen) < 10, "the walk went round"
        return listing.get(path, [])

    assert newest_below("r/1/", items) == 7.0
    assert seen == ["r/1", "r/1/rec"]


def test_scan_lists_every_object_below_the_path_only() -> None:
    store = memory_store()
    store.write_entry(f"{store.root}/run/1", FILES, {"global_steps": 1})
    store.write_entry(f"{store.root}/runner/1", FILES, {"global_steps": 1})
    tree = store.scan(f"{store.root}/run")
    assert tree.dirs(f"{store.root}/run") == ["1"]
    assert sorted(tree.files(f"{store.root}/run/1")) == sorted(
        [META_FILE, *(i["object"] for i in store.probe(f"{store.root}/run/1").meta["files"].values())])
    assert all(item.mtime is not None for item in tree.files(f"{store.root}/run/1").values())
    assert store.scan(f"{store.root}/missing").dirs(f"{store.root}/missing") == []


@pytest.mark.parametrize("names, now, expected", [
    ({"meta.json": 0.0, "data.0123456789ab.json": 0.0}, 9e9, False),  # one write: what meta.json names
    ({"data.0123456789ab.json": 0.0, "data.ba9876543210.json": 0.0}, 9e9, False),  # no meta.json: no entry
    ({"meta.json": 0.0, "data.0123456789ab.json": 0.0, "data.ba9876543210.json": 0.0}, 9e9, True),
    ({"meta.json": 0.0, "data.0123456789ab.json": 0.0, "data.ba9876543210.json": 0.0}, 10.0, False),  # just written
    ({"meta.json": 0.0, "data.0123456789ab.json": 100.0, "data.ba9876543210.json": 100.0}, 10.0, True),  # ahead
    ({"meta.json": 0.0, "data.0123456789ab.json": None, "data.ba9876543210.json": 0.0}, 10.0, True),  # no time
    ({"meta.json": 0.0, "data.json": 0.0, "data.0123456789ab.json": 0.0}, 9e9, True),  # a local entry, an orphan
    ({"meta.json": 0.0, "data.json": 0.0, "README": 0.0}, 9e9, False),  # nothing deletable: no tokened object
])
def test_which_entries_may_hold_leftovers(names: dict[str, Any], now: float, expected: bool) -> None:
    files = {name: DirItem(name, "file", 1, when) for name, when in names.items()}
    assert may_hold_leftovers(files, now, young=600.0) is expected


# --------------------------------------------------------------------------- the clean-up


@pytest.mark.parametrize("count", [10, 200])
def test_clean_up_probes_only_the_entries_the_listing_marks(count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the number of clean entries, the two that hold leftovers are the only ones probed, and
    only once their leftovers are stale (not at all before)."""
    store = memory_store()
    run, leftovers = run_with(store, count)
    probed = counting_probes(monkeypatch)
    assert store.remove_leftovers(run) == [] and probed == []  # everything was written just now
    now = store_module.wall_time() + LATER
    store.clock = lambda: now
    assert sorted(store.remove_leftovers(run)) == leftovers
    assert sorted(probed) == [f"{run}/0", f"{run}/{count}"]
    for step in (0, count // 2, count):
        assert store.read_entry(f"{run}/{step}")[1] == FILES
    probed.clear()
    assert store.remove_leftovers(run) == [] and probed == []  # clean now: nothing is looked at


def test_clean_up_keeps_leftovers_within_their_grace_period_or_not_stale_yet() -> None:
    store = memory_store()
    run, leftovers = run_with(store, 3)
    retired = [p for p in leftovers if "deadbeef" not in p]
    replaced_at = store.probe(f"{run}/3").meta["retired"]
    when = max(replaced_at.values())
    store.clock = lambda: when + GRACE_SECONDS - 1  # the orphan is not stale either (STALE_SECONDS > grace)
    assert store.remove_leftovers(run) == []
    store.clock = lambda: when + GRACE_SECONDS + 1
    assert sorted(store.remove_leftovers(run)) == retired  # past the grace period; the orphan not an hour old
    store.clock = lambda: store_module.wall_time() + LATER
    assert store.remove_leftovers(run) == [f"{run}/0/data.deadbeef0000.json"]


def test_clean_up_never_deletes_what_it_did_not_write_nor_from_a_damaged_entry() -> None:
    store = memory_store()
    run = f"{store.root}/run"
    store.write_entry(f"{run}/1", FILES, {"global_steps": 1})
    foreign = [f"{run}/1/README", f"{run}/1/notes.txt"]
    for path in foreign:
        store.backend.fs.pipe_file(store.backend.key(path), b"a user's note")
    store.write_entry(f"{run}/2", FILES, {"global_steps": 2})
    store.backend.fs.pipe_file(store.backend.key(f"{run}/2/data.deadbeef0000.json"), b"orphan")
    # damaged: nothing in it is deleted
    store.backend.fs.pipe_file(store.backend.key(f"{run}/2/{META_FILE}"), b"{not json")
    store.clock = lambda: store_module.wall_time() + LATER
    assert store.remove_leftovers(run) == []
    assert all(store.backend.fs.exists(store.backend.key(p)) for p in [*foreign, f"{run}/2/data.deadbeef0000.json"])
    assert store.probe(f"{run}/1").state is EntryState.PRESENT


def test_clean_up_with_a_tree_of_another_directory_lists_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    store = memory_store()
    run, leftovers = run_with(store, 2)
    store.clock = lambda: store_module.wall_time() + LATER
    elsewhere = store.scan(f"{store.root}/elsewhere")
    assert sorted(store.remove_leftovers(run, tree=elsewhere)) == leftovers


def test_moving_the_wall_clock_moves_the_stores_default_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    store = memory_store()
    monkeypatch.setattr(store_module, "_clock", lambda: 123.0)
    assert store.clock() == 123.0


# --------------------------------------------------------------------------- V1 steps (manifests)


def _item(when: float | None = 100.0) -> DirItem:
    return DirItem("x", "file", 1, when)


REC_A, REC_B = "rec-0123456789ab", "rec-ba9876543210"


@pytest.mark.parametrize("layout, now, expected", [
    ({f"1/{MANIFEST_FILE}": 100.0, f"1/{REC_A}/0/meta.json": 100.0, f"1/{REC_A}/0/d.0123456789ab.json": 100.0},
     9e9, False),  # the recording the manifest names, clean
    ({f"1/{MANIFEST_FILE}": 100.0, f"1/{REC_A}/0/meta.json": 100.0, f"1/{REC_B}/0/meta.json": 100.0},
     9e9, True),  # another recording: retired or never committed
    ({f"1/{MANIFEST_FILE}": 100.0, f"1/{REC_A}/0/meta.json": 100.0, f"1/{REC_B}/0/meta.json": 100.0},
     110.0, False),  # ... both written just now
    ({f"1/{REC_A}/0/meta.json": 100.0}, 9e9, True),  # a recording nothing names, stale
    ({f"1/{REC_A}/0/meta.json": None}, 110.0, True),  # ... of unknown age
    ({f"1/{MANIFEST_FILE}": 100.0, f"1/{REC_A}/0/meta.json": 100.0, f"1/{REC_A}/0/d.0123456789ab.json": 100.0,
      f"1/{REC_A}/0/d.ba9876543210.json": 100.0}, 9e9, True),  # an inner entry holding two writes' objects
    ({"1/0/meta.json": 100.0, "1/0/d.0123456789ab.json": 100.0, "1/0/d.ba9876543210.json": 100.0},
     9e9, True),  # ... of a step written in place (no manifest)
    ({"1/0/meta.json": 100.0, "1/0/d.0123456789ab.json": 100.0}, 9e9, False),
])
def test_which_v1_steps_may_need_clean_up(layout: dict[str, Any], now: float, expected: bool) -> None:
    tree = Tree("memory://b/run", {rel: _item(when) for rel, when in layout.items()})
    store = memory_store()
    assert may_need_clean_up(store, tree, "memory://b/run/1", now=now) is expected
