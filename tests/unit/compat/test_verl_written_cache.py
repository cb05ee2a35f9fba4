"""Caches written by verl 0.9.1's own code (tests/fixtures/verl) read back without verl installed."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from verl_fixtures import RUN, EchoLoop, check_load_module, comparable, copy_fixture, expected_summary
from verl_fixtures import fixture_config as config

from stepskip import Batch, SkipConfigError, SkipManager


@pytest.fixture
def verl_cache(tmp_path):
    return copy_fixture("cache", tmp_path)


def test_verl_is_not_installed_here():
    assert "verl" not in sys.modules and importlib.util.find_spec("verl") is None


@pytest.mark.parametrize("step", [1, 2])
def test_gen_batch_written_by_verl_replays_exactly(verl_cache, step):
    SkipManager.init(config(verl_cache, allow_pickle=True, action="replay"))
    SkipManager.set_step(step)
    loop = EchoLoop()
    out = loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["x"] * 8}))
    assert loop.calls == 0
    assert isinstance(out, Batch)
    expected = expected_summary(f"gen_batch_step{step}")
    assert comparable(check_load_module().summarise(out)) == comparable(expected)


def test_pickle_entry_is_refused_without_allow_pickle_and_left_untouched(verl_cache):
    data = verl_cache / RUN / "1" / "gen_batch.dp"
    before = data.read_bytes()
    SkipManager.init(config(verl_cache))
    SkipManager.set_step(1)
    loop = EchoLoop()
    with pytest.raises(SkipConfigError) as err:
        loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["x"] * 8}))
    assert "allow_pickle" in str(err.value) and "stepskip convert" in str(err.value)
    SkipManager.flush()
    assert loop.calls == 0
    assert data.read_bytes() == before


def test_record_overwrites_a_verl_entry_with_a_safe_one(verl_cache):
    SkipManager.init(config(verl_cache, action="record"))
    SkipManager.set_step(1)
    loop = EchoLoop()
    loop.generate_sequences(Batch.from_dict(non_tensors={"uid": ["x"] * 8}))
    SkipManager.flush()
    assert loop.calls == 1
    entry = verl_cache / RUN / "1"
    assert sorted(p.name for p in entry.iterdir()) == ["data.json", "data.safetensors", "meta.json"]


def test_tq_batch_written_by_verl_loads_through_the_allow_list(verl_cache):
    from stepskip._formats import get_format

    files = {"tq_batch.pt": (verl_cache / RUN / "3" / "0" / "tq_batch.pt").read_bytes()}
    payload = get_format("verl-tq").decode(files)
    expected = expected_summary("tq_batch_step3")
    assert comparable(check_load_module().summarise(payload)) == comparable(expected)
