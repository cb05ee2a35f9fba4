"""Content fingerprints from verl's own config: verl 0.9.1 composes its ``ppo_trainer`` config (through
the launcher's ``--cfg job``, which starts nothing) with the model and data paths overridden as a user
does; ``SkipManager.init`` on that config digests the model directory's tokenizer, template and
config, and the data file, under verl's keys."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from stepskip import SkipManager
from stepskip._identity import fingerprint_diff

ROOT = Path(__file__).resolve().parents[3]
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not os.path.exists(VERL_PYTHON),
                       reason="verl 0.9.1 environment not built (run `make verl-env`)"),
]


def test_verls_composed_config_names_what_is_digested(tmp_path):
    from omegaconf import OmegaConf

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (model / "tokenizer.json").write_text(json.dumps({"vocab": {"a": 0}}))
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    data = tmp_path / "train.parquet"
    data.write_bytes(b"d" * 500)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("STEPSKIP_VERL", None)
    cmd = [VERL_PYTHON, "-W", "ignore", "-m", "stepskip.integrations.verl", "verl.trainer.main_ppo",
           "skip.rollout.enable=true", "skip.rollout.steps=[1]", f"skip.rollout.dump_dir={tmp_path / 'dump'}",
           f"actor_rollout_ref.model.path={model}", f"data.train_files=[{data}]", "--cfg", "job"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    config = OmegaConf.create(yaml.safe_load(done.stdout))

    SkipManager.init(config)
    first = dict(SkipManager.skip_instances["rollout"].fingerprint)
    assert first["actor_rollout_ref.model.path"] == str(model)
    assert set(first["content.tokenizer"]["files"]) == {"tokenizer.json", "tokenizer_config.json"}
    assert set(first["content.model_config"]) == {"config.json"}
    assert first["content.data"][str(data)]["size"] == 500

    data.write_bytes(b"e" * 600)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ other }}"}))
    SkipManager.init(config)
    assert fingerprint_diff(first, SkipManager.skip_instances["rollout"].fingerprint) == [
        "tokenizer chat template changed", f"data file {data} changed (size 500 -> 600)"]
