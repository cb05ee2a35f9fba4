"""Role options added beyond verl's four: compress, storage_options, and the format name table."""

from __future__ import annotations

import json

import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipConfigError, SkipManager
from stepskip._entries import FORMATS
from stepskip._formats import get_format
from stepskip.testing import make_rollout_batch


class Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        return make_rollout_batch(16, 32, 48, n=4)


@pytest.mark.parametrize("compress", ["auto", "none"])
def test_compress_decides_how_entries_are_written(tmp_path, compress):
    SkipManager.init(training_config(tmp_path, steps=[1], compress=compress))
    SkipManager.set_step(1)
    Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["u"] * 16}))
    tree = json.loads((run_path(tmp_path) / "1" / "data.json").read_text())
    encodings = {node.get("enc") for node in tree["root"]["batch"]["entries"].values()}
    if compress == "none":
        assert encodings == {None}
    else:
        assert {"trim", "concat"} <= encodings
    SkipManager.init(training_config(tmp_path, steps=[1], compress=compress))
    SkipManager.set_step(1)
    replayed = Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["u"] * 16}))
    assert torch.equal(replayed.batch["input_ids"], make_rollout_batch(16, 32, 48, n=4).batch["input_ids"])


@pytest.mark.parametrize("bad", [["endpoint"], "s3", {1: "x"}])
def test_storage_options_must_be_a_mapping_of_names(tmp_path, bad):
    with pytest.raises(SkipConfigError, match="skip.rollout.storage_options"):
        SkipManager.init(training_config(tmp_path, storage_options=bad))


def test_unknown_url_scheme_is_a_startup_error(tmp_path):
    with pytest.raises(SkipConfigError, match="nosuchfs://"):
        SkipManager.init(training_config("nosuchfs://bucket/cache"))


def test_the_light_format_table_agrees_with_the_formats():
    for name, spec in FORMATS.items():
        codec = get_format(name)
        assert (codec.name, codec.uses_pickle, codec.files) == (spec.name, spec.uses_pickle, spec.files)
