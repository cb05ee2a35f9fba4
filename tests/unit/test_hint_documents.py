"""The JSON hint documents of ``stepskip._matching.hints`` (``rollout_tq``'s V1 steps; the entry records an
earlier writer kept) are read from data someone else may have written: every ill-typed or unbounded
value makes the whole document refused, never an exception, a recursion or an unbounded allocation."""

from __future__ import annotations

import json
from typing import Any

import pytest

import stepskip._matching.hints as hints_module
from stepskip._matching.hints import HintDocument, parse_hints


@pytest.mark.parametrize("meta, added", [
    ({"global_steps": 1, "run_id": "r", "created_unix": 1.0, "row_prompts": ["a"]}, True),
    ({"global_steps": 1, "run_id": "r", "created_unix": 1.0}, False),  # no row digests: nothing to hint
    ({"global_steps": 1, "run_id": "r", "row_prompts": ["a"]}, False),  # no identity to check it by
    ({"global_steps": 1, "run_id": "r", "created_unix": 1.0, "row_prompts": [None]}, False),
])
def test_a_document_describes_only_what_can_be_checked(meta: dict[str, Any], added: bool) -> None:
    doc = HintDocument("r", "rollout")
    assert doc.add("1", meta) is added
    assert doc.add("../1", dict(meta, row_prompts=["a"], created_unix=1.0)) is False
    hints, problem = parse_hints(doc.to_bytes(), "doc")
    assert not problem and (("1" in hints) is added)


GOOD_ENTRY = {"step": 1, "run_id": "r", "created_unix": 1.5, "rows": [["a", 2]]}


@pytest.mark.parametrize("entries", [
    {"\u0661": GOOD_ENTRY},  # a digit, but not an ASCII one: no step directory's name
    {"1/2": GOOD_ENTRY}, {"": GOOD_ENTRY}, {"1" * 20: GOOD_ENTRY},
    {"1": dict(GOOD_ENTRY, step=True)}, {"1": dict(GOOD_ENTRY, step=1.0)}, {"1": dict(GOOD_ENTRY, step=2**63)},
    {"1": dict(GOOD_ENTRY, created_unix=None)}, {"1": dict(GOOD_ENTRY, created_unix="1.5")},
    {"1": dict(GOOD_ENTRY, run_id=7)}, {"1": dict(GOOD_ENTRY, rows={"a": 2})},
    {"1": dict(GOOD_ENTRY, rows=[["a", 0]])}, {"1": dict(GOOD_ENTRY, rows=[["a", True]])},
    {"1": dict(GOOD_ENTRY, rows=[["a", 2, 3]])}, {"1": dict(GOOD_ENTRY, rows=[["a" * 300, 2]])},
    {"1": dict(GOOD_ENTRY, rows=[["a", 2**20], ["b", 1]])},  # more rows than one entry may have
    {"1": [GOOD_ENTRY]},
])
def test_parse_hints_refuses_every_ill_typed_or_unbounded_value(entries: dict[str, Any]) -> None:
    raw = json.dumps({"stepskip_hints": 1, "entries": entries}).encode()
    hints, problem = parse_hints(raw, "doc")
    assert hints == {} and problem.startswith("doc")


def test_parse_hints_bounds_nesting_and_the_rows_of_a_reader() -> None:
    assert parse_hints(b"[" * 100_000 + b"]" * 100_000, "doc")[1]  # never a RecursionError
    raw = json.dumps({"stepskip_hints": 1, "entries": {"1": GOOD_ENTRY, "2": GOOD_ENTRY}}).encode()
    assert sorted(parse_hints(raw, "doc")[0]) == ["1", "2"]
    assert parse_hints(raw, "doc", max_rows=3) == ({}, "doc describes more than 3 rows")


def test_a_hint_claiming_more_rows_than_a_meta_json_can_list_is_refused():
    raw = json.dumps({"stepskip_hints": 1, "run_id": "x", "role": "rollout",
                      "entries": {"1": {"step": 1, "run_id": "x", "created_unix": 1.0,
                                        "rows": [["a" * 16, hints_module._MAX_ENTRY_ROWS + 1]]}}}).encode()
    hints, problem = parse_hints(raw, "doc")
    assert not hints and "more than" in problem
