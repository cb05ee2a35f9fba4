"""``listed_steps`` on local disk reuses its parsed listing while the run directory is unchanged.

Directory times are set with ``os.utime`` (no sleeping): a directory last changed long ago is
"settled", one changed just now is not.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager


class Loop:
    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts):
        return Batch.from_dict(tensors={"x": torch.ones(2, 3)})


def _recorded(tmp_path, steps):
    SkipManager.init(training_config(tmp_path, steps="all"))
    for step in steps:
        SkipManager.set_step(step)
        Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    SkipManager.reset()
    SkipManager.init(training_config(tmp_path, steps="all", action="repeat"))
    return SkipManager.skip_instances["rollout"]


@pytest.fixture(autouse=True)
def _still_clock(monkeypatch):
    """The reuse clock stands still (a listing never gets too old here) unless a test moves it."""
    from stepskip._reading import listing

    monkeypatch.setattr(listing, "_monotonic", lambda: 1000.0)


def _age(path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _count_listings(monkeypatch, skip) -> list[str]:
    calls: list[str] = []
    original = skip.store.list_dir

    def counted(path, *args, **kwargs):
        calls.append(path)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(skip.store, "list_dir", counted)
    return calls


def test_a_settled_directory_is_listed_once_until_it_changes(tmp_path, monkeypatch):
    skip = _recorded(tmp_path, [1, 3])
    run = run_path(tmp_path)
    _age(run, 60)
    calls = _count_listings(monkeypatch, skip)
    assert skip.listed_steps() == [1, 3] and skip.listed_steps() == [1, 3]
    assert len(calls) == 1
    (run / "5").mkdir()  # a new step: the directory's version changes
    assert skip.listed_steps() == [1, 3, 5] and len(calls) == 2
    _age(run, 60)  # settled again (and a different version): listed once more, then reused
    assert skip.listed_steps() == [1, 3, 5] and skip.listed_steps() == [1, 3, 5] and len(calls) == 3
    os.rmdir(run / "5")
    assert skip.listed_steps() == [1, 3]


def test_a_directory_changed_just_now_is_listed_on_every_call(tmp_path, monkeypatch):
    skip = _recorded(tmp_path, [2])
    _age(run_path(tmp_path), -3600)  # not settled however long the test takes (``_age(run, 0)`` would be after 2 s)
    calls = _count_listings(monkeypatch, skip)
    assert skip.listed_steps() == [2] and skip.listed_steps() == [2]
    assert len(calls) == 2  # its time cannot prove the listing complete yet


def test_repeat_still_validates_the_chosen_entry(tmp_path):
    skip = _recorded(tmp_path, [1, 3])
    run = run_path(tmp_path)
    _age(run, 60)
    assert skip.resolve_load_step(4) == 3
    (run / "3" / "meta.json").write_text("{not json")  # damaged inside: the directory's own version is unchanged
    assert skip.resolve_load_step(4) == 1


def _fixed_version(monkeypatch, skip) -> None:
    """What a FUSE mount with fixed directory times (mountpoint-s3, goofys) reports: one settled version."""
    monkeypatch.setattr(skip.store, "dir_version", lambda path: (1, 2, 0, 0))


@pytest.mark.parametrize("async_dump", [False, True])
def test_a_role_sees_its_own_dumps_where_directory_times_never_change(tmp_path, monkeypatch, async_dump):
    SkipManager.init(training_config(tmp_path, steps="all", action="repeat", async_dump=async_dump))
    skip = SkipManager.skip_instances["rollout"]
    _fixed_version(monkeypatch, skip)
    assert skip.listed_steps() == [] and skip.listed_steps() == []  # listed, then reused
    SkipManager.set_step(1)
    Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))  # a miss: dumped
    SkipManager.flush()  # (the background write, when async, ends the reuse as it finishes)
    assert skip.stats["misses"] == 1 and skip.listed_steps() == [1]
    SkipManager.set_step(2)
    Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))  # step 1 repeated
    assert skip.stats["misses"] == 1 and skip.stats["hits"] == 1


def test_an_mtime_set_back_after_a_change_still_changes_the_version(tmp_path, monkeypatch):
    skip = _recorded(tmp_path, [1])
    run = run_path(tmp_path)
    _age(run, 60)
    calls = _count_listings(monkeypatch, skip)
    assert skip.listed_steps() == [1] and skip.listed_steps() == [1] and len(calls) == 1
    before = os.stat(run)
    (run / "4").mkdir()
    os.utime(run, ns=(before.st_atime_ns, before.st_mtime_ns))  # as rsync -a or touch -r would
    while os.stat(run).st_ctime_ns == before.st_ctime_ns:  # a coarse ctime clock (before Linux 6.13) may not
        os.utime(run, ns=(before.st_atime_ns, before.st_mtime_ns))  # have ticked yet: it does within ~10 ms
    assert os.stat(run).st_mtime_ns == before.st_mtime_ns
    assert skip.listed_steps() == [1, 4]  # the ctime moved: utime cannot set it back


def test_a_reused_listing_is_taken_afresh_after_a_while(tmp_path, monkeypatch):
    from stepskip._reading import listing

    skip = _recorded(tmp_path, [1])
    _fixed_version(monkeypatch, skip)
    now = [1000.0]
    monkeypatch.setattr(listing, "_monotonic", lambda: now[0])
    calls = _count_listings(monkeypatch, skip)
    assert skip.listed_steps() == [1] and len(calls) == 1
    (run_path(tmp_path) / "6").mkdir()  # another writer; the fixed version cannot show it
    now[0] += listing.LISTING_MAX_AGE - 1
    assert skip.listed_steps() == [1] and len(calls) == 1
    now[0] += 2
    assert skip.listed_steps() == [1, 6] and len(calls) == 2


@pytest.mark.parametrize("changed", [False, True])
def test_the_first_call_of_a_run_takes_the_start_up_listing(tmp_path, monkeypatch, changed):
    """The start-up clean-up lists the run directory anyway: a settled directory unchanged since is not
    listed again by the first call; one changed since (a step added by another writer) is."""
    _recorded(tmp_path, [1, 3])
    SkipManager.reset()
    run = run_path(tmp_path)
    _age(run, 60)
    SkipManager.init(training_config(tmp_path, steps="all", action="repeat"))
    skip = SkipManager.skip_instances["rollout"]
    calls = _count_listings(monkeypatch, skip)
    if changed:
        (run / "5").mkdir()
    assert skip.listed_steps() == ([1, 3, 5] if changed else [1, 3])
    assert len(calls) == (1 if changed else 0)


@pytest.mark.parametrize("action", ["repeat", "random"])
def test_a_call_lists_a_changing_directory_once(tmp_path, monkeypatch, action):
    """A call whose directory cannot be reused (changed just now) lists it once: the step its hit was
    decided on is the step it reads, not resolved (and listed) again."""
    _recorded(tmp_path, [2, 4])
    SkipManager.reset()
    SkipManager.init(training_config(tmp_path, steps="all", action=action))
    skip = SkipManager.skip_instances["rollout"]
    _age(run_path(tmp_path), -3600)
    calls = _count_listings(monkeypatch, skip)
    SkipManager.set_step(3)
    out = Loop().generate_sequences(Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    assert out.batch["x"].equal(torch.ones(2, 3))
    assert SkipManager.stats()["skip/rollout/hits"] == 1
    assert len(calls) == 1, calls


def test_the_step_decided_on_is_read_unless_it_went_meanwhile(tmp_path):
    """The read takes the step the decision resolved while that step's entry is there; one removed
    in between is resolved again (the next candidate is read)."""
    import shutil

    skip = _recorded(tmp_path, [2, 4])
    SkipManager.set_step(5)
    assert skip.meet_precondition(5)  # repeat: step 4
    shutil.rmtree(run_path(tmp_path) / "4")
    out = skip.warp_function(5, None, Batch.from_dict(non_tensors={"uid": ["a", "b"]}))
    assert out.batch["x"].equal(torch.ones(2, 3))
    assert SkipManager.stats()["skip/rollout/hits"] == 1
    assert skip.listing.take_resolved(5) is None  # taken by the read


def test_a_listing_in_the_order_of_the_last_reuses_its_steps_and_a_list_changed_in_place_does_not():
    """The names of an unchanged directory come back in the same order: its steps are reused as they
    are. The list the caller passed is not kept: changing it in place and passing it again parses it."""
    from stepskip._reading.listing import StepListing

    listing = StepListing(lambda: None)
    names = ["7", "x", "3", "12"]
    assert listing._parse("/run", names) == [3, 7, 12]
    assert listing._parse("/run", list(names)) == [3, 7, 12]
    names.append("5")
    names.remove("7")
    assert listing._parse("/run", names) == [3, 5, 12]
    assert listing._parse("/other", names) == [3, 5, 12]


def test_parsed_step_names_are_updated_as_a_fresh_parse_would_read_them():
    """A listing that differs from the last one parsed in a few names (another writer's entry, a
    removed one) updates the kept steps; the result is always what parsing every name gives."""
    import random

    from stepskip._layout import Layout
    from stepskip._reading.listing import StepListing

    listing = StepListing(lambda: None)
    rng = random.Random(0)
    names = [str(i) for i in range(300)] + ["03", "x", ".tmp-1", "\u0663"]
    for _ in range(300):
        for _ in range(rng.randrange(0, 5)):
            if rng.random() < 0.5 and names:
                names.pop(rng.randrange(len(names)))
            else:
                names.append(rng.choice([str(rng.randrange(400)), "0" + str(rng.randrange(50)), "y"]))
        names = list(dict.fromkeys(names))
        if rng.random() < 0.05:  # a different listing altogether
            names = [str(i) for i in range(rng.randrange(200))]
        expected = sorted(s for s in map(Layout.parse_step, names) if s is not None)
        assert listing._parse("/run", names) == expected
    assert listing._parse("/other", ["7", "1"]) == [1, 7]
