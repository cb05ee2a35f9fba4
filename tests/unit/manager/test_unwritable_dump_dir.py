"""An existing dump dir this process cannot write is a start-up error for every action that records,
and stays usable for ``action: replay``.

Run as a user without special rights (root writes whatever the mode bits say; see
tests/support/unprivileged.py), against directories made read-only with chmod, as a shared cache is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from unprivileged import as_unprivileged, owned_tmp_dir

from stepskip import Batch, SkipConfigError, SkipManager

WRITING_ACTIONS = ["cache", "repeat", "random", "match", "record"]


class Loop:
    def __init__(self) -> None:
        self.calls = 0

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        self.calls += 1
        return Batch.from_dict(tensors={"responses": prompts["input_ids"] + 100},
                               non_tensors={"uid": list(prompts["uid"])})


def prompts() -> Batch:
    return Batch.from_dict(tensors={"input_ids": torch.arange(6).reshape(2, 3)}, non_tensors={"uid": ["a", "b"]})


def init(dump_dir: Path | str, action: str) -> None:
    SkipManager.init({"skip": {"rollout": {"enable": True, "steps": [1], "dump_dir": str(dump_dir),
                                           "action": action, "async_dump": False}}})


def start_up_errors(dump_dir: Path) -> dict[str, str | None]:
    """Action -> the SkipConfigError SkipManager.init raises for it (None: it started)."""
    found: dict[str, str | None] = {}
    for action in [*WRITING_ACTIONS, "replay"]:
        try:
            init(dump_dir, action)
            found[action] = None
        except SkipConfigError as err:
            found[action] = str(err)
        finally:
            SkipManager.reset()
    return found


def make_read_only(root: Path) -> None:
    for directory, _, _ in os.walk(root):
        os.chmod(directory, 0o555)


def record_then_share_read_only(dump_dir: Path) -> dict[str, Any]:
    """Record step 1, make the whole cache read-only, then start every action on it and replay step 1."""
    init(dump_dir, "cache")
    SkipManager.set_step(1)
    recorded = Loop().generate_sequences(prompts())
    SkipManager.reset()
    make_read_only(dump_dir)
    errors = start_up_errors(dump_dir)
    init(dump_dir, "replay")
    SkipManager.set_step(1)
    loop = Loop()
    replayed = loop.generate_sequences(prompts())
    SkipManager.reset()
    return {"errors": errors, "calls": loop.calls,
            "same": bool(torch.equal(replayed["responses"], recorded["responses"]))}


def assert_refused_for_writing_actions(errors: dict[str, str | None], dump_dir: Path) -> None:
    assert errors["replay"] is None
    for action in WRITING_ACTIONS:
        message = errors[action]
        assert message is not None, f"action {action} started on a read-only dump dir"
        assert f"skip.rollout.dump_dir = {str(dump_dir)!r}" in message
        assert "cannot write" in message and "Permission denied" in message
        assert "set skip.rollout.action = replay" in message  # the way to use it anyway


def test_a_read_only_cache_is_refused_for_recording_and_replays() -> None:
    with owned_tmp_dir() as dump_dir:
        seen = as_unprivileged(lambda: record_then_share_read_only(dump_dir))
        assert_refused_for_writing_actions(seen["errors"], dump_dir)
        assert seen["calls"] == 0 and seen["same"]  # replay served the recorded step without generating


def test_an_empty_read_only_dump_dir_is_refused_for_recording() -> None:
    with owned_tmp_dir() as dump_dir:
        dump_dir.chmod(0o555)
        assert_refused_for_writing_actions(as_unprivileged(lambda: start_up_errors(dump_dir)), dump_dir)


def test_a_writable_dump_dir_and_one_not_created_yet_start(tmp_path: Path) -> None:
    for dump_dir in (tmp_path, tmp_path / "not" / "yet"):
        assert start_up_errors(dump_dir) == dict.fromkeys([*WRITING_ACTIONS, "replay"])
    assert not (tmp_path / "not").exists()  # the check creates nothing
    assert [p.name for p in tmp_path.iterdir()] == []  # and leaves nothing behind


@pytest.mark.parametrize("scheme", ["local://", "file://"])
def test_local_urls_are_checked_too(scheme: str) -> None:
    with owned_tmp_dir() as dump_dir:
        dump_dir.chmod(0o555)

        def started() -> str | None:
            try:
                init(f"{scheme}{dump_dir}", "cache")
            except SkipConfigError as err:
                return str(err)
            finally:
                SkipManager.reset()
            return None

        message = as_unprivileged(started)
        assert message is not None and "cannot write" in message
