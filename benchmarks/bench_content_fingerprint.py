"""What content fingerprints add to ``SkipManager.init``: a real tokenizer, a model directory, a big
data file and a git work tree, digested as a verl run's config names them.

Run: .venv/bin/python benchmarks/bench_content_fingerprint.py [--data-mib 200] [--vocab 150000] [--files 500]

Builds in a temporary directory: a ``tokenizers`` WordLevel tokenizer of ``--vocab`` words saved with
``transformers``' ``save_pretrained`` (with a chat template), a model directory (``config.json``,
``generation_config.json`` and a sparse 1 GiB ``model.safetensors``), a ``--data-mib`` training data
file of random bytes, and a git work tree of ``--files`` tracked files the run starts in. Then
times ``SkipManager.init`` on a verl-shaped config naming them (one enabled role), median of
``--tries``: without content digests (an identity without sources), with them, and with
``fingerprint_weights: true``; and each digest alone. The files were just written, so they are in
the page cache: a first start after a reboot reads the sampled windows and the tokenizer from disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import stepskip
from stepskip import SkipManager
from stepskip import _content as content
from stepskip._identity import RunIdentity


def build(root: Path, data_mib: int, vocab: int, files: int) -> dict:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = root / "model"
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i:06d}": i + 3 for i in range(vocab)}}
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                                                   "num_hidden_layers": 32, "vocab_size": vocab + 3}))
    (model / "generation_config.json").write_text(json.dumps({"temperature": 1.0, "top_p": 1.0}))
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(1 << 30)
    data = root / "train.parquet"
    with open(data, "wb") as f:
        for _ in range(data_mib):
            f.write(os.urandom(1 << 20))
    code = root / "code"
    code.mkdir()
    for i in range(files):
        (code / f"module_{i}.py").write_text(f"VALUE = {i}\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "code"]):
        subprocess.run(["git", "-C", str(code), *args], check=True, env=env, capture_output=True)
    tokenizer_bytes = sum(p.stat().st_size for p in model.iterdir() if p.name.startswith(("tokenizer", "special")))
    return {"model": model, "data": data, "code": code, "tokenizer_bytes": tokenizer_bytes}


def median_ms(fn: Callable[[], object], tries: int) -> float:
    times = []
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-mib", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=150_000)
    parser.add_argument("--files", type=int, default=500, help="tracked files of the git work tree")
    parser.add_argument("--tries", type=int, default=15)
    args = parser.parse_args()
    if min(args.data_mib, args.vocab, args.files, args.tries) < 1:
        parser.error("--data-mib, --vocab, --files and --tries must be at least 1")
    with tempfile.TemporaryDirectory(prefix="bench-content-") as tmp:
        root = Path(tmp)
        made = build(root, args.data_mib, args.vocab, args.files)
        os.chdir(made["code"])

        def config(**skip: object) -> dict:
            return {"trainer": {"experiment_name": "bench", "project_name": "content"},
                    "actor_rollout_ref": {"model": {"path": str(made["model"])}, "rollout": {"n": 1}},
                    "data": {"train_files": [str(made["data"])], "train_batch_size": 8},
                    "skip": {"rollout": {"enable": True, "dump_dir": str(root / "dump"), "steps": [1], **skip}}}

        bare = RunIdentity.from_config(config())
        without = RunIdentity(bare.experiment_name, bare.project_name, bare.gbs, bare.n, bare.prompt_len,
                              bare.response_len, bare.fingerprint)
        content._CODE_CACHE.clear()
        start = time.perf_counter()
        first = content.code_revision(made["code"])
        first_git_ms = 1000 * (time.perf_counter() - start)
        assert first is not None and first["dirty"] is False

        def init(identity: RunIdentity | None = None, **skip: object) -> None:
            SkipManager.init(config(**skip), identity=identity)

        init()  # imports and first start-up out of the way
        rows = [
            ("init, no content digests", median_ms(lambda: init(without), args.tries)),
            ("init, content digests (default)", median_ms(init, args.tries)),
            ("init, content digests + fingerprint_weights", median_ms(lambda: init(fingerprint_weights=True),
                                                                        args.tries)),
        ]
        SkipManager.reset()
        sources = RunIdentity.from_config(config()).content
        assert sources is not None
        parts = [
            (f"tokenizer files ({made['tokenizer_bytes'] / 2**20:.1f} MiB) + chat template",
             lambda: content._tokenizer_digests(str(made["model"]), None)),
            ("model config.json + generation_config.json", lambda: content._model_digests(str(made["model"]), None,
                                                                                         False)),
            ("model weights (1 GiB file, sampled)", lambda: content._model_digests(str(made["model"]), None, True)),
            (f"data file ({args.data_mib} MiB, "
             f"{'sampled' if args.data_mib << 20 > content.FULL_HASH_BYTES else 'hashed whole'})",
             lambda: content.file_digest(made["data"])),
            (f"code revision ({args.files} tracked files, unchanged since the last run)",
             lambda: content.code_revision(made["code"])),
            ("all of them, as init reads them", lambda: content.content_digests(sources)),
        ]
        print(f"bench_content_fingerprint: stepskip {stepskip.__version__}, python {sys.version.split()[0]}, "
              f"median of {args.tries}, files in the page cache")
        for name, ms in rows:
            print(f"  {name:<66} {ms:8.2f} ms")
        print(f"  {'added by content digests':<66} {rows[1][1] - rows[0][1]:8.2f} ms")
        print("each digest alone:")
        for name, fn in parts:
            print(f"  {name:<66} {median_ms(fn, args.tries):8.2f} ms")
        print(f"  {'code revision, first read (git ls-files + git status)':<66} {first_git_ms:8.2f} ms")
        os.chdir(root.parent)


if __name__ == "__main__":
    main()
