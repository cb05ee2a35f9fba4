"""The data behind every view (stepskip.view.data) on real caches: listings, pages, distributions, trends,
comparisons, V1 and stage-role entries, verl-written entries and damaged ones."""

from __future__ import annotations

import pytest
from cli_caches import FIXTURE_RUN, ROLLOUT_STEPS, ROWS, SAFE_RUN, V1_RUN, VERL_FMT_RUN

from stepskip.view.data import MAX_PAGE, EntryProblem, ViewNotFound, ViewSource, compare_groups, percentiles


@pytest.fixture(scope="module")
def source(view_cache):
    return ViewSource(str(view_cache), allow_pickle=True)


def test_listing_names_runs_roles_and_steps_with_their_facts(source):
    listing = source.listing()
    runs = {r["name"]: r for r in listing["runs"]}
    assert set(runs) == {SAFE_RUN, VERL_FMT_RUN, V1_RUN, FIXTURE_RUN}
    roles = {r["role"]: r for r in runs[SAFE_RUN]["roles"]}
    assert list(roles) == ["rollout", "reward"]
    steps = roles["rollout"]["steps"]
    assert [s["step"] for s in steps] == ROLLOUT_STEPS
    first = steps[0]
    assert first["formats"] == ["safe"] and first["valid"] and first["bytes"] > 0
    assert first["generation_seconds"] is not None and first["generation_seconds"] >= 0
    assert first["fingerprint_values"]["actor_rollout_ref.rollout.n"] == 2
    assert len(first["fingerprint"]) == 12 and first["age_seconds"] >= 0
    assert runs[SAFE_RUN]["shape"] == {"gbs": 4, "n": 2, "prompt_len": 8, "response_len": 6}
    v1 = runs[V1_RUN]["roles"][0]["steps"][0]
    assert v1["kind"] == "v1" and [i["inner"] for i in v1["inner"]] == [0, 1]
    assert runs[FIXTURE_RUN]["roles"][0]["steps"][0]["written_by"] == "verl"


def test_a_step_is_paged_on_the_server(source):
    page = source.step_page(SAFE_RUN, "rollout", 3, offset=2, limit=3)
    assert page["total"] == ROWS and page["matched"] == ROWS
    assert [r["i"] for r in page["rows"]] == [2, 3, 4]
    assert source.step_page(SAFE_RUN, "rollout", 3, offset=7, limit=3)["rows"][0]["i"] == 7
    assert source.step_page(SAFE_RUN, "rollout", 3, limit=10**9)["limit"] == MAX_PAGE


def test_rows_carry_prompt_response_reward_length_and_group(source):
    rows = source.step_page(SAFE_RUN, "rollout", 1, limit=ROWS)["rows"]
    # cli_caches.rollout_batch: reward r % 2 at the last response token, group s{step}-u{r // 2}
    assert [r["reward"] for r in rows] == [float(i % 2) for i in range(ROWS)]
    assert [r["group"] for r in rows] == [f"s1-u{i // 2}" for i in range(ROWS)]
    for r in rows:
        assert len(r["response"]) == r["length"] and all(100 <= t < 200 for t in r["response"])
        assert all(10 <= t < 100 for t in r["prompt"])  # left padding removed


def test_sorting_filters_and_search(source):
    rows = source.step_page(SAFE_RUN, "rollout", 2, limit=ROWS, sort="length", desc=True)["rows"]
    assert [r["length"] for r in rows] == sorted((r["length"] for r in rows), reverse=True)
    zero = source.step_page(SAFE_RUN, "rollout", 2, filters=["reward0"])
    assert zero["matched"] == ROWS // 2 and all(r["reward"] == 0 for r in zero["rows"])
    capped = source.step_page(SAFE_RUN, "rollout", 2, filters=["lenmax"])
    assert capped["max_length"] == 6 and all(r["length"] >= 6 for r in capped["rows"])
    everything = source.step_page(SAFE_RUN, "rollout", 2, limit=ROWS)["rows"]
    assert capped["matched"] == sum(r["length"] >= 6 for r in everything)
    found = source.step_page(SAFE_RUN, "rollout", 2, q="S2-U3")
    assert [r["group"] for r in found["rows"]] == ["s2-u3", "s2-u3"]
    with pytest.raises(Exception, match="unknown filter"):
        source.step_page(SAFE_RUN, "rollout", 2, filters=["nope"])


def test_distributions_and_trend(source):
    stats = source.step_stats(SAFE_RUN, "rollout", 1)
    assert sum(stats["reward"]["histogram"]["counts"]) == ROWS
    assert stats["reward"]["histogram"]["edges"] == [0.0, 1.0, 2.0]  # 0/1 rewards: one bar per value
    assert stats["reward"]["summary"]["mean"] == 0.5
    assert sum(stats["length"]["histogram"]["counts"]) == ROWS
    trend = source.trend(SAFE_RUN, "rollout")
    assert [s["step"] for s in trend["steps"]] == ROLLOUT_STEPS and trend["problems"] == []
    lengths = [r["length"] for r in source.step_page(SAFE_RUN, "rollout", 4, limit=ROWS)["rows"]]
    assert trend["steps"][3]["length"]["mean"] == pytest.approx(sum(lengths) / len(lengths))


def test_percentiles_interpolate():
    assert percentiles([3, 1, 2, 4]) == {"count": 4, "mean": 2.5, "min": 1.0, "p10": 1.3, "p50": 2.5,
                                         "p90": pytest.approx(3.7), "max": 4.0}
    assert percentiles([None, float("nan")]) is None


def test_compare_matches_groups_by_uid_across_runs_and_by_order_across_steps(source):
    same_step = source.compare((SAFE_RUN, "rollout", 1), (VERL_FMT_RUN, "rollout", 1))
    assert same_step["total"] == ROWS // 2
    for g in same_step["groups"]:
        assert g["a"]["group"] == g["b"]["group"]
        assert [r["response"] for r in g["a"]["rows"]] == [r["response"] for r in g["b"]["rows"]]
    two_steps = source.compare((SAFE_RUN, "rollout", 1), (SAFE_RUN, "rollout", 2), limit=2)
    assert [(g["a"]["group"], g["b"]["group"]) for g in two_steps["groups"]] == [("s1-u0", "s2-u0"),
                                                                                ("s1-u1", "s2-u1")]
    assert two_steps["total"] == ROWS // 2 and two_steps["a"]["reward"]["mean"] == 0.5
    lopsided = compare_groups([{"i": 0, "group": "x"}], [{"i": 0, "group": "x"}, {"i": 1, "group": "y"}])
    assert lopsided[1]["a"] is None and lopsided[1]["b"]["group"] == "y"


def test_v1_steps_merge_inner_entries_with_keys_tags_and_prompt_groups(source):
    page = source.step_page(V1_RUN, "rollout_tq", 1, limit=100)
    assert page["total"] == 8  # both inner entries of the step, merged
    for row in page["rows"]:
        assert row["id"].startswith(row["group"] + "_")  # {uid}_{session}_{turn}: the group is the uid
        assert row["tags"]["status"] == "finished" and row["tags"]["global_steps"] == 1
    assert len({r["group"] for r in page["rows"]}) == 4
    assert page["columns"][:2] == ["key", "group"] and all(r["key"] == r["id"] for r in page["rows"])
    assert source.step_page(V1_RUN, "rollout_tq", 1, q=page["rows"][3]["key"])["matched"] == 1


def test_stage_role_entries_show_their_rewards(source):
    page = source.step_page(SAFE_RUN, "reward", 1, limit=ROWS)
    assert page["reward_source"] == "reward"
    assert [r["reward"] for r in page["rows"]] == [float(i % 2) for i in range(ROWS)]


def test_verl_written_entries_need_allow_pickle(view_cache):
    refusing = ViewSource(str(view_cache))
    with pytest.raises(EntryProblem, match="allow-pickle") as caught:
        refusing.step_page(FIXTURE_RUN, "rollout", 1)
    assert caught.value.kind == "pickle"
    trend = refusing.trend(FIXTURE_RUN, "rollout")
    assert trend["steps"] == [] and {p["kind"] for p in trend["problems"]} == {"pickle"}
    allowed = ViewSource(str(view_cache), allow_pickle=True).step_page(FIXTURE_RUN, "rollout", 1)
    assert allowed["total"] == 8 and all(r["length"] > 0 for r in allowed["rows"])


def test_names_outside_the_listing_are_refused(source):
    for run in ("..", "../..", "/etc", "exp_proj/../exp_v1/GBS4_N2_in0_out0", f"{SAFE_RUN}/..", "%2e%2e"):
        with pytest.raises(ViewNotFound):
            source.step_page(run, "rollout", 1)
    for role, step in (("..", 1), ("rollout", "../1"), ("rollout", "1/../2"), ("rollout", 99), ("/etc", 1)):
        with pytest.raises(ViewNotFound):
            source.step_page(SAFE_RUN, role, step)


def test_damaged_and_unreadable_steps_give_their_reason(copy_view_cache):
    dump = copy_view_cache()
    data = dump / SAFE_RUN / "3" / "data.safetensors"
    data.write_bytes(data.read_bytes()[:10])  # truncated
    meta = dump / SAFE_RUN / "4" / "meta.json"
    meta.write_text(meta.read_text().replace('"format": "safe"', '"format": "safe-v99"'))
    source = ViewSource(str(dump))
    steps = {s["step"]: s for s in source.listing()["runs"][0]["roles"][0]["steps"]}
    assert not steps[3]["valid"] and steps[3]["issues"]
    assert "safe-v99" in " ".join(steps[4]["issues"])
    with pytest.raises(EntryProblem) as damaged:
        source.step_page(SAFE_RUN, "rollout", 3)
    assert damaged.value.kind == "damaged"
    with pytest.raises(EntryProblem) as unsupported:
        source.step_page(SAFE_RUN, "rollout", 4)
    assert unsupported.value.kind == "unreadable" and "safe-v99" in str(unsupported.value)
    trend = source.trend(SAFE_RUN, "rollout")
    assert {p["step"] for p in trend["problems"]} == {3, 4}
    assert source.step_page(SAFE_RUN, "rollout", 5)["total"] == ROWS  # the rest still reads


def test_a_tokenizer_turns_ids_into_text(view_cache, tmp_path):
    from stepskip.cli.content import load_tokenizer

    path = _tiny_tokenizer(tmp_path / "tok")
    source = ViewSource(str(view_cache), tokenizer=load_tokenizer(str(path)))
    row = source.step_page(SAFE_RUN, "rollout", 1, limit=1)["rows"][0]
    ids = ViewSource(str(view_cache)).step_page(SAFE_RUN, "rollout", 1, limit=1)["rows"][0]
    assert row["response"].split() == [f"t{i}" for i in ids["response"]]
    assert source.step_page(SAFE_RUN, "rollout", 1, q=row["response"].split()[0])["matched"] >= 1


def _tiny_tokenizer(path):
    """A word-level Hugging Face tokenizer saved locally: id i <-> "t{i}"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))
    return path


def test_rows_of_a_step_are_listed_once_it_was_read(view_cache):
    fresh = ViewSource(str(view_cache))

    def rows_of(step):
        run = next(r for r in fresh.listing()["runs"] if r["name"] == SAFE_RUN)
        return next(s for s in run["roles"][0]["steps"] if s["step"] == step)["rows"]

    assert rows_of(2) is None  # a stepskip safe entry's meta.json does not record its rows
    fresh.step_page(SAFE_RUN, "rollout", 2)
    assert rows_of(2) == ROWS
    v1 = next(r for r in fresh.listing()["runs"] if r["name"] == V1_RUN)["roles"][0]["steps"][0]
    assert v1["rows"] == 8  # V1 inner entries record num_trajectories


def test_a_memory_store_cache_is_viewed_alike(view_cache):
    """The view reads through the index's store abstraction: a ``memory://`` copy shows the same rows."""
    import uuid

    import fsspec

    root = f"memory://view-{uuid.uuid4().hex[:8]}/dump"
    fs = fsspec.filesystem("memory")
    for path in sorted((view_cache / SAFE_RUN).rglob("*")):
        if path.is_file():
            with fs.open(f"{root}/{SAFE_RUN}/{path.relative_to(view_cache / SAFE_RUN)}", "wb") as out:
                out.write(path.read_bytes())
    remote = ViewSource(root)
    assert [r["name"] for r in remote.listing()["runs"]] == [SAFE_RUN]
    local = ViewSource(str(view_cache)).step_page(SAFE_RUN, "rollout", 5, limit=ROWS)
    assert remote.step_page(SAFE_RUN, "rollout", 5, limit=ROWS)["rows"] == local["rows"]
