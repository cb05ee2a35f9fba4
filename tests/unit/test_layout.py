"""``Layout`` builds every path stepskip writes and parses each back; one normaliser names dump dirs."""

from __future__ import annotations

import os

import pytest

from stepskip import RunIdentity
from stepskip._matching.hints import document_name, document_of, table_name, table_of
from stepskip._storage import open_store
from stepskip._drift import drift_records
from stepskip._layout import DRIFT_DIR, Layout, normalize_location
from stepskip._manifest import MANIFEST_FILE, is_recording, new_recording

IDENTITY = RunIdentity("exp", "proj", gbs=4, n=2, prompt_len=8, response_len=6, fingerprint={"model": "tiny"})


def test_a_layout_holds_its_run_identity_and_reads_the_shape_from_it():
    lay = Layout.for_identity("/d", IDENTITY, subdir="reward")
    assert lay.identity is IDENTITY
    assert (lay.experiment_name, lay.project_name, lay.gbs, lay.n, lay.prompt_len, lay.response_len) == (
        "exp", "proj", 4, 2, 8, 6)
    assert lay.run_name == IDENTITY.run_name == "GBS4_N2_in8_out6"
    assert lay.project_dir == "/d/exp_proj/GBS4_N2_in8_out6/reward"
    assert lay.project_dir_of("GBS8_N2_in8_out6") == "/d/exp_proj/GBS8_N2_in8_out6/reward"
    assert lay.run_dir_of("GBS8_N2_in8_out6") == "/d/exp_proj/GBS8_N2_in8_out6"


def test_every_path_a_v1_step_is_written_to_parses_back():
    lay = Layout.for_identity("/d", IDENTITY)
    staging = lay.staging_dir(12, "0123456789ab")
    assert os.path.dirname(staging) == lay.project_dir
    assert Layout.parse_staging(os.path.basename(staging)) == 12
    assert Layout.parse_step(os.path.basename(staging)) is None  # never a step
    recording = new_recording()
    assert is_recording(recording)
    inner = lay.inner_dir(12, 1, recording)
    assert inner == f"{lay.step_dir(12)}/{recording}/1" and Layout.step_dir_of(inner) == lay.step_dir(12)
    assert Layout.step_dir_of(lay.inner_dir(12, 1)) == lay.step_dir(12)
    assert Layout.parse_step(os.path.basename(lay.inner_dir(12, 1))) == 1
    assert lay.manifest_path(12) == f"{lay.step_dir(12)}/{MANIFEST_FILE}"
    for name in (".tmp-12-0123456789ab-x", ".tmp-012-0123456789ab", ".tmp-12-0123456789AB", "12"):
        assert Layout.parse_staging(name) is None


def test_a_call_entry_and_the_hint_files_parse_back():
    lay = Layout.for_identity("/d", IDENTITY, subdir="a/b")
    call = lay.call_dir(3, "c1t0", 2)
    assert Layout.parse_call(os.path.basename(call)).rank == 2 and os.path.dirname(call) == lay.step_dir(3)
    document, table = lay.hint_path(document_name, "0" * 16), lay.hint_path(table_name, "f" * 16)
    assert os.path.dirname(document) == os.path.dirname(table) == lay.hints_dir == "/d/exp_proj/.stepskip-index"
    assert document_of(os.path.basename(document)) == (lay.run_name, lay.safe_subdir) == ("GBS4_N2_in8_out6", "a_b")
    assert table_of(os.path.basename(table)) == (lay.run_name, lay.safe_subdir)


def test_a_drift_record_lies_beside_the_steps_and_is_found_from_its_step():
    lay = Layout.for_identity("memory://layout-drift", IDENTITY, subdir="reward")
    flat, call = lay.drift_path(lay.step_dir(12)), lay.drift_path(lay.call_dir(12, "c0", 1))
    assert os.path.dirname(flat) == os.path.dirname(call) == Layout.drift_dir_of(lay.step_dir(12))
    assert Layout.drift_dir_of(lay.step_dir(12)) == f"{lay.project_dir}/{DRIFT_DIR}"
    assert (os.path.basename(flat), os.path.basename(call)) == ("12.json", "12-c0-r1.json")
    assert Layout.parse_step(DRIFT_DIR) is None  # never taken for a step
    store = open_store(lay.dump_dir)
    for path, step in ((flat, 12), (call, 12), (lay.drift_path(lay.step_dir(120)), 120)):
        store.put_small(path, f'{{"step": {step}, "path": "{path}"}}'.encode())
    assert sorted(r["path"] for r in drift_records(store, lay.step_dir(12))) == sorted([flat, call])


@pytest.mark.parametrize("given, expected", [
    ("s3://bucket/dump/", "s3://bucket/dump"),
    ("memory://dump", "memory://dump"),
    ("file:///tmp/dump/", "/tmp/dump"),
    ("local:///tmp/dump", "/tmp/dump"),
    ("/tmp/dump/../dump/", "/tmp/dump"),
    ("/", "/"),
])
def test_one_normaliser_names_a_dump_dir(given, expected):
    assert normalize_location(given) == expected


def test_the_normaliser_expands_home_and_resolves_links_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert normalize_location("~/link") == str(tmp_path / "link")
    assert normalize_location("~/link", resolve_links=True) == os.path.realpath(tmp_path / "real")
    assert Layout.for_identity("~/link/", IDENTITY).dump_dir == str(tmp_path / "link")
