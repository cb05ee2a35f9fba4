"""A V1 (rollout_tq) entry whose responses are padded, as verl's agent loop writes them: ``info``, ``show``
and the view count and print only response tokens (``response_mask``, else the response part of
``attention_mask``), never the padding. The entries are written by the real rollout_tq role through the
V1 harness of tests/support over the in-process queue (which returns per-row tensors jagged, as
TransferQueue does)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import stepskip
from v1_harness import PAD_WIDTH, V1Trainer

from stepskip import SkipManager
from stepskip.tq import InProcessTQClient
from stepskip.view.data import ViewSource

RUN = "exp_padded_v1/GBS4_N2_in0_out0"
STEP = 1000  # the harness adds 1000 * step to every response token


def record(dump_dir: Path, padded: str) -> Path:
    config = {
        "trainer": {"experiment_name": "exp", "project_name": "padded_v1"},
        "data": {"train_batch_size": 4},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout_tq": {"enable": True, "dump_dir": str(dump_dir), "steps": [1], "async_dump": False}},
    }
    V1Trainer(config, InProcessTQClient(), prompts_per_step=4, n=2, padded=padded).fit(1)
    SkipManager.close()
    SkipManager.reset()
    return dump_dir / RUN


def expected_response(prompt: int, session: int) -> list[int]:
    """What the harness generated for prompt ``prompt``, session ``session`` at step 1 (padding excluded)."""
    return [x + 100 * prompt + 10 * session + STEP for x in range((prompt + session) % 4 + 1)]


@pytest.mark.parametrize("padded", ["response_mask", "attention_mask"])
def test_info_show_and_view_count_response_tokens_not_padding(tmp_path, padded):
    run = record(tmp_path, padded)

    info = stepskip("info", run / "1", "--json")
    assert info.code == 0, info
    data = info.json()
    assert data["kind"] == "v1" and {f["name"]: f["kind"] for f in data["fields"]}["responses"] == "jagged"
    stats = {s["name"]: s for s in data["stats"]}["response_length"]
    assert stats["source"] == padded
    assert stats["max"] <= 4 < PAD_WIDTH  # responses of 1..4 tokens, padded to 6

    shown = stepskip("show", run / "1", "--rows", "8", "--json")
    assert shown.code == 0, shown
    rows = shown.json()["rows"]
    assert len(rows) == 8
    lengths = {}
    for row in rows:
        prompt, session = row["prompt"][0], int(row["id"].split("_")[1])
        assert row["prompt"] == [prompt] * (prompt % 3 + 2)  # left padding removed
        assert row["response"] == expected_response(prompt, session)  # right padding removed
        lengths[row["id"]] = len(row["response"])
    assert sorted(lengths.values()) == sorted(stats_lengths(run)), "info and show agree"

    source = ViewSource(str(tmp_path))
    page = source.step_page(RUN, "rollout_tq", 1, limit=100)
    assert page["length_source"] == padded
    assert {r["key"]: r["length"] for r in page["rows"]} == lengths
    assert {r["key"]: r["response"] for r in page["rows"]} == {r["id"]: r["response"] for r in rows}
    assert source.step_stats(RUN, "rollout_tq", 1)["length"]["summary"]["max"] <= 4


def stats_lengths(run: Path) -> list[int]:
    from stepskip.cli.content import response_lengths
    from stepskip._index import CacheIndex

    index = CacheIndex(str(run / "1"))
    step_dir, _ = index.resolve()
    found = response_lengths(index.read_step(step_dir))
    assert found is not None
    return found[1]


def test_text_lines_name_the_mask(tmp_path):
    run = record(tmp_path, "response_mask")
    text = stepskip("info", run, "--step", "1")
    assert text.code == 0, text
    assert "response_length (response_mask)" in text.out
    out = stepskip("show", run / "1", "--rows", "8").out
    assert f"({PAD_WIDTH} tokens)" not in out.split("response", 1)[1]  # no response shown at its padded width
