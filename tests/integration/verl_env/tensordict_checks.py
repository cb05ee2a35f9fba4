"""`format: verl` under whichever tensordict this interpreter has (run by test_tensordict_versions.py).

    PYTHONPATH=src python tests/integration/verl_env/tensordict_checks.py

Run twice by the test: with the main suite's interpreter (current tensordict) and with verl 0.9.1's
(.venv-verl, tensordict 0.10.0). Each check prints one JSON line {"check", "ok", "detail"}; the exit
status is 0 even when a check fails (the test reads the lines and reports which failed).

The two tensordict 0.10 regressions it guards against:
1. `torch.load(weights_only=True)` refused tensordict's rebuild functions, so no verl-written
   `gen_batch.dp` / `tq_batch.pt` could be read (and the role regenerated over it);
2. `TensorDict.contiguous()` turned `NonTensorStack` columns into empty TensorDicts, so V1 entries
   written with `format: verl` lost `uid` and the like.
"""

from __future__ import annotations

import importlib.util
import io
import json
import pickle
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensordict
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support"))

from verl_fixtures import FIXTURE_RUN, check_load_module, comparable, expected_summary  # noqa: E402

from stepskip._formats import get_format  # noqa: E402

summarise = check_load_module().summarise
CHECKS: list[Callable[[], str]] = []


def check(fn: Callable[[], str]) -> Callable[[], str]:
    CHECKS.append(fn)
    return fn


def _safe_globals_ids() -> set[int]:
    return {id(g) for g in torch.serialization.get_safe_globals()}


def _v1_fixture() -> dict[str, Any]:
    return get_format("verl-tq").decode({"tq_batch.pt": (FIXTURE_RUN / "3" / "0" / "tq_batch.pt").read_bytes()})


def _v0_fixture(step: int) -> Any:
    return get_format("verl").decode({"gen_batch.dp": (FIXTURE_RUN / str(step) / "gen_batch.dp").read_bytes()})


@check
def verl_written_v0_entries_decode() -> str:
    before = _safe_globals_ids()
    for step in (1, 2):
        got = comparable(summarise(_v0_fixture(step)))
        assert got == comparable(expected_summary(f"gen_batch_step{step}")), f"step {step}: values differ"
    assert _safe_globals_ids() == before, "the load left globals allowed in torch after it returned"
    return "steps 1 and 2 equal verl's own load"


@check
def verl_written_v1_entry_decodes() -> str:
    before = _safe_globals_ids()
    got = comparable(summarise(_v1_fixture()))
    assert got == comparable(expected_summary("tq_batch_step3")), "values differ"
    assert _safe_globals_ids() == before, "the load left globals allowed in torch after it returned"
    return "step 3 equals verl's own load"


@check
def v1_entry_written_here_keeps_non_tensor_columns() -> str:
    payload = _v1_fixture()
    fmt = get_format("verl-tq")
    data = fmt.encode(fmt.freeze(payload, copy=True))["tq_batch.pt"]
    want = comparable(summarise(payload))
    assert want["tensordict"]["non_tensor"]["uid"]["value"], "the fixture has no uid column to lose"
    ours = comparable(summarise(fmt.decode({"tq_batch.pt": data})))
    assert ours == want, f"stepskip's read differs: {ours['tensordict']['non_tensor']}"
    verls = comparable(summarise(torch.load(io.BytesIO(data), weights_only=False)))  # what verl's skip does
    assert verls == want, f"verl's read differs: {verls['tensordict']['non_tensor']}"
    return "uid and messages survive, read by stepskip and by verl's torch.load"


@check
def v0_entry_written_here_keeps_non_tensor_columns() -> str:
    from tensordict import NonTensorStack

    batch = _v0_fixture(1)
    batch.batch["tag"] = NonTensorStack(*[f"row{i}" for i in range(batch.batch.batch_size[0])])
    fmt = get_format("verl")
    data = fmt.encode(fmt.freeze(batch, copy=True))["gen_batch.dp"]
    back = fmt.decode({"gen_batch.dp": data})
    assert back.batch.get("tag").tolist() == [f"row{i}" for i in range(batch.batch.batch_size[0])]
    assert comparable(summarise(back)) == comparable(summarise(batch))
    assert all(isinstance(v, np.ndarray) for v in back.non_tensor_batch.values())
    if importlib.util.find_spec("verl") is None:
        return "a NonTensorStack column in the batch survives"
    verls = pickle.loads(data)  # what verl's DataProto.load_from_disk does; only in verl's own environment
    assert type(verls).__module__ == "verl.protocol"
    assert comparable(summarise(verls)) == comparable(summarise(batch))
    return "a NonTensorStack column in the batch survives, read by stepskip and by verl's unpickling"


@check
def consolidated_batch_is_written_without_a_copy_first() -> str:
    """A verl-written entry loads consolidated (views of one buffer in several dtypes); `convert` encodes it as is."""
    fmt = get_format("verl")
    batch = _v0_fixture(2)
    assert batch.batch.is_consolidated(), "the fixture no longer loads consolidated; this check tests nothing"
    back = fmt.decode(fmt.encode(fmt.freeze(batch, copy=False)))
    assert comparable(summarise(back)) == comparable(summarise(batch))
    jagged = batch.batch.clone()
    jagged["jagged"] = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(8)], layout=torch.jagged)
    batch.batch = jagged.consolidate()
    back = fmt.decode(fmt.encode(fmt.freeze(batch, copy=False)))
    assert comparable(summarise(back)) == comparable(summarise(batch))
    return "step 2, with and without a jagged column"


@check
def concurrent_loads_share_the_allowed_globals() -> str:
    """Loads in many threads at once: none may see the globals withdrawn by another one finishing."""
    data = (FIXTURE_RUN / "3" / "0" / "tq_batch.pt").read_bytes()
    fmt = get_format("verl-tq")
    before = _safe_globals_ids()
    errors: list[str] = []
    start = threading.Barrier(8)

    def reader() -> None:
        start.wait()
        for _ in range(15):
            try:
                fmt.decode({"tq_batch.pt": data})
            except Exception as err:  # noqa: BLE001 - collected and reported by the check
                errors.append(f"{type(err).__name__}: {str(err)[:200]}")

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert _safe_globals_ids() == before, "globals left allowed after the last load"
    return "120 loads in 8 threads"


def main() -> int:
    print(json.dumps({"check": "versions", "ok": True,
                      "detail": f"torch {torch.__version__}, tensordict {tensordict.__version__}"}))
    for fn in CHECKS:
        try:
            detail, ok = fn(), True
        except Exception:  # noqa: BLE001 - one failed check must not hide the others
            detail, ok = traceback.format_exc(limit=6), False
        print(json.dumps({"check": fn.__name__, "ok": ok, "detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
