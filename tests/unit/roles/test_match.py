"""``action: match``: each prompt group's recorded responses replayed wherever they were recorded;
the function called once, with only the groups never recorded."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipConfigError, SkipManager

N = 2  # samples per prompt (a GRPO group)
PROMPT_POOL = 40


def prompts_for(ids: list[int], epoch: str) -> Batch:
    """verl-style prompts: each prompt repeated N times (interleaved), fresh uids every run."""
    rows = [i for i in ids for _ in range(N)]
    tokens = torch.tensor([[i, i + 1, i + 2] for i in rows])
    return Batch.from_dict(
        tensors={"input_ids": tokens, "attention_mask": torch.ones_like(tokens)},
        non_tensors={"uid": [f"{epoch}-{i}" for i in rows],
                     "raw_prompt": [[{"role": "user", "content": f"question {i}"}] for i in rows]},
    )


class Rollout:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.seen: list[list[int]] = []

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        ids = prompts.batch["input_ids"][:, 0].tolist()
        self.seen.append(ids)
        noise = torch.randint(0, 1000, (len(ids), 1), generator=self.generator)
        responses = torch.cat([prompts.batch["input_ids"] * 100, noise], dim=1)  # depends on the prompt and luck
        return Batch.from_dict(tensors={"responses": responses},
                               non_tensors={"uid": list(prompts.non_tensor_batch["uid"])})


def shuffled(seed: int) -> list[int]:
    return list(np.random.default_rng(seed).permutation(PROMPT_POOL))


def config(tmp_path, **fields):
    return training_config(tmp_path, steps="all", action="match", **fields)


def record_call(tmp_path, rollout: Rollout, step: int, ids: list[int], epoch: str = "rec") -> None:
    """One run recording one call of ``rollout`` over the prompts ``ids`` at ``step``."""
    SkipManager.init(config(tmp_path))
    SkipManager.set_step(step)
    rollout.generate_sequences(prompts_for(ids, epoch))
    SkipManager.flush()
    SkipManager.reset()


def run(tmp_path, batch_prompts: int, order: list[int], steps: int, seed: int, epoch: str, **fields):
    """A run over ``order`` in batches of ``batch_prompts``; returns (rollout, {prompt id: response rows})."""
    SkipManager.init(config(tmp_path, **fields))
    rollout = Rollout(seed)
    answers: dict[int, list[list[int]]] = {}
    for step in range(1, steps + 1):
        SkipManager.set_step(step)
        ids = order[(step - 1) * batch_prompts: step * batch_prompts]
        live = prompts_for(ids, epoch)
        out = rollout.generate_sequences(live)
        assert out.non_tensor_batch["uid"].tolist() == live.non_tensor_batch["uid"].tolist()  # live identities
        assert out.batch["responses"][:, 0].tolist() == [i * 100 for i in ids for _ in range(N)]  # live row order
        for row, prompt in enumerate(i for i in ids for _ in range(N)):
            answers.setdefault(prompt, []).append(out.batch["responses"][row].tolist())
    SkipManager.flush()
    return rollout, answers


@pytest.mark.parametrize("batch_prompts", [4, 16])
def test_another_batch_size_and_order_replays_exactly_what_was_recorded(tmp_path, batch_prompts):
    """Recorded in batches of 8 with shuffle seed 1; run in batches of 4 (and 16) with shuffle seed 2."""
    recorder, recorded = run(tmp_path, batch_prompts=8, order=shuffled(1), steps=3, seed=0, epoch="a")
    assert len(recorder.seen) == 3 and len(recorded) == 24
    later_order = shuffled(2)
    steps = 32 // batch_prompts
    replayer, replayed = run(tmp_path, batch_prompts=batch_prompts, order=later_order, steps=steps, seed=99,
                             epoch="b")
    wanted = later_order[:steps * batch_prompts]
    missing = [p for p in wanted if p not in recorded]
    assert missing and len(missing) < len(wanted)  # both paths: replayed groups and generated ones
    # the function saw exactly the missing groups, in live order, each once per sample
    seen = [p for call in replayer.seen for p in call[::N]]
    assert seen == missing
    for prompt in wanted:
        if prompt in recorded:
            assert replayed[prompt] == recorded[prompt]  # the recorded responses of this very prompt
    stats = SkipManager.stats()
    assert stats["skip/rollout/rows_replayed"] == N * (len(wanted) - len(missing))
    assert stats["skip/rollout/rows_generated"] == N * len(missing)


def test_a_run_whose_prompts_were_all_recorded_never_generates(tmp_path):
    order = shuffled(3)
    run(tmp_path, batch_prompts=4, order=order, steps=4, seed=0, epoch="a")
    replayer, _ = run(tmp_path, batch_prompts=8, order=list(reversed(order[:16])), steps=2, seed=5, epoch="b")
    assert replayer.seen == []
    assert SkipManager.stats()["skip/rollout/hits"] == 2


def test_newly_generated_groups_are_recorded_and_earlier_ones_kept(tmp_path):
    run(tmp_path, batch_prompts=2, order=[1, 2], steps=1, seed=0, epoch="a")
    # step 1 again with one old and one new prompt: the entry of step 1 keeps prompt 2's rows
    run(tmp_path, batch_prompts=2, order=[1, 3], steps=1, seed=0, epoch="b")
    meta = json.loads((run_path(tmp_path) / "1" / "meta.json").read_text())
    assert len(meta["row_prompts"]) == 3 * N
    replayer, _ = run(tmp_path, batch_prompts=3, order=[3, 2, 1], steps=1, seed=7, epoch="c")
    assert replayer.seen == []


def test_a_different_sample_count_cycles_or_is_missing_when_strict(tmp_path):
    run(tmp_path, batch_prompts=2, order=[5, 6], steps=1, seed=0, epoch="a")
    global N
    saved, N = N, 3
    try:
        cyclic, _ = run(tmp_path, batch_prompts=2, order=[5, 6], steps=1, seed=0, epoch="b")
        assert cyclic.seen == []
        strict, _ = run(tmp_path, batch_prompts=2, order=[5, 6], steps=1, seed=0, epoch="c", match_n="strict")
        assert [ids[::3] for ids in strict.seen] == [[5, 6]]
    finally:
        N = saved


def test_match_is_refused_where_rows_do_not_map_to_prompts(tmp_path):
    cfg = training_config(tmp_path, role="reward", kind="stage", action="match")
    with pytest.raises(SkipConfigError, match="row_wise"):
        SkipManager.init(cfg)
    cfg = training_config(tmp_path, role="async_rollout", action="match")
    with pytest.raises(ValueError, match="Unsupported action"):
        SkipManager.init(cfg)


def test_a_row_wise_stage_role_matches_too(tmp_path):
    calls = []

    @SkipManager.annotate(role="reward")
    def score(self, batch):
        calls.append(batch.batch["input_ids"][:, 0].tolist())
        return Batch.from_dict(tensors={"score": batch.batch["input_ids"][:, :1].float() * 0.5})

    for ids in ([1, 2], [2, 3]):
        SkipManager.init(training_config(tmp_path, role="reward", kind="stage", row_wise=True, action="match",
                                         steps="all"))
        SkipManager.set_step(1)
        out = score(None, prompts_for(ids, "x"))
        SkipManager.flush()
        assert out.batch["score"][:, 0].tolist() == [i * 0.5 for i in ids for _ in range(N)]
    assert calls == [[1, 1, 2, 2], [3, 3]]


def test_prompts_recorded_under_another_batch_size_are_found(tmp_path):
    """The batch size is part of the run directory (GBS...): match looks in every run directory of
    the experiment with the same prompt and response lengths."""
    recorder, recorded = run(tmp_path, batch_prompts=4, order=[1, 2, 3, 4], steps=1, seed=0, epoch="a")
    SkipManager.init(config(tmp_path, gbs=2))  # another run directory: GBS2_...
    SkipManager.set_step(1)
    replayer = Rollout(seed=9)
    out = replayer.generate_sequences(prompts_for([4, 9], "b"))
    SkipManager.flush()
    assert [ids[::N] for ids in replayer.seen] == [[9]]
    assert out.batch["responses"][:N].tolist() == recorded[4]
    assert (run_path(tmp_path, gbs=2) / "1" / "meta.json").exists()


def test_a_prompt_recurring_while_its_dump_is_queued_is_replayed(tmp_path, monkeypatch):
    """Background dumps: the second call of the same prompts waits for the queued entry instead of
    generating again. The worker is held until that wait begins, so the entry is still queued then."""
    import threading

    from stepskip._dumping.worker import default_worker

    SkipManager.init(config(tmp_path, async_dump=True))
    skip = SkipManager.skip_instances["rollout"]
    release, running = threading.Event(), threading.Event()
    default_worker().submit(lambda: (running.set(), release.wait(60)))
    assert running.wait(60)
    waited: list[bool] = []
    await_pending = skip.dumper.await_pending

    def waiting_for(path):
        waited.append(os.path.exists(f"{path}/meta.json"))  # not written yet: only queued
        release.set()
        await_pending(path)

    monkeypatch.setattr(skip.dumper, "await_pending", waiting_for)
    rollout = Rollout(seed=0)
    SkipManager.set_step(1)
    first = rollout.generate_sequences(prompts_for([1, 2], "a"))
    SkipManager.set_step(2)
    again = rollout.generate_sequences(prompts_for([2, 1], "b"))
    release.set()
    SkipManager.flush()
    assert waited and not waited[0]  # the second call waited for the queued dump
    assert len(rollout.seen) == 1
    assert again.batch["responses"].tolist() == first.batch["responses"][[2, 3, 0, 1]].tolist()
