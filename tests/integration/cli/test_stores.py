"""Every command on every store: a local directory, ``memory://`` and a real S3 server (moto), in process."""

from __future__ import annotations

import json

from cli_caches import FIXTURE_RUN, V1_RUN, rollout_batch
from cli_run import stepskip
from store_runs import RECORDED_RUN, RECORDED_STEPS

from stepskip.cli.content import value_digest
from stepskip._index import CacheIndex


def test_ls_info_show_on_every_store(store_cache):
    opts = [a for o in store_cache.options for a in ("-o", o)]
    listing = stepskip("ls", store_cache.dump_dir, "--json", *opts)
    assert listing.code == 0, listing
    runs = {r["name"]: r for r in listing.json()["runs"]}
    assert sorted(runs) == sorted([RECORDED_RUN, V1_RUN, FIXTURE_RUN])
    roles = {r["role"]: r for r in runs[RECORDED_RUN]["roles"]}
    assert roles["rollout"]["steps"] == RECORDED_STEPS and roles["rollout"]["formats"] == ["safe"]
    assert roles["reward"]["steps"] == [1, 2]  # the stage role's subdirectory, on this store too
    v1 = {r["role"]: r for r in runs[V1_RUN]["roles"]}["rollout_tq"]
    assert (v1["steps"], v1["entries"]) == ([1, 2, 3], 6)
    assert all(r["problems"] == 0 and r["bytes"] > 0 for r in runs.values())
    table = stepskip("ls", store_cache.dump_dir, *opts)
    assert table.code == 0 and "3 runs, 15 entries" in table.out, table

    info = stepskip("info", store_cache.path(f"{RECORDED_RUN}/3"), store_cache.path(f"{V1_RUN}/2"), "--json", *opts)
    assert info.code == 0, info
    rollout, v1_step = info.json()
    assert (rollout["role"], rollout["rows"], rollout["meta"]["global_steps"]) == ("rollout", 8, 3)
    assert {f["name"] for f in rollout["fields"]} >= {"prompts", "responses", "uid"}
    assert rollout["fingerprint"]["actor_rollout_ref.model.path"] == "Qwen/Qwen2.5-0.5B"
    assert (v1_step["kind"], v1_step["rows"], [e["inner"] for e in v1_step["entries"]]) == ("v1", 8, [0, 1])

    shown = stepskip("show", store_cache.path(RECORDED_RUN), "--step", "2", "--rows", "1", "--json", *opts)
    assert shown.code == 0, shown
    expected = rollout_batch(2)
    row = shown.json()["rows"][0]
    assert row["id"] == expected.non_tensor_batch["uid"][0]
    assert row["response"] == expected.batch["responses"][0][expected.batch["response_mask"][0].bool()].tolist()
    pickled = stepskip("show", store_cache.path(f"{FIXTURE_RUN}/1"), *opts)
    assert pickled.code == 2 and "--allow-pickle" in pickled.err, pickled


def test_verify_repair_and_prune_on_every_store(store_cache):
    opts = [a for o in store_cache.options for a in ("-o", o)]
    clean = stepskip("verify", store_cache.dump_dir, "--deep", "--allow-pickle", *opts)
    assert clean.code == 0 and "no problems found" in clean.out, clean

    index = CacheIndex(store_cache.dump_dir, store_cache.storage_options)
    run = index.scan_run(store_cache.path(RECORDED_RUN))
    step1 = next(s for s in run.steps if s.role == "rollout" and s.step == 1).entries[0]
    obj = step1.meta["files"]["data.safetensors"].get("object", "data.safetensors")
    raw = bytearray(store_cache.get(f"{RECORDED_RUN}/1/{obj}"))
    raw[-3] ^= 0xFF  # same size, wrong checksum
    store_cache.put(f"{RECORDED_RUN}/1/{obj}", bytes(raw))
    meta4 = json.loads(store_cache.get(f"{RECORDED_RUN}/4/meta.json"))
    meta4["format"] = "safe-v9"  # a newer stepskip's entry: never removed
    store_cache.put(f"{RECORDED_RUN}/4/meta.json", json.dumps(meta4).encode())
    kept_meta = store_cache.get(f"{RECORDED_RUN}/4/meta.json")

    found = stepskip("verify", store_cache.dump_dir, "--json", *opts)
    assert found.code == 1, found
    kinds = {store_cache.rel(p["path"]): p["kind"] for p in found.json()["problems"]}
    assert kinds == {f"{RECORDED_RUN}/1": "checksum", f"{RECORDED_RUN}/4": "unsupported"}

    repaired = stepskip("verify", store_cache.dump_dir, "--repair", "--grace", "0", "--json", *opts)
    assert repaired.code == 1, repaired  # the unsupported entry stays, reported
    assert [store_cache.rel(p) for p in repaired.json()["repaired"]] == [f"{RECORDED_RUN}/1"]
    assert not store_cache.exists(f"{RECORDED_RUN}/1/meta.json")
    assert store_cache.get(f"{RECORDED_RUN}/4/meta.json") == kept_meta

    pruned = stepskip("prune", store_cache.path(RECORDED_RUN), "--steps", "all", "--role", "rollout", "--json", *opts)
    assert pruned.code == 0, pruned
    report = pruned.json()
    assert [r["step"] for r in report["remove"]] == [2, 3]
    assert [p["kind"] for p in report["protected"]] == ["unsupported"]
    assert store_cache.get(f"{RECORDED_RUN}/4/meta.json") == kept_meta
    listing = stepskip("ls", store_cache.dump_dir, "--json", *opts).json()
    roles = {r["role"]: r for run in listing["runs"] if run["name"] == RECORDED_RUN for r in run["roles"]}
    assert roles["rollout"]["steps"] == [] and roles["rollout"]["invalid_steps"] == [4]
    assert roles["reward"]["steps"] == [1, 2]  # another role: untouched
    assert not [n for n in store_cache.names(RECORDED_RUN) if n.startswith((".tmp-", ".trash-"))]


def test_convert_between_stores(store_cache, tmp_path):
    opts = [a for o in store_cache.options for a in ("-o", o)]
    out = store_cache.dump_dir.rsplit("/", 1)[0] + "/converted"  # a sibling prefix on the same store
    src = store_cache.path(RECORDED_RUN.split("/")[0])  # an experiment directory
    done = stepskip("convert", src, out, "--to", "verl", "--role", "rollout", "--json", *opts)
    assert done.code == 0, done
    assert len(done.json()["converted"]) == len(RECORDED_STEPS)
    listing = stepskip("ls", out, "--json", *opts).json()
    roles = {run["name"]: {r["role"]: r for r in run["roles"]} for run in listing["runs"]}
    assert roles[RECORDED_RUN]["rollout"]["formats"] == ["verl"]
    assert roles[RECORDED_RUN]["rollout"]["steps"] == RECORDED_STEPS

    back = tmp_path / "back"  # and from the store to a local dump dir
    home = stepskip("convert", out, back, "--to", "safe", "--allow-pickle", *opts)
    assert home.code == 0, home
    assert sorted(p.name for p in (back / RECORDED_RUN).iterdir()) == ["1", "2", "3", "4"]
    local = CacheIndex(str(back))
    source = CacheIndex(store_cache.dump_dir, store_cache.storage_options)
    for step in RECORDED_STEPS:
        mine = local.resolve(str(back / RECORDED_RUN / str(step)))[0].entries[0]
        original = source.resolve(store_cache.path(f"{RECORDED_RUN}/{step}"))[0].entries[0]
        assert value_digest(local.read_entry(mine)) == value_digest(source.read_entry(original))
