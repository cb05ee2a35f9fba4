"""stepskip with TRL: a GRPO run recorded once, then trained again with its generation replayed.

Runs on a CPU in well under a minute with nothing downloaded: the model is a 2-layer Llama built
from a config (random weights), the tokenizer a word-level one built in memory, the dataset a few
dozen prompts made of its words, and the reward counts one word. Needs the ``trl`` extra:

    pip install -c constraints.txt -e ".[trl]"
    python examples/trl_grpo.py                  # two runs in a fresh temporary cache
    python examples/trl_grpo.py --cache /tmp/trl_cache --verbose

Run 1 generates every step and records it; run 2 builds the same trainer again and replays those
steps: generation never runs, and with ``restore_rng`` (on by default for TRL) every logged loss is
what run 1 logged. The exit status is 0 only when run 2 replayed every step and matched run 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing below needs the hub; make sure nothing tries
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCABULARY = ["sun", "moon", "star", "sky", "sea", "tree", "stone", "rain", "wind", "fire", "snow", "leaf"]
STEPS = 4


def make_tokenizer():
    """A word-level tokenizer over VOCABULARY, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", *VOCABULARY]
    core = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_model(tokenizer):
    """A tiny causal LM from a config: random weights, the same ones on every run (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(config)


def make_dataset():
    """Distinct three-word prompts."""
    from datasets import Dataset

    n = len(VOCABULARY)
    prompts = [f"{VOCABULARY[i % n]} {VOCABULARY[(i // n + 2) % n]} {VOCABULARY[(3 * i + 1) % n]}" for i in range(24)]
    return Dataset.from_dict({"prompt": prompts})


def says_star(completions, **kwargs):
    """The reward: one point per "star", a little for length."""
    return [text.split().count("star") + 0.05 * len(text.split()) for text in completions]


def train(cache: str, output_dir: str) -> tuple[dict[int, bool], list[float]]:
    """One training run on ``cache``: which steps were replayed, and the logged losses."""
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from stepskip.integrations.trl import enable_stepskip

    tokenizer = make_tokenizer()
    args = GRPOConfig(output_dir=output_dir, use_cpu=True, bf16=False, seed=7, max_steps=STEPS,
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      learning_rate=5e-3, logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                      dataloader_num_workers=0)
    trainer = GRPOTrainer(model=make_model(tokenizer), args=args, reward_funcs=says_star,
                          train_dataset=make_dataset(), processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # this script prints its own summary of each step
    # The two lines that matter: record steps 1..STEPS on the first run, replay them on later ones.
    state = enable_stepskip(trainer, skip={"enable": True, "dump_dir": cache, "steps": f"1-{STEPS}"})
    trainer.train()
    replayed = {call.step: call.hit for call in state.calls}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return replayed, losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", help="the dump dir to record into and replay from (default: a temporary one)")
    parser.add_argument("--verbose", action="store_true", help="show stepskip's hit, miss and dump log lines")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices of transformers' own calls
    if args.verbose:
        logging.getLogger("stepskip").setLevel(logging.INFO)

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="stepskip-trl-") as tmp:
        cache = args.cache or os.path.join(tmp, "cache")
        print(f"cache: {cache}")
        runs = []
        for run, what in ((1, "record"), (2, "replay")):
            replayed, losses = train(cache, os.path.join(tmp, f"run{run}"))
            print(f"run {run} ({what}):")
            for (step, hit), loss in zip(sorted(replayed.items()), losses):
                print(f"  step {step}: {'replayed ' if hit else 'generated'}  loss {loss:+.6f}")
            runs.append((replayed, losses))
        (_, first_losses), (second, second_losses) = runs
        all_replayed = sorted(second) == list(range(1, STEPS + 1)) and all(second.values())
        same = first_losses == second_losses
        print(f"run 2 replayed every step: {'yes' if all_replayed else 'no'}; "
              f"losses equal to run 1's: {'yes' if same else 'no'}")
    return 0 if all_replayed and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
