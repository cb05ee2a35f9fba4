"""EntryStore.write_entries over the local backend: several entries published with their fsyncs batched,
each one still whole."""

from __future__ import annotations

import json

from stepskip._storage import EntryState, EntryStore, LocalBackend


def test_every_entry_is_published_whole_and_readable(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    items = [(f"{tmp_path}/run/{i}", {"data.json": json.dumps({"i": i}).encode()}, {"global_steps": i})
             for i in range(5)]
    results = store.write_entries(items)
    assert all(isinstance(r, int) and r > 0 for r in results)
    for i in range(5):
        meta, files = store.read_entry(f"{tmp_path}/run/{i}")
        assert meta["global_steps"] == i and json.loads(files["data.json"]) == {"i": i}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [str(i) for i in range(5)]  # no temporaries


def test_a_bad_entry_fails_alone_and_leaves_nothing(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    results = store.write_entries([
        (f"{tmp_path}/run/1", {"data.json": b"1"}, {"global_steps": 1}),
        (f"{tmp_path}/run/2", {"../escape": b"x"}, {"global_steps": 2}),
        (f"{tmp_path}/run/3", {"data.json": b"3"}, {"global_steps": 3}),
    ])
    assert isinstance(results[0], int) and isinstance(results[1], OSError) and isinstance(results[2], int)
    assert store.probe(f"{tmp_path}/run/2").state is EntryState.MISSING
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1", "3"]
    assert not (tmp_path / "escape").exists()


def test_replaces_an_existing_entry(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    store.write_entry(f"{tmp_path}/run/1", {"data.json": b"old"}, {"global_steps": 1})
    (result,) = store.write_entries([(f"{tmp_path}/run/1", {"data.json": b"new"}, {"global_steps": 1})])
    assert isinstance(result, int)
    assert store.read_entry(f"{tmp_path}/run/1")[1]["data.json"] == b"new"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["1"]
