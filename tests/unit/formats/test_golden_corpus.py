"""The golden corpus: caches written by every on-disk version of stepskip, read back bit for bit.

``tests/fixtures/golden/<era>/cache`` holds what each era's own writer wrote (``make.py`` says which
commits and how), and ``<era>/expected.json`` what each entry holds, described from the value
given to the writer (``writer.describe``: dtypes, shapes and digests of tensors' raw bytes, plain
values, floats by their bits), never from what a reader returns. Every entry is read through
today's public reading paths — the cache index the CLI reads with, ``stepskip verify``, and each
role's replay — and must describe exactly as recorded. Today's writer, run again, must write the
committed bytes: only the run id, the times and the recorded durations may differ (normalised
below, field by field), so a format cannot change by accident.

Stand-ins: TRL's ``GRPOTrainer`` is its own class without a model (a real model would not return
the fixture's completions), and V1's trainer is two decorated methods over stepskip's in-process
queue client (the real TransferQueue needs Ray).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from stepskip import SkipManager
from stepskip._matching.hints import (
    HINTS_DIR,
    TABLE_SUFFIX,
    digest_keys,
    identity_key,
    parse_hints,
    parse_table,
)
from stepskip._index import CacheIndex
from stepskip.tq import InProcessTQClient

try:  # imported here: the role registers itself once, before any test's registry snapshot
    from stepskip.integrations import trl as trl_integration
except ImportError:  # an environment without TRL (the tensordict-0.10 leg): its cases skip
    trl_integration = None

GOLDEN = Path(__file__).resolve().parents[2] / "fixtures" / "golden"


def _module(name: str) -> ModuleType:
    """``tests/fixtures/golden/{name}.py``, imported under a name no other test module uses."""
    spec = importlib.util.spec_from_file_location(f"golden_{name}", GOLDEN / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


writer = _module("writer")
make = _module("make")
describe = writer.describe
ERAS = {era.name: era for era in make.ERAS}
CURRENT = next(era.name for era in make.ERAS if era.commit is None)


def expected(era: str) -> dict[str, Any]:
    return json.loads((GOLDEN / era / "expected.json").read_text(encoding="utf-8"))


def entries_of(era: str, kind: str) -> dict[str, dict[str, Any]]:
    return {path: entry for path, entry in expected(era)["entries"].items() if entry["kind"] == kind}


def cases(*kinds: str) -> list[Any]:
    """``(era, kind)`` for every era holding one of ``kinds`` (TRL's skip where TRL is not installed)."""
    needs_trl = pytest.mark.skipif(trl_integration is None, reason="TRL is not installed")
    return [pytest.param(era.name, kind, id=f"{era.name}-{kind}", marks=[needs_trl] if kind == "trl" else [])
            for era in make.ERAS for kind in era.kinds if kind in kinds]


@pytest.fixture
def cache_copy(tmp_path: Path) -> Iterator[Any]:
    """A copy of an era's cache to read from (readers may clean up or index; the fixture stays as committed)."""

    def copy(era: str) -> Path:
        target = tmp_path / era
        shutil.copytree(GOLDEN / era / "cache", target)
        return target

    yield copy


# --------------------------------------------------------------------------- the corpus itself


def test_every_era_of_the_make_script_is_committed_and_holds_what_it_lists():
    committed = sorted(p.name for p in GOLDEN.iterdir() if (p / "expected.json").exists())
    assert committed == sorted(ERAS)
    for name, era in ERAS.items():
        body = expected(name)
        assert tuple(body["kinds"]) == era.kinds
        assert {entry["kind"] for entry in body["entries"].values()} == set(era.kinds)
        for path in body["entries"]:
            assert (GOLDEN / name / "cache" / path / "meta.json").is_file(), path


def test_the_corpus_stays_small():
    sizes = sum(f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    assert sizes < 1 << 20


def test_the_eras_cover_every_safe_tree_version_and_manifest_and_hint_format():
    """Each tree version this stepskip reads was written by some era (so reading it is tested)."""
    from stepskip._formats import safe

    versions: set[int] = set()
    for era in ERAS:
        for tree in (GOLDEN / era / "cache").rglob("data*.json"):
            versions.add(json.loads(tree.read_bytes())["version"])
    assert versions == set(range(1, safe.READ_VERSION + 1))
    assert any((GOLDEN / era / "cache").rglob("step.json") for era in ERAS)
    hint_files = {f.suffix for era in ERAS for f in (GOLDEN / era / "cache").rglob(f"{HINTS_DIR}/*")}
    assert hint_files == {".json", TABLE_SUFFIX}


# --------------------------------------------------------------------------- the CLI's reader


def _index_entries(index: CacheIndex, root: Path) -> dict[str, Any]:
    found = {}
    for run in index.runs():
        for step in run.steps:
            for entry in step.entries:
                found[os.path.relpath(entry.path, root)] = entry
    return found


@pytest.mark.parametrize(("era", "kind"), cases(*writer.KINDS))
def test_the_cache_index_reads_every_entry_bit_exact(era, kind):
    """The index the CLI and the viewer read with finds each entry where its era wrote it, valid, and
    decodes it to the value recorded."""
    root = GOLDEN / era / "cache"
    index = CacheIndex(str(root))
    found = _index_entries(index, root)
    for path, entry in entries_of(era, kind).items():
        record = found.get(path)
        assert record is not None, f"{path} is not indexed as an entry"
        assert record.valid, (path, record.state, record.reason)
        assert (record.step, record.inner, record.role) == (entry["step"], entry["inner"], entry["role"])
        value = index.read_entry(record, allow_pickle=True)
        if kind == "trl":  # entries of the integration's own packing hold it: unpacked as the role does
            value = trl_integration._unpack_generation(value, path)
        assert describe(value) == entry["value"], path


# --------------------------------------------------------------------------- the roles' replay


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the stage ran: the entry was not replayed")


@pytest.mark.parametrize(("era", "kind"), cases("rollout", "verl"))
def test_rollout_replays_every_entry_bit_exact(era, kind, cache_copy):
    """``action: replay`` serves each recorded step as it was returned (``format: safe`` and ``verl``)."""
    section = {"action": "replay"}
    if kind == "verl":
        section.update(format="verl", allow_pickle=True)
    experiment = "safe" if kind == "rollout" else "verl"
    SkipManager.init(writer.training_config(str(cache_copy(era)), experiment, "rollout", section))
    generate = SkipManager.annotate(role="rollout")(_never)
    for entry in entries_of(era, kind).values():
        SkipManager.set_step(entry["step"])
        assert describe(generate(None, writer.rollout_prompts(entry["step"]))) == entry["value"]
    assert SkipManager.stats()["skip/rollout/hits"] == len(entries_of(era, kind))


@pytest.mark.parametrize(("era", "kind"), cases("stage"))
def test_a_stage_role_replays_its_entry_bit_exact(era, kind, cache_copy):
    """A generic stage role's TensorDict (dense, jagged, nested and non-tensor entries) comes back whole."""
    section = {"kind": "stage", "action": "replay"}
    SkipManager.init(writer.training_config(str(cache_copy(era)), "stage", "reward", section))
    score = SkipManager.annotate(role="reward")(_never)
    for entry in entries_of(era, kind).values():
        SkipManager.set_step(entry["step"])
        assert describe(score(None, writer.rollout_prompts(entry["step"]))) == entry["value"]


def _memory_copy(root: Path, only: str = "") -> str:
    """The files under ``root`` (under ``root/only`` alone, if given) in a fresh ``memory://`` directory:
    an object store, as the entries were written."""
    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"/golden-{uuid.uuid4().hex[:8]}"
    for path in (root / only).rglob("*"):
        if path.is_file():
            fs.pipe_file(f"{base}/{path.relative_to(root).as_posix()}", path.read_bytes())
    return f"memory://{base}"


@pytest.mark.parametrize(("era", "kind"), cases("v1", "v1_verl", "v1_object_store"))
def test_rollout_tq_injects_every_inner_entry_bit_exact(era, kind, cache_copy):
    """The replayed step put under the recorded uids gives back, key by key, the rows and tags recorded."""
    experiment = {"v1": "v1", "v1_verl": "v1verl", "v1_object_store": "v1store"}[kind]
    section: dict[str, Any] = {"action": "replay"}
    if kind == "v1_verl":
        section.update(format="verl", allow_pickle=True)
    dump_dir = str(cache_copy(era))
    if kind == "v1_object_store":
        dump_dir = _memory_copy(Path(dump_dir))
    client = InProcessTQClient()
    SkipManager.init(writer.training_config(dump_dir, experiment, "rollout_tq", section, v1=True), tq_client=client)
    role = SkipManager.skip_instances["rollout_tq"]
    uids = [u for inner in range(writer.V1_SYNC) for u in writer.v1_uids(1, inner)]
    role.load_dump_data(step=1, new_prompt_uids=uids, n=writer.N, global_steps=1)
    listing = client.kv_list(partition_id="train")["train"]
    entries = sorted(entries_of(era, kind).values(), key=lambda e: e["inner"])
    assert [e["inner"] for e in entries] == list(range(writer.V1_SYNC))
    for entry in entries:
        keys = _field(entry["value"], "keys")["v"]
        payload = {"tensordict": client.kv_batch_get(keys=keys, partition_id="train"),
                   "tags": [listing[k] for k in keys], "keys": keys, "global_steps": 1}
        assert describe(payload) == entry["value"]


def _field(description: dict[str, Any], key: str) -> Any:
    """The description of ``value[key]`` in the description of a dict ``value``."""
    return dict(description["v"])[key]


def _trl_replay(dump_dir: str) -> Any:
    trainer = writer.trl_trainer(_never)
    trl_integration.enable_stepskip(trainer, skip=writer.trl_skip(dump_dir, action="replay"),
                                    identity=writer.trl_identity())
    return trainer


@pytest.mark.parametrize(("era", "kind"), cases("trl"))
def test_trl_replays_every_call_bit_exact_with_its_random_state(era, kind, cache_copy):
    """Each generation call of the step replays its ``(completion_ids, logprobs)`` (older entries: the
    integration's own packing, unpacked) and leaves the random state the recorded call left."""
    trainer = _trl_replay(str(cache_copy(era)))
    entries = sorted(entries_of(era, kind).items())
    assert len(entries) == len(writer.trl_calls())
    for i, ((prompt_ids, _), (path, entry)) in enumerate(zip(writer.trl_calls(), entries)):
        assert path.endswith(f"/c{i}-r0")
        torch.manual_seed(1000 + i)
        result = trainer._generate_single_turn(prompt_ids, None, None, writer.N)
        assert describe(result) == entry["value"]
        assert trainer.stepskip.last.hit
        recorded = torch.Generator().manual_seed(i).get_state()  # the state the call left when recorded
        assert torch.equal(torch.get_rng_state(), recorded)


# --------------------------------------------------------------------------- stepskip verify


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _verify(*args: Any) -> tuple[int, dict[str, Any]]:
    from typer.testing import CliRunner

    from stepskip.cli.app import app

    done = CliRunner().invoke(app, ["verify", *map(str, args), "--json"], catch_exceptions=False,
                              env={"COLUMNS": "200"})
    return done.exit_code, json.loads(done.stdout)


@pytest.mark.parametrize("era", sorted(ERAS))
def test_stepskip_verify_finds_every_era_clean_and_its_repair_removes_nothing(era, cache_copy):
    """``verify --deep`` decodes every entry and finds nothing wrong; ``--repair`` with no grace period
    (every file counts as old) leaves every file in place."""
    root = cache_copy(era)
    before = _tree(root)
    code, report = _verify(root, "--deep", "--allow-pickle")
    assert report["problems"] == [] and report["entries"] == report["decoded"] == len(expected(era)["entries"])
    code_after_repair, repaired = _verify(root, "--deep", "--allow-pickle", "--repair", "--grace", "0")
    after = _tree(root)
    assert code == code_after_repair == 0 and report["clean"] and repaired["repaired"] == []
    assert after == before


@pytest.mark.parametrize(("era", "kind"), cases("v1_object_store"))
def test_the_cache_index_reads_object_store_steps_on_the_store_they_were_written_to(era, kind):
    """The V1 entries written to an object store, read back through ``memory://`` (their object names
    are the files' names, their manifest picks the recording)."""
    url = _memory_copy(GOLDEN / era / "cache", only="v1store_golden")
    index = CacheIndex(url)
    base = url[len("memory://"):]
    found = {entry.path.split(base, 1)[-1].lstrip("/"): entry for run in index.runs() for step in run.steps
             for entry in step.entries}
    for path, entry in entries_of(era, kind).items():
        record = found[path]
        assert record.valid, (path, record.reason)
        assert describe(index.read_entry(record)) == entry["value"]
    code, report = _verify(url, "--deep")
    assert code == 0 and report["clean"], report["problems"]


# --------------------------------------------------------------------------- hints


def _metas(root: Path) -> dict[str, dict[str, Any]]:
    return {os.path.relpath(p.parent, root): json.loads(p.read_bytes()) for p in root.rglob("meta.json")}


def hint_files() -> list[Any]:
    """``(era, path)`` of every hint file of the corpus (one writer's, per experiment)."""
    out = []
    for era in sorted(ERAS):
        for path in sorted((GOLDEN / era / "cache").rglob(f"{HINTS_DIR}/*")):
            name = path.relative_to(GOLDEN / era / "cache").as_posix()
            out.append(pytest.param(era, name, id=f"{era}-{name.split('/')[0]}-{path.suffix[1:]}"))
    return out


@pytest.mark.parametrize(("era", "name"), hint_files())
def test_hint_files_parse_to_what_the_entries_they_describe_record(era, name):
    """Digest tables and hint documents (``{experiment}/.stepskip-index/``) read back whole, describing
    each entry as its own ``meta.json`` does: identity, and the digest of every row's prompt."""
    root = GOLDEN / era / "cache"
    raw = (root / name).read_bytes()
    experiment, _, document = name.partition(f"/{HINTS_DIR}/")
    run_name, *subdir = document.split("+")[:-1]
    project = "/".join([experiment, run_name, *subdir])
    metas = {path: meta for path, meta in _metas(root).items() if path.startswith(f"{project}/")}
    if name.endswith(TABLE_SUFFIX):
        table, problem = parse_table(raw, name)
        assert table is not None, problem
        steps = sorted(int(p.rsplit("/", 1)[-1]) for p in metas if p.count("/") == project.count("/") + 1)
        assert table.names.tolist() == steps
        for i, step in enumerate(steps):
            meta = metas[f"{project}/{step}"]
            assert int(table.identities[i]) == identity_key(meta)
            assert table.keys_of(i).tolist() == digest_keys(meta["row_prompts"]).tolist()
        return
    hints, problem = parse_hints(raw, name)
    assert hints and not problem, problem
    assert sorted(hints) == sorted({p[len(project) + 1:].split("/")[0] for p in metas})  # every entry its writer wrote
    for step, hint in hints.items():
        if hasattr(hint, "inner"):  # a V1 step: each inner entry, in the recording its manifest names
            where = f"{project}/{step}" + (f"/{hint.recording}" if hint.recording else "")
            if hint.recording:
                assert json.loads((root / project / step / "step.json").read_bytes())["recording"] == hint.recording
            inner = [(metas[f"{where}/{i}"], part) for i, part in enumerate(hint.inner)]
            assert len(inner) == writer.V1_SYNC
        else:
            inner = [(metas[f"{project}/{step}"], hint)]
        for meta, part in inner:
            assert part.describes(meta) and part.step == meta["global_steps"]
            assert part.digests == [d or "" for d in meta["row_prompts"]]


def _match(dump_dir: Path, experiment: str, prompts: list[Any], caplog: Any) -> tuple[list[Any], list[str]]:
    """What ``action: match`` replays for each of ``prompts`` (at steps never recorded: only the prompts
    lead to the entries), and the warnings stepskip logged meanwhile."""
    SkipManager.init(writer.training_config(str(dump_dir), experiment, "rollout", {"action": "match", "steps": "all"}))
    generate = SkipManager.annotate(role="rollout")(_never)
    replayed = []
    with caplog.at_level("WARNING", logger="stepskip"):
        for i, batch in enumerate(prompts):
            SkipManager.set_step(1000 + i)
            replayed.append(generate(None, batch))
    assert SkipManager.stats()["skip/rollout/misses"] == 0
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("stepskip") and r.levelname == "WARNING"]
    return replayed, warned


@pytest.mark.parametrize(("era", "kind"), cases("hints"))
def test_match_finds_every_recorded_prompt_with_the_eras_hint_files(era, kind, cache_copy, caplog):
    """Enough entries for ``action: match`` to read the writers' hint files first: each prompt replays its
    recorded rows, and no hint file is ignored (a digest table this stepskip could not read would be,
    with a warning: see the next test)."""
    entries = sorted(entries_of(era, kind).values(), key=lambda e: e["step"])
    assert len(entries) == writer.HINT_STEPS
    replayed, warned = _match(cache_copy(era), "hints", [writer.hint_prompts(e["step"]) for e in entries], caplog)
    assert [describe(r) for r in replayed] == [e["value"] for e in entries]
    assert not warned


@pytest.mark.parametrize(("era", "kind"), [c for c in cases("hints") if any(
    (GOLDEN / c.values[0] / "cache" / "hints_golden" / HINTS_DIR).glob(f"*{TABLE_SUFFIX}"))])
def test_match_reads_the_eras_digest_tables(era, kind, cache_copy, caplog):
    """The previous test's tables are read: one cut short is noticed (and the entries then read directly)."""
    root = cache_copy(era)
    for table in (root / "hints_golden" / HINTS_DIR).glob(f"*{TABLE_SUFFIX}"):
        table.write_bytes(table.read_bytes()[:-4])
    entries = sorted(entries_of(era, kind).values(), key=lambda e: e["step"])
    replayed, warned = _match(root, "hints", [writer.hint_prompts(e["step"]) for e in entries], caplog)
    assert [describe(r) for r in replayed] == [e["value"] for e in entries]
    assert any("ignoring the digest table" in w for w in warned), warned


def _records_row_digests(era: str) -> bool:
    return all("row_prompts" in json.loads((GOLDEN / era / "cache" / path / "meta.json").read_bytes())
               for path in entries_of(era, "rollout"))


@pytest.mark.parametrize(("era", "kind"), [c for c in cases("rollout") if _records_row_digests(c.values[0])])
def test_match_replays_every_recorded_batch_by_its_prompts(era, kind, cache_copy, caplog):
    """Entries recording each row's prompt digest are found by their prompts alone, and replayed whole."""
    entries = sorted(entries_of(era, kind).values(), key=lambda e: e["step"])
    replayed, warned = _match(cache_copy(era), "safe", [writer.rollout_prompts(e["step"]) for e in entries], caplog)
    assert [describe(r) for r in replayed] == [e["value"] for e in entries]
    assert not warned


# --------------------------------------------------------------------------- today's writer


_VARYING = re.compile(rb'("(?:run_id|created_unix|generation_seconds)": ?)(?:"[0-9a-f]{32}"|-?[0-9.]+(?:e-?[0-9]+)?)')
_TOKENS = ((re.compile(rb"rec-[0-9a-f]{12}"), b"rec-*"), (re.compile(rb"data\.[0-9a-f]{12}\."), b"data.*."),
           (re.compile(rb"\+[0-9a-f]{16}(?:-[0-9]+)?\.(json|keys)$"), rb"+*.\1"))
_TABLE_HEADER = struct.Struct("<8sIIQII")  # magic, version, entries, keys, CRC-32 of the body, zero


def _normalised(name: str, data: bytes) -> tuple[str, bytes]:
    """A written file with what legitimately differs between two writes of the same values made equal:
    the run id, the times (``created_unix``) and durations recorded; the random names of a recording,
    of an object store's data objects and of a writer's hint files; and in a digest table, the identity
    keys (hashes of run id and time) and the checksum over them."""
    path = name.encode()
    for pattern, replacement in _TOKENS:
        path = pattern.sub(replacement, path)
    if name.endswith(TABLE_SUFFIX):
        _, _, entries, _, _, _ = _TABLE_HEADER.unpack_from(data)
        start = _TABLE_HEADER.size + 8 * entries
        data = data[:24] + bytes(4) + data[28:start] + bytes(8 * entries) + data[start + 8 * entries:]
    elif name.endswith(".json") and "/data" not in name:
        data = _VARYING.sub(rb'\1"*"', data)
        for pattern, replacement in _TOKENS[:2]:
            data = pattern.sub(replacement, data)
    return path.decode(), data


def test_todays_writer_writes_the_committed_bytes(tmp_path, monkeypatch):
    """The current era written again: every file the same bytes, but for the fields that vary by run.

    Left out where this environment cannot write them as committed: TRL's entries without TRL, and the
    ``tq_batch.pt`` files (``torch.save`` of a TensorDict) and their ``meta.json`` under other torch or
    tensordict versions than the corpus was written with; then the descriptions of the rest are compared.
    """
    kinds = [kind for kind in ERAS[CURRENT].kinds if kind != "trl" or trl_integration is not None]
    monkeypatch.chdir(tmp_path)  # outside any git work tree, as make.py writes: no code revision in the fingerprint
    writer.write(tmp_path, kinds)
    fresh = dict(_normalised(p, b) for p, b in _tree(tmp_path).items())
    committed = dict(_normalised(p, b) for p, b in _tree(GOLDEN / CURRENT).items())
    left_out = [] if "trl" in kinds else ["cache/grpo_"]
    if writer.libraries() != expected(CURRENT)["libraries"]:
        left_out += sorted({p.rsplit("/", 1)[0] + "/" for p in committed if p.endswith("/tq_batch.pt")})
    if left_out:
        fresh = {p: b for p, b in fresh.items() if not p.startswith(tuple(left_out))}
        committed = {p: b for p, b in committed.items() if not p.startswith(tuple(left_out))}
        described = json.loads(fresh.pop("expected.json"))["entries"]
        recorded = json.loads(committed.pop("expected.json"))["entries"]
        assert described == {p: e for p, e in recorded.items() if e["kind"] in kinds}
    assert sorted(fresh) == sorted(committed)
    changed = [p for p in committed if fresh[p] != committed[p]]
    assert not changed, f"today's writer writes other bytes than the committed {CURRENT} era: {changed}"


def test_the_normalisation_keeps_everything_but_the_varying_fields():
    meta = b'{"created_unix": 1.5, "files": {"data.json": {"object": "data.0123456789ab.json"}}, ' \
           b'"generation_seconds": 4.8e-06, "global_steps": 3, "run_id": "' + b"a" * 32 + b'"}'
    name, data = _normalised("x/rec-0123456789ab/0/meta.json", meta)
    assert name == "x/rec-*/0/meta.json"
    assert data == b'{"created_unix": "*", "files": {"data.json": {"object": "data.*.json"}}, ' \
                   b'"generation_seconds": "*", "global_steps": 3, "run_id": "*"}'
    assert _normalised("x/0/data.json", b'{"run_id": "' + b"a" * 32 + b'"}')[1] == b'{"run_id": "' + b"a" * 32 + b'"}'
