"""One tiny GRPO training run with the real TRL, for the TRL integration tests and the benchmark.

Everything is built locally (nothing downloaded): a 2-layer ``LlamaConfig`` model, a ``tokenizers``
WordLevel tokenizer wrapped in ``PreTrainedTokenizerFast``, a 32-prompt dataset and a reward that
counts one word. Run as ``python trl_run.py SPEC.json OUT.json`` (or under ``torchrun``); SPEC holds
``skip`` (the role's section, or null for plain TRL), ``args`` (GRPOConfig overrides), ``eval``
(evaluate after training), ``env`` (variables set before the trainer is built: where its
``report_to`` trackers write), ``hidden_size`` and ``destroy`` (destroy the process group at the end, the
trainer released first: see the comment there).
OUT (per rank: ``OUT.rank{r}.json``) gets the log history, how many
times generation really ran, the calls as the integration saw them and the skip stats.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "one", "two", "three", "cat", "dog", "yes", "no"]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def build_model(tokenizer, hidden_size: int = 32):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(config)


def build_dataset(size: int = 32):
    from datasets import Dataset

    n = len(WORDS)  # every prompt differs from every other: (i mod n, i div n) names it
    prompts = [" ".join([WORDS[i % n], WORDS[(i // n + 3) % n], WORDS[(i * 5) % n]][: 2 + i % 2] + ["yes"] * (i % 3))
               for i in range(size)]
    assert len(set(prompts)) == size
    return Dataset.from_dict({"prompt": prompts})


class StandInVLLMGeneration:
    """Stands in for TRL's ``VLLMGeneration`` (vLLM does not run on this machine): counts how often it is
    built, how often weights are moved into it and how often it generates; it "generates" random words."""

    counts = {"constructed": 0, "weight_syncs": 0, "generations": 0}

    def __init__(self, **kwargs):
        import random

        StandInVLLMGeneration.counts["constructed"] += 1
        self.mode = kwargs.get("mode")
        self.max_completion_length = kwargs.get("max_completion_length") or 8
        vocab = kwargs["processing_class"].get_vocab()
        self.word_ids = [vocab[w] for w in WORDS]
        self.eos = kwargs["processing_class"].eos_token_id
        self.rng = random.Random(11)
        self.vllm_client = self

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}

    def sync_weights(self):
        StandInVLLMGeneration.counts["weight_syncs"] += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        StandInVLLMGeneration.counts["generations"] += 1
        completions, logprobs = [], []
        for _ in prompts:
            length = self.rng.randint(1, self.max_completion_length - 1)
            ids = [self.rng.choice(self.word_ids) for _ in range(length)] + [self.eos]
            completions.append(ids)
            logprobs.append([[-1.0 - 0.01 * t] for t in ids])
        return prompts, completions, logprobs, None


def count_blue(completions, **kwargs):
    return [float(text.split().count("blue")) + 0.1 * len(text.split()) for text in completions]


def main(spec_path: str, out_path: str) -> None:
    import torch
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.update(spec.get("env", {}))
    generated = []

    base = GRPOTrainer
    if spec.get("vllm"):
        import trl.trainer.grpo_trainer as grpo_module

        grpo_module.VLLMGeneration = StandInVLLMGeneration
    if spec.get("stepskip_trainer"):
        from stepskip.integrations.trl import StepskipGRPOTrainer

        base = StepskipGRPOTrainer

    class CountingTrainer(base):
        """A user's own subclass: counts the generation calls that really ran."""

        def _generate_single_turn(self, *args, **kwargs):
            generated.append(self.state.global_step + 1)
            return super()._generate_single_turn(*args, **kwargs)

    defaults = dict(output_dir=spec["output_dir"], use_cpu=True, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, max_steps=4, logging_steps=1, report_to=[], save_strategy="no",
                    learning_rate=5e-3, seed=7, temperature=1.0, dataloader_num_workers=0, disable_tqdm=True,
                    per_device_eval_batch_size=4, bf16=False)
    if spec.get("vllm"):
        defaults.update(use_vllm=True, vllm_mode=spec["vllm"])
    defaults.update(spec.get("args", {}))
    tokenizer = build_tokenizer()
    dataset = build_dataset()
    model = build_model(tokenizer, spec.get("hidden_size", 32))
    extra = {"skip": spec["skip"]} if spec.get("stepskip_trainer") else {}
    error = None
    try:
        trainer = CountingTrainer(model=model, args=GRPOConfig(**defaults), reward_funcs=count_blue,
                                  train_dataset=dataset, eval_dataset=dataset.select(range(4)),
                                  processing_class=tokenizer, **extra)
    except Exception as err:  # reported to the test (a refused start-up)
        error = {"type": type(err).__name__, "message": str(err), "mro": [c.__name__ for c in type(err).__mro__]}
        with open(out_path, "w") as f:
            json.dump({"error": error, "vllm": StandInVLLMGeneration.counts, "init_failed": True}, f)
        return
    seen_logs = []
    if spec.get("skip") is not None and not spec.get("stepskip_trainer"):
        from transformers import TrainerCallback

        from stepskip.integrations.trl import enable_stepskip

        enable_stepskip(trainer, skip=spec["skip"])
    if spec.get("skip") is not None:
        from transformers import TrainerCallback

        class Seen(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                seen_logs.append(dict(logs or {}))

        trainer.add_callback(Seen())
    start = time.perf_counter()
    try:
        trainer.train()
        if spec.get("eval"):
            trainer.evaluate()
    except Exception as err:  # reported to the test
        error = {"type": type(err).__name__, "message": str(err),
                 "mro": [c.__name__ for c in type(err).__mro__]}
    seconds = time.perf_counter() - start
    from stepskip import SkipManager

    SkipManager.flush()
    state = getattr(trainer, "stepskip", None)
    result = {
        "log_history": trainer.state.log_history,
        "generated_steps": generated,
        "calls": [vars(c) for c in state.calls] if state is not None else [],
        "stats": SkipManager.stats(),
        "drift": SkipManager.drift("trl_generate") if spec.get("skip") is not None else [],
        "seen_logs": seen_logs,
        "error": error,
        "train_seconds": seconds,
        "vllm": StandInVLLMGeneration.counts,
        "vllm_backend": type(getattr(trainer, "vllm_generation", None)).__name__,
        "engine_plan": getattr(getattr(state, "engine_plan", None), "reason", None),
        "rank": int(trainer.accelerator.process_index),
    }
    rank = int(trainer.accelerator.process_index)
    if int(trainer.accelerator.num_processes) > 1:
        out_path = f"{out_path}.rank{rank}.json"
    with open(out_path, "w") as f:
        json.dump(result, f, default=repr)
    SkipManager.reset()
    if spec.get("destroy"):
        import gc

        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while another still uses them
            # The DDP wrapper accelerate put around the model holds the process group: while the trainer
            # lives, destroy_process_group leaves the group's gloo worker threads running into the
            # interpreter's finalisation. One of them may still be releasing the barrier's work there,
            # and with it the tensors of a TRL all_gather the barrier waited on; taking the GIL during
            # finalisation ends that thread inside a noexcept destructor: "terminate called without an
            # active exception", SIGABRT, in about 1 of 10 runs here (core dumps: ~AsyncAllgatherWork
            # in ~AsyncBarrierWork on a pt_gloo_runloop thread, the main thread in Py_FinalizeEx; torch's
            # teardown, not stepskip's: see pytorch/pytorch#179291). Dropping the trainer first lets
            # destroy_process_group destroy the group and join its threads while Python is fully alive.
            del trainer, state
            gc.collect()
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
