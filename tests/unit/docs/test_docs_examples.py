"""The worked examples of the docs and the README run as written."""

from __future__ import annotations

import torch
from doc_blocks import DOCS, README, block

from stepskip import SKIP_REGISTRY, Batch, SkipManager


def test_subclass_route_example(tmp_path):
    """The custom-role recipe of the docs' "A role of your own": a registered role with a field of its own."""
    namespace: dict = {}
    recipe = block(DOCS / "own-trainer.md", "python", '@register_skip("ref_log_prob")')
    exec(compile(recipe, "own-trainer.md", "exec"), namespace)
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


def test_the_readme_plain_loop_records_then_replays(tmp_path, monkeypatch, capsys):
    """The README's complete plain-loop script: run 1 generates every step, run 2 only the unlisted one."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # its dump dir lands in this test's tmp_path
    script = block(README, "python", "calls.clear()")
    exec(compile(script, "README.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.splitlines() == ["run 1: generated 3 of 3 steps", "run 2: generated 1 of 3 steps"]
    # {mkdtemp}/{experiment}_{project}/{run}/{step}/meta.json: the two listed steps, recorded once
    assert sorted(p.parent.name for p in tmp_path.glob("*/*/*/*/meta.json")) == ["1", "2"]


def test_the_identity_example_names_the_run_directory_it_says(tmp_path):
    """The docs' RunIdentity example: its entries go under the directory its comment names."""
    example = block(DOCS / "own-trainer.md", "python", "RunIdentity(")
    given = '{"skip": {"rollout": {"enable": True, "steps": "all"}}}'
    example = example.replace(given, given.replace('"all"', f'"all", "dump_dir": {str(tmp_path)!r}'))
    assert str(tmp_path) in example, "the example's config changed: update this test's substitution"
    namespace: dict = {}
    exec(compile(example, "own-trainer.md", "exec"), namespace)
    SkipManager.set_step(1)
    namespace["Trainer"]().generate({"prompt_ids": [[1, 2]], "is_eval": True})  # bypassed: nothing recorded
    run_dir = SkipManager.skip_instances["rollout"].project_dump_dir
    assert run_dir.replace("\\", "/").endswith("grpo_math/GBS64_N8_in512_out1024")
