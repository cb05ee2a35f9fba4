"""The README's worked examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from stepskip import SKIP_REGISTRY, Batch, SkipManager

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def python_block(containing: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    return next(b for b in blocks if containing in b)


def test_subclass_route_example(tmp_path):
    namespace: dict = {}
    exec(compile(python_block('@register_skip("ref_log_prob")'), "README", "exec"), namespace)
    try:
        class Worker:
            def __init__(self):
                self.calls = 0

            @SkipManager.annotate(role="ref_log_prob")
            def compute_ref_log_prob(self, prompts):
                self.calls += 1
                return Batch.from_dict(tensors={"ref_log_prob": torch.full((len(prompts), 2), float(self.calls))})

        config = {"skip": {"ref_log_prob": {"enable": True, "steps": [1], "dump_dir": str(tmp_path), "min_rows": 3}}}
        small = Batch.from_dict(tensors={"x": torch.zeros(2, 1)})
        big = Batch.from_dict(tensors={"x": torch.zeros(4, 1)})
        calls = []
        for _run in range(2):  # record, then replay
            SkipManager.init(config)
            SkipManager.set_step(1)
            worker = Worker()
            worker.compute_ref_log_prob(big)
            SkipManager.flush()
            calls.append(worker.calls)
        assert calls == [1, 0]
        worker.compute_ref_log_prob(small)
        assert worker.calls == 1  # below min_rows: the custom precondition says run it
        assert SkipManager.skip_instances["ref_log_prob"].local_config.min_rows == 3
    finally:
        SKIP_REGISTRY.pop("ref_log_prob", None)
