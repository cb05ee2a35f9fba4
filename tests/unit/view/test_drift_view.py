"""A step that ``action: compare`` compared carries its drift record in the view's data and in a report;
drift records are read as files someone else may have written."""

from __future__ import annotations

import json

import pytest
from skip_configs import run_path, training_config

from stepskip import Batch, SkipManager
from stepskip.testing import make_rollout_batch
from stepskip.view.data import ViewSource
from stepskip.view.server import handle_api

RUN = "exp_proj/GBS4_N2_in8_out6"


class Loop:
    def __init__(self, bump: int) -> None:
        self.bump = bump

    @SkipManager.annotate(role="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        out = make_rollout_batch(8, 16, 24, n=4)
        out.batch["responses"][:, : self.bump] += 1
        return out


@pytest.fixture
def compared(tmp_path):
    """Steps 1 and 2 recorded; step 1 compared with a live rollout that drifted."""
    prompts = Batch.from_dict(non_tensors={"uid": [f"u{i}" for i in range(8)]})
    SkipManager.init(training_config(tmp_path, steps=[1, 2]))
    for step in (1, 2):
        SkipManager.set_step(step)
        Loop(0).generate_sequences(prompts)
    SkipManager.init(training_config(tmp_path, steps=[1], action="compare"))
    SkipManager.set_step(1)
    Loop(10).generate_sequences(prompts)
    SkipManager.reset()
    return tmp_path


def test_the_listing_marks_compared_steps_and_the_page_carries_the_record(compared):
    source = ViewSource(str(compared))
    steps = source.listing()["runs"][0]["roles"][0]["steps"]
    assert [(s["step"], s["compared"]) for s in steps] == [(1, True), (2, False)]
    page = source.step_page(RUN, "rollout", 1)
    [record] = page["drift"]
    assert record["step"] == 1 and record["passed"] is False and record["worst_field"] == "responses"
    examples = record["fields"]["responses"]["examples"]
    assert examples and examples[0]["recorded"] != examples[0]["live"]  # the pair the page puts side by side
    assert source.step_page(RUN, "rollout", 2)["drift"] == []
    status, body = handle_api(source, "/api/step", {"run": [RUN], "role": ["rollout"], "step": ["1"]})
    assert status == 200 and body["drift"][0]["token_match"] == record["token_match"]


def test_a_report_inlines_the_drift_record(compared):
    from stepskip.view.report import build_report

    html = build_report(ViewSource(str(compared)))
    assert '"drift":[{' in html and '"worst_field":"responses"' in html


@pytest.mark.parametrize("planted", [b"not json", b"[1, 2]", b'{"step": "x", "token_match": "high"}',
                                     b"[" * 100_000, b'{"passed": true}' + b" " * 10])
def test_planted_drift_records_are_ignored_or_shown_as_data(compared, planted, tmp_path_factory):
    """A JSON object is shown as the data it is, anything else is passed over; a link is never followed."""
    where = run_path(compared) / ".stepskip-drift"
    (where / "2.json").write_bytes(planted)
    outside = tmp_path_factory.mktemp("outside") / "record.json"
    outside.write_text(json.dumps({"step": 2, "planted": "outside the dump dir"}))
    (where / "2-extra.json").symlink_to(outside)
    try:
        parsed = json.loads(planted)
    except (ValueError, RecursionError):
        parsed = None
    shown = [parsed] if isinstance(parsed, dict) else []
    source = ViewSource(str(compared))
    page = source.step_page(RUN, "rollout", 2)
    assert page["drift"] == shown
    json.dumps(page["drift"])
    from stepskip.cli.render import drift_line

    for record in page["drift"]:
        assert "step" in drift_line(record)  # text rendering never trusts a record's types
    # the same record as a file of the dump dir is read: the link alone kept it out
    (where / "2-extra.json").unlink()
    (where / "2-extra.json").write_bytes(outside.read_bytes())
    assert ViewSource(str(compared)).step_page(RUN, "rollout", 2)["drift"] == [json.loads(outside.read_text()), *shown]


def test_a_record_larger_than_the_bound_is_not_read(compared, monkeypatch):
    import stepskip._drift

    monkeypatch.setattr(stepskip._drift, "MAX_RECORD_BYTES", 64)
    assert ViewSource(str(compared)).step_page(RUN, "rollout", 1)["drift"] == []
