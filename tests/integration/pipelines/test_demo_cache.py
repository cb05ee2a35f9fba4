"""What ``stepskip demo --dump-dir D`` leaves for a new user to look at: ``D`` is a dump dir that ``stepskip ls``,
``show`` and ``view`` open as given; it holds the reward stage next to the rollout, and its trajectories read
as text (the pipelines' character tokenizer, built in code) with their rewards."""

from __future__ import annotations

import contextlib
import io
import json
import sys
import urllib.request
from pathlib import Path

import pytest
from interrupts import view_command
from pipeline_helpers import entry_dirs

from stepskip.pipelines import demo
from stepskip.pipelines.tokenizer import CharTokenizer
from stepskip.view.data import ViewSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "cli"))

from cli_run import stepskip  # noqa: E402

RUN = "colocated_stepskip_pipelines/GBS4_N4_in5_out8"
SHORT = ["--pipeline", "colocated", "--steps", "2", "--replay-steps", "1-2", "data.max_response_length=8",
         "trainer.val_before_train=false"]  # the colocated pipeline records a reward stage too


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> tuple[Path, str]:
    """One demo run kept in a dump dir (its printed output too)."""
    dump = tmp_path_factory.mktemp("demo") / "cache"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the demo's rich console writes to sys.stdout
        assert demo.main([*SHORT, "--dump-dir", str(dump)]) == 0
    return dump, printed.getvalue()


def test_the_dump_dir_is_a_cache_ls_show_and_report_open(demo_dir):
    dump, printed = demo_dir
    assert f"stepskip ls {dump}" in printed and f"stepskip view {dump}" in printed
    assert entry_dirs(dump) == [f"{RUN}/1", f"{RUN}/2", f"{RUN}/reward/1", f"{RUN}/reward/2"]
    listed = stepskip("ls", dump, "--json")
    assert listed.code == 0, listed
    (run,) = listed.json()["runs"]
    assert run["name"] == RUN
    assert {r["role"]: r["steps_spec"] for r in run["roles"]} == {"rollout": "1-2", "reward": "1-2"}
    shown = stepskip("show", dump / RUN / "1", "--rows", "16", "--json")
    assert shown.code == 0, shown
    assert len(shown.json()["rows"]) == 16


def test_stepskip_view_serves_the_dump_dir(demo_dir):
    """The real console command on the demo's --dump-dir; Ctrl-C (SIGINT) stops it."""
    dump, _ = demo_dir
    with view_command(dump, "--port", "0") as view:
        assert view.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{view.url}api/runs") as res:
            runs = json.load(res)["runs"]
        assert [r["name"] for r in runs] == [RUN]
        with urllib.request.urlopen(f"{view.url}api/step?run={RUN}&role=rollout&step=2") as res:
            page = json.load(res)
        assert page["reward_source"].startswith("reward role") and isinstance(page["rows"][0]["response"], str)


def test_the_view_shows_text_and_rewards(demo_dir):
    dump, printed = demo_dir
    source = ViewSource(str(dump))
    tok = CharTokenizer()
    for step in (1, 2):
        page = source.step_page(RUN, "rollout", step, limit=100)
        assert page["total"] == 16 and page["reward_source"] == "reward role (token_level_scores)"
        for row in page["rows"]:
            assert isinstance(row["prompt"], str) and row["prompt"].startswith("<s>") and len(row["prompt"]) == 7
            assert tok.encode(row["prompt"])[0] == 1  # text that encodes back to the task's prompt ids
            assert isinstance(row["response"], str) and len(tok.encode(row["response"])) == row["length"]
            assert 0.0 <= row["reward"] <= 1.0
        stats = source.step_stats(RUN, "rollout", step)
        assert stats["reward"]["histogram"] is not None and stats["reward"]["summary"]["count"] == 16
    trend = source.trend(RUN, "rollout")
    assert [s["reward"]["count"] for s in trend["steps"]] == [16, 16]
    first = source.step_page(RUN, "rollout", 1, limit=1)["rows"][0]
    assert f"prompt {first['prompt']!r} -> response {first['response']!r}" in printed  # the demo shows one


def test_show_prints_text_and_the_reward_stage_rewards(demo_dir):
    dump, _ = demo_dir
    shown = stepskip("show", dump / RUN, "--step", "1", "--rows", "16", "--json")
    assert shown.code == 0, shown
    rows = shown.json()["rows"]
    scored = stepskip("show", dump / RUN / "reward" / "1", "--rows", "16", "--json").json()["rows"]
    tok = CharTokenizer()
    for row, score in zip(rows, scored, strict=True):
        assert row["prompt_decoded"] == tok.decode(row["prompt"]) and row["prompt_decoded"].startswith("<s>")
        assert row["response_decoded"] == tok.decode(row["response"])
        assert row["reward"] == score["reward"] is not None
        assert row["extra"]["reward from"] == "reward role (token_level_scores)"
    text = stepskip("show", dump / RUN / "2", "--rows", "1")
    assert text.code == 0, text
    assert "prompt (5 tokens): '<s>" in text.out and " reward " in text.out


def test_all_pipelines_must_record_apart(tmp_path, capsys):
    code = demo.main(["--all", "--dump-dir", str(tmp_path / "cache"), "trainer.experiment_name=same"])
    assert code == 2
    assert "one experiment directory" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
