"""V1 steps on object stores are committed by a per-step manifest: ``{step}/step.json``,
written last, names the one recording (``{step}/rec-{token}/``) readers use.

On ``memory://`` and a real S3 server (moto): two recorders racing on one step (interleaved
deterministically, on the calling thread or on events) leave one recorder's complete step, never
a mix; a reader that resolved the old manifest still reads the old recording whole; a killed
recorder's recording is invisible and removed only once stale; hostile manifests are damage
(counted, regenerated, raised under ``replay``) or, for a newer version, unreadable — never a crash,
in the role and in the CLI's index, ``verify``, ``ls`` and ``view``. Steps without a manifest (written
in place, as verl and earlier versions do) are still read. The queue is the in-process TransferQueue
stand-in (``InProcessTQClient``); no inference servers run: the trajectories are made up by
``v1_harness.trajectory_fields``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from v1_harness import trajectory_fields

from stepskip import CorruptEntryError, UnreadableEntryError
from stepskip._storage import STALE_SECONDS, open_store
from stepskip.cli.verify import repair, verify_runs
from stepskip._identity import RunIdentity
from stepskip._index import CacheIndex, IssueKind, StepKind
from stepskip._manifest import (
    MANIFEST_FILE,
    StepManifest,
    is_recording,
    publish_manifest,
    read_manifest,
    remove_stale_recordings,
)
from stepskip.roles.base import RunContext
from stepskip.roles.rollout_tq import RolloutTqSkip
from stepskip.tq import InProcessTQClient, KVBatchMeta

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "cli"))  # the in-process CLI runner

N = 2
SYNC = 2
RUN = "default_experiment_name_default_project_name/GBS4_N2_in0_out0"


@pytest.fixture(params=["memory", "s3"])
def object_store(request) -> tuple[str, dict[str, Any]]:
    """``(dump_dir, storage_options)`` of a fresh object store: fsspec's memory:// or a moto S3 bucket."""
    if request.param == "memory":
        return f"memory://stepskip-{uuid.uuid4().hex[:8]}/dump", {}
    endpoint = request.getfixturevalue("s3_server")
    import s3fs

    options = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/dump", options


def make_config(dump_dir: str, options: dict[str, Any], action: str = "record") -> dict[str, Any]:
    return {
        "actor_rollout_ref": {"rollout": {"n": N}},
        "data": {"train_batch_size": 4},
        "trainer": {"v1": {"trainer_mode": "separate_async", "separate_async": {"parameter_sync_step": SYNC}}},
        "skip": {"rollout_tq": {"enable": True, "steps": [1], "action": action, "dump_dir": dump_dir,
                                "storage_options": options, "async_dump": False}},
    }


class Recorder:
    """One run's rollout_tq role (as SkipManager.init binds it) and its own queue."""

    def __init__(self, store: tuple[str, dict[str, Any]], action: str = "record") -> None:
        config = make_config(*store, action=action)
        self.tq = InProcessTQClient()
        self.run_id = uuid.uuid4().hex
        self.role = RolloutTqSkip(config["skip"]["rollout_tq"], config)
        self.role.bind(RunContext(name="rollout_tq", run_id=self.run_id, identity=RunIdentity.from_config(config),
                                  runtime={"tq_client": self.tq}))

    def sample(self, step: int, prompts: list[int], marker: int) -> None:
        """One sample call: ``prompts``' trajectories (responses tagged with ``marker``) saved as an inner entry."""
        rows, fields = trajectory_fields(prompts, N, marker)
        keys = [f"u{p}-{self.run_id[:6]}_{s}_0" for p, s in rows]
        tags = [{"global_steps": step, "status": "finished"} for _ in keys]
        self.tq.kv_batch_put(keys=keys, fields=fields, tags=tags, partition_id="train")
        self.role.save_sample(step, KVBatchMeta(keys=keys, tags=tags, partition_id="train"))

    def record(self, step: int, marker: int) -> None:
        self.role.begin_recording(step)
        self.sample(step, [0, 1], marker)
        self.sample(step, [2, 3], marker)


def replayed_markers(store, step: int = 1) -> set[int]:
    """Load ``step`` as a fresh ``cache`` run would and return the markers of every trajectory it injects."""
    reader = Recorder(store, action="cache")
    assert reader.role.meet_precondition(step)
    uids = ["a", "b", "c", "d"]
    reader.role.inject(step, uids)
    keys = [f"{u}_{s}_0" for u in uids for s in range(N)]
    data = reader.tq.kv_batch_get(keys=keys, partition_id="train")
    return {int(r[0]) // 1000 for r in data["responses"]}


def run_ids(store, step: int = 1) -> set[str]:
    reader = Recorder(store, action="cache")
    return {(p.meta or {}).get("run_id") for _, p in reader.role.entries.probed(step)}


def step_dir(store) -> str:
    return f"{store[0]}/{RUN}/1"


def fs_store(store):
    return open_store(store[0], store[1])


@pytest.mark.parametrize("order", ["a0 b0 b1 a1", "a0 b0 a1 b1", "b0 a0 a1 b1"])
def test_two_recorders_interleaved_on_one_step_leave_one_complete_step(object_store, order):
    """Written in place, ``a0 b0 b1 a1`` ends with inner 0 of B and inner 1 of A: never a whole step."""
    a, b = Recorder(object_store), Recorder(object_store)
    a.role.begin_recording(1)
    b.role.begin_recording(1)
    who = {"a": (a, 10), "b": (b, 20)}
    done: list[str] = []
    for move in order.split():
        recorder, marker = who[move[0]]
        recorder.sample(1, [0, 1] if move[1] == "0" else [2, 3], marker)
        done.append(move)
    last = order.split()[-1][0]  # the recorder whose manifest was written last
    assert run_ids(object_store) == {who[last][0].run_id}
    assert replayed_markers(object_store) == {who[last][1]}
    manifest = read_manifest(fs_store(object_store), step_dir(object_store))
    assert manifest is not None and manifest.inner_entries == SYNC and manifest.run_id == who[last][0].run_id
    recordings = [n for n in fs_store(object_store).list_dir(step_dir(object_store)) if is_recording(n)]
    assert len(recordings) == 2  # the other recording is retired: kept for readers holding the old manifest
    assert set(manifest.retired) == set(recordings) - {manifest.recording}


def test_a_recorder_blocked_before_its_manifest_is_invisible_and_then_wins(object_store):
    a, b = Recorder(object_store), Recorder(object_store)
    a_ready, release_a = threading.Event(), threading.Event()
    put = a.role.store.put_small

    def held_put(path: str, data: bytes) -> None:
        if path.endswith(MANIFEST_FILE):
            a_ready.set()
            assert release_a.wait(300)
        put(path, data)

    a.role.store.put_small = held_put
    errors: list[BaseException] = []

    def record_a() -> None:
        try:
            a.record(1, marker=10)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=record_a)
    thread.start()
    try:
        assert a_ready.wait(300)  # A wrote both inner entries; its manifest is not written yet
        assert not Recorder(object_store, action="cache").role.has_v1_cache(1)  # nothing of A is visible
        b.record(1, marker=20)
        assert replayed_markers(object_store) == {20}
        holder = Recorder(object_store, action="cache")
        held = holder.role.entries.root(1)  # a reader that resolved B's manifest ...
    finally:
        release_a.set()
        thread.join(300)
    assert not errors
    assert replayed_markers(object_store) == {10}  # A's manifest was written last
    for inner in range(SYNC):  # ... still reads B's recording whole (retired, within the grace period)
        payload, meta, _, _ = holder.role.reader.read(f"{held.root}/{inner}", 1, 1)
        assert meta["run_id"] == b.run_id
        assert {int(r[0]) // 1000 for r in payload["tensordict"]["responses"]} == {20}


def test_a_killed_recorders_recording_is_invisible_and_removed_only_once_stale(object_store):
    b = Recorder(object_store)
    b.record(1, marker=20)
    killed = Recorder(object_store)
    killed.role.begin_recording(1)
    killed.sample(1, [0, 1], marker=30)  # then killed: no second inner entry, no manifest
    assert replayed_markers(object_store) == {20}
    store, where = fs_store(object_store), step_dir(object_store)
    named = read_manifest(store, where).recording
    recordings = sorted(n for n in store.list_dir(where) if is_recording(n))
    (abandoned,) = [n for n in recordings if n != named]

    index = CacheIndex(object_store[0], object_store[1])
    (run,) = index.runs()
    (step,) = run.steps
    assert step.valid and [e.run_id for e in step.entries] == [b.run_id] * SYNC
    assert step.leftovers == [f"{where}/{abandoned}"]
    report = verify_runs(index, [run])
    assert [(p.kind, p.path, p.recent) for p in report.problems] == [(IssueKind.LEFTOVER, f"{where}/{abandoned}",
                                                                       True)]
    assert repair(index, report).removed == []  # recent: it may be a recorder still writing

    assert remove_stale_recordings(store, where) == []  # not stale yet
    Recorder(object_store)  # a new run's start-up clean-up keeps it as well
    assert abandoned in store.list_dir(where)
    assert remove_stale_recordings(store, where, older_than=0, now=store.clock() + 5) == [f"{where}/{abandoned}"]
    assert sorted(n for n in store.list_dir(where) if is_recording(n)) == [named]  # the named one stays
    assert replayed_markers(object_store) == {20}


@pytest.mark.parametrize("removed", ["recording", "a data file"])
def test_a_recording_removed_while_it_was_written_is_never_published(object_store, removed):
    """Another run's start-up clean-up removes a recording idle for long as stale (or is part-way through
    removing it): its recorder must not then publish a manifest naming the incomplete recording (and
    retiring the good one)."""
    store, where = fs_store(object_store), step_dir(object_store)
    Recorder(object_store).record(1, marker=10)
    good = read_manifest(store, where)
    late = Recorder(object_store)
    late.role.begin_recording(1)
    late.sample(1, [0, 1], 20)
    (idle,) = [n for n in store.list_dir(where) if is_recording(n) and n != good.recording]
    if removed == "recording":  # what remove_stale_recordings does to a recording idle past STALE_SECONDS
        store.remove(f"{where}/{idle}")
    else:
        (data,) = [n for n in store.list_dir(f"{where}/{idle}/0") if n.endswith(".json") and n != "meta.json"]
        store.backend.fs.rm(f"{store.backend.key(where)}/{idle}/0/{data}")
    late.sample(1, [2, 3], 20)  # the last inner entry: the step would be published now
    assert late.role.stats["dump_failures"] == 1
    assert read_manifest(store, where) == good
    assert replayed_markers(object_store) == {10}
    with pytest.raises(FileNotFoundError, match="incomplete"):
        publish_manifest(store, where, idle, SYNC, "r")


def test_a_step_published_while_it_is_verified_is_never_repaired_away(object_store):
    """``verify --repair`` lists a step, then reads its manifest: a recorder publishing in between must not
    make the step look as if its recording lacked inner entries (and have it deleted)."""
    store, where = fs_store(object_store), step_dir(object_store)
    Recorder(object_store).record(1, marker=10)
    stale = store.list_items(where)  # the scan's listing, taken before the next recorder wrote anything
    Recorder(object_store).record(1, marker=20)
    index = CacheIndex(object_store[0], object_store[1])
    listed = index.store.list_items
    calls: list[str] = []

    def list_items(path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(path)
        if path.rstrip("/").endswith(f"{RUN}/1") and calls.count(path) == 1:
            return stale
        return listed(path, *args, **kwargs)

    index.store.list_items = list_items
    (run,) = index.runs()
    (step,) = run.steps
    assert step.problem is None and step.valid
    report = verify_runs(index, [run])
    assert not [p for p in report.problems if p.kind is IssueKind.DAMAGED]
    repair(index, report)
    assert replayed_markers(object_store) == {20}


def test_a_step_republished_while_its_recording_is_listed_is_scanned_again(object_store, caplog):
    store, where = fs_store(object_store), step_dir(object_store)
    Recorder(object_store).record(1, marker=10)
    first = read_manifest(store, where).recording
    index = CacheIndex(object_store[0], object_store[1])
    listed = index.store.list_items

    def list_items(path: str, *args: Any, **kwargs: Any) -> Any:
        if path.rstrip("/").endswith(first) and not getattr(list_items, "done", False):
            list_items.done = True  # type: ignore[attr-defined]
            Recorder(object_store).record(1, marker=20)  # publishes while the scan lists the old recording
            return [i for i in listed(path, *args, **kwargs) if i.name != "1"]  # listed half-deleted
        return listed(path, *args, **kwargs)

    index.store.list_items = list_items
    index.tree_stats = lambda path: (0, 0.0)  # type: ignore[method-assign]  # list the recording in the scan only
    with caplog.at_level("DEBUG", logger="stepskip._index"):
        (run,) = index.runs()
    (step,) = run.steps
    assert getattr(list_items, "done", False) and "changed while it was scanned" in caplog.text
    assert step.problem is None and step.valid and step.manifest.recording != first
    report = verify_runs(index, [run])
    assert not [p for p in report.problems if p.kind is IssueKind.DAMAGED]
    repair(index, report)
    assert replayed_markers(object_store) == {20}


def test_retired_recordings_go_after_the_grace_period_never_the_named_one(object_store):
    store, where = fs_store(object_store), step_dir(object_store)
    first = Recorder(object_store)
    first.record(1, marker=10)
    old = read_manifest(store, where).recording
    second = Recorder(object_store)
    second.record(1, marker=20)
    manifest = read_manifest(store, where)
    assert old in manifest.retired
    when = manifest.retired[old]
    assert remove_stale_recordings(store, where, older_than=0, now=when + 1) == []  # within the grace period
    assert remove_stale_recordings(store, where, older_than=0, now=when + store.grace_seconds) == [f"{where}/{old}"]
    assert replayed_markers(object_store) == {20}


def test_a_writer_deletes_retired_recordings_past_the_grace_period_after_its_manifest(object_store):
    store, where = fs_store(object_store), step_dir(object_store)
    names = [f"rec-{c * 12}" for c in "abcd"]
    for name in names:
        store.write_entry(f"{where}/{name}/0", {"data.json": b"{}"}, {"global_steps": 1})
    grace = store.grace_seconds
    assert publish_manifest(store, where, names[0], 1, "r", now=1000.0) == []
    assert publish_manifest(store, where, names[1], 1, "r", now=1100.0) == []
    assert read_manifest(store, where).retired == {names[0]: 1100.0}
    assert publish_manifest(store, where, names[2], 1, "r", now=1100.0 + grace - 1) == []  # within the grace period
    assert publish_manifest(store, where, names[3], 1, "r", now=1100.0 + grace) == [f"{where}/{names[0]}"]
    assert sorted(n for n in store.list_dir(where) if is_recording(n)) == names[1:]
    assert read_manifest(store, where).retired == {names[1]: 1100.0 + grace - 1, names[2]: 1100.0 + grace}


HOSTILE = {
    "not json": b"{not json",
    "a list": b"[1, 2]",
    "too large": b'{"pad": "' + b"x" * (80 * 1024) + b'"}',
    "deep": b"[" * 50000 + b"]" * 50000,
    "not utf-8": b'{"recording": "\xff\xfe"}',
    "version bool": json.dumps({"stepskip_manifest": True, "recording": "rec-0123456789ab",
                                "inner_entries": 2}).encode(),
    "parent dir": json.dumps({"stepskip_manifest": 1, "recording": "..", "inner_entries": 2}).encode(),
    "dotdot path": json.dumps({"stepskip_manifest": 1, "recording": "../../1/rec-0123456789ab",
                               "inner_entries": 2}).encode(),
    "absolute": json.dumps({"stepskip_manifest": 1, "recording": "/etc", "inner_entries": 2}).encode(),
    "slash": json.dumps({"stepskip_manifest": 1, "recording": "rec-0123456789ab/0", "inner_entries": 2}).encode(),
    "inner dir": json.dumps({"stepskip_manifest": 1, "recording": "0", "inner_entries": 2}).encode(),
    "inner list": json.dumps({"stepskip_manifest": 1, "recording": "rec-0123456789ab",
                              "inner_entries": [2]}).encode(),
    "inner huge": json.dumps({"stepskip_manifest": 1, "recording": "rec-0123456789ab",
                              "inner_entries": 10**9}).encode(),
    "run_id list": json.dumps({"stepskip_manifest": 1, "recording": "rec-0123456789ab", "inner_entries": 2,
                               "run_id": ["x"]}).encode(),
    "retired outside": json.dumps({"stepskip_manifest": 1, "recording": "rec-0123456789ab", "inner_entries": 2,
                                   "retired": {"../../x": 0}}).encode(),
    "names nothing": json.dumps({"stepskip_manifest": 1, "recording": "rec-0123456789ab",
                                 "inner_entries": 2}).encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_manifest_is_a_damaged_step_regenerated_and_never_a_crash(object_store, name):
    Recorder(object_store).record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    store.put_small(f"{where}/{MANIFEST_FILE}", HOSTILE[name])

    cached = Recorder(object_store, action="cache")
    assert not cached.role.meet_precondition(1)  # a miss: the step is regenerated
    assert cached.role.stats["corrupt"] == 1
    replay = Recorder(object_store, action="replay")
    with pytest.raises(CorruptEntryError):
        replay.role.inject(1, ["a", "b"])

    index = CacheIndex(object_store[0], object_store[1])
    (run,) = index.runs()
    (step,) = run.steps
    assert step.kind is StepKind.V1 and not step.valid
    assert [i.kind for i in step.issues()] == [IssueKind.DAMAGED]
    verify_runs(index, [run])  # reports, never raises

    cached.role.begin_recording(1)  # the regenerated step replaces the bad manifest
    cached.sample(1, [0, 1], 40)
    cached.sample(1, [2, 3], 40)
    assert replayed_markers(object_store) == {40}


def test_a_manifest_of_a_newer_version_is_unreadable_and_kept(object_store):
    Recorder(object_store).record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    newer = json.dumps({"stepskip_manifest": 2, "recording": "anything/else", "inner_entries": 2}).encode()
    store.put_small(f"{where}/{MANIFEST_FILE}", newer)
    with pytest.raises(UnreadableEntryError, match="upgrade stepskip"):
        Recorder(object_store, action="cache").role.meet_precondition(1)
    index = CacheIndex(object_store[0], object_store[1])
    (run,) = index.runs()
    report = verify_runs(index, [run])
    assert [p.kind for p in report.problems] == [IssueKind.UNSUPPORTED]
    assert repair(index, report).removed == []
    assert store.read_small(f"{where}/{MANIFEST_FILE}", 1 << 16) == newer


def test_a_directory_named_like_the_manifest_is_damage(object_store):
    Recorder(object_store).record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    store.remove(f"{where}/{MANIFEST_FILE}")
    store.put_small(f"{where}/{MANIFEST_FILE}/x", b"{}")
    cached = Recorder(object_store, action="cache")
    assert not cached.role.meet_precondition(1)
    assert cached.role.stats["corrupt"] == 1
    (run,) = CacheIndex(object_store[0], object_store[1]).runs()
    assert [i.kind for i in run.steps[0].issues()] == [IssueKind.DAMAGED]


def test_steps_written_in_place_are_still_read_beside_manifest_steps(object_store):
    """A step without a manifest (verl's layout, earlier stepskip versions on object stores)."""
    recorder = Recorder(object_store)
    recorder.record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    recording = read_manifest(store, where).recording
    legacy = f"{object_store[0]}/{RUN}/2"
    for inner in range(SYNC):  # copy the recording's inner entries in place at step 2, without a manifest
        meta, files = store.read_entry(f"{where}/{recording}/{inner}")
        store.write_entry(f"{legacy}/{inner}", files, {k: v for k, v in meta.items() if k not in ("files", "retired")})
    reader = Recorder(object_store, action="cache")
    assert reader.role.available_steps() == [1, 2]
    assert replayed_markers(object_store, step=2) == {10}
    (run,) = CacheIndex(object_store[0], object_store[1]).runs()
    assert [(s.step, s.valid, s.manifest is not None) for s in run.steps] == [(1, True, True), (2, True, False)]


@pytest.mark.parametrize("written", ["before the manifest", "after the manifest"])
def test_in_place_inner_directories_beside_a_manifest_are_removed_only_when_it_superseded_them(object_store,
                                                                                              written):
    """``{step}/{inner}/`` beside ``step.json``: left by an earlier in-place write the manifest superseded
    (a leftover, repaired away), or written after it, by verl's own dumper or an older stepskip (someone's
    data: reported as shadowed and never removed, whatever the grace period)."""
    recorder = Recorder(object_store)
    recorder.record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    recording = read_manifest(store, where).recording
    for inner in range(SYNC):  # the recording's inner entries, copied in place beside the manifest
        meta, files = store.read_entry(f"{where}/{recording}/{inner}")
        store.write_entry(f"{where}/{inner}", files, {k: v for k, v in meta.items() if k not in ("files", "retired")})
    now = store.clock()
    # the manifest republished (same recording) dated after or before the in-place writes
    publish_manifest(store, where, recording, SYNC, recorder.run_id,
                     now=now + 10**6 if written == "before the manifest" else now - 10**6)
    in_place = [f"{where}/{inner}" for inner in range(SYNC)]
    index = CacheIndex(object_store[0], object_store[1])
    (run,) = index.runs()
    (step,) = run.steps
    assert step.valid and step.manifest is not None
    report = verify_runs(index, [run], grace=0.0, now=now + 2 * 10**6)
    removed = repair(index, report).removed
    if written == "before the manifest":
        assert step.leftovers == in_place and step.shadowed == []
        assert sorted(removed) == in_place
        assert not any(n.isdigit() for n in store.list_dir(where))
    else:
        assert step.leftovers == [] and step.shadowed == in_place
        assert [(p.kind, p.path, p.remove) for p in report.problems] == [(IssueKind.SHADOWED, p, "") for p in in_place]
        assert removed == []
        assert sorted(n for n in store.list_dir(where) if n.isdigit()) == [str(i) for i in range(SYNC)]
    assert replayed_markers(object_store) == {10}  # the manifest's recording, either way


def test_start_up_clean_up_reads_a_manifest_only_where_the_listing_shows_a_possible_leftover(object_store,
                                                                                           monkeypatch):
    """The run directory is listed once, recursively: a step whose objects all come from one write per
    entry (or were all written just now) is not looked at; one holding another write's object has its
    manifest read once, and the recording the manifest names is cleaned, once the object is stale."""
    Recorder(object_store).record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    recording = read_manifest(store, where).recording
    reads: list[str] = []
    cleaned: list[str] = []
    read_small, remove_leftovers = type(store).read_small, type(store).remove_leftovers
    monkeypatch.setattr(type(store), "read_small", lambda self, path, limit: reads.append(path) or read_small(
        self, path, limit))
    monkeypatch.setattr(type(store), "remove_leftovers", lambda self, path, *a, **k: cleaned.append(path) or
                        remove_leftovers(self, path, *a, **k))
    Recorder(object_store)  # binding starts the role: its clean-up
    assert reads == [] and cleaned == [where.rsplit("/", 1)[0]]  # the run directory's own clean-up alone
    orphan = f"{where}/{recording}/0/data.deadbeef0000.json"  # a crashed writer's object, nothing names it
    store.backend.fs.pipe_file(store.backend.key(orphan), b"orphan")
    reads.clear()
    cleaned.clear()
    late = Recorder(object_store)
    # written just now: not stale, not looked at
    assert reads == [] and store.backend.fs.exists(store.backend.key(orphan))
    late.role.store.clock = lambda: time.time() + 2 * STALE_SECONDS
    late.role.start()
    assert reads == [f"{where}/{MANIFEST_FILE}"]
    assert cleaned[-1:] == [f"{where}/{recording}"] and where not in cleaned  # the run directory's own is before
    assert not store.backend.fs.exists(store.backend.key(orphan))
    assert replayed_markers(object_store) == {10}


def test_a_cache_hit_reads_the_manifest_once_per_phase_and_loads_the_recording_it_probed(object_store, monkeypatch):
    """``meet_precondition`` decides from the one probe of the step; ``inject`` reads the inner entries of
    the recording its own probe validated, even when the manifest names another one by then."""
    Recorder(object_store).record(1, marker=10)
    store, where = fs_store(object_store), step_dir(object_store)
    reader = Recorder(object_store, action="cache")
    reads: list[str] = []
    read_small = type(store).read_small
    monkeypatch.setattr(type(store), "read_small", lambda self, path, limit: reads.append(path) or read_small(
        self, path, limit))
    assert reader.role.meet_precondition(1)
    assert reads == [f"{where}/{MANIFEST_FILE}"]
    probed = reader.role.entries.probed

    def then_renamed(step, *args):
        out = probed(step, *args)  # then another manifest, naming a recording that is not there
        store.put_small(f"{where}/{MANIFEST_FILE}", StepManifest("rec-ffffffffffff", SYNC, "other").to_bytes())
        return out

    monkeypatch.setattr(reader.role.entries, "probed", then_renamed)
    reads.clear()
    uids = ["a", "b", "c", "d"]
    reader.role.inject(1, uids)
    assert reads == [f"{where}/{MANIFEST_FILE}"]
    data = reader.tq.kv_batch_get(keys=[f"{u}_{s}_0" for u in uids for s in range(N)], partition_id="train")
    assert {int(r[0]) // 1000 for r in data["responses"]} == {10}


def test_the_cli_lists_verifies_shows_and_views_manifest_steps(object_store):
    from cli_run import stepskip

    from stepskip.view.data import ViewSource

    a = Recorder(object_store)
    a.record(1, marker=10)
    Recorder(object_store).record(1, marker=20)  # a's recording retired
    dump_dir, options = object_store
    flags: list[str] = []
    for key, value in (options.get("client_kwargs") or {}).items():
        flags += ["-o", f"client_kwargs.{key}={value}"]
    if options:
        flags += ["-o", "skip_instance_cache=true"]
    listed = stepskip("ls", dump_dir, "--json", *flags)
    assert listed.code == 0, listed
    verified = stepskip("verify", dump_dir, *flags)
    assert verified.code == 1 and "leftover" in verified.out  # the retired recording, kept while recent
    info = stepskip("info", f"{dump_dir}/{RUN}/1", "--json", *flags)
    assert info.code == 0, info
    shown = info.json()
    assert [e["inner"] for e in shown["entries"]] == [0, 1]
    source = ViewSource(dump_dir, options)
    page = source.step_page(RUN, "rollout_tq", 1, limit=50)
    assert len(page["rows"]) == 4 * N


def test_a_manifest_round_trips_and_names_only_recordings():
    manifest = StepManifest("rec-00112233aabb", 3, "run", 5.0, {"rec-ffeeddccbbaa": 1.0})
    from stepskip._manifest import parse_manifest

    assert parse_manifest(manifest.to_bytes()) == manifest
    assert not is_recording("rec-00112233aabb/..") and not is_recording("REC-00112233AABB")



def test_a_manifest_step_copied_to_local_disk_is_read_there_and_a_linked_manifest_is_not_followed(tmp_path):
    """``aws s3 sync`` of an object-store cache: the local store reads manifests too (it writes none)."""
    import os

    import fsspec

    remote = (f"memory://stepskip-{uuid.uuid4().hex[:8]}/dump", {})
    Recorder(remote).record(1, marker=10)
    Recorder(remote).record(1, marker=20)
    fs = fsspec.filesystem("memory")
    local = tmp_path / "dump"
    for path in fs.find(remote[0]):
        target = local / path[len(fs._strip_protocol(remote[0])) + 1:]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(path))
    copy = (str(local), {})
    assert replayed_markers(copy) == {20}
    (run,) = CacheIndex(str(local)).runs()
    assert run.steps[0].valid and len(run.steps[0].leftovers) == 1  # the retired recording

    manifest = local / RUN / "1" / MANIFEST_FILE
    outside = tmp_path / "planted.json"
    outside.write_bytes(manifest.read_bytes())
    manifest.unlink()
    os.symlink(outside, manifest)
    cached = Recorder(copy, action="cache")
    assert not cached.role.meet_precondition(1)
    assert cached.role.stats["corrupt"] == 1
    (run,) = CacheIndex(str(local)).runs()
    assert [i.kind for i in run.steps[0].issues()] == [IssueKind.DAMAGED]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    manifest.unlink()
    os.symlink(fifo, manifest)
    assert not Recorder(copy, action="cache").role.meet_precondition(1)  # never opened through the link: no hang
    manifest.unlink()
    os.mkfifo(manifest)
    assert not Recorder(copy, action="cache").role.meet_precondition(1)  # a FIFO in its place: no hang either


def test_local_small_files_are_read_bounded_and_written_whole(tmp_path):
    from stepskip._storage import EntryStore, LocalBackend

    store = EntryStore(LocalBackend(str(tmp_path)))
    assert store.read_small(str(tmp_path / "absent.json"), 10) is None
    store.put_small(str(tmp_path / "a" / "x.json"), b"12345")
    store.put_small(str(tmp_path / "a" / "x.json"), b"678")
    assert store.read_small(str(tmp_path / "a" / "x.json"), 10) == b"678"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["x.json"]  # no temporary left
    with pytest.raises(CorruptEntryError, match="more than"):
        store.read_small(str(tmp_path / "a" / "x.json"), 2)
    with pytest.raises(CorruptEntryError):
        store.read_small(str(tmp_path / "a"), 10)  # a directory


def test_convert_writes_a_manifest_step_in_place_and_clears_a_destination_manifest(object_store, tmp_path,
                                                                                   monkeypatch):
    from stepskip.cli.convert import convert_cache

    Recorder(object_store).record(1, marker=10)
    Recorder(object_store).record(1, marker=20)
    local = tmp_path / "converted"
    report = convert_cache(CacheIndex(*object_store), CacheIndex(str(local)), to="safe")
    assert report.ok and len(report.converted) == SYNC
    assert sorted(p.name for p in (local / RUN / "1").iterdir()) == ["0", "1"]  # in place: no manifest needed
    assert replayed_markers((str(local), {})) == {20}
    # back onto the object store, over the manifest step: the old manifest goes, the converted step is read
    removes: list[str] = []
    remove = type(fs_store(object_store)).remove
    monkeypatch.setattr(type(fs_store(object_store)), "remove", lambda self, path: removes.append(path) or
                        remove(self, path))
    back = convert_cache(CacheIndex(str(local)), CacheIndex(*object_store), to="safe", overwrite=True)
    assert back.ok
    assert [p for p in removes if p.endswith(MANIFEST_FILE)] == [f"{step_dir(object_store)}/{MANIFEST_FILE}"]  # once
    assert read_manifest(fs_store(object_store), step_dir(object_store)) is None
    assert replayed_markers(object_store) == {20}


def test_two_recorder_processes_on_s3_end_with_the_step_of_the_last_manifest(s3_server):
    """Real recorder processes (SkipManager each) on the moto server: A writes inner 0, B records the
    whole step, then A writes inner 1; each waits for the other's event, never for time."""
    import multiprocessing

    import s3fs
    from v1_recorders import record_step

    options = {"client_kwargs": {"endpoint_url": s3_server}, "skip_instance_cache": True}
    bucket = f"stepskip-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    store = (f"s3://{bucket}/dump", options)
    ctx = multiprocessing.get_context("spawn")
    a_first, b_done, release_a = ctx.Event(), ctx.Event(), ctx.Event()
    a_results, b_results = ctx.Queue(), ctx.Queue()
    a = ctx.Process(target=record_step, args=(store[0], None, a_first, release_a, None, a_results),
                    kwargs={"storage_options": options})
    b = ctx.Process(target=record_step, args=(store[0], a_first, None, None, b_done, b_results),
                    kwargs={"storage_options": options})
    a.start()
    b.start()
    try:
        a_run, b_run = a_results.get(timeout=300), b_results.get(timeout=300)
        assert b_done.wait(300)
        b.join(300)
        assert b.exitcode == 0
        assert run_ids(store) == {b_run}  # B's whole step while A is still recording
    finally:
        release_a.set()
        a.join(300)
    assert a.exitcode == 0
    assert run_ids(store) == {a_run}  # A's manifest was written last: its whole step
    (run,) = CacheIndex(*store).runs()
    assert run.steps[0].valid and len(run.steps[0].leftovers) == 1  # B's recording, retired


def test_match_finds_prompts_in_manifest_steps(object_store):
    """rollout_tq under action: match indexes the recording a step's manifest names (and nothing else)."""
    from v1_harness import V1Trainer

    from stepskip import SkipManager

    def trainer(action: str, gbs: int, start: int) -> V1Trainer:
        config = make_config(*object_store, action=action)
        config["skip"]["rollout_tq"]["steps"] = [1, 2]
        config["data"]["train_batch_size"] = gbs
        del config["trainer"]
        live = V1Trainer(config, InProcessTQClient(), prompts_per_step=gbs)
        live.next_prompt = start
        return live

    recorder = trainer("record", 4, 0)
    recorder.fit(2)  # prompts 0-3 at step 1, 4-7 at step 2
    SkipManager.reset()
    store = fs_store(object_store)
    assert read_manifest(store, f"{object_store[0]}/default_experiment_name_default_project_name/"
                                f"GBS4_N2_in0_out0/1") is not None
    live = trainer("match", 3, 2)  # prompts 2-4 and 5-7, in another run directory (GBS3)
    live.fit(2)
    assert live.agent_loop.submitted == []
    stats = SkipManager.stats()
    assert stats["skip/rollout_tq/rows_replayed"] == 2 * 3  # prompts injected
