"""GRPO groups whose rewards are all equal: their advantages are all zero, so they teach the policy nothing.

A group is the rows sharing a ``group`` (verl's ``uid``, a V1 trajectory's prompt); rows without one
are cut into consecutive groups of the run's ``n`` (rollouts per prompt). The view counts such groups
on each step and across the steps of a role.

Example:
    >>> rows = [{"i": 0, "group": "a", "reward": 1.0}, {"i": 1, "group": "a", "reward": 1.0},
    ...         {"i": 2, "group": "b", "reward": 0.0}, {"i": 3, "group": "b", "reward": 1.0}]
    >>> equal_reward_groups(rows)["equal"], equal_reward_groups(rows)["by_value"]
    (1, {'1': 1})
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["MAX_VALUES", "equal_reward_groups", "sum_equal_groups"]

#: Distinct rewards named in ``by_value`` (a hostile or continuous reward column stays a short list).
MAX_VALUES = 8


def _reward(row: Mapping[str, Any]) -> float | None:
    value = row.get("reward")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None
    return float(value)


def _grouped(rows: Sequence[Mapping[str, Any]], n: int | None) -> tuple[list[list[Mapping[str, Any]]], str] | None:
    if rows and all(r.get("group") is not None for r in rows):
        by: dict[str, list[Mapping[str, Any]]] = {}
        for row in rows:
            by.setdefault(str(row["group"]), []).append(row)
        return list(by.values()), "group"
    if n is not None and n > 1 and rows:
        ordered = sorted(rows, key=lambda r: r["i"] if isinstance(r.get("i"), int) else 0)
        return [ordered[k:k + n] for k in range(0, len(ordered), n)], f"consecutive rows ({n} per prompt)"
    return None


def _label(value: float) -> str:
    return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)


def equal_reward_groups(rows: Sequence[Mapping[str, Any]], n: int | None = None) -> dict[str, Any] | None:
    """How many groups of a step have rewards all equal (zero advantage), and at which reward.

    Args:
        rows: the step's rows (``i``, ``group``, ``reward``), as :class:`~stepskip.view.data.StepRows` holds them.
        n: rollouts per prompt, for rows without a group (the run directory's ``N``).

    Returns:
        ``groups`` (scored groups of two rows or more), ``equal`` (those whose rewards are all equal),
        ``fraction``, ``by_value`` (equal groups per shared reward, the most common first, at most
        :data:`MAX_VALUES`), ``unscored`` (groups with a row without a finite reward), ``single``
        (groups of one row) and ``grouped_by``; None when no row has a reward or the rows cannot be grouped.
    """
    if not any(_reward(r) is not None for r in rows):
        return None
    found = _grouped(rows, n)
    if found is None:
        return None
    groups, how = found
    scored = equal = unscored = single = 0
    values: dict[str, int] = {}
    for group in groups:
        rewards = [_reward(r) for r in group]
        if any(v is None for v in rewards):
            unscored += 1
            continue
        if len(group) < 2:
            single += 1
            continue
        scored += 1
        if all(v == rewards[0] for v in rewards):
            equal += 1
            label = _label(float(rewards[0]))  # type: ignore[arg-type]
            values[label] = values.get(label, 0) + 1
    top = sorted(values.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_VALUES]
    return {"groups": scored, "equal": equal, "fraction": equal / scored if scored else None,
            "by_value": dict(top), "unscored": unscored, "single": single, "grouped_by": how}


def sum_equal_groups(counts: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The counts of several steps added up (None when no step had any).

    Example:
        >>> sum_equal_groups([{"groups": 4, "equal": 1}, None, {"groups": 4, "equal": 3}])["fraction"]
        0.5
    """
    present = [c for c in counts if c]
    if not present:
        return None
    groups = sum(int(c.get("groups") or 0) for c in present)
    equal = sum(int(c.get("equal") or 0) for c in present)
    return {"steps": len(present), "groups": groups, "equal": equal, "fraction": equal / groups if groups else None}
