"""``LayeredStore``: the dump dir's store with read-only layers below it, on local directories (the roles'
behaviour through the public config is tested in tests/unit/roles/test_layered_caches.py)."""

from __future__ import annotations

import os

import pytest

from stepskip._storage import EntryState, EntryStore, LocalBackend
from stepskip._storage.layered import Layer, LayeredStore, origin_of
from stepskip._storage.readonly import ReadOnlyStore
from stepskip._storage.meta import MANIFEST_FILE


def store(root) -> EntryStore:
    return EntryStore(LocalBackend(str(root)))


@pytest.fixture
def layered(tmp_path):
    mine, team = store(tmp_path / "mine"), store(tmp_path / "team")
    layer = Layer(ReadOnlyStore(team, "source 0 is read only"), str(tmp_path / "mine"), str(tmp_path / "team"), "source 0", "hits_from/0",
                  str(tmp_path / "team" / "run"))
    return LayeredStore(mine, [layer]), mine, team, tmp_path


def test_every_method_of_the_read_only_view_that_writes_refuses(tmp_path):
    team = store(tmp_path)
    team.write_entry(f"{tmp_path}/run/1", {"data.json": b"team"}, {"global_steps": 1})
    before = sorted((p.relative_to(tmp_path), p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    view = ReadOnlyStore(team, "source 0 is read only")
    path = f"{tmp_path}/run/1"
    for call in (lambda: view.write_entry(f"{tmp_path}/run/2", {"data.json": b"x"}, {"global_steps": 2}),
                 lambda: view.put_small(f"{tmp_path}/run/hint", b"{}"), lambda: view.publish_dir(path, path),
                 lambda: view.remove(path), lambda: view.retire_entry(path), lambda: view.remove_leftovers(path)):
        with pytest.raises(PermissionError, match="source 0 is read only: nothing is written there"):
            call()
    refused = view.write_entries([(f"{tmp_path}/run/3", {"data.json": b"x"}, {"global_steps": 3})])
    assert len(refused) == 1 and isinstance(refused[0], PermissionError)
    assert view.probe(path).state is EntryState.PRESENT
    assert sorted((p.relative_to(tmp_path), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in tmp_path.rglob("*")) == before


def test_entries_are_read_from_the_dump_dir_first_then_the_layer(layered):
    store_, mine, team, root = layered
    team.write_entry(f"{root}/team/run/1", {"data.json": b"team"}, {"global_steps": 1})
    team.write_entry(f"{root}/team/run/2", {"data.json": b"team"}, {"global_steps": 2})
    mine.write_entry(f"{root}/mine/run/2", {"data.json": b"mine"}, {"global_steps": 2})
    one = store_.probe(f"{root}/mine/run/1")
    assert one.state is EntryState.PRESENT and origin_of(one.meta).path == f"{root}/team/run/1"
    meta, files = store_.read_entry(f"{root}/mine/run/1", probe=one)
    assert files == {"data.json": b"team"} and origin_of(meta).counter == "hits_from/0"
    meta, files = store_.read_entry(f"{root}/mine/run/2")
    assert files == {"data.json": b"mine"} and origin_of(meta) is None
    assert store_.probe(f"{root}/mine/run/3").state is EntryState.MISSING
    assert store_.list_dir(f"{root}/mine/run") == ["1", "2"]
    assert store_.is_dir(f"{root}/mine/run/1") and not store_.is_dir(f"{root}/mine/run/3")


def test_writes_go_to_the_dump_dir_only(layered):
    store_, mine, team, root = layered
    store_.write_entry(f"{root}/mine/run/5", {"data.json": b"x"}, {"global_steps": 5})
    store_.put_small(f"{root}/mine/run/hint", b"x")
    assert mine.probe(f"{root}/mine/run/5").state is EntryState.PRESENT
    assert not (root / "team").exists()


def test_a_manifest_is_read_from_the_first_store_holding_the_step(layered):
    store_, mine, team, root = layered
    team.put_small(f"{root}/team/run/4/{MANIFEST_FILE}", b"{}")
    os.makedirs(root / "mine" / "run" / "4" / "0")  # the dump dir holds step 4 in place, without a manifest
    assert store_.read_small(f"{root}/mine/run/4/{MANIFEST_FILE}", 1 << 16) is None
    assert store_.read_small(f"{root}/mine/run/7/{MANIFEST_FILE}", 1 << 16) is None
    team.put_small(f"{root}/team/run/7/{MANIFEST_FILE}", b"{}")
    assert store_.read_small(f"{root}/mine/run/7/{MANIFEST_FILE}", 1 << 16) == b"{}"


def test_drift_records_are_the_runs_own(layered):
    store_, _, team, root = layered
    team.put_small(f"{root}/team/run/.stepskip-drift/1.json", b"{}")
    assert store_.list_dir(f"{root}/mine/run/.stepskip-drift") == []
    assert store_.read_small(f"{root}/mine/run/.stepskip-drift/1.json", 100) is None


def test_a_damaged_layer_entry_is_missing_there(layered, caplog):
    store_, _, team, root = layered
    team.write_entry(f"{root}/team/run/1", {"data.json": b"team"}, {"global_steps": 1})
    (root / "team" / "run" / "1" / "data.json").write_bytes(b"te")
    assert store_.probe(f"{root}/mine/run/1").state is EntryState.MISSING
    assert store_.probe(f"{root}/mine/run/1").state is EntryState.MISSING
    assert sum("counts as missing" in r.getMessage() for r in caplog.records) == 1  # logged once


def test_listing_versions_join_every_layer(layered):
    store_, mine, team, root = layered
    mine.write_entry(f"{root}/mine/run/1", {"data.json": b"x"}, {"global_steps": 1})
    assert store_.dir_version(f"{root}/mine/run") is None  # the layer has no such directory: never reused
    team.write_entry(f"{root}/team/run/2", {"data.json": b"x"}, {"global_steps": 2})
    version = store_.dir_version(f"{root}/mine/run")
    mine_version, team_version = mine.dir_version(f"{root}/mine/run"), team.dir_version(f"{root}/team/run")
    assert version is not None and mine_version is not None and team_version is not None
    assert version[2] == max(mine_version[2], team_version[2])  # the newest mtime: settled only when both are
    assert version[3:] == (*mine_version, *team_version)
