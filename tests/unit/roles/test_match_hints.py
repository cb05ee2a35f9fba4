"""``action: match``'s first call of a run builds its prompt index from the writers' hint documents
(``stepskip.hints``), not from every entry's ``meta.json``: it reads as many entries with 200 entries
as with 10. The documents are hints: a damaged, oversized, lying or misplaced one is ignored (with a
warning) and the entries read directly; a hint to a removed entry is skipped; one to an entry
rewritten since is corrected from that entry. Whatever the documents say, the rows replayed are the
recorded rows of the live prompts. On a local directory and on fsspec's ``memory://``; the rollout
is made up (no inference server): each response row is its prompt id times 100.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

import pytest
import torch
from skip_configs import training_config

import stepskip.hints as hints_module
from stepskip import Batch, SkipManager
from stepskip.cli.verify import verify_runs
from stepskip.hints import HINTS_DIR, HintDocument, document_of, parse_hints
from stepskip.index import CacheIndex
from stepskip.store import FsspecStore, LocalStore

N = 2


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


def record(dump_dir: str, steps: dict[int, list[int]], marker: int = 1) -> None:
    """One recording run: at each step, the prompts listed."""
    SkipManager.init(config(dump_dir, "record"))
    rollout = Rollout(marker)
    for step, ids in steps.items():
        SkipManager.set_step(step)
        rollout.generate_sequences(prompts_for(ids, "rec"))
    SkipManager.flush()
    SkipManager.reset()


def cache_of(dump_dir: str, count: int) -> None:
    """``count`` entries, step ``s`` holding prompts ``2s`` and ``2s + 1``, recorded by one writer."""
    record(dump_dir, {s: [2 * s, 2 * s + 1] for s in range(count)})


class Reads:
    """Every look at an entry's ``meta.json`` (a probe, or a read of the entry) the role's store takes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        for cls in (LocalStore, FsspecStore):
            for method in ("probe", "read_entry"):
                original = getattr(cls, method)
                monkeypatch.setattr(cls, method, self._counted(original))

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
    monkeypatch.undo()
    SkipManager.flush()
    return out, rollout, looked


def replayed(out: Batch, ids: list[int]) -> dict[int, int]:
    """Prompt id -> the marker of the run that generated its rows (1: recorded, 2: this call)."""
    rows = out.batch["responses"].tolist()
    assert [r[0] for r in rows] == [i * 100 for i in ids for _ in range(N)]  # the live order, the live prompts
    return {i: rows[N * k][1] for k, i in enumerate(ids)}


def hints_dir(dump_dir: str) -> tuple[Any, str]:
    store = SkipManager.skip_instances["rollout"].store if SkipManager.skip_instances else None
    if store is None:
        from stepskip.store import open_store
        store = open_store(dump_dir)
    return store, f"{dump_dir}/exp_proj/{HINTS_DIR}"


def documents(dump_dir: str) -> dict[str, bytes]:
    store, where = hints_dir(dump_dir)
    return {name: store.read_small(f"{where}/{name}", 1 << 30) for name in store.list_dir(where)
            if document_of(name) is not None}


def put_document(dump_dir: str, name: str, data: bytes) -> None:
    store, where = hints_dir(dump_dir)
    store.put_small(f"{where}/{name}", data)


def remove_documents(dump_dir: str, names: Any = None) -> None:
    store, where = hints_dir(dump_dir)
    for name in (names if names is not None else documents(dump_dir)):
        store.remove(f"{where}/{name}")


# --------------------------------------------------------------------------- the cost of the first call


def test_first_match_call_looks_at_as_many_entries_at_10_and_200(dump_dir, monkeypatch) -> None:
    looked = {}
    for count in (10, 200):
        root = f"{dump_dir}/{count}"
        cache_of(root, count)
        assert len(documents(root)) == 1  # one writer, one document
        ids = [0, 2 * (count - 1), 99_999]
        out, rollout, looked[count] = match_call(root, ids, monkeypatch)
        assert replayed(out, ids) == {0: 1, 2 * (count - 1): 1, 99_999: 2}
        assert rollout.seen == [[99_999]]
        SkipManager.reset()
    assert len(looked[10]) == len(looked[200]) <= 8, looked  # the two entries chosen, and the step written


def test_entries_no_document_covers_are_read_directly(dump_dir, monkeypatch) -> None:
    """Entries of verl, of an older stepskip or of a writer that stopped before its document."""
    cache_of(dump_dir, 12)
    remove_documents(dump_dir)
    out, rollout, looked = match_call(dump_dir, [0, 22, 99_999], monkeypatch)
    assert replayed(out, [0, 22, 99_999]) == {0: 1, 22: 1, 99_999: 2}
    assert len(set(looked)) >= 12  # every entry's meta.json, as without hints


def test_a_later_writers_document_covers_only_its_own_entries(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    remove_documents(dump_dir)
    record(dump_dir, {s: [2 * s, 2 * s + 1] for s in range(10, 20)})  # documented; steps 0-9 are not
    out, _, looked = match_call(dump_dir, [0, 38], monkeypatch)
    assert replayed(out, [0, 38]) == {0: 1, 38: 1}
    run = f"{dump_dir}/exp_proj/GBS4_N2_in8_out6"
    assert {f"{run}/{s}" for s in range(10)} <= set(looked)  # read directly
    # hinted and not chosen: never read, but for the two a document is checked against before it is used
    assert len({f"{run}/{s}" for s in range(10, 19)} & set(looked)) <= 2


# --------------------------------------------------------------------------- documents that are wrong


@pytest.mark.parametrize("damage", ["garbage", "not-an-object", "other-version", "outside", "absolute",
                                    "rows-ill-typed", "rows-oversized", "step-negative"])
def test_a_damaged_document_is_ignored_and_the_entries_read(dump_dir, monkeypatch, caplog, damage) -> None:
    cache_of(dump_dir, 10)
    name, raw = next(iter(documents(dump_dir).items()))
    body = json.loads(raw)
    entry = next(iter(body["entries"].values()))
    if damage == "garbage":
        data = b"\x00{not json"
    elif damage == "not-an-object":
        data = b"[1, 2]"
    elif damage == "other-version":
        data = json.dumps(dict(body, stepskip_hints=99)).encode()
    elif damage in ("outside", "absolute"):
        key = "../../other/3" if damage == "outside" else "/etc/passwd"
        data = json.dumps(dict(body, entries={**body["entries"], key: entry})).encode()
    elif damage == "rows-ill-typed":
        data = json.dumps(dict(body, entries={"0": dict(entry, rows=[[1, "x"]])})).encode()
    elif damage == "rows-oversized":
        data = json.dumps(dict(body, entries={"0": dict(entry, rows=[["d", 10**12]])})).encode()
    else:
        data = json.dumps(dict(body, entries={"0": dict(entry, step=-1)})).encode()
    put_document(dump_dir, name, data)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, _, looked = match_call(dump_dir, [0, 18, 99_999], monkeypatch)
    assert replayed(out, [0, 18, 99_999]) == {0: 1, 18: 1, 99_999: 2}
    assert "ignoring the hint document" in caplog.text
    assert len(set(looked)) >= 10


def test_an_oversized_document_is_not_read_past_its_bound(dump_dir, monkeypatch, caplog) -> None:
    cache_of(dump_dir, 10)
    monkeypatch.setattr(hints_module, "HINTS_MAX_BYTES", 64)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        SkipManager.init(config(dump_dir, "match"))
        SkipManager.set_step(10_000)
        out = Rollout(2).generate_sequences(prompts_for([0, 18], "live"))
    assert replayed(out, [0, 18]) == {0: 1, 18: 1}
    assert "ignoring the hint document" in caplog.text and "64" in caplog.text


def test_a_lying_document_is_ignored_once_a_chosen_entry_contradicts_it(dump_dir, monkeypatch, caplog) -> None:
    """The document says step 1 holds step 0's prompts (the identity of step 1's meta.json, other digests)."""
    cache_of(dump_dir, 10)
    name, raw = next(iter(documents(dump_dir).items()))
    body = json.loads(raw)
    body["entries"]["1"]["rows"], body["entries"]["0"]["rows"] = body["entries"]["0"]["rows"], [["xxh3v2:0", 4]]
    put_document(dump_dir, name, json.dumps(body).encode())
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, rollout, _ = match_call(dump_dir, [0, 1, 2, 99_999], monkeypatch)
    assert replayed(out, [0, 1, 2, 99_999]) == {0: 1, 1: 1, 2: 1, 99_999: 2}
    assert rollout.seen == [[99_999]]
    assert "otherwise than its meta.json" in caplog.text


def test_a_misnamed_or_planted_document_is_not_read(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    name, raw = next(iter(documents(dump_dir).items()))
    remove_documents(dump_dir)
    for planted in (".tmp-" + name, "notes.json", name.replace("GBS4", "GBS8"), name.replace("+", "+reward+", 1)):
        put_document(dump_dir, planted, raw)  # a temporary, no writer's name, another run's, another role's
    _, _, looked = match_call(dump_dir, [0], monkeypatch)
    assert len(set(looked)) >= 10


def test_a_symlinked_document_is_not_followed(tmp_path, monkeypatch, caplog) -> None:
    dump_dir = str(tmp_path / "dump")
    cache_of(dump_dir, 10)
    name, raw = next(iter(documents(dump_dir).items()))
    where = tmp_path / "dump" / "exp_proj" / HINTS_DIR
    (tmp_path / "elsewhere.json").write_bytes(raw)
    os.remove(where / name)
    os.symlink(tmp_path / "elsewhere.json", where / name)
    with caplog.at_level(logging.WARNING, logger="stepskip"):
        out, _, looked = match_call(dump_dir, [0, 18], monkeypatch)
    assert replayed(out, [0, 18]) == {0: 1, 18: 1}
    assert "ignoring the hint document" in caplog.text and len(set(looked)) >= 10


# --------------------------------------------------------------------------- entries that changed


def test_a_hint_to_a_removed_entry_is_skipped(dump_dir, monkeypatch) -> None:
    cache_of(dump_dir, 10)
    SkipManager.init(config(dump_dir, "match"))
    role = SkipManager.skip_instances["rollout"]
    assert role.store.retire_entry(role.step_dump_dir(0))  # as `stepskip prune` removes it
    SkipManager.reset()
    out, rollout, _ = match_call(dump_dir, [0, 18], monkeypatch)
    assert replayed(out, [0, 18]) == {0: 2, 18: 1}
    assert rollout.seen == [[0]]


def test_a_hint_to_an_entry_rewritten_since_is_corrected_from_the_entry(dump_dir, monkeypatch) -> None:
    """Step 0 recorded again by a run whose document never got written: its hint is stale."""
    cache_of(dump_dir, 10)
    first = set(documents(dump_dir))
    record(dump_dir, {0: [50, 51]}, marker=3)
    remove_documents(dump_dir, set(documents(dump_dir)) - first)
    out, rollout, _ = match_call(dump_dir, [0, 50, 18], monkeypatch)
    assert replayed(out, [0, 50, 18]) == {0: 2, 50: 3, 18: 1}  # 0 is no longer recorded anywhere
    assert rollout.seen == [[0]]


def test_an_entry_two_documents_disagree_on_is_read_directly(dump_dir, monkeypatch) -> None:
    """Two writers' documents describe step 0 differently: neither writer's clock decides, the entry's
    own meta.json does (a skewed clock or a planted document never hides what an entry holds)."""
    cache_of(dump_dir, 10)
    record(dump_dir, {0: [50, 51]}, marker=3)
    assert len(documents(dump_dir)) == 2
    out, rollout, looked = match_call(dump_dir, [50, 18], monkeypatch)
    assert replayed(out, [50, 18]) == {50: 3, 18: 1}
    assert rollout.seen == [] and len(set(looked)) <= 8 + 2 * 2  # and the two entries each document is checked on


# --------------------------------------------------------------------------- writers and the tools


def test_a_writer_starts_another_document_when_its_own_is_full(dump_dir, monkeypatch) -> None:
    monkeypatch.setattr(hints_module, "HINTS_ROLL_BYTES", 600)
    cache_of(dump_dir, 12)
    names = sorted(documents(dump_dir))
    assert len(names) > 2 and len({n.rsplit("-", 1)[0] for n in names if "-" in n.rsplit("+", 1)[1]}) == 1
    covered: dict[str, Any] = {}
    for raw in documents(dump_dir).values():
        parsed, problem = parse_hints(raw, "doc")
        assert not problem and len(raw) <= 600 + 400
        covered.update(parsed)
    assert sorted(covered, key=int) == [str(s) for s in range(12)]
    monkeypatch.undo()
    out, _, looked = match_call(dump_dir, [0, 22], monkeypatch)
    # and the two entries each document is checked on before it is used
    assert replayed(out, [0, 22]) == {0: 1, 22: 1} and len(set(looked)) <= 8 + 2 * len(names)


def test_verify_and_ls_see_no_damage_in_the_hint_documents(dump_dir) -> None:
    cache_of(dump_dir, 3)
    index = CacheIndex(dump_dir)
    runs = index.runs()
    assert [r.path.rsplit("/", 1)[-1] for r in runs] == ["GBS4_N2_in8_out6"]
    assert [s.step for s in runs[0].steps] == [0, 1, 2] and not runs[0].others and not runs[0].leftovers
    report = verify_runs(index, runs)
    assert not report.problems and not report.others
    assert CacheIndex(f"{dump_dir}/exp_proj").find_run_dirs() == [f"{dump_dir}/exp_proj/GBS4_N2_in8_out6"]


@pytest.mark.parametrize("meta, added", [
    ({"global_steps": 1, "run_id": "r", "created_unix": 1.0, "row_prompts": ["a"]}, True),
    ({"global_steps": 1, "run_id": "r", "created_unix": 1.0}, False),  # no row digests: nothing to hint
    ({"global_steps": 1, "run_id": "r", "row_prompts": ["a"]}, False),  # no identity to check it by
    ({"global_steps": 1, "run_id": "r", "created_unix": 1.0, "row_prompts": [None]}, False),
])
def test_a_document_describes_only_what_can_be_checked(meta: dict[str, Any], added: bool) -> None:
    doc = HintDocument("r", "rollout")
    assert doc.add("1", meta) is added
    assert doc.add("../1", dict(meta, row_prompts=["a"], created_unix=1.0)) is False
    hints, problem = parse_hints(doc.to_bytes(), "doc")
    assert not problem and (("1" in hints) is added)


def test_a_stage_roles_documents_serve_it_across_run_directories(dump_dir, monkeypatch) -> None:
    """A row-wise stage role keeps its entries in ``{run}/{role}/``: its documents are named for that
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
    cache_of(dump_dir, 10)  # the rollout role's entries and document, in the same run directory
    names = sorted(documents(dump_dir))
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


GOOD_ENTRY = {"step": 1, "run_id": "r", "created_unix": 1.5, "rows": [["a", 2]]}


@pytest.mark.parametrize("entries", [
    {"\u0661": GOOD_ENTRY},  # a digit, but not an ASCII one: no step directory's name
    {"1/2": GOOD_ENTRY}, {"": GOOD_ENTRY}, {"1" * 20: GOOD_ENTRY},
    {"1": dict(GOOD_ENTRY, step=True)}, {"1": dict(GOOD_ENTRY, step=1.0)}, {"1": dict(GOOD_ENTRY, step=2**63)},
    {"1": dict(GOOD_ENTRY, created_unix=None)}, {"1": dict(GOOD_ENTRY, created_unix="1.5")},
    {"1": dict(GOOD_ENTRY, run_id=7)}, {"1": dict(GOOD_ENTRY, rows={"a": 2})},
    {"1": dict(GOOD_ENTRY, rows=[["a", 0]])}, {"1": dict(GOOD_ENTRY, rows=[["a", True]])},
    {"1": dict(GOOD_ENTRY, rows=[["a", 2, 3]])}, {"1": dict(GOOD_ENTRY, rows=[["a" * 300, 2]])},
    {"1": dict(GOOD_ENTRY, rows=[["a", 2**20], ["b", 1]])},  # more rows than one entry may have
    {"1": [GOOD_ENTRY]},
])
def test_parse_hints_refuses_every_ill_typed_or_unbounded_value(entries: dict[str, Any]) -> None:
    raw = json.dumps({"stepskip_hints": 1, "entries": entries}).encode()
    hints, problem = parse_hints(raw, "doc")
    assert hints == {} and problem.startswith("doc")


def test_parse_hints_bounds_nesting_and_the_rows_of_a_reader() -> None:
    assert parse_hints(b"[" * 100_000 + b"]" * 100_000, "doc")[1]  # never a RecursionError
    raw = json.dumps({"stepskip_hints": 1, "entries": {"1": GOOD_ENTRY, "2": GOOD_ENTRY}}).encode()
    assert sorted(parse_hints(raw, "doc")[0]) == ["1", "2"]
    assert parse_hints(raw, "doc", max_rows=3) == ({}, "doc describes more than 3 rows")


@pytest.mark.parametrize("kept", [True, False])
def test_a_planted_document_claiming_to_be_newest_hides_nothing(dump_dir, monkeypatch, kept) -> None:
    """A document (planted, or a writer whose clock runs ahead) describing every entry with a far-future
    identity, huge steps and digests no prompt has: it fails the check on its two lowest entries and is
    ignored, with or without the real writer's document beside it; every recorded prompt is replayed."""
    cache_of(dump_dir, 12)
    if not kept:
        remove_documents(dump_dir)
    entries = {str(s): {"step": 2 ** 62, "run_id": "x", "created_unix": 1e18, "rows": [[f"{s:064x}", 4]]}
               for s in range(12)}
    put_document(dump_dir, f"GBS4_N2_in8_out6+{'f' * 16}.json",
                 json.dumps({"stepskip_hints": 1, "run_id": "x", "role": "rollout", "entries": entries}).encode())
    out, rollout, _ = match_call(dump_dir, [0, 1, 2, 3], monkeypatch)
    assert replayed(out, [0, 1, 2, 3]) == {0: 1, 1: 1, 2: 1, 3: 1} and rollout.seen == []
    index = SkipManager.skip_instances["rollout"]._index
    assert not any(digest.startswith("0" * 48) for digest in index.groups)  # none of its claims


def test_a_hint_claiming_more_rows_than_a_meta_json_can_list_is_refused():
    raw = json.dumps({"stepskip_hints": 1, "run_id": "x", "role": "rollout",
                      "entries": {"1": {"step": 1, "run_id": "x", "created_unix": 1.0,
                                        "rows": [["a" * 16, hints_module._MAX_ENTRY_ROWS + 1]]}}}).encode()
    hints, problem = parse_hints(raw, "doc")
    assert not hints and "more than" in problem
