"""Pure decisions of the cache: which step an action loads, and how a V1 step is remapped.

No disk, no state: the roles hand in what they listed and validate only the candidate chosen,
so a call costs the same with ten entries as with ten thousand.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from stepskip._policies import SkipAction

__all__ = ["EXACT_ACTIONS", "load_candidates", "resolve_load_step", "V1Remap", "remap_v1"]

#: The actions that load a call's own step or nothing (no listing needed to choose one).
EXACT_ACTIONS = frozenset({SkipAction.CACHE, SkipAction.REPLAY, SkipAction.COMPARE})


def load_candidates(action: SkipAction, step: int, listed: Iterable[int], seed: int = 0,
                    ordered: bool = False) -> Iterator[int]:
    """The steps ``action`` would load for a call at ``step``, best first, among ``listed`` steps.

    The caller validates candidates in order and takes the first valid one; an invalid candidate
    only costs the next one. ``cache``/``replay``/``compare``: ``step`` alone. ``repeat`` (as verl defines it):
    ``step``, then the smaller steps downwards, then the larger ones upwards. ``random``: steps
    drawn reproducibly from ``seed`` and ``step`` without replacement (when every listed step is
    valid, the first draw is uniform over them). ``record``, ``empty`` and ``match`` (which looks
    prompts up, not steps): nothing. ``ordered``: ``listed`` is a sorted list without repeats (a
    listing's steps), taken as it is.

    Example:
        >>> list(load_candidates(SkipAction.REPEAT, 5, [1, 3, 7, 9]))
        [3, 1, 7, 9]
    """
    if action in (SkipAction.RECORD, SkipAction.EMPTY, SkipAction.MATCH):
        return
    if action in EXACT_ACTIONS:
        yield step
        return
    # a listing is sorted already: 2,000 steps sorted again cost ~0.05 ms a call
    steps = listed if ordered and isinstance(listed, list) else sorted(set(listed))
    if action is SkipAction.REPEAT:
        below = bisect.bisect_left(steps, step)  # the steps are sorted: no pass over all of them
        above = below + 1 if below < len(steps) and steps[below] == step else below
        if above > below:
            yield step
        yield from reversed(steps[:below])
        yield from steps[above:]
        return
    rng = random.Random(f"{seed}:{step}")
    pool = list(steps)
    while pool:
        yield pool.pop(rng.randrange(len(pool)))


def resolve_load_step(action: SkipAction, step: int, listed: Iterable[int], is_valid: Callable[[int], bool],
                      seed: int = 0) -> int:
    """The first candidate of :func:`load_candidates` that ``is_valid``; -1 for none.

    Example:
        >>> resolve_load_step(SkipAction.REPEAT, 5, [1, 3, 7], is_valid=lambda s: s != 3)
        1
    """
    for candidate in load_candidates(action, step, listed, seed):
        if is_valid(candidate):
            return candidate
    return -1


@dataclass(frozen=True)
class V1Remap:
    """Where each trajectory of a recorded V1 step goes under the live step's prompt uids.

    Args:
        rows: for each new trajectory, the recorded row it copies.
        keys: the new trajectory keys, ``{uid}_{session}_0``.
        tags: the new trajectory tags (recorded tag, steps set to the live step, ``is_prompt`` dropped).
        groups: how many prompt groups the recorded step holds.
        sessions: trajectories per prompt.
    """

    rows: list[int]
    keys: list[str]
    tags: list[dict[str, Any]]
    groups: int
    sessions: int


def remap_v1(recorded_keys: Sequence[Any], recorded_tags: Sequence[dict[str, Any]], new_prompt_uids: Sequence[str],
             n: int, global_steps: int) -> V1Remap:
    """verl's V1 remap: group trajectories by parent uid, cycle groups and sessions.

    Trajectories are grouped by ``key.split("_")[0]`` (any key order; groups in order of first
    appearance); prompt ``i`` gets group ``i % groups``; session ``s`` in ``[0, n)`` gets
    ``group[s % len(group)]`` (``n <= 0``: the largest group's size).

    Raises:
        ValueError: the recorded step holds no trajectories, or keys and tags differ in length.

    Example:
        >>> plan = remap_v1(["a_0_0", "a_1_0", "b_0_0"], [{}, {}, {}], ["x", "y", "z"], n=2, global_steps=7)
        >>> plan.rows, plan.keys[:3]
        ([0, 1, 2, 2, 0, 1], ['x_0_0', 'x_1_0', 'y_0_0'])
    """
    if len(recorded_keys) != len(recorded_tags):
        raise ValueError(f"{len(recorded_keys)} keys but {len(recorded_tags)} tags")
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(recorded_keys):
        groups.setdefault(str(key).split("_")[0], []).append(index)
    group_list = list(groups.values())
    if not group_list:
        raise ValueError("the recorded step holds no trajectories")
    sessions = n if n > 0 else max(len(g) for g in group_list)
    rows: list[int] = []
    keys: list[str] = []
    tags: list[dict[str, Any]] = []
    for prompt_idx, uid in enumerate(new_prompt_uids):
        group = group_list[prompt_idx % len(group_list)]
        for session in range(sessions):
            row = group[session % len(group)]
            rows.append(row)
            keys.append(f"{uid}_{session}_0")
            tag = dict(recorded_tags[row])
            tag["global_steps"] = tag["min_global_steps"] = tag["max_global_steps"] = global_steps
            tag.pop("is_prompt", None)
            tags.append(tag)
    return V1Remap(rows=rows, keys=keys, tags=tags, groups=len(group_list), sessions=sessions)
