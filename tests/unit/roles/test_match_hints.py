"""``action: match`` finds the recorded prompts of a run through the writers' digest tables
(``stepskip._matching.hints``), not by reading every entry's ``meta.json``: the first call looks at as many
entries with 200 entries as with 10 (the two a table is checked on, and those holding the live
prompts). The tables are hints: a damaged, oversized, lying, misplaced or planted one is ignored (with
a warning) and the entries read directly; a claim to a removed entry is skipped; one to an entry
rewritten since is corrected from that entry; a key two prompts share costs a read; and among entries
recording the same prompt the latest step still wins. Whatever the tables say, the rows replayed are
the recorded rows of the live prompts. On a local directory and on fsspec's ``memory://``; the rollout
is made up (no inference server): each response row is its prompt id times 100, its second column the
marker of the run that generated it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import uuid
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from skip_configs import training_config

import stepskip._matching.hints as hints_module
import stepskip._matching.tables as tables_module
import stepskip._reading.listing as listing_module
from stepskip import Batch, SkipManager
from stepskip._matching.hints import HINTS_DIR, DigestTable, identity_key, parse_table, table_of
from stepskip._storage import EntryStore
from stepskip.cli.verify import verify_runs
from stepskip._fidelity import prompt_row_digests
from stepskip._index import CacheIndex

N = 2
RUN = "exp_proj/GBS4_N2_in8_out6"


def prompts_for(ids: list[int], epoch: str) -> Batch:
    rows = [i for i in ids for _ in range(N)]
    tokens = torch.tensor([[i, i + 1] for i in rows])
    return Batch.from_dict(tensors={"input_ids": tokens}, non_tensors={"uid": [f"{epoch}-{i}" for i in rows]})


class Rollout:
    def __init__(self, marker: int = 0) -> None:
        self.seen: list[list[int]] = []
        self.marker = marker

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        ids = prompts.batch["input_ids"][:, 0].tolist()
        self.seen.append(sorted(set(ids)))
        out = torch.tensor([[i * 100, self.marker] for i in ids])
        return Batch.from_dict(tensors={"responses": out}, non_tensors={"uid": list(prompts.non_tensor_batch["uid"])})


@pytest.fixture(params=["local", "memory"])
def dump_dir(request, tmp_path) -> str:
    return str(tmp_path / "dump") if request.param == "local" else f"memory://hints-{uuid.uuid4().hex[:8]}/dump"


def config(dump_dir: str, action: str) -> dict[str, Any]:
    return training_config(dump_dir, steps="all", action=action)


def record(dump_dir: str, steps: dict[int, list[int]], marker: int = 1, gbs: int = 4) -> None:
    """One recording run in ``exp_proj/GBS{gbs}_N2_in8_out6``: at each step, the prompts listed."""
    SkipManager.init(training_config(dump_dir, gbs=gbs, steps="all", action="record"))
    rollout = Rollout(marker)
    for step, ids in steps.items():
        SkipManager.set_step(step)
        rollout.generate_sequences(prompts_for(ids, "rec"))
    SkipManager.flush()
    SkipManager.reset()


def cache_of(dump_dir: str, count: int, first: int = 0) -> None:
    """``count`` entries from step ``first``, step ``s`` holding prompts ``2s`` and ``2s + 1``, by one writer."""
    record(dump_dir, {s: [2 * s, 2 * s + 1] for s in range(first, first + count)})


class Reads:
    """Every look at an entry's ``meta.json`` (a probe, or a read of the entry) the role's store takes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        for method in ("probe", "read_entry"):
            original = getattr(EntryStore, method)
            monkeypatch.setattr(EntryStore, method, self._counted(original))

    def _counted(self, original: Any) -> Any:
        def counted(store: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            self.paths.append(path)
            return original(store, path, *args, **kwargs)
        return counted


def match_call(dump_dir: str, ids: list[int], monkeypatch: pytest.MonkeyPatch, step: int = 10_000
               ) -> tuple[Batch, Rollout, list[str]]:
    """The first call of a ``match`` run over ``ids``: (its result, the rollout, the entries it looked at)."""
    SkipManager.init(config(dump_dir, "match"))
    rollout = Rollout(marker=2)
    reads = Reads(monkeypatch)
    SkipManager.set_step(step)
    out = rollout.generate_sequences(prompts_for(ids, "live"))
    looked = list(reads.paths)
    reads.paths.clear()
    SkipManager.flush()
    return out, rollout, looked


def replayed(out: Batch, ids: list[int]) -> dict[int, int]:
    """Prompt id -> the marker of the run that generated its rows (1: recorded, 2: this call)."""
    rows = out.batch["responses"].tolist()
    assert [r[0] for r in rows] == [i * 100 for i in ids for _ in range(N)]  # the live order, the live prompts
    return {i: rows[N * k][1] for k, i in enumerate(ids)}


def store_of(dump_dir: str) -> Any:
    store = SkipManager.skip_instances["rollout"].store if SkipManager.skip_instances else None
    if store is None:
        from stepskip._storage import open_store
        store = open_store(dump_dir)
    return store


def tables(dump_dir: str) -> dict[str, bytes]:
    store, where = store_of(dump_dir), f"{dump_dir}/exp_proj/{HINTS_DIR}"
    return {name: store.read_small(f"{where}/{name}", 1 << 30) for name in sorted(store.list_dir(where))
            if table_of(name) is not None}


def put_table(dump_dir: str, name: str, data: bytes) -> None:
    store_of(dump_dir).put_small(f"{dump_dir}/exp_proj/{HINTS_DIR}/{name}", data)


def remove_tables(dump_dir: str, names: Any = None) -> None:
    store = store_of(dump_dir)
    for name in (names if names is not None else tables(dump_dir)):
        store.remove(f"{dump_dir}/exp_proj/{HINTS_DIR}/{name}")


def meta_of(dump_dir: str, step: int) -> dict[str, Any]:
    return json.loads(store_of(dump_dir).read_small(f"{dump_dir}/{RUN}/{step}/meta.json", 1 << 20))


def table_from(dump_dir: str, metas: dict[int, dict[str, Any]]) -> bytes:
    """A table written by the writer's own code, describing each step as the ``meta`` given."""
    table = DigestTable()
    for step, meta in metas.items():
        assert table.add(str(step), meta)
    return table.to_bytes()


def entry(dump_dir: str, step: int) -> str:
    return f"{dump_dir}/{RUN}/{step}"


# --------------------------------------------------------------------------- the cost of the first call


def test_first_match_call_looks_at_as_many_entries_at_10_and_200(dump_dir, monkeypatch) -> None:
    looked = {}
    for count in (10, 200):
        root = f"{dump_dir}/{count}"
        cache_of(root, count)
        assert len(tables(root)) == 1  # one writer, one table
        ids = [0, 2 * (count - 1), 99_999]
        out, rollout, looked[count] = match_call(root, ids, monkeypatch)
        assert replayed(out, ids) == {0: 1, 2 * (count - 1): 1, 99_999: 2}
        assert rollout.seen == [[99_999]]
        monkeypatch.undo()
        SkipManager.reset()
    # the two entries the table is checked on, the one chosen beyond them (each probed, then read), the step written
    assert len(looked[10]) == len(looked[200]) <= 8, looked
    assert f"{dump_dir}/200/{RUN}/199" in looked[200] and f"{dump_dir}/200/{RUN}/100" not in looked[200]


def test_later_calls_read_only_the_entries_the_live_prompts_point_at(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 30)
    out, _, _ = match_call(dump_dir, [0, 10], monkeypatch)
    assert replayed(out, [0, 10]) == {0: 1, 10: 1}
    reads = Reads(monkeypatch)
    for step, ids in ((10_001, [20, 21]), (10_002, [40, 58])):
        SkipManager.set_step(step)
        out = Rollout(marker=2).generate_sequences(prompts_for(ids, "live"))
        assert replayed(out, ids) == dict.fromkeys(ids, 1)
    assert set(reads.paths) == {entry(dump_dir, s) for s in (10, 20, 29)}, reads.paths


def test_entries_no_table_covers_are_read_directly(dump_dir, monkeypatch) -> None:
    """Entries of verl, of an older stepskip or of a writer that stopped before its table."""
    cache_of(dump_dir, 12)
    remove_tables(dump_dir)
    out, rollout, looked = match_call(dump_dir, [0, 22, 99_999], monkeypatch)
    assert replayed(out, [0, 22, 99_999]) == {0: 1, 22: 1, 99_999: 2}
    assert len(set(looked)) >= 12  # every entry's meta.json, as without tables


def test_a_later_writers_table_covers_only_its_own_entries(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    remove_tables(dump_dir)
    cache_of(dump_dir, 10, first=10)  # tabled; steps 0-9 are not
    out, _, looked = match_call(dump_dir, [0, 38], monkeypatch)
    assert replayed(out, [0, 38]) == {0: 1, 38: 1}
    assert {entry(dump_dir, s) for s in range(10)} <= set(looked)  # read directly
    # tabled and not chosen: never read, but for the two a table is checked on before it is used
    assert {entry(dump_dir, s) for s in range(10, 20)} & set(looked) == {entry(dump_dir, s) for s in (10, 11, 19)}


# --------------------------------------------------------------------------- tables that are wrong


def _reheader(raw: bytes, **fields: int) -> bytes:
    """``raw`` with header fields replaced (its checksum left as it was unless ``crc`` is given)."""
    magic, version, entries, rows, crc, zero = struct.unpack_from("<8sIIQII", raw)
    values = dict(version=version, entries=entries, rows=rows, crc=crc, zero=zero) | fields
    return struct.pack("<8sIIQII", magic, values["version"], values["entries"], values["rows"], values["crc"],
                       values["zero"]) + raw[32:]


def _rebody(raw: bytes, body: bytes) -> bytes:
    return _reheader(raw[:32] + body, crc=zlib.crc32(body))


def _damaged(raw: bytes, damage: str) -> bytes:
    """A table of 10 entries, 2 keys each, damaged as ``damage`` says (sums and sizes kept right where
    only the structure is wrong, so that each check is what refuses it)."""
    body = raw[32:]
    names, identities = np.frombuffer(body, "<u8", 10).copy(), body[80:160]
    keys, owners = np.frombuffer(body, "<u8", 20, 160).copy(), np.frombuffer(body, "<u4", 20, 320).copy()
    if damage == "garbage":
        return b"\x00{not a table" * 10
    if damage == "json":
        return b'{"stepskip_hints": 1, "entries": {}}'
    if damage == "other-version":
        return _reheader(raw, version=2)
    if damage == "truncated":
        return raw[:-5]
    if damage == "padded":
        return raw + b"\x00" * 8
    if damage == "header-only":
        return raw[:32]
    if damage == "checksum":
        return raw[:-1] + bytes([raw[-1] ^ 1])
    if damage == "huge-counts":
        return _reheader(raw, entries=1 << 30, rows=1 << 40)
    if damage == "names-unsorted":
        names[[0, 1]] = names[[1, 0]]
    elif damage == "names-duplicate":
        names[1] = names[0]
    elif damage == "name-not-a-step":
        names[-1] = np.uint64(10**19)
    elif damage == "keys-unsorted":
        keys[[0, -1]] = keys[[-1, 0]]
    elif damage == "owner-outside":
        owners[3] = 10
    elif damage == "latest-not-first":
        keys[:] = keys[0]  # every entry files one key: the order among them must then be by step, latest first
        owners[:] = np.sort(owners)
    return _rebody(raw, names.tobytes() + identities + keys.tobytes() + owners.tobytes())


DAMAGES = ["garbage", "json", "other-version", "truncated", "padded", "header-only", "checksum", "huge-counts",
           "names-unsorted", "names-duplicate", "name-not-a-step", "keys-unsorted", "owner-outside", "latest-not-first"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_parse_table_refuses_every_malformed_table(damage: str) -> None:
    metas = {s: {"run_id": "r", "created_unix": 1.0 + s, "row_prompts": [f"p{s}", f"q{s}"]} for s in range(10)}
    raw = table_from("", metas)
    assert parse_table(raw, "t.keys")[1] == ""
    table, problem = parse_table(_damaged(raw, damage), "t.keys")
    assert table is None and problem.startswith("t.keys"), problem


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_table_is_ignored_and_the_entries_read(dump_dir, monkeypatch, caplog, damage) -> None:
    cache_of(dump_dir, 10)
    (name, raw), = tables(dump_dir).items()
    put_table(dump_dir, name, _damaged(raw, damage))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, _, looked = match_call(dump_dir, [0, 18, 99_999], monkeypatch)
    assert replayed(out, [0, 18, 99_999]) == {0: 1, 18: 1, 99_999: 2}
    assert "ignoring the digest table" in caplog.text
    assert len(set(looked)) >= 10


def test_an_oversized_table_is_not_read_past_its_bound(dump_dir, monkeypatch, caplog) -> None:
    cache_of(dump_dir, 10)
    monkeypatch.setattr(hints_module, "TABLE_MAX_BYTES", 64)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        SkipManager.init(config(dump_dir, "match"))
        SkipManager.set_step(10_000)
        out = Rollout(2).generate_sequences(prompts_for([0, 18], "live"))
    assert replayed(out, [0, 18]) == {0: 1, 18: 1}
    assert "ignoring the digest table" in caplog.text and "64" in caplog.text


def test_a_table_that_lies_about_an_entry_is_dropped_and_its_entries_read(dump_dir, monkeypatch, caplog) -> None:
    """The table says step 6 (its own identity) holds step 5's prompts, and step 5 holds nothing live:
    its first two entries are right, so it passes the check; the call that follows its claim finds
    the lie, stops believing the table and reads the entries it covered."""
    cache_of(dump_dir, 10)
    metas = {s: meta_of(dump_dir, s) for s in range(10)}
    metas[6] = dict(metas[6], row_prompts=metas[5]["row_prompts"] + metas[6]["row_prompts"])
    metas[5] = dict(metas[5], row_prompts=["xxh3v2:0"])
    (name, _), = tables(dump_dir).items()
    put_table(dump_dir, name, table_from(dump_dir, metas))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [10, 12, 99_999], monkeypatch)
    assert replayed(out, [10, 12, 99_999]) == {10: 1, 12: 1, 99_999: 2}
    assert rollout.seen == [[99_999]]
    assert "describes" in caplog.text and "otherwise than its meta.json" in caplog.text
    assert len(set(looked)) >= 10  # dropped: what it covered is read directly


def test_a_lying_table_is_dropped_alone(dump_dir, monkeypatch, caplog) -> None:
    """Two writers' tables: the first lies about step 6 (as above) and is dropped once a call follows that
    claim; the entries only it covered are read directly, the second's stay covered and unread."""
    cache_of(dump_dir, 10)
    liar = next(iter(tables(dump_dir)))
    cache_of(dump_dir, 10, first=10)
    metas = {s: meta_of(dump_dir, s) for s in range(10)}
    metas[6] = dict(metas[6], row_prompts=metas[5]["row_prompts"] + metas[6]["row_prompts"])
    metas[5] = dict(metas[5], row_prompts=["xxh3v2:0"])
    put_table(dump_dir, liar, table_from(dump_dir, metas))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [10, 30], monkeypatch)
    assert replayed(out, [10, 30]) == {10: 1, 30: 1} and rollout.seen == []
    assert "otherwise than its meta.json; ignoring that table" in caplog.text
    assert {entry(dump_dir, s) for s in range(10)} <= set(looked)
    assert not {entry(dump_dir, s) for s in (13, 14, 16, 17, 18)} & set(looked)
    role = SkipManager.skip_instances["rollout"]
    claims = role.match_index.tables.claims
    assert [claim.table.document.rsplit("/", 1)[1] for claim in claims] != [liar] and len(claims) == 1


def test_parse_table_bounds_the_keys_of_a_reader() -> None:
    raw = table_from("", {1: {"run_id": "r", "created_unix": 1.0, "row_prompts": ["a", "b", "c"]}})
    assert parse_table(raw, "t")[0] is not None
    table, problem = parse_table(raw, "t", max_rows=2)
    assert table is None and "more than a reader takes" in problem


def test_a_table_lying_about_the_entries_it_is_checked_on_is_ignored(dump_dir, monkeypatch, caplog) -> None:
    cache_of(dump_dir, 10)
    metas = {s: meta_of(dump_dir, s) for s in range(10)}
    metas[1] = dict(metas[1], row_prompts=metas[0]["row_prompts"])
    (name, _), = tables(dump_dir).items()
    put_table(dump_dir, name, table_from(dump_dir, metas))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, _, looked = match_call(dump_dir, [2, 18], monkeypatch)
    assert replayed(out, [2, 18]) == {2: 1, 18: 1}
    assert "otherwise than its meta.json (checked before use)" in caplog.text and len(set(looked)) >= 10


def test_a_misnamed_or_planted_table_is_not_read(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    (name, raw), = tables(dump_dir).items()
    remove_tables(dump_dir)
    for planted in (".tmp-" + name, "notes.keys", name.replace("GBS4", "GBS8"), name.replace("+", "+reward+", 1),
                    name.replace(".keys", ".json")):
        put_table(dump_dir, planted, raw)  # a temporary, no writer's name, another run's, another role's, a document
    _, _, looked = match_call(dump_dir, [0], monkeypatch)
    assert len(set(looked)) >= 10


def test_a_symlinked_table_is_not_followed(tmp_path, monkeypatch, caplog) -> None:
    dump_dir = str(tmp_path / "dump")
    cache_of(dump_dir, 10)
    (name, raw), = tables(dump_dir).items()
    where = tmp_path / "dump" / "exp_proj" / HINTS_DIR
    (tmp_path / "elsewhere.keys").write_bytes(raw)
    os.remove(where / name)
    os.symlink(tmp_path / "elsewhere.keys", where / name)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, _, looked = match_call(dump_dir, [0, 18], monkeypatch)
    assert replayed(out, [0, 18]) == {0: 1, 18: 1}
    assert "ignoring the digest table" in caplog.text and len(set(looked)) >= 10


@pytest.mark.parametrize("kept", [True, False])
def test_a_planted_table_claiming_every_entry_hides_nothing(dump_dir, monkeypatch, kept) -> None:
    """A table (planted, or a writer whose clock runs ahead) naming every entry with identities of no
    version the entries have and keys no prompt has: no entry it is checked on confirms it, it is
    ignored, with or without the real writer's table beside it; every recorded prompt is replayed."""
    cache_of(dump_dir, 12)
    if not kept:
        remove_tables(dump_dir)
    planted = {s: {"run_id": "x", "created_unix": 1e18, "row_prompts": [f"{s:064x}"]} for s in range(12)}
    put_table(dump_dir, f"GBS4_N2_in8_out6+{'f' * 16}.keys", table_from(dump_dir, planted))
    out, rollout, looked = match_call(dump_dir, [0, 1, 2, 3, 22], monkeypatch)
    assert replayed(out, [0, 1, 2, 3, 22]) == dict.fromkeys([0, 1, 2, 3, 22], 1) and rollout.seen == []
    role = SkipManager.skip_instances["rollout"]
    assert len(role.match_index.tables.claims) == (1 if kept else 0)


def test_tables_naming_entries_without_serving_them_end_the_use_of_tables(dump_dir, monkeypatch, caplog) -> None:
    """A table right about the entries it is checked on, then filing a live prompt under every other
    entry with identities of other versions (each such claim looks like an entry rewritten since, not
    a lie): a call reads at most ``_CANDIDATE_READS + 2 x prompts`` of them, then reads every entry directly."""
    monkeypatch.setattr(tables_module, "CANDIDATE_READS", 2)
    cache_of(dump_dir, 20)
    metas = {s: meta_of(dump_dir, s) for s in range(20)}
    bait = metas[0]["row_prompts"][0]  # prompt 0
    for s in range(2, 20):
        metas[s] = dict(metas[s], created_unix=1e18, row_prompts=[bait])
    (name, _), = tables(dump_dir).items()
    put_table(dump_dir, name, table_from(dump_dir, metas))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [0, 30], monkeypatch)
    assert replayed(out, [0, 30]) == {0: 1, 30: 1} and rollout.seen == []
    assert "without serving them" in caplog.text
    assert len(set(looked)) == 20  # every entry, once
    assert not SkipManager.skip_instances["rollout"].match_index.tables.claims


# --------------------------------------------------------------------------- entries that changed, keys shared


def test_a_claim_to_a_removed_entry_is_skipped(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    SkipManager.init(config(dump_dir, "match"))
    role = SkipManager.skip_instances["rollout"]
    assert role.store.retire_entry(role.step_dump_dir(5))  # as `stepskip prune` removes it
    SkipManager.reset()
    out, rollout, _ = match_call(dump_dir, [10, 18], monkeypatch)
    assert replayed(out, [10, 18]) == {10: 2, 18: 1}
    assert rollout.seen == [[10]]


def test_a_claim_to_an_entry_rewritten_since_is_corrected_from_the_entry(dump_dir, monkeypatch) -> None:
    """Step 5 recorded again by a run whose table never got written: the first table's claim is stale."""
    cache_of(dump_dir, 10)
    first = set(tables(dump_dir))
    record(dump_dir, {5: [50, 51]}, marker=3)
    remove_tables(dump_dir, set(tables(dump_dir)) - first)
    out, rollout, _ = match_call(dump_dir, [10, 50, 18], monkeypatch)
    assert replayed(out, [10, 50, 18]) == {10: 2, 50: 3, 18: 1}  # 10 is no longer recorded anywhere
    assert rollout.seen == [[10]]
    assert len(SkipManager.skip_instances["rollout"].match_index.tables.claims) == 1  # a stale claim is no lie


def test_an_entry_two_tables_describe_is_served_as_it_is_now(dump_dir, monkeypatch) -> None:
    """Two writers' tables describe step 0 differently (the later one rewrote it): the entry's own
    meta.json decides, and the earlier table still serves its other entries."""
    cache_of(dump_dir, 10)
    record(dump_dir, {0: [50, 51]}, marker=3)
    assert len(tables(dump_dir)) == 2
    out, rollout, looked = match_call(dump_dir, [50, 18, 0], monkeypatch)
    assert replayed(out, [50, 18, 0]) == {50: 3, 18: 1, 0: 2}
    assert rollout.seen == [[0]] and len(set(looked)) <= 5  # the entries the tables are checked on, step 9, the step


def test_a_key_two_prompts_share_costs_a_read_and_serves_the_right_rows(dump_dir, monkeypatch, caplog) -> None:
    """Keys of 2 bits: most prompts share their key with others. The entries filed under a live
    prompt's key are read latest first until one holds the prompt itself; nothing counts as a lie."""
    real = hints_module.digest_key
    monkeypatch.setattr(hints_module, "digest_key", lambda digest: real(digest) % 4)
    cache_of(dump_dir, 12)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [0, 7, 22, 99_999], monkeypatch)
    assert replayed(out, [0, 7, 22, 99_999]) == {0: 1, 7: 1, 22: 1, 99_999: 2}
    assert rollout.seen == [[99_999]] and "digest table" not in caplog.text
    assert len(SkipManager.skip_instances["rollout"].match_index.tables.claims) == 1


# --------------------------------------------------------------------------- the latest step wins


def test_the_latest_step_wins_among_an_indexed_entry_and_a_tabled_one(dump_dir, monkeypatch) -> None:
    """Prompt 7 is recorded at step 3 by an untabled run (indexed directly) and at step 15 by a tabled
    one; prompt 30 at step 15 (tabled) and at step 40 (untabled); prompt 21 at steps 10 and 12 of the
    tabled run: each is served from its latest step, and step 10 is never read."""
    record(dump_dir, {3: [7], 40: [30]}, marker=3)
    remove_tables(dump_dir)
    record(dump_dir, {s: [100 + s] for s in (0, 1, 2, 4, 5, 6)} | {10: [21], 12: [21], 15: [7, 30]}, marker=1)
    out, rollout, looked = match_call(dump_dir, [7, 30, 21], monkeypatch)
    assert replayed(out, [7, 30, 21]) == {7: 1, 30: 3, 21: 1} and rollout.seen == []
    role = SkipManager.skip_instances["rollout"]
    digests = prompt_row_digests(prompts_for([7, 30, 21], "x"), role.rebind_keys)[::N]
    assert [role.match_index.prompts.groups[d][0].rsplit("/", 1)[1] for d in digests] == ["15", "40", "12"]
    assert entry(dump_dir, 10) not in looked


def test_the_latest_of_two_tables_wins(dump_dir, monkeypatch) -> None:
    """Prompt 9 recorded at step 20 by one tabled run and at step 25 by another: step 25 serves it,
    whichever table is read first."""
    record(dump_dir, {s: [200 + s] for s in range(10, 21)} | {20: [9]}, marker=1)
    record(dump_dir, {s: [300 + s] for s in range(21, 26)} | {25: [9]}, marker=3)
    assert len(tables(dump_dir)) == 2
    out, rollout, looked = match_call(dump_dir, [9], monkeypatch)
    assert replayed(out, [9]) == {9: 3} and rollout.seen == []
    assert entry(dump_dir, 20) not in looked


# --------------------------------------------------------------------------- writers and the tools


def test_a_writer_starts_another_table_when_its_own_is_full(dump_dir, monkeypatch) -> None:
    monkeypatch.setattr(hints_module, "TABLE_ROLL_BYTES", 200)  # 32 bytes of header, 40 per entry of 2 prompts
    cache_of(dump_dir, 12)
    names = sorted(tables(dump_dir))
    assert len(names) == 3 and len({n.rsplit("-", 1)[0] for n in names if "-" in n.rsplit("+", 1)[1]}) == 1
    covered: list[int] = []
    for raw in tables(dump_dir).values():
        table, problem = parse_table(raw, "t")
        assert not problem and len(raw) <= 200
        covered += table.names.tolist()
    assert sorted(covered) == list(range(12))
    monkeypatch.undo()
    out, _, looked = match_call(dump_dir, [0, 22, 12], monkeypatch)
    # the two entries each table is checked on, and the two chosen beyond them (steps 11 and 6)
    assert replayed(out, [0, 22, 12]) == {0: 1, 22: 1, 12: 1} and len(set(looked)) == 2 * len(names) + 2


def test_a_writer_rewriting_an_entry_describes_it_as_last_given() -> None:
    table = DigestTable()
    first = {"run_id": "r", "created_unix": 1.0, "row_prompts": ["a", "b"]}
    again = {"run_id": "r", "created_unix": 2.0, "row_prompts": ["c", "c"]}
    assert table.add("4", first) and table.add("4", again)
    parsed, _ = parse_table(table.to_bytes(), "t")
    assert parsed.names.tolist() == [4] and parsed.keys.tolist() == [hints_module.digest_key("c")]
    assert int(parsed.identities[0]) == identity_key(again) != identity_key(first)
    assert table.size == len(table.to_bytes())


def test_verify_and_ls_see_no_damage_in_the_tables(dump_dir) -> None:
    cache_of(dump_dir, 3)
    index = CacheIndex(dump_dir)
    runs = index.runs()
    assert [r.path.rsplit("/", 1)[-1] for r in runs] == ["GBS4_N2_in8_out6"]
    assert [s.step for s in runs[0].steps] == [0, 1, 2] and not runs[0].others and not runs[0].leftovers
    report = verify_runs(index, runs)
    assert not report.problems and not report.others
    assert CacheIndex(f"{dump_dir}/exp_proj").find_run_dirs() == [f"{dump_dir}/exp_proj/GBS4_N2_in8_out6"]


@pytest.mark.parametrize("meta, added", [
    ({"run_id": "r", "created_unix": 1.0, "row_prompts": ["a"]}, True),
    ({"run_id": None, "created_unix": 1, "row_prompts": []}, True),
    ({"run_id": "r", "created_unix": 1.0}, False),  # no row digests: nothing to look up
    ({"run_id": "r", "row_prompts": ["a"]}, False),  # no identity to check it by
    ({"run_id": "r", "created_unix": True, "row_prompts": ["a"]}, False),
    ({"run_id": 7, "created_unix": 1.0, "row_prompts": ["a"]}, False),
    ({"run_id": "r", "created_unix": 1.0, "row_prompts": [None]}, False),
])
def test_a_table_describes_only_what_can_be_checked(meta: dict[str, Any], added: bool) -> None:
    table = DigestTable()
    assert table.add("1", meta) is added
    assert table.add("../1", dict(meta, row_prompts=["a"], created_unix=1.0)) is False
    assert table.add("1" * 20, dict(meta, row_prompts=["a"], created_unix=1.0)) is False
    parsed, problem = parse_table(table.to_bytes(), "t")
    assert not problem and parsed.names.tolist() == ([1] if added else [])
    assert table.size == len(table.to_bytes())


def test_a_stage_roles_tables_serve_it_across_run_directories(dump_dir, monkeypatch) -> None:
    """A row-wise stage role keeps its entries in ``{run}/{role}/``: its tables are named for that
    directory, read by the same role in a run of another batch size, and never by the rollout role."""
    calls: list[list[int]] = []

    @SkipManager.annotate(role="reward")
    def score(self: Any, batch: Batch) -> Batch:
        calls.append(sorted(set(batch.batch["input_ids"][:, 0].tolist())))
        return Batch.from_dict(tensors={"score": batch.batch["input_ids"][:, :1].float() * 0.5})

    def reward_config(gbs: int) -> dict[str, Any]:
        return training_config(dump_dir, role="reward", gbs=gbs, kind="stage", row_wise=True, action="match",
                               steps="all")

    SkipManager.init(reward_config(4))
    for step in range(10):
        SkipManager.set_step(step)
        score(None, prompts_for([2 * step, 2 * step + 1], "rec"))
    SkipManager.flush()
    SkipManager.reset()
    cache_of(dump_dir, 10)  # the rollout role's entries and table, in the same run directory
    names = sorted(tables(dump_dir))
    assert len(names) == 2 and sum("+reward+" in n for n in names) == 1
    SkipManager.init(reward_config(2))  # another run directory: GBS2_...
    reads = Reads(monkeypatch)
    SkipManager.set_step(1)
    out = score(None, prompts_for([0, 19, 500], "live"))
    looked = list(reads.paths)
    monkeypatch.undo()
    SkipManager.flush()
    assert out.batch["score"][:, 0].tolist() == [i * 0.5 for i in (0, 19, 500) for _ in range(N)]
    assert calls[-1] == [500] and len(set(looked)) <= 8, looked
    assert all("/reward/" in p for p in looked)


# --------------------------------------------------------------------------- later calls: listings and changes


def test_an_entry_removed_after_the_first_call_is_not_served(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    out, _, _ = match_call(dump_dir, [0], monkeypatch)
    role = SkipManager.skip_instances["rollout"]
    assert role.store.retire_entry(role.step_dump_dir(7))  # covered, never read: its prompts are 14 and 15
    SkipManager.set_step(10_001)
    rollout = Rollout(marker=2)
    out = rollout.generate_sequences(prompts_for([14, 16], "live"))
    assert replayed(out, [14, 16]) == {14: 2, 16: 1} and rollout.seen == [[14]]


def test_later_calls_reuse_the_listing_of_settled_directories_until_one_changes(tmp_path, monkeypatch) -> None:
    """On local disk: run directories last changed long ago are listed once; a step another writer adds
    changes the directory's version, and the next call lists it again and finds the new step."""
    dump_dir = str(tmp_path / "dump")
    cache_of(dump_dir, 10)
    monkeypatch.setattr(listing_module, "_monotonic", lambda: 1000.0)  # the listing never gets too old here
    then = os.path.getmtime(tmp_path) - 60
    for path in (f"{dump_dir}/exp_proj", f"{dump_dir}/{RUN}"):
        os.utime(path, (then, then))
    out, _, _ = match_call(dump_dir, [0], monkeypatch)
    role = SkipManager.skip_instances["rollout"]
    listed: list[str] = []
    original = role.store.list_dir
    monkeypatch.setattr(role.store, "list_dir", lambda path, *a, **k: listed.append(path) or original(path, *a, **k))
    for step in (10_001, 10_002):
        SkipManager.set_step(step)
        out = Rollout(marker=2).generate_sequences(prompts_for([2, 3], "live"))
        assert replayed(out, [2, 3]) == {2: 1, 3: 1}
    assert listed == []
    # another writer adds step 40 holding prompts 2 and 3 (a copy of step 1's entry, as that step)
    shutil.copytree(f"{dump_dir}/{RUN}/1", f"{tmp_path}/40")
    meta = json.loads((tmp_path / "40" / "meta.json").read_text())
    (tmp_path / "40" / "meta.json").write_text(json.dumps(dict(meta, global_steps=40)))
    os.rename(tmp_path / "40", f"{dump_dir}/{RUN}/40")
    SkipManager.set_step(10_003)
    out = Rollout(marker=2).generate_sequences(prompts_for([2, 3], "live"))
    assert replayed(out, [2, 3]) == {2: 1, 3: 1} and f"{dump_dir}/{RUN}" in listed
    digests = prompt_row_digests(prompts_for([2, 3], "x"), role.rebind_keys)
    assert {role.match_index.prompts.groups[d][0] for d in digests} == {entry(dump_dir, 40)}  # the latest step wins


def test_a_table_filing_a_key_under_many_unlisted_entries_costs_a_bounded_scan(dump_dir, monkeypatch, caplog) -> None:
    """Right about its two lowest entries, then filing a live prompt's key under 500 steps that do not
    exist: a call looks at no more than ``_CANDIDATE_SCAN`` of those rows, then reads every entry directly."""
    monkeypatch.setattr(tables_module, "CANDIDATE_SCAN", 50)
    cache_of(dump_dir, 10)
    metas = {s: meta_of(dump_dir, s) for s in range(2)}
    bait = meta_of(dump_dir, 4)["row_prompts"][0]  # prompt 8
    metas |= {s: {"run_id": "x", "created_unix": 1.0, "row_prompts": [bait]} for s in range(1000, 1500)}
    (name, _), = tables(dump_dir).items()
    put_table(dump_dir, name, table_from(dump_dir, metas))
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [8, 18], monkeypatch)
    assert replayed(out, [8, 18]) == {8: 1, 18: 1} and rollout.seen == []
    assert "filed more than 50 keys" in caplog.text and len(set(looked)) == 10
    assert not SkipManager.skip_instances["rollout"].match_index.tables.claims


def test_the_first_call_reuses_the_start_up_listing_of_a_settled_run_directory(tmp_path, monkeypatch) -> None:
    """The start-up clean-up lists this run's directory anyway: match's first call takes that listing
    while the directory is unchanged, and lists it again once another writer added a step since."""
    dump_dir = str(tmp_path / "dump")
    cache_of(dump_dir, 10)
    then = os.path.getmtime(tmp_path) - 60
    monkeypatch.setattr(listing_module, "_monotonic", lambda: 1000.0)
    for changed in (False, True):
        os.utime(f"{dump_dir}/{RUN}", (then, then))
        SkipManager.init(config(dump_dir, "match"))
        role = SkipManager.skip_instances["rollout"]
        listed: list[str] = []
        original = role.store.list_dir
        monkeypatch.setattr(role.store, "list_dir",
                            lambda path, *a, o=original, **k: listed.append(path) or o(path, *a, **k))
        if changed:  # another writer's step 40, holding prompt 2 (a copy of step 1's entry)
            shutil.copytree(f"{dump_dir}/{RUN}/1", tmp_path / "40")
            meta = json.loads((tmp_path / "40" / "meta.json").read_text())
            (tmp_path / "40" / "meta.json").write_text(json.dumps(dict(meta, global_steps=40)))
            os.rename(tmp_path / "40", f"{dump_dir}/{RUN}/40")
        SkipManager.set_step(10_000)
        out = Rollout(marker=2).generate_sequences(prompts_for([2, 18], "live"))
        assert replayed(out, [2, 18]) == {2: 1, 18: 1}
        assert (f"{dump_dir}/{RUN}" in listed) is changed, listed
        served = role.match_index.prompts.groups[prompt_row_digests(prompts_for([2], "x"), role.rebind_keys)[0]][0]
        assert served == entry(dump_dir, 40 if changed else 1)
        SkipManager.reset()


# --------------------------------------------------------------------------- ties between run directories


@pytest.mark.parametrize("tie_step", [1, 5])  # an entry a table is checked on; one only a live prompt reads
@pytest.mark.parametrize("tabled", ["GBS4", "GBS8", "both"])
def test_a_tie_between_run_directories_is_broken_as_without_tables(dump_dir, monkeypatch, tie_step, tabled) -> None:
    """Prompt 7 recorded at the same step in two run directories (``GBS4_...`` and ``GBS8_...``): without
    tables every entry is indexed in path order and the later path wins the tie (``GBS8``); so it must
    with tables, whichever run directory's table is there (the other's entries read directly)."""
    for gbs, marker in ((4, 1), (8, 3)):
        record(dump_dir, {s: [7] if s == tie_step else [100 * gbs + s] for s in range(10)}, marker, gbs=gbs)
        if tabled not in (f"GBS{gbs}", "both"):
            remove_tables(dump_dir, [n for n in tables(dump_dir) if n.startswith(f"GBS{gbs}_")])
    assert len(tables(dump_dir)) == (2 if tabled == "both" else 1)
    out, rollout, _ = match_call(dump_dir, [7], monkeypatch)
    assert replayed(out, [7]) == {7: 3} and rollout.seen == []


def test_a_call_looking_at_exactly_its_scan_of_key_rows_keeps_the_tables(dump_dir, monkeypatch, caplog) -> None:
    """Prompt 8 is filed once (step 4): a call looks at its row, reads step 4, then looks at that row
    again (no longer covered) and ends: two rows, which a scan of two allows; the tables stay in use."""
    monkeypatch.setattr(tables_module, "CANDIDATE_SCAN", 2)
    cache_of(dump_dir, 10)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [8], monkeypatch)
    assert replayed(out, [8]) == {8: 1} and rollout.seen == []
    assert "without serving them" not in caplog.text
    assert len(SkipManager.skip_instances["rollout"].match_index.tables.claims) == 1
    assert entry(dump_dir, 5) not in looked


@pytest.mark.parametrize("seed", range(30))
def test_tables_or_not_the_index_serves_each_prompt_from_the_same_entry(tmp_path, monkeypatch, seed) -> None:
    """Three run directories (GBS4, GBS8, GBS2) recording a few of 12 prompts at random steps, some of them
    again (ties of one step across directories, prompts recorded many times), some directories' tables
    removed: the first match call serves every live prompt from the entry it serves it from with no table
    at all (every entry read, in path order)."""
    import random

    rnd = random.Random(seed)
    dump_dir = str(tmp_path / "dump")
    for gbs, marker in ((4, 1), (8, 3), (2, 4)):
        steps = sorted(rnd.sample(range(30), rnd.randint(3, 14)))
        record(dump_dir, {s: rnd.sample(range(12), 2) for s in steps}, marker, gbs=gbs)
        if rnd.random() < 0.4:
            remove_tables(dump_dir, [n for n in tables(dump_dir) if n.startswith(f"GBS{gbs}_")])
    ids = sorted(rnd.sample(range(12), 5))
    kept = tables(dump_dir)
    served = {}
    for tabled in (False, True):
        if tabled:
            shutil.rmtree(f"{dump_dir}/{RUN}/10000", ignore_errors=True)  # what the call without tables recorded
            for name, raw in kept.items():
                put_table(dump_dir, name, raw)
        else:
            remove_tables(dump_dir)
        out, _, _ = match_call(dump_dir, ids, monkeypatch)
        role = SkipManager.skip_instances["rollout"]
        digests = prompt_row_digests(prompts_for(ids, "x"), role.rebind_keys)[::N]
        served[tabled] = ([role.match_index.prompts.groups.get(d, ("",))[0] for d in digests], replayed(out, ids))
        monkeypatch.undo()
        SkipManager.reset()
    assert served[True] == served[False]


@pytest.mark.parametrize("async_dump", [False, True])
def test_a_table_that_cannot_be_written_fails_no_dump(tmp_path, monkeypatch, caplog, async_dump) -> None:
    """``.stepskip-index`` is a file here (planted, or a tool's mistake): every table write fails. The
    entries are written and counted all the same, each failed write (one per batch of dumps) is a warning,
    and a match run finds them by reading them directly."""
    dump_dir = str(tmp_path / "dump")
    os.makedirs(f"{dump_dir}/exp_proj")
    (tmp_path / "dump" / "exp_proj" / HINTS_DIR).write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        SkipManager.init(training_config(dump_dir, steps="all", action="record", async_dump=async_dump))
        rollout = Rollout(1)
        for step in range(10):
            SkipManager.set_step(step)
            rollout.generate_sequences(prompts_for([2 * step, 2 * step + 1], "rec"))
        SkipManager.flush()
        stats = SkipManager.stats()
        SkipManager.reset()
    assert stats["skip/rollout/dumps"] == 10 and stats["skip/rollout/dump_failures"] == 0, stats
    assert 1 <= caplog.text.count("could not write the digest table") <= 10  # once per batch of dumps
    out, rollout, looked = match_call(dump_dir, [0, 19], monkeypatch)
    assert replayed(out, [0, 19]) == {0: 1, 19: 1} and rollout.seen == [] and len(set(looked)) >= 10


def test_a_table_whose_lowest_entries_were_recorded_again_is_checked_on_others(dump_dir, monkeypatch, caplog) -> None:
    """Steps 0-3 of a 20-step run recorded again by another run (its own table): the first table's lowest
    entries hold another version now, so it is checked on entries no other table names; both stay in use
    and the first call reads a few entries, not all 20."""
    cache_of(dump_dir, 20)
    record(dump_dir, {s: [50 + s] for s in range(4)}, marker=3)
    assert len(tables(dump_dir)) == 2
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, looked = match_call(dump_dir, [30, 51, 0], monkeypatch)
    assert replayed(out, [30, 51, 0]) == {30: 1, 51: 3, 0: 2} and rollout.seen == [[0]]
    assert "ignoring the digest table" not in caplog.text
    assert len(SkipManager.skip_instances["rollout"].match_index.tables.claims) == 2 and len(set(looked)) <= 10, looked
