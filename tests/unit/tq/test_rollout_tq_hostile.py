"""rollout_tq under ``cache`` and ``replay`` over inner entries whose decoded payload is no V1 payload:
a crafted safe-format entry (checksums recomputed) whose tags are not mappings, or that lacks its
``keys`` or ``tensordict``. The checksums hold, so only the payload check can tell: the step is
counted corrupt and regenerated under ``cache``; ``replay`` raises ``CorruptEntryError``; no
``TypeError`` or ``KeyError`` reaches the trainer. The V1 harness's agent loop stands in for the
inference servers, which cannot run here."""

from __future__ import annotations

import pytest
from test_rollout_tq import make_config, project_dir
from v1_harness import V1Trainer, rewrite_inner_entry

from stepskip import CorruptEntryError, SkipManager
from stepskip._index import CacheIndex
from stepskip.tq import InProcessTQClient


def tamper(dump_dir, step, change):
    """Rewrite step ``step``'s inner entry 0 with ``change(payload)`` applied, its checksums valid."""
    rewrite_inner_entry(str(project_dir(dump_dir) / str(step) / "0"), change)


def tags_not_mappings(payload):
    payload["tags"] = [5] * len(payload["tags"])


def tags_not_a_list(payload):
    payload["tags"] = 5


def no_keys(payload):
    del payload["keys"]


def no_tensordict(payload):
    del payload["tensordict"]


def fewer_keys(payload):
    payload["keys"] = payload["keys"][:1]


@pytest.mark.parametrize("change", [tags_not_mappings, tags_not_a_list, no_keys, no_tensordict, fewer_keys])
def test_a_payload_that_is_no_v1_payload_is_damage_under_cache_and_replay(tmp_path, change):
    V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient()).fit(1)
    SkipManager.reset()
    tamper(tmp_path, 1, change)
    replayer = V1Trainer(make_config(tmp_path, steps=[1], action="replay"), InProcessTQClient())
    with pytest.raises(CorruptEntryError, match="damaged"):
        replayer.fit(1)
    assert replayer.agent_loop.calls == 0
    assert SkipManager.stats()["skip/rollout_tq/corrupt"] >= 1
    SkipManager.reset()
    trainer = V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient())
    trainer.fit(1)  # regenerated: the crafted entry never reaches the trainer
    assert trainer.agent_loop.calls == 1
    assert SkipManager.stats()["skip/rollout_tq/corrupt"] >= 1
    SkipManager.reset()
    again = V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient())
    again.fit(1)
    assert again.agent_loop.calls == 0  # the regenerated step is whole
    SkipManager.reset()


@pytest.mark.parametrize("change", [tags_not_mappings, tags_not_a_list, fewer_keys])
def test_the_cli_reads_such_a_step_as_damaged(tmp_path, change):
    """``stepskip show``/``describe``/``view`` merge a V1 step's inner entries through ``read_step``."""
    V1Trainer(make_config(tmp_path, steps=[1]), InProcessTQClient()).fit(1)
    SkipManager.reset()
    tamper(tmp_path, 1, change)
    index = CacheIndex(str(tmp_path))
    (run,) = index.runs()
    (step,) = run.steps
    with pytest.raises(CorruptEntryError, match="/1/0: "):
        index.read_step(step)
