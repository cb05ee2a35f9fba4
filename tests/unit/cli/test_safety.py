"""A cache someone else wrote: no command follows a link, reads outside the dump dir, or removes what it
cannot read (an unknown format, intact bytes that do not decode here); convert never writes into its source."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from cli_caches import SAFE_RUN, V1_RUN
from cli_run import stepskip

from stepskip._storage import checksum
from stepskip._index import CacheIndex, NotACacheError


def tree_digest(root: Path) -> dict[str, str]:
    """Every file below ``root`` (links not followed) with its content digest."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            out[rel] = "link" if path.is_symlink() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture
def victim(tmp_path: Path, pristine_cache: Path) -> Path:
    """Someone else's data outside the cache: a copy of a whole run plus a plain file."""
    outside = tmp_path / "outside"
    shutil.copytree(pristine_cache / SAFE_RUN, outside / "run")
    (outside / "secret.txt").write_text("not yours")
    return outside


def test_verify_repair_and_prune_never_follow_symlinked_directories(copy_cache, victim, tmp_path):
    dump = copy_cache("dump")
    before = tree_digest(victim)
    run = dump / SAFE_RUN
    broken = victim / "run" / "2" / "data.json"  # damaged *outside*: a follower would "repair" it there
    broken.write_text("{}")
    before = tree_digest(victim)
    os.symlink(victim / "run" / "2", run / "7")  # a linked step directory
    os.symlink(victim / "run", dump / "exp_proj" / "GBS9_N9_in9_out9")  # a linked run directory
    os.symlink(victim / "run" / "reward", run / "critic")  # a linked role directory
    os.symlink(victim / "run" / "3", dump / SAFE_RUN / "reward" / "5")  # a linked step in a role directory
    os.symlink(victim / "secret.txt", run / ".tmp-9-0123456789ab")  # a linked "leftover"

    repaired = stepskip("verify", dump, "--repair", "--grace", "0", "--json")
    assert tree_digest(victim) == before  # nothing outside changed
    report = repaired.json()
    assert repaired.code == 0 and report["repaired"] == [], repaired
    links = {os.path.relpath(p, dump) for p in report["links"]}  # reported, never entered
    assert links == {f"{SAFE_RUN}/7", f"{SAFE_RUN}/critic", f"{SAFE_RUN}/reward/5", f"{SAFE_RUN}/.tmp-9-0123456789ab"}
    assert [r["name"] for r in stepskip("ls", dump, "--json").json()["runs"]].count("exp_proj/GBS9_N9_in9_out9") == 0

    pruned = stepskip("prune", run / "reward", "--steps", "all")  # the role directory: its real steps only
    assert pruned.code == 0 and "removed 2 steps" in pruned.out, pruned
    assert tree_digest(victim) == before
    for args in (["--keep-last", "0"], ["--older-than", "0"], ["--steps", "all"]):
        pruned = stepskip("prune", run, *args)
        assert pruned.code == 0, pruned
        assert tree_digest(victim) == before
    assert not [n for n in os.listdir(run) if n.isdigit() and not os.path.islink(run / n)]
    assert os.path.islink(run / "7") and os.path.islink(run / "critic")  # links are left where they are
    assert os.path.islink(run / ".tmp-9-0123456789ab") and os.path.islink(run / "reward" / "5")


def test_verify_never_reads_files_a_meta_json_names_outside_its_entry(copy_cache, tmp_path, capsys):
    dump = copy_cache("dump")
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 100)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # a reader that opened it would hang forever
    entry = dump / SAFE_RUN / "3"
    meta = json.loads((entry / "meta.json").read_text())
    info = meta["files"]["data.json"]
    meta["files"]["data.json"] = dict(info, object=os.path.relpath(secret, entry), bytes=100,
                                      checksum=checksum(b"x" * 100))
    (entry / "meta.json").write_text(json.dumps(meta))
    linked = dump / SAFE_RUN / "4"  # a data file that is a link (to a FIFO)
    (linked / "data.json").unlink()
    os.symlink(fifo, linked / "data.json")
    meta_link = dump / SAFE_RUN / "5"
    (meta_link / "meta.json").unlink()
    os.symlink(entry / "meta.json", meta_link / "meta.json")
    reads_seen = _reads_are_visible(tmp_path)
    os.utime(secret, (0, secret.stat().st_mtime))  # a read would move the access time (relatime)

    result = stepskip("verify", dump, "--deep", "--json")
    assert result.code == 1, result
    problems = {os.path.relpath(p["path"], dump): p for p in result.json()["problems"]}
    outside = problems[f"{SAFE_RUN}/3"]
    assert outside["kind"] == "damaged" and re.search("outside the entry|inside the entry", outside["detail"])
    assert problems[f"{SAFE_RUN}/4"]["kind"] == "damaged" and "symbolic link" in problems[f"{SAFE_RUN}/4"]["detail"]
    assert problems[f"{SAFE_RUN}/5"]["kind"] == "damaged" and "symbolic link" in problems[f"{SAFE_RUN}/5"]["detail"]
    for args in (["info", entry], ["show", entry]):
        shown = stepskip(*args)
        assert shown.code == 1 and re.search("outside the entry|inside the entry", shown.out + shown.err), shown

    if reads_seen:
        assert secret.stat().st_atime == 0, "a command read the file a meta.json named outside its entry"

    repaired = stepskip("verify", dump, "--repair", "--grace", "0")
    assert repaired.code == 0, repaired
    assert secret.exists() and fifo.exists()  # the entries went, what they pointed at did not
    assert not entry.exists() and not linked.exists() and not meta_link.exists()


def _reads_are_visible(tmp_path: Path) -> bool:
    """True when reading a file updates its access time here (relatime, strictatime; not noatime)."""
    probe = tmp_path / "atime-probe"
    probe.write_bytes(b"x")
    os.utime(probe, (0, probe.stat().st_mtime))
    probe.read_bytes()
    return probe.stat().st_atime != 0


def test_hostile_metadata_values_are_damage_not_crashes(copy_cache):
    dump = copy_cache("dump")
    run = dump / SAFE_RUN
    (run / "1" / "meta.json").write_text("[" * 100_000 + "]" * 100_000)  # nested too deep to parse
    for step, key, value in ((2, "format", ["safe"]), (3, "run_id", ["a", "b"]), (4, "parameter_sync_step", "2")):
        meta = json.loads((run / str(step) / "meta.json").read_text())
        meta[key] = value
        (run / str(step) / "meta.json").write_text(json.dumps(meta))
    v1_meta = dump / V1_RUN / "1" / "0" / "meta.json"
    meta = json.loads(v1_meta.read_text())
    meta["parameter_sync_step"] = 10**9  # a count no listing may materialise
    v1_meta.write_text(json.dumps(meta))

    listing = stepskip("ls", dump, "--json")
    assert listing.code == 0, listing
    result = stepskip("verify", dump, "--json")
    assert result.code == 1, result
    kinds = {os.path.relpath(p["path"], dump): p["kind"] for p in result.json()["problems"]}
    assert kinds == {f"{SAFE_RUN}/{s}": "damaged" for s in (1, 2, 3, 4)} | {f"{V1_RUN}/1/0": "damaged"}


def test_a_huge_inner_count_is_never_materialised():
    """``StepDir.issues`` names a few missing inner entries, whatever count an inner meta.json claims."""
    from stepskip._index import EntryRecord, EntryStatus, StepDir, StepKind

    entries = [EntryRecord(f"/c/run/1/{i}", 1, i, "rollout_tq", "safe", EntryStatus.PRESENT, "",
                           {"global_steps": 1, "parameter_sync_step": 10**9, "run_id": "r"}, 1, 0.0) for i in (0, 1)]
    (issue,) = StepDir("/c/run/1", 1, StepKind.V1, "rollout_tq", entries).issues()
    assert "entries 2, 3, 4, 5, 6, 7, 8, 9 and 999999990 more of 1000000000" in issue.detail


def test_unsupported_and_unreadable_entries_are_kept_by_repair_and_prune(copy_cache):
    dump = copy_cache("dump")
    run = dump / SAFE_RUN
    newer = run / "4" / "meta.json"
    meta = json.loads(newer.read_text())
    meta["format"] = "safe-v9"  # a newer stepskip's format
    newer.write_text(json.dumps(meta))
    odd = run / "6"  # intact (checksums match) but not decodable here
    tree = b'{"format": "safe", "version": 1, "root": {"kind": "no-such-node"}}'
    (odd / "data.json").write_bytes(tree)
    meta6 = json.loads((odd / "meta.json").read_text())
    meta6["files"]["data.json"].update(bytes=len(tree), checksum=checksum(tree))
    (odd / "meta.json").write_text(json.dumps(meta6))
    kept = {f"{SAFE_RUN}/4", f"{SAFE_RUN}/6"}
    before = {name: tree_digest(dump / name) for name in kept}

    repaired = stepskip("verify", dump, "--deep", "--repair", "--grace", "0", "--json")
    assert repaired.code == 1, repaired
    kinds = {os.path.relpath(p["path"], dump): p["kind"] for p in repaired.json()["problems"]}
    assert kinds == {f"{SAFE_RUN}/4": "unsupported", f"{SAFE_RUN}/6": "undecodable"}
    assert repaired.json()["repaired"] == []

    shown = stepskip("info", run / "6", "--json")
    assert shown.code == 1 and shown.json()["issues"][0]["kind"] == "undecodable", shown
    show = stepskip("show", run / "4")
    assert show.code == 1 and "newer stepskip" in show.err, show

    pruned = stepskip("prune", run, "--steps", "all", "--role", "rollout", "--deep", "--json")
    assert pruned.code == 0, pruned
    protected = {os.path.relpath(p["path"], dump): p["kind"] for p in pruned.json()["protected"]}
    assert protected == {f"{SAFE_RUN}/4": "unsupported", f"{SAFE_RUN}/6": "undecodable"}
    assert sorted(int(n) for n in os.listdir(run) if n.isdigit()) == [4, 6]
    assert {name: tree_digest(dump / name) for name in kept} == before

    again = stepskip("prune", run, "--keep-last", "0", "--role", "rollout")  # without --deep: the unknown format
    assert again.code == 0 and "kept" in again.out, again
    assert (run / "4").exists()
    assert stepskip("convert", run, dump.parent / "out", "--to", "verl").code == 1  # left out, reported


def test_convert_refuses_a_destination_that_is_a_link_into_its_source(copy_cache, tmp_path):
    dump = copy_cache("dump")
    before = tree_digest(dump)
    inside = tmp_path / "alias"
    os.symlink(dump, inside)  # DST *is* SRC through a link
    deeper = tmp_path / "deeper"
    os.symlink(dump / "exp_proj", deeper)  # DST inside SRC through a link
    for dst in (inside, deeper / "converted", dump / "exp_proj" / "converted"):
        result = stepskip("convert", dump, dst, "--to", "verl", "--overwrite", "--allow-pickle")
        assert result.code == 2 and "inside" in result.err, result
    above = stepskip("convert", dump / "exp_proj", dump.parent, "--to", "verl", "--overwrite")
    assert above.code == 2 and "a parent of" in above.err, above
    assert tree_digest(dump) == before  # the source was never rewritten


def test_retire_is_confined_to_the_index_root(copy_cache, tmp_path):
    dump = copy_cache("dump")
    index = CacheIndex(str(dump / SAFE_RUN))
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", dump / SAFE_RUN / "link")
    for path in (str(dump / "exp_v1"), str(dump / SAFE_RUN), f"{dump / SAFE_RUN}/../../exp_v1",
                 str(dump / SAFE_RUN / "link"), str(dump / SAFE_RUN / "link" / "x")):
        with pytest.raises(NotACacheError):
            index.retire(path)
    assert (dump / "exp_v1").exists() and (tmp_path / "elsewhere").exists()
    index.retire(str(dump / SAFE_RUN / "1"))
    assert not (dump / SAFE_RUN / "1").exists()


@pytest.mark.parametrize("created", [1e300, 1e20, -0.0])
def test_a_time_no_calendar_holds_is_shown_as_unknown_not_a_crash(copy_cache, created):
    """``created_unix`` may be any finite number >= 0 in a meta.json someone else wrote: ls and info print it."""
    dump = copy_cache("dump")
    meta_path = dump / SAFE_RUN / "2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["created_unix"] = created
    meta_path.write_text(json.dumps(meta))
    for args in (["ls", dump], ["ls", dump, "--json"], ["info", dump / SAFE_RUN / "2"],
                 ["info", dump / SAFE_RUN / "2", "--json"]):
        result = stepskip(*args)
        assert result.code == 0, result


HOSTILE_DRIFT = {
    "nan": '{"step": 1, "token_match": NaN, "first_row": NaN, "worst_field": "x"}',
    "infinity": '{"step": 1, "first_row": Infinity, "worst_field": "x"}',
    "overflowing": '{"step": 1, "first_row": 1e999, "worst_field": "x"}',
    "huge_int": '{"step": 1, "worst_match": ' + "9" * 4000 + ', "worst_field": "x"}',
    "deep": '{"step": 1, "fields": ' + "[" * 900 + "]" * 900 + "}",
    "run_id_list": '{"step": 1, "passed": true, "entry": {"run_id": ["a"]}}',
}


@pytest.mark.parametrize("name", sorted(HOSTILE_DRIFT))
def test_a_planted_drift_record_is_never_a_crash(copy_cache, name):
    """A drift record is a file beside the steps anyone may have written: info and show print the step
    (the record passed over when it is not what action: compare writes), in text and in JSON."""
    from stepskip._drift import drift_records
    from stepskip._index import CacheIndex

    dump = copy_cache("dump")
    records = dump / SAFE_RUN / ".stepskip-drift"
    records.mkdir()
    (records / "1.json").write_text(HOSTILE_DRIFT[name])
    (records / "1-x.json").write_text('{"step": 1, "passed": true, "token_match": 1.0}')  # a sound one beside it
    step = dump / SAFE_RUN / "1"
    for args in (["info", step], ["info", step, "--json"], ["show", step], ["show", step, "--json"]):
        result = stepskip(*args)
        assert result.code == 0, result
        if "--json" in args:
            assert json.loads(result.out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))
    kept = drift_records(CacheIndex(str(dump)).store, str(step))
    assert {"step": 1, "passed": True, "token_match": 1.0} in kept
    assert name == "run_id_list" or len(kept) == 1


def test_token_columns_a_tokenizer_cannot_take_are_shown_as_ids(tmp_path):
    """An entry claiming the demo's model (so show picks the built-in tokenizer) whose token columns hold
    NaN and infinity: show prints the ids instead of crashing, in text and JSON."""
    import torch
    from skip_configs import run_path, training_config

    from stepskip import Batch, SkipManager
    from stepskip.pipelines.tokenizer import MODEL_NAME

    config = training_config(tmp_path, steps=[1])
    config["actor_rollout_ref"]["model"] = {"path": MODEL_NAME}

    class Loop:
        @SkipManager.annotate(role="rollout")
        def generate_sequences(self, prompts: Batch) -> Batch:
            return Batch.from_dict(tensors={"prompts": torch.tensor([[1.0, float("nan")], [1.0, 3.0]]),
                                            "responses": torch.tensor([[float("inf"), 4.0], [4.0, 5.0]])})

    SkipManager.init(config)
    SkipManager.set_step(1)
    Loop().generate_sequences(Batch.from_dict(tensors={"input_ids": torch.zeros(2, 2)}))
    SkipManager.close()
    step = run_path(tmp_path) / "1"
    shown = stepskip("show", step)
    assert shown.code == 0 and "[inf, 4.0]" in shown.out and "'<s>0'" in shown.out, shown
    rows = stepskip("show", step, "--json").json()["rows"]
    assert rows[0]["prompt_decoded"] is None and rows[1]["response_decoded"] == "12"
