"""A read handed the probe just taken reuses its parsed meta.json, only while it is the same file version.

The local backend's ``read_at_stat`` is wrapped (the real call still runs) to count the reads of meta.json.
"""

from __future__ import annotations

import json
import os

import pytest

from stepskip._storage import META_FILE, EntryState, EntryStore, LocalBackend, _localfs


@pytest.fixture
def meta_reads(monkeypatch):
    reads: list[str] = []
    real = _localfs.read_at_stat

    def spied(dir_fd, name, *args, **kwargs):
        if name == META_FILE:
            reads.append(name)
        return real(dir_fd, name, *args, **kwargs)

    monkeypatch.setattr(_localfs, "read_at_stat", spied)
    return reads


def _write(store, path, version, fill=b"1"):
    store.write_entry(path, {"data.bin": fill * 16}, {"global_steps": 3, "v": version})


def test_a_fresh_probe_saves_the_second_parse(tmp_path, meta_reads):
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    assert probe.state is EntryState.PRESENT and len(meta_reads) == 1
    meta, files = store.read_entry(path, probe=probe)
    assert len(meta_reads) == 1  # not read again
    assert meta == probe.meta and files == {"data.bin": b"1" * 16}


def test_an_entry_replaced_between_probe_and_read_is_read_as_its_new_version(tmp_path, meta_reads):
    """Same sizes, same meta length: only the directory's identity tells the versions apart."""
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    _write(store, path, 2, fill=b"2")
    meta, files = store.read_entry(path, probe=probe)
    assert meta["v"] == 2 and files == {"data.bin": b"2" * 16}  # never the old meta with the new data
    assert len(meta_reads) == 2


def test_a_meta_json_swapped_inside_the_entry_is_read_again(tmp_path, meta_reads):
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    meta_path = os.path.join(path, META_FILE)
    edited = json.loads(open(meta_path, "rb").read())
    edited["v"] = 7
    with open(meta_path + ".new", "w") as fh:
        json.dump(edited, fh)
    os.replace(meta_path + ".new", meta_path)  # a new file in the same directory
    meta, _ = store.read_entry(path, probe=probe)
    assert meta["v"] == 7 and len(meta_reads) == 2


def test_a_removed_entry_is_a_miss_even_with_a_probe(tmp_path):
    from stepskip import CacheMissError

    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    store.retire_entry(path)
    with pytest.raises(CacheMissError):
        store.read_entry(path, probe=probe)


def test_data_damaged_after_the_probe_is_still_caught(tmp_path):
    from stepskip import CorruptEntryError

    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    with open(os.path.join(path, "data.bin"), "r+b") as fh:  # same size, other bytes
        fh.write(b"X")
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.read_entry(path, probe=probe)


def test_without_checksums_the_probe_is_not_reused(tmp_path, meta_reads):
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    store.read_entry(path, probe=probe, verify=False)
    assert len(meta_reads) == 2


def test_a_probe_of_another_entry_is_not_reused(tmp_path, meta_reads):
    store = EntryStore(LocalBackend(str(tmp_path)))
    _write(store, f"{tmp_path}/run/3", 1)
    _write(store, f"{tmp_path}/run/4", 2)
    other = store.probe(f"{tmp_path}/run/4")
    meta, _ = store.read_entry(f"{tmp_path}/run/3", probe=other)
    assert meta["v"] == 1 and len(meta_reads) == 2


def test_a_probe_that_kept_a_small_entry_serves_the_read_as_it_was_probed(tmp_path, meta_reads):
    """One look at the disk for both: the read takes the version the probe read, even once the
    entry is gone from the disk (a hit decided on it is served from it)."""
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path, keep=1024)
    assert probe.state is EntryState.PRESENT and probe.files == {"data.bin": b"1" * 16}
    store.retire_entry(path)
    meta, files = store.read_entry(path, probe=probe)
    assert meta["v"] == 1 and files == {"data.bin": b"1" * 16} and len(meta_reads) == 1


def test_a_probe_keeps_only_entries_within_its_bound(tmp_path):
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    assert store.probe(path, keep=15).files is None and store.probe(path).files is None
    assert store.probe(path, keep=16).files is not None


def test_a_kept_probe_of_another_entry_is_not_used(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    _write(store, f"{tmp_path}/run/3", 1)
    _write(store, f"{tmp_path}/run/4", 2, fill=b"2")
    other = store.probe(f"{tmp_path}/run/4", keep=1024)
    meta, files = store.read_entry(f"{tmp_path}/run/3", probe=other)
    assert meta["v"] == 1 and files == {"data.bin": b"1" * 16}


def test_a_kept_file_that_fails_its_checksum_is_read_again_and_reported(tmp_path, meta_reads):
    """The probe checks sizes only: the read checks what it kept, and on a mismatch looks at the
    disk itself before calling the entry damaged."""
    from stepskip import CorruptEntryError

    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    with open(os.path.join(path, "data.bin"), "r+b") as fh:  # same size, other bytes
        fh.write(b"X")
    probe = store.probe(path, keep=1024)
    assert probe.state is EntryState.PRESENT and probe.files is not None
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.read_entry(path, probe=probe)
    assert len(meta_reads) == 2  # the probe's, and the read's own look
    _write(store, path, 2, fill=b"2")  # rewritten whole since the probe: the read's own look finds it intact
    meta, files = store.read_entry(path, probe=probe)
    assert meta["v"] == 2 and files == {"data.bin": b"2" * 16}


@pytest.mark.parametrize("keep", [0, 1024])
def test_a_read_given_a_kept_probe_fails_as_a_read_given_none(tmp_path, keep):
    """A kept probe changes where the bytes come from, never what a read refuses or returns."""
    from stepskip import CorruptEntryError

    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)

    def failing(meta):
        raise PermissionError(13, "the callback's own read failed")

    with pytest.raises(CorruptEntryError, match="the callback's own read failed"):
        store.read_entry(path, names=failing, probe=store.probe(path, keep=keep))
    with pytest.raises(CorruptEntryError, match="not listed"):
        store.read_entry(path, names=["other.bin"], probe=store.probe(path, keep=keep))
    with open(os.path.join(path, "data.bin"), "r+b") as fh:  # same size, other bytes: only a checksum tells
        fh.write(b"X")
    meta, files = store.read_entry(path, probe=store.probe(path, keep=keep), verify=False)
    assert meta["v"] == 1 and files == {"data.bin": b"X" + b"1" * 15}
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.read_entry(path, probe=store.probe(path, keep=keep))


def _miss_then_hit(dump_dir, rows, width, looks):
    """Record step 1 through the decorator, clear ``looks``, then hit it: (the recorded batch, the hit's)."""
    from stepskip import Batch, SkipManager
    from stepskip.testing import make_rollout_batch

    result = make_rollout_batch(rows, width, width, n=1)

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts):
            return result

    config = {"trainer": {"experiment_name": "e", "project_name": "p"},
              "data": {"train_batch_size": rows, "max_prompt_length": width, "max_response_length": width},
              "actor_rollout_ref": {"rollout": {"n": 1}},
              "skip": {"rollout": {"enable": True, "dump_dir": str(dump_dir), "steps": [1], "async_dump": False}}}
    SkipManager.init(config)
    try:
        SkipManager.set_step(1)
        prompts = Batch.from_dict(non_tensors={"uid": [f"u{i}" for i in range(rows)]})
        Loop().generate_sequences(prompts)  # the miss writes it
        looks.clear()
        out = Loop().generate_sequences(prompts)
        assert SkipManager.stats()["skip/rollout/hits"] == 1
        return result, out
    finally:
        SkipManager.reset()


def test_a_small_hit_through_the_decorator_opens_its_entry_once(tmp_path, monkeypatch):
    """A one-sample entry: the probe that decides the hit reads it whole, and the hit is served
    from that read (one open of the entry's directory, one read of each file)."""
    from stepskip._storage import local

    opened: list[str] = []
    real_open = local.open_below  # every directory the local backend opens, an entry's or another
    monkeypatch.setattr(local, "open_below", lambda base, parts, *a: opened.append("/".join([base, *parts]))
                        or real_open(base, parts, *a))
    result, out = _miss_then_hit(tmp_path, 1, 8, opened)
    assert len(opened) == 1 and opened[0].startswith(str(tmp_path)), opened  # the probe's; the read used it
    for key in result.batch.keys():
        assert out.batch[key].equal(result.batch[key]), key


def test_a_hit_through_the_decorator_parses_meta_json_once(tmp_path, meta_reads):
    _miss_then_hit(tmp_path, 2, 4, meta_reads)
    assert len(meta_reads) == 1  # the probe's; the read reused it


def test_a_stale_reused_meta_is_read_again_before_anything_is_called_damaged(tmp_path, monkeypatch):
    """An in-place rewrite within the timestamps' granularity can leave the stamp unchanged: the
    reused meta.json then disagrees with the data, and only a read of meta.json itself may say damage."""
    store, path = EntryStore(LocalBackend(str(tmp_path))), f"{tmp_path}/run/3"
    _write(store, path, 1)
    probe = store.probe(path)
    _write(store, path, 2, fill=b"2")
    monkeypatch.setattr(_localfs.LocalEntry, "meta_stamp", lambda self: probe.stamp)  # the stamp "matched"
    meta, files = store.read_entry(path, probe=probe)
    assert meta["v"] == 2 and files == {"data.bin": b"2" * 16}
