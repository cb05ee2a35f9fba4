"""``stepskip verify``: every kind of damage found (exit 1), ``--repair`` removes only what can never be valid."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from cli_caches import FIXTURE_RUN, SAFE_RUN, V1_RUN, VERL_FMT_RUN
from cli_run import stepskip

from stepskip.cli import main
from stepskip.cli.verify import verify_runs
from stepskip._index import CacheIndex


def damage(dump: Path) -> dict[str, str]:
    """Damage a copy of the cache in every way the storage tests can; returns {relative path: problem kind}."""
    safe, v1, fixture = dump / SAFE_RUN, dump / V1_RUN, dump / FIXTURE_RUN
    data = bytearray((safe / "1" / "data.safetensors").read_bytes())
    data[-5] ^= 0xFF  # a flipped byte: same size, wrong checksum
    (safe / "1" / "data.safetensors").write_bytes(bytes(data))
    (safe / "2" / "data.safetensors").write_bytes((safe / "2" / "data.safetensors").read_bytes()[:-10])
    (safe / "3" / "meta.json").write_text("{not json")
    (safe / "5" / "data.json").unlink()
    stale = time.time() - 7200
    for leftover in (safe / ".tmp-7-0123456789ab", safe / "reward" / ".trash-1-0123456789ab"):
        leftover.mkdir()
        (leftover / "data.json").write_text("{}")
        os.utime(leftover / "data.json", (stale, stale))
        os.utime(leftover, (stale, stale))
    (safe / "9").mkdir()  # a step directory whose write never finished
    (safe / "9" / "data.json").write_text("{}")
    shutil.rmtree(v1 / "2" / "1")  # a V1 step missing an inner entry
    meta = json.loads((v1 / "3" / "1" / "meta.json").read_text())
    meta["run_id"] = "another-run"  # a V1 step completed by another run
    (v1 / "3" / "1" / "meta.json").write_text(json.dumps(meta))
    dp = fixture / "2" / "gen_batch.dp"  # verl wrote no checksums: only decoding (--deep) finds the truncation
    dp.write_bytes(dp.read_bytes()[: len(dp.read_bytes()) // 2])
    return {
        f"{SAFE_RUN}/1": "checksum", f"{SAFE_RUN}/2": "damaged", f"{SAFE_RUN}/3": "damaged",
        f"{SAFE_RUN}/5": "damaged", f"{SAFE_RUN}/.tmp-7-0123456789ab": "leftover",
        f"{SAFE_RUN}/reward/.trash-1-0123456789ab": "leftover", f"{SAFE_RUN}/9": "half-written",
        f"{V1_RUN}/2": "incomplete", f"{V1_RUN}/3": "mixed-runs", f"{FIXTURE_RUN}/2": "damaged",
    }


VALID_AFTER_DAMAGE = [f"{SAFE_RUN}/{s}" for s in (4, 6, 8, 10)] + [
    f"{SAFE_RUN}/reward/1", f"{SAFE_RUN}/reward/2", f"{V1_RUN}/1", f"{VERL_FMT_RUN}/1", f"{VERL_FMT_RUN}/2",
    f"{FIXTURE_RUN}/1", f"{FIXTURE_RUN}/3",
]
IN_PROGRESS = {f"{SAFE_RUN}/9", f"{V1_RUN}/2", f"{V1_RUN}/3"}  # just modified: may be a live writer's


def digests(root: Path, entries: list[str]) -> dict[str, str]:
    out = {}
    for entry in entries:
        for path in sorted((root / entry).rglob("*")):
            if path.is_file():
                out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def relative(paths: list[str], root: Path) -> set[str]:
    return {os.path.relpath(p, root) for p in paths}


def test_verify_finds_every_kind_of_damage_and_repair_removes_only_invalid_things(pristine_cache, copy_cache, capsys):
    clean = stepskip("verify", pristine_cache)
    dump = copy_cache("dump")
    expected = damage(dump)
    before = digests(dump, VALID_AFTER_DAMAGE)

    # Without --repair (in process: the console script's own entry point) nothing changes; exit code 1.
    assert main(["verify", str(dump), "--deep", "--allow-pickle", "--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert {os.path.relpath(p["path"], dump): p["kind"] for p in found["problems"]} == expected
    assert digests(dump, VALID_AFTER_DAMAGE) == before and all((dump / path).exists() for path in expected)

    first = stepskip("verify", dump, "--repair", "--deep", "--allow-pickle", "--json")
    result = clean
    assert result.code == 0, result
    assert "checked 21 entries in 4 runs: 18 against their checksums" in result.out
    assert "3 entries written by verl carry no checksums" in result.out
    assert "no problems found" in result.out

    assert first.code == 1, first  # what may still be in progress is kept (younger than --grace 1h)
    report = first.json()
    assert {os.path.relpath(p["path"], dump): p["kind"] for p in report["problems"]} == expected
    assert report["clean"] is False
    assert relative(report["repaired"], dump) == set(expected) - IN_PROGRESS
    assert relative([p["remove"] for p in report["kept"]], dump) == IN_PROGRESS
    assert all((dump / path).exists() for path in IN_PROGRESS)
    assert digests(dump, VALID_AFTER_DAMAGE) == before

    second = stepskip("verify", dump, "--repair", "--grace", "0", "--json")
    assert second.code == 0, second
    assert relative(second.json()["repaired"], dump) == IN_PROGRESS

    assert not any((dump / path).exists() for path in expected)
    assert digests(dump, VALID_AFTER_DAMAGE) == before  # no valid entry was touched
    index = CacheIndex(str(dump))
    after = verify_runs(index, index.runs(), deep=True, allow_pickle=True)
    assert after.clean and after.entries == 12  # 11 steps, V1 step 1 has two inner entries
    assert not [name for name in os.listdir(dump / SAFE_RUN) if name.startswith((".tmp-", ".trash-"))]


def test_repair_keeps_intact_entries_it_cannot_decode(copy_cache, capsys):
    """An unknown format (a newer stepskip's) and intact bytes that do not decode are reported, never removed."""
    dump = copy_cache("dump")
    newer = dump / SAFE_RUN / "4" / "meta.json"
    meta = json.loads(newer.read_text())
    meta["format"] = "safe-v9"
    newer.write_text(json.dumps(meta))
    odd = dump / SAFE_RUN / "6"
    files = json.loads((odd / "meta.json").read_text())["files"]
    tree = b'{"format": "safe", "version": 1, "root": {"kind": "no-such-node"}}'
    (odd / "data.json").write_bytes(tree)  # checksums recomputed below: the bytes are intact, just not decodable
    meta6 = json.loads((odd / "meta.json").read_text())
    from stepskip._storage import checksum

    meta6["files"]["data.json"] = dict(files["data.json"], bytes=len(tree), checksum=checksum(tree))
    (odd / "meta.json").write_text(json.dumps(meta6))
    before = digests(dump, [f"{SAFE_RUN}/4", f"{SAFE_RUN}/6"])

    assert main(["verify", str(dump), "--deep", "--repair", "--grace", "0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    kinds = {os.path.relpath(p["path"], dump): p["kind"] for p in report["problems"]}
    assert kinds == {f"{SAFE_RUN}/4": "unsupported", f"{SAFE_RUN}/6": "undecodable"}
    assert "newer stepskip" in next(p["detail"] for p in report["problems"] if p["kind"] == "unsupported")
    assert report["repaired"] == []
    assert digests(dump, [f"{SAFE_RUN}/4", f"{SAFE_RUN}/6"]) == before
