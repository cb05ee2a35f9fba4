"""check_dump_dir: a dump dir the process cannot use is a SkipConfigError naming the key and the fix.

Permission cases run the check as a user without special rights (tests/support/unprivileged.py: root
ignores permissions), so the checks meet the filesystem's real answers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import unprivileged

from stepskip import RunIdentity, SkipConfigError
from stepskip._storage import check_dump_dir
from stepskip._layout import Layout

KEY = "skip.rollout.dump_dir"


def error_of(fn: Callable[[], None]) -> str | None:
    try:
        fn()
    except SkipConfigError as err:
        return str(err)
    return None


def as_unprivileged(fn: Callable[[], None]) -> str | None:
    """The SkipConfigError message ``fn`` raises when run by a user without special rights."""
    return unprivileged.as_unprivileged(lambda: error_of(fn))


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A directory an unprivileged user may pass through (mode 0711), below /tmp."""
    with unprivileged.passable_tmp_dir() as path:
        yield path


def test_usable_dump_dirs_pass(tmp_path: Path) -> None:
    check_dump_dir(str(tmp_path), key=KEY)
    check_dump_dir(str(tmp_path / "not" / "yet"), key=KEY)
    check_dump_dir(f"local://{tmp_path}/dump", key=KEY)
    check_dump_dir(f"file://{tmp_path}/dump", key=KEY)
    check_dump_dir("memory://bucket/dump", key=KEY)
    lay = Layout(str(tmp_path), RunIdentity("exp" * 40, "proj" * 20))
    check_dump_dir(str(tmp_path), key=KEY, entry_dir=lay.project_dir)


def test_an_experiment_name_too_long_for_a_file_name(tmp_path: Path) -> None:
    lay = Layout(str(tmp_path), RunIdentity("e" * 250, "project"))
    message = error_of(lambda: check_dump_dir(str(tmp_path), key=KEY, entry_dir=lay.step_dir(3)))
    assert message and KEY in message and "255" in message and "trainer.experiment_name" in message


def test_multibyte_names_are_measured_in_bytes(tmp_path: Path) -> None:
    lay = Layout(str(tmp_path), RunIdentity("é" * 120, "p"))  # 120 characters, 241 bytes + "_p"
    check_dump_dir(str(tmp_path), key=KEY, entry_dir=lay.project_dir)
    lay = Layout(str(tmp_path), RunIdentity("é" * 130, "p"))  # 261 bytes
    assert error_of(lambda: check_dump_dir(str(tmp_path), key=KEY, entry_dir=lay.project_dir))


def test_a_dump_dir_component_too_long(tmp_path: Path) -> None:
    message = error_of(lambda: check_dump_dir(str(tmp_path / ("d" * 300)), key=KEY))
    assert message and KEY in message and "255" in message


def test_a_dump_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    for path in (tmp_path / "f", tmp_path / "f" / "below"):
        message = error_of(lambda p=path: check_dump_dir(str(p), key=KEY))
        assert message and KEY in message and "is a file" in message


def test_a_dump_dir_the_process_cannot_read(open_tmp: Path) -> None:
    dump = open_tmp / "dump"
    dump.mkdir()
    dump.chmod(0o300 if os.geteuid() != 0 else 0o700)  # root owns it: nobody may not list it
    message = as_unprivileged(lambda: check_dump_dir(str(dump), key=KEY))
    assert message and KEY in message and "cannot list" in message and "chmod" in message


def test_a_dump_dir_below_a_directory_the_process_cannot_enter(open_tmp: Path) -> None:
    closed = open_tmp / "closed"
    closed.mkdir()
    closed.chmod(0o600 if os.geteuid() != 0 else 0o700)
    message = as_unprivileged(lambda: check_dump_dir(str(closed / "dump"), key=KEY))
    assert message and KEY in message


def test_a_dump_dir_that_cannot_be_created(open_tmp: Path) -> None:
    readonly = open_tmp / "ro"
    readonly.mkdir()
    readonly.chmod(0o555)
    message = as_unprivileged(lambda: check_dump_dir(str(readonly / "dump"), key=KEY))
    assert message and KEY in message and "cannot create" in message


def test_a_read_only_dump_dir_is_fine_for_replaying(open_tmp: Path) -> None:
    dump = open_tmp / "shared"
    dump.mkdir()
    dump.chmod(0o555)
    assert as_unprivileged(lambda: check_dump_dir(str(dump), key=KEY)) is None


def test_an_unknown_url_scheme(tmp_path: Path) -> None:
    message = error_of(lambda: check_dump_dir("nosuchfs://bucket/dump", key=KEY))
    assert message and "nosuchfs://" in message
