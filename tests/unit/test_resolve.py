"""Pure decisions without a disk: which step an action loads, and the V1 remap."""

from __future__ import annotations

import pytest

from stepskip._policies import SkipAction
from stepskip._resolve import load_candidates, remap_v1, resolve_load_step

LISTED = [2, 4, 6, 8]


@pytest.mark.parametrize("action", [SkipAction.CACHE, SkipAction.REPLAY])
def test_exact_actions_try_the_step_alone(action):
    assert list(load_candidates(action, 5, LISTED)) == [5]


@pytest.mark.parametrize("action", [SkipAction.RECORD, SkipAction.EMPTY])
def test_record_never_loads(action):
    assert list(load_candidates(action, 4, LISTED)) == []
    assert resolve_load_step(action, 4, LISTED, is_valid=lambda s: True) == -1


@pytest.mark.parametrize(("step", "expected"), [
    (4, [4, 2, 6, 8]),  # exact first
    (5, [4, 2, 6, 8]),  # then the largest smaller, downwards
    (1, [2, 4, 6, 8]),  # nothing smaller: the smallest larger, upwards
    (9, [8, 6, 4, 2]),
])
def test_repeat_follows_the_seed(step, expected):
    assert list(load_candidates(SkipAction.REPEAT, step, LISTED)) == expected


def test_repeat_takes_the_next_candidate_when_one_is_invalid():
    assert resolve_load_step(SkipAction.REPEAT, 5, LISTED, is_valid=lambda s: s != 4) == 2
    assert resolve_load_step(SkipAction.REPEAT, 5, LISTED, is_valid=lambda s: s > 5) == 6
    assert resolve_load_step(SkipAction.REPEAT, 5, [], is_valid=lambda s: True) == -1


def test_random_is_reproducible_and_draws_every_step_once():
    draws = list(load_candidates(SkipAction.RANDOM, 7, LISTED, seed=3))
    assert sorted(draws) == LISTED
    assert draws == list(load_candidates(SkipAction.RANDOM, 7, list(reversed(LISTED)), seed=3))
    firsts = {next(load_candidates(SkipAction.RANDOM, step, LISTED, seed=0)) for step in range(200)}
    assert firsts == set(LISTED)  # every listed step can be the one replayed


def test_random_skips_invalid_steps_deterministically():
    valid = {4, 8}
    picks = [resolve_load_step(SkipAction.RANDOM, step, LISTED, is_valid=valid.__contains__, seed=1)
             for step in range(50)]
    assert set(picks) == valid
    assert picks == [resolve_load_step(SkipAction.RANDOM, step, LISTED, is_valid=valid.__contains__, seed=1)
                     for step in range(50)]


def test_only_the_candidates_tried_are_validated():
    checked = []

    def is_valid(step):
        checked.append(step)
        return True

    assert resolve_load_step(SkipAction.REPEAT, 5, range(10_000), is_valid) == 5
    assert checked == [5]


@pytest.mark.parametrize("action", [SkipAction.REPEAT, SkipAction.RANDOM])
@pytest.mark.parametrize("step", [0, 5, 6, 41, 99])
def test_an_ordered_listing_gives_the_candidates_of_any_listing(action, step):
    """A listing's steps, sorted without repeats, are taken as they are: the same candidates, in the same
    order, as the same steps given shuffled and repeated; the caller's list is left as it was."""
    import random

    steps = sorted(random.Random(step).sample(range(100), 40))
    shuffled = steps + steps[::3]
    random.Random(1).shuffle(shuffled)
    given = list(steps)
    assert list(load_candidates(action, step, given, seed=3, ordered=True)) == \
        list(load_candidates(action, step, shuffled, seed=3))
    assert given == steps


def test_remap_cycles_groups_and_sessions():
    keys = ["a_0_0", "b_0_0", "a_1_0", "b_1_0", "c_0_0"]
    tags = [{"k": i, "is_prompt": False, "global_steps": 1} for i in range(len(keys))]
    plan = remap_v1(keys, tags, ["x", "y", "z", "w"], n=3, global_steps=9)
    assert (plan.groups, plan.sessions) == (3, 3)
    # groups in order of first appearance: a=[0,2], b=[1,3], c=[4]; prompt 3 cycles back to a
    assert plan.rows == [0, 2, 0, 1, 3, 1, 4, 4, 4, 0, 2, 0]
    assert plan.keys[:4] == ["x_0_0", "x_1_0", "x_2_0", "y_0_0"] and plan.keys[-1] == "w_2_0"
    assert all(t["global_steps"] == t["min_global_steps"] == t["max_global_steps"] == 9 for t in plan.tags)
    assert all("is_prompt" not in t for t in plan.tags)
    assert [t["k"] for t in plan.tags] == plan.rows
    assert tags[0]["global_steps"] == 1 and "is_prompt" in tags[0]  # the recorded tags are not modified


def test_remap_without_n_uses_the_largest_group():
    plan = remap_v1(["a_0_0", "a_1_0", "b_0_0"], [{}, {}, {}], ["x"], n=0, global_steps=1)
    assert plan.sessions == 2 and plan.rows == [0, 1]


def test_remap_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no trajectories"):
        remap_v1([], [], ["x"], n=2, global_steps=1)
    with pytest.raises(ValueError, match="tags"):
        remap_v1(["a_0_0"], [], ["x"], n=2, global_steps=1)
