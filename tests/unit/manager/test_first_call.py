"""A process's first decorated call pays for nothing ``SkipManager.init`` could do before it."""

from __future__ import annotations

import json
import subprocess
import sys

FIRST_CALLS = """
import json, sys, threading
import torch
from stepskip import SkipManager
from stepskip.testing import make_rollout_batch

result = make_rollout_batch(8, 4, 6, n=2, seed=0)

@SkipManager.annotate(role="rollout")
def generate(prompts):
    return result

SkipManager.init({"skip": {"rollout": {"enable": True, "steps": "all", "dump_dir": sys.argv[1]}}})
after_init = set(sys.modules)
threads = sorted(t.name.split("_")[0] for t in threading.enumerate())
SkipManager.set_step(1)
generate(result)  # a miss, dumped in the background
SkipManager.flush()
generate(result)  # a hit
assert SkipManager.stats()["skip/rollout/hits"] == 1, SkipManager.stats()
print(json.dumps({"imported_by_calls": sorted(set(sys.modules) - after_init), "threads": threads}))
"""


def test_init_imports_the_codec_and_starts_the_threads_a_first_call_would(tmp_path):
    """In a process that uses torch, ``init`` imports the role's codec (and the libraries it reads
    with) and starts the dump worker and the codec pools: the first miss and the first hit import
    no module and wait for no thread to start (on a loaded machine each took milliseconds)."""
    out = subprocess.run([sys.executable, "-c", FIRST_CALLS, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["imported_by_calls"] == [], got
    assert {"stepskip-dump", "stepskip-codec", "stepskip-snapshot"} <= set(got["threads"]), got
