"""A debugging batch's hit looks at its entry once: the probe that decides the hit reads the small
entry whole (one confined walk to it), and the read serves the hit from that, checksums checked."""

from __future__ import annotations

import json

import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip.errors import CorruptEntryError

RESULT = Batch.from_dict(tensors={"logp": torch.randn(100, 256, generator=torch.Generator().manual_seed(0))},
                         non_tensors={"uid": [f"u{i}" for i in range(100)]})


class Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        return RESULT


def _recorded(tmp_path):
    SkipManager.init(training_config(tmp_path, steps="all"))
    SkipManager.set_step(1)
    Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a"]}))
    SkipManager.flush()
    skip = SkipManager.skip_instances["rollout"]
    entry = run_path(tmp_path) / "1"
    size = sum(info["bytes"] for info in json.loads((entry / "meta.json").read_text())["files"].values())
    assert 64 << 10 < size < 256 << 10, size  # a debugging batch's entry: tens of KB to a few hundred
    return skip, entry


def _count_opens(monkeypatch, skip) -> list[str]:
    opened: list[str] = []
    original = skip.store.backend.open_entry

    def counted(path, *args, **kwargs):
        opened.append(path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(skip.store.backend, "open_entry", counted)
    return opened


def test_a_small_entry_is_opened_once_per_hit(tmp_path, monkeypatch):
    skip, entry = _recorded(tmp_path)
    opened = _count_opens(monkeypatch, skip)
    SkipManager.set_step(1)
    out = Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a"]}))
    assert out.batch["logp"].equal(RESULT.batch["logp"])
    assert SkipManager.stats()["skip/rollout/hits"] == 1
    assert opened == [str(entry)], opened


def test_a_small_entry_damaged_after_its_probe_is_still_caught(tmp_path, monkeypatch):
    """The bytes the probe kept are checked against meta.json's checksums when the hit reads them."""
    skip, entry = _recorded(tmp_path)
    data = entry / "data.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))  # the same size: only the checksum tells
    SkipManager.set_step(1)
    assert skip.meet_precondition(1)  # a probe reads no checksum
    with pytest.raises(CorruptEntryError, match="checksum"):
        skip.warp_function(1, None, Batch.from_dict(non_tensors={"uid": ["a"]}))
