"""verl-environment side of test_verl_cache_untouched.py: every stepskip run and CLI command over a verl cache.

    PYTHONPATH=src .venv-verl/bin/python tests/integration/verl_real/cache_untouched_side.py CACHE OTHER

CACHE is a copy of the cache verl 0.9.1 wrote (tests/fixtures/verl/cache: V0 steps 1 and 2, V1
step 3). Runs stepskip's ``rollout`` role under every action but ``record`` (the one action meant
to replace entries) with and without ``allow_pickle``, then every command of the ``stepskip`` CLI
(``prune`` only with ``--dry-run``, and ``convert`` onto the cache itself only without ``--overwrite``:
removing and replacing is what those are for). OTHER receives what
``convert`` writes. Prints one JSON object: what each run and command did.

The decorated function is a stand-in for verl's rollout (it returns a fresh DataProto and counts
its calls): a role that decided to regenerate a cached step would call it and dump its result.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from typer.testing import CliRunner
from verl.protocol import DataProto

from stepskip.cli.app import app
from stepskip.errors import SkipConfigError
from stepskip.integrations.verl import install

install()

from verl.utils.skip import SkipManager  # noqa: E402

RUN = "fx_verl/GBS4_N2_in8_out6"
# cache last: its miss at step 4 writes an entry the other actions would then find
ACTIONS = ("repeat", "random", "replay", "cache")


class Rollout:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        self.calls += 1
        rows = len(prompts)
        return DataProto.from_dict(tensors={"responses": torch.zeros(rows, 6, dtype=torch.int64)},
                                   non_tensors={"uid": prompts.non_tensor_batch["uid"]})


def config(cache: str, action: str, allow_pickle: bool) -> Any:
    return OmegaConf.create({
        "trainer": {"experiment_name": "fx", "project_name": "verl", "v1": {"trainer_mode": "sync", "sync": {}}},
        "data": {"train_batch_size": 4, "max_prompt_length": 8, "max_response_length": 6},
        "actor_rollout_ref": {"rollout": {"n": 2}},
        "skip": {"rollout": {"enable": True, "steps": [1, 2, 4], "action": action, "dump_dir": cache,
                             "allow_pickle": allow_pickle, "async_dump": False}},
    })


def run_role(cache: str, action: str, allow_pickle: bool) -> dict[str, Any]:
    prompts = DataProto.from_dict(non_tensors={"uid": np.array([f"u{i // 2}" for i in range(8)], dtype=object)})
    rollout = Rollout()
    outcome: dict[str, Any] = {}
    SkipManager.init(config(cache, action, allow_pickle))
    for step in (1, 2, 4):
        SkipManager.set_step(step)
        try:
            rollout.generate_sequences(prompts)
            outcome[str(step)] = "returned"
        except Exception as err:  # noqa: BLE001 - recorded; the test asserts on the files, not on this
            kind = "config error" if isinstance(err, SkipConfigError) else "error"
            outcome[str(step)] = f"{kind}: {type(err).__name__}: {str(err)[:300]}"
    SkipManager.flush()
    stats = SkipManager.stats()
    SkipManager.reset()
    return {"steps": outcome, "calls": rollout.calls, "hits": stats.get("skip/rollout/hits"),
            "dumps": stats.get("skip/rollout/dumps")}


def cli(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, list(args))
    return {"args": list(args), "exit_code": result.exit_code, "output": result.output[-600:],
            "exception": None if result.exception is None or isinstance(result.exception, SystemExit)
            else repr(result.exception)}


def main() -> None:
    cache, other = sys.argv[1], sys.argv[2]
    run = f"{cache}/{RUN}"
    roles = {f"{action}/allow_pickle={allow}": run_role(cache, action, allow)
             for action in ACTIONS for allow in (True, False)}
    pickle_flags = ([], ["--allow-pickle"])
    commands = [cli("ls", cache), cli("ls", cache, "--json")]
    for flags in pickle_flags:
        commands += [cli("info", run, *flags), cli("verify", cache, *flags), cli("verify", cache, "--deep", *flags),
                     cli("verify", cache, "--repair", "--grace", "0s", *flags),
                     cli("verify", cache, "--repair", "--deep", "--grace", "0s", *flags)]
        for step in ("1", "2", "3"):
            commands += [cli("info", run, "--step", step, *flags), cli("show", run, "--step", step, *flags),
                         cli("show", run, "--step", step, "--json", *flags)]
        for to in ("safe", "verl"):
            commands.append(cli("convert", cache, f"{other}/{to}{len(flags)}", "--to", to, *flags))
            commands.append(cli("convert", cache, cache, "--to", to, *flags))  # onto itself, without --overwrite
    commands += [cli("prune", run, "--keep-last", "0", "--dry-run"),
                 cli("prune", run, "--steps", "1-3", "--dry-run")]
    print(json.dumps({"roles": roles, "commands": commands}))


if __name__ == "__main__":
    main()
