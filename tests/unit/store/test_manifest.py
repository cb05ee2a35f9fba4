"""``stepskip._manifest``: a V1 step manifest is hostile data; whatever its bytes, parsing it either yields a
manifest naming only a recording directory of its step, or raises a typed error."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stepskip._storage import EntryState, EntryStore, LocalBackend
from stepskip._storage.outages import StoreOutage
from stepskip.errors import CorruptEntryError, StoreUnavailableError, UnreadableEntryError
from stepskip._manifest import MANIFEST_MAX_BYTES, StepManifest, is_recording, parse_manifest, resolve_step

GOOD = {"stepskip_manifest": 1, "recording": "rec-0123456789ab", "inner_entries": 2, "run_id": "r",
        "created_unix": 1.0}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


def _check(raw: bytes) -> None:
    try:
        manifest = parse_manifest(raw)
    except (CorruptEntryError, UnreadableEntryError):
        return
    assert is_recording(manifest.recording)
    assert all(is_recording(name) for name in manifest.retired)
    assert 1 <= manifest.inner_entries


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_raise_a_typed_error(raw):
    _check(raw)


@given(st.dictionaries(st.sampled_from(sorted(GOOD) + ["retired", "x"]), json_values, max_size=7))
def test_any_json_object_parses_or_raises_a_typed_error(fields):
    _check(json.dumps({**GOOD, **fields}).encode())


@pytest.mark.parametrize("recording", ["..", ".", "", "/", "/etc/passwd", "../rec-0123456789ab", "rec-0123456789ab/..",
                                       "rec-0123456789ab/0", "rec-0123456789AB", "rec-0123456789a", "0", "meta.json",
                                       "rec-0123456789ab\x00", 7, None, ["rec-0123456789ab"]])
def test_only_a_recording_name_may_be_named(recording):
    with pytest.raises(CorruptEntryError, match="recording"):
        parse_manifest(json.dumps({**GOOD, "recording": recording}).encode())


def test_bounds():
    with pytest.raises(CorruptEntryError, match="more than"):
        parse_manifest(b" " * (MANIFEST_MAX_BYTES + 1))
    with pytest.raises(CorruptEntryError, match="nests too deep"):
        parse_manifest(b"[" * 30_000 + b"]" * 30_000)
    with pytest.raises(UnreadableEntryError, match="version 2"):
        parse_manifest(json.dumps({**GOOD, "stepskip_manifest": 2}).encode())
    manifest = parse_manifest(json.dumps({**GOOD, "retired": {"rec-ffffffffffff": 3}}).encode())
    assert manifest == StepManifest("rec-0123456789ab", 2, "r", 1.0, {"rec-ffffffffffff": 3.0})


def test_a_step_without_a_manifest_resolves_to_itself(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    where = resolve_step(store, str(tmp_path / "1"))
    assert (where.root, where.manifest, where.state) == (str(tmp_path / "1"), None, EntryState.PRESENT)


@pytest.mark.parametrize("fields", [{"created_unix": 10**400}, {"retired": {"rec-ffffffffffff": 10**400}},
                                    {"created_unix": -(10**400)}])
def test_a_huge_integer_time_is_damage_not_an_overflow(fields):
    """math.isfinite(10**400) raises OverflowError; parsing must still raise only the typed error."""
    with pytest.raises(CorruptEntryError):
        parse_manifest(json.dumps({**GOOD, **fields}).encode())


def test_a_huge_integer_time_makes_the_step_damaged_not_a_crash(tmp_path):
    store = EntryStore(LocalBackend(str(tmp_path)))
    step = tmp_path / "1"
    step.mkdir()
    (step / "step.json").write_text(json.dumps({**GOOD, "created_unix": 10**400}))
    assert resolve_step(store, str(step)).state == EntryState.DAMAGED


@pytest.mark.parametrize("name", ["rec-0123456789ab\n", "\nrec-0123456789ab", "rec-0123456789ab\r"])
def test_a_recording_name_with_a_line_break_is_not_a_recording(name):
    assert not is_recording(name)
    with pytest.raises(CorruptEntryError, match="recording"):
        parse_manifest(json.dumps({**GOOD, "recording": name}).encode())


def test_what_a_manifest_lacks_is_named_in_one_message_bounded_in_length():
    manifest = StepManifest("rec-0123456789ab", 4096)
    assert StepManifest("rec-0123456789ab", 3).lacking(iter([2, 0, 7])) == [1]
    lacking = manifest.lacking([0])
    assert lacking == list(range(1, 4096))
    reason = manifest.lacking_reason(lacking)
    assert reason.startswith("step.json names the recording rec-0123456789ab, which lacks inner entries 1, 2,")
    assert reason.endswith(" and 4087 more") and len(reason) < 200


class _Unanswered(LocalBackend):
    """A local directory whose small-file reads do not answer, as an object store's GET of ``step.json``
    that times out (the real-socket cases: tests/integration/storage/test_v1_outages.py)."""

    def read_file(self, path: str, limit: int) -> bytes | None:
        raise StoreOutage(path, TimeoutError("Read timeout on endpoint URL"))


def test_a_manifest_the_store_did_not_answer_for_is_unavailable_not_damaged_and_nothing_is_published(tmp_path):
    from stepskip._manifest import publish_manifest
    from stepskip._reading.classify import EntryStatus, root_state

    step = tmp_path / "1"
    step.mkdir()
    (step / "step.json").write_text(json.dumps(GOOD))
    store = EntryStore(_Unanswered(str(tmp_path)))
    where = resolve_step(store, str(step))
    assert (where.state, where.manifest, root_state(where)) == (EntryState.UNAVAILABLE, None, EntryStatus.UNAVAILABLE)
    assert "did not answer" in where.reason and "Read timeout" in where.reason
    with pytest.raises(StoreUnavailableError):  # the current manifest unseen: nothing it names is retired
        publish_manifest(store, str(step), "rec-ffffffffffff", 0, "r2")
    assert json.loads((step / "step.json").read_text()) == GOOD
