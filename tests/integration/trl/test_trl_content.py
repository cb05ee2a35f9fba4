"""The TRL integration picks up content fingerprints from the trainer itself: ``processing_class`` (its
chat template and tokenizer files), the model's config and, with ``fingerprint_weights``, its weight
files, beside the dataset's own ``_fingerprint``. A real ``GRPOTrainer`` on a tiny local model, built in
this process (no training run: the digests are taken when stepskip starts)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from trl_run import build_dataset, build_model, build_tokenizer, count_blue  # noqa: E402

from stepskip._identity import fingerprint_diff  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tokenizer and a model saved to local directories, as a user's checkpoint is."""
    root = tmp_path_factory.mktemp("trl-content")
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "model")
    build_model(tokenizer).save_pretrained(root / "model")
    return root / "model"


def trainer_for(saved, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, max_steps=1, report_to=[], save_strategy="no",
                      seed=7, dataloader_num_workers=0, disable_tqdm=True, bf16=False)
    return GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(saved), args=args, reward_funcs=count_blue,
                       train_dataset=build_dataset(), processing_class=AutoTokenizer.from_pretrained(saved))


def test_the_trainer_gives_its_tokenizer_template_model_and_dataset(saved, tmp_path):
    from stepskip.integrations.trl import enable_stepskip

    trainer = trainer_for(saved, tmp_path)
    skip = {"enable": True, "dump_dir": str(tmp_path / "cache"), "steps": [1], "fingerprint_weights": True}
    state = enable_stepskip(trainer, skip=skip)
    first = dict(state.role.fingerprint)
    assert "tokenizer.json" in first["content.tokenizer"]["files"]
    assert first["content.chat_template"] != "none"
    assert set(first["content.model_config"]) == {"config.json", "generation_config.json"}
    assert "model.safetensors" in first["content.model_weights"]
    assert first["trl.train_dataset"] == trainer.train_dataset._fingerprint

    trainer.processing_class.chat_template = TEMPLATE + "!"  # changed in code, files untouched
    trainer.model.generation_config.top_k = 7
    second = dict(enable_stepskip(trainer, skip=skip).role.fingerprint)
    assert fingerprint_diff(first, second) == ["tokenizer chat template changed",
                                               "model config generation_config.json changed"]


def test_a_recording_replayed_under_another_template_stops_under_error(saved, tmp_path):
    from stepskip import SkipManager
    from stepskip.errors import FingerprintMismatchError
    from stepskip.integrations.trl import enable_stepskip

    skip = {"enable": True, "dump_dir": str(tmp_path / "cache"), "steps": [1], "on_mismatch": "error"}
    recorder = trainer_for(saved, tmp_path)
    enable_stepskip(recorder, skip=skip)
    recorder.train()
    SkipManager.flush()
    assert SkipManager.stats()["skip/trl_generate/dumps"] >= 1
    replayer = trainer_for(saved, tmp_path)
    replayer.processing_class.chat_template = TEMPLATE + "!"
    enable_stepskip(replayer, skip=skip)
    with pytest.raises(FingerprintMismatchError, match="tokenizer chat template changed"):
        replayer.train()
