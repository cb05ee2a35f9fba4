"""What `format: verl` writes loads in verl 0.9.1's own environment (tensordict 0.10, verl's loaders).

The environment is built by `make verl-env` (part of `make test`) into .venv-verl; set
STEPSKIP_VERL_PYTHON to use another interpreter. Each file is loaded there by
tests/fixtures/verl/check_load.py, which uses `DataProto.load_from_disk` / `torch.load` exactly
as verl's skip code does, and its summary must equal the summary of what we wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from verl_fixtures import FIXTURE_RUN, FIXTURES, check_load_module, comparable

from stepskip._formats import get_format

ROOT = Path(__file__).resolve().parents[3]
RUN = FIXTURE_RUN
VERL_PYTHON = os.environ.get("STEPSKIP_VERL_PYTHON") or str(ROOT / ".venv-verl" / "bin" / "python")

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not shutil.which(VERL_PYTHON) and not os.path.exists(VERL_PYTHON),
                       reason="verl 0.9.1 environment not built (run `make verl-env`)"),
]


def verl_summary(path: Path) -> dict:
    done = subprocess.run([VERL_PYTHON, str(FIXTURES / "check_load.py"), str(path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def fixture_batch():
    fmt = get_format("verl")
    return fmt.decode({"gen_batch.dp": (RUN / "1" / "gen_batch.dp").read_bytes()})


def test_gen_batch_we_write_loads_in_verl(tmp_path):
    batch = fixture_batch()
    fmt = get_format("verl")
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(fmt.encode(fmt.freeze(batch, copy=True))["gen_batch.dp"])
    assert comparable(verl_summary(path)) == comparable(check_load_module().summarise(batch))


def test_gen_batch_with_jagged_tensors_loads_in_verl(tmp_path):
    batch = fixture_batch()
    batch.batch["jagged"] = torch.nested.nested_tensor([torch.arange(i + 1) for i in range(8)], layout=torch.jagged)
    fmt = get_format("verl")
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(fmt.encode(fmt.freeze(batch, copy=True))["gen_batch.dp"])
    assert comparable(verl_summary(path)) == comparable(check_load_module().summarise(batch))


def test_tq_batch_we_write_loads_in_verl(tmp_path):
    fmt = get_format("verl-tq")
    payload = fmt.decode({"tq_batch.pt": (RUN / "3" / "0" / "tq_batch.pt").read_bytes()})
    path = tmp_path / "tq_batch.pt"
    path.write_bytes(fmt.encode(fmt.freeze(payload, copy=True))["tq_batch.pt"])
    assert comparable(verl_summary(path)) == comparable(check_load_module().summarise(payload))
