"""The library's cache index (``stepskip._index``) on its own, on ``memory://`` and a local directory: the
role layout, V1 completeness, entry records, reading (pickle only when allowed) and retiring."""

from __future__ import annotations

import uuid

import pytest
import torch

from stepskip import Batch
from stepskip._storage import open_store
from stepskip.errors import CorruptEntryError, UnreadableEntryError
from stepskip._formats import get_format
from stepskip._index import CacheIndex, EntryStatus, IssueKind, NotACacheError, PickleNotAllowedError, StepKind

RUN = "exp_proj/GBS4_N2_in8_out6"


@pytest.fixture(params=["memory", "local"])
def root(request, tmp_path) -> str:
    return f"memory://index-{uuid.uuid4().hex[:8]}/dump" if request.param == "memory" else str(tmp_path / "dump")


def batch(rows: int = 4) -> Batch:
    return Batch.from_dict({"responses": torch.arange(rows * 3).reshape(rows, 3)},
                           {"uid": [f"u{i}" for i in range(rows)]})


def write(root: str, rel: str, value=None, fmt: str = "safe", **meta) -> None:
    codec = get_format(fmt)
    files = codec.encode(codec.freeze(batch() if value is None else value, copy=True))
    meta = {"global_steps": int(rel.split("/")[-1]) if rel.split("/")[-1].isdigit() else 0, "format": fmt, **meta}
    open_store(root).write_entry(f"{root}/{rel}", files, meta)


def test_roles_live_where_the_layout_puts_them(root):
    write(root, f"{RUN}/1", role="rollout", num_trajectories=4, generation_seconds=1.5,
          fingerprint={"actor_rollout_ref.rollout.n": 2})
    write(root, f"{RUN}/2", role="async_rollout")
    write(root, f"{RUN}/ref_log_prob/1", role="ref_log_prob")
    # the directory decides whose step it is, not meta.json; recorded by another role, the role of the
    # directory cannot replay it (as that role itself says): kept, never removed
    write(root, f"{RUN}/ref_log_prob/3", role="something-else")
    for inner in (0, 1):
        write(root, f"{RUN}/5/{inner}", role="rollout_tq", run_id="r1", parameter_sync_step=2, inner_idx=inner)

    index = CacheIndex(root)
    (run,) = index.runs()
    assert run.name == RUN and run.shape == {"gbs": 4, "n": 2, "prompt_len": 8, "response_len": 6}
    summary = {r.role: r.steps for r in run.roles()}
    assert summary == {"rollout": [1], "async_rollout": [2], "rollout_tq": [5], "ref_log_prob": [1]}
    assert list(summary) == ["rollout", "async_rollout", "rollout_tq", "ref_log_prob"]
    assert [r.invalid_steps for r in run.roles() if r.role == "ref_log_prob"] == [[3]]
    foreign = next(s for s in run.steps if s.role == "ref_log_prob" and s.step == 3).entries[0]
    assert foreign.state is EntryStatus.UNREADABLE and foreign.kept
    assert "recorded by role 'something-else'" in foreign.reason
    v1 = next(s for s in run.steps if s.kind is StepKind.V1)
    assert (v1.role, v1.expected_inner, [e.inner for e in v1.entries], v1.valid) == ("rollout_tq", 2, [0, 1], True)
    first = next(s for s in run.steps if s.role == "rollout").entries[0]
    assert (first.rows, first.generation_seconds, first.fingerprint) == (4, 1.5, {"actor_rollout_ref.rollout.n": 2})
    assert first.state is EntryStatus.PRESENT and first.bytes > 0 and first.time > 0
    assert first.written_by.startswith("stepskip") and first.has_checksums


def test_v1_completeness_comes_from_the_inner_meta(root):
    write(root, f"{RUN}/1/0", run_id="r1", parameter_sync_step=3)
    write(root, f"{RUN}/1/2", run_id="r1", parameter_sync_step=3)
    write(root, f"{RUN}/2/0", run_id="r1", parameter_sync_step=2)
    write(root, f"{RUN}/2/1", run_id="r2", parameter_sync_step=2)
    run = CacheIndex(root).runs()[0]
    issues = {(i.kind, i.path.rsplit("/", 1)[-1]) for s in run.steps for i in s.issues()}
    assert issues == {(IssueKind.INCOMPLETE, "1"), (IssueKind.MIXED_RUNS, "2")}
    assert "lacks inner entry 1 of 3" in run.steps[0].issues()[0].detail
    assert all(r.steps == [] and r.invalid_steps == [1, 2] for r in run.roles())


def test_read_entry_decodes_and_pickle_needs_permission(root):
    write(root, f"{RUN}/1")
    write(root, f"{RUN}/2", fmt="verl")
    write(root, f"{RUN}/3", format="safe-v9")  # a newer stepskip's format
    index = CacheIndex(root)
    steps = {s.step: s for s in index.runs()[0].steps}
    value = index.read_step(steps[1])
    assert torch.equal(value.batch["responses"], batch().batch["responses"])
    with pytest.raises(PickleNotAllowedError, match="allow_pickle") as refused:
        index.read_step(steps[2])
    assert isinstance(refused.value, UnreadableEntryError)
    assert list(index.read_step(steps[2], allow_pickle=True).non_tensor_batch["uid"]) == ["u0", "u1", "u2", "u3"]
    newer = steps[3].entries[0]
    assert newer.state is EntryStatus.UNSUPPORTED and "newer stepskip" in newer.reason
    with pytest.raises(UnreadableEntryError, match="newer stepskip"):
        index.read_entry(newer)
    assert index.check_entry(newer) is None  # nothing to check: it is kept as it is


def test_damage_and_undecodable_entries_are_told_apart(root):
    write(root, f"{RUN}/1")
    write(root, f"{RUN}/2")
    index = CacheIndex(root)
    store = index.store
    step1, step2 = index.runs()[0].steps
    obj = step1.entries[0].meta["files"]["data.safetensors"].get("object", "data.safetensors")
    raw = bytearray(store.read_files(step1.path, step1.entries[0].meta, ["data.safetensors"], verify=True)
                    ["data.safetensors"])
    raw[-1] ^= 0xFF
    _put(index, f"{step1.path}/{obj}", bytes(raw))
    issue = index.check_entry(step1.entries[0])
    assert issue is not None and issue.kind is IssueKind.CHECKSUM
    with pytest.raises(CorruptEntryError):
        index.read_entry(step1.entries[0])

    # Rewritten with a tree this stepskip does not know: checksums match, decoding fails: unreadable.
    tree = b'{"format": "safe", "version": 1, "root": {"kind": "no-such-node"}}'
    files = {"data.json": tree, "data.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "}
    store.write_entry(step2.path, files, {"global_steps": 2, "format": "safe"})
    entry = index.scan_step(step2.path, 2).entries[0]
    assert entry.state is EntryStatus.PRESENT  # no decoding at scan time
    issue = index.check_entry(entry, decode=True)
    assert issue is not None and issue.kind is IssueKind.UNDECODABLE
    with pytest.raises(UnreadableEntryError, match="re-record"):
        index.read_entry(entry)


def _put(index: CacheIndex, path: str, data: bytes) -> None:
    if index.is_url:
        index.store.backend.fs.pipe_file(index.store.backend.key(path), data)
    else:
        with open(path, "wb") as fh:
            fh.write(data)


def test_retire_removes_a_step_whole_and_only_below_the_root(root):
    for step in (1, 2):
        write(root, f"{RUN}/{step}")
    for inner in (0, 1):
        write(root, f"{RUN}/3/{inner}", run_id="r", parameter_sync_step=2)
    index = CacheIndex(f"{root}/{RUN}")
    index.retire(f"{root}/{RUN}/3")
    index.retire(f"{root}/{RUN}/1")
    assert [s.step for s in index.scan_run(f"{root}/{RUN}").steps] == [2]
    assert sorted(index.store.list_dir(f"{root}/{RUN}")) == ["2"]  # no directory, trash or object left behind
    with pytest.raises(NotACacheError):
        index.retire(f"{root}/{RUN}")  # the root itself
    with pytest.raises(NotACacheError):
        index.retire(f"{root}/{RUN}/../GBS4_N2_in8_out6/2")
    index.retire(f"{root}/{RUN}/9")  # already gone: nothing to do


def test_paths_that_are_not_caches_are_named(root):
    with pytest.raises(NotACacheError, match="no such file or directory"):
        CacheIndex(root).runs()
    write(root, "notes/1")
    with pytest.raises(NotACacheError, match="not a rollout cache"):
        CacheIndex(f"{root}/notes").runs()
    with pytest.raises(NotACacheError, match="is a run directory"):
        write(root, f"{RUN}/1")
        CacheIndex(f"{root}/{RUN}").resolve()
