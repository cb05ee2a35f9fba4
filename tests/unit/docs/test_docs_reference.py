"""The docs site's generated references describe the code as it is: every config field, every command
and option, and a build that fails rather than drift when the code lacks what a page needs."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest
from doc_blocks import DOCS, reference_hook

import stepskip.integrations._trl_config  # noqa: F401  (the TRL role's config, without importing TRL)
import stepskip.roles  # noqa: F401  (registers the built-in roles)
from stepskip.config import SkipRoleConfig

hook = reference_hook()


def _config_classes() -> list[type]:
    """Every config dataclass of the package: the base and all its subclasses defined in stepskip."""
    found, todo = [], [SkipRoleConfig]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("stepskip.") and cls not in found:
            found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


def _row(reference: str, key: str) -> str:
    rows = [line for line in reference.splitlines() if line.startswith(f"| `{key}` |")]
    assert rows, f"the configuration reference has no row for {key!r}"
    return rows[0]


def _default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def test_every_config_field_appears_with_its_type_and_default() -> None:
    reference = hook.config_reference()
    shown = {f.name: f for f in dataclasses.fields(SkipRoleConfig)}
    for cls in _config_classes():
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            _key, type_name, default, text = (c.strip() for c in _row(reference, f.name).strip("| ").split(" | ", 3))
            assert type_name and text, f"{cls.__qualname__}.{f.name}"
            base = shown.get(f.name)
            if base is None or _default(base) == _default(f):  # a changed default is in the roles' table
                assert default == f"`{hook._yaml(_default(f))}`", f"{cls.__qualname__}.{f.name}: {default}"


def test_every_role_config_class_is_named_with_the_defaults_it_changes() -> None:
    reference = hook.config_reference()
    for cls in _config_classes():
        if cls.__name__ in ("SkipRoleConfig", "StageSkipConfig"):
            continue
        assert f".{cls.__qualname__}`" in reference, f"{cls.__qualname__} is not in the configuration reference"
    trl_row = _row(reference, "trl_generate")
    assert "stepskip.integrations.trl.TrlGenerateConfig" in trl_row
    assert "`restore_rng: true`" in trl_row and "`rebind_keys: []`" in trl_row


def test_allowed_values_come_from_the_code() -> None:
    reference = hook.config_reference()
    assert all(f"`{action}`" in _row(reference, "action") for action in SkipRoleConfig.allowed_actions)
    assert "`regenerate`" in _row(reference, "on_mismatch") and "`strict`" in _row(reference, "match_n")


def test_a_field_without_a_description_fails_the_build() -> None:
    @dataclass
    class Undocumented(SkipRoleConfig):
        """A role config whose docstring forgets its field.

        Args:
            other: something else.
        """

        newly_added: int = 3

    with pytest.raises(hook.DocsBuildError, match="newly_added has no description"):
        hook._field_table(Undocumented, ["newly_added"])


def test_an_unknown_generated_section_fails_the_build() -> None:
    with pytest.raises(hook.DocsBuildError, match="no-such-section"):
        hook.expand("# page\n\n<!-- generated: no-such-section -->\n", "page.md")


def test_every_command_and_option_appears_in_the_cli_reference() -> None:
    import typer.main

    from stepskip.cli.app import app

    reference = hook.cli_reference()
    group = typer.main.get_command(app)
    ctx = group.context_class(group)
    names = hook.command_names()
    assert {"ls", "info", "verify", "prune", "convert", "show", "demo", "view", "report"} <= set(names)
    for name in names:
        assert f"### `stepskip {name}`" in reference, name
        section = reference.split(f"### `stepskip {name}`", 1)[1].split("\n### ", 1)[0]
        for param in group.get_command(ctx, name).params:
            for opt in param.opts if param.param_type_name == "option" else []:
                assert f"`{opt}`" in section, f"stepskip {name}: {opt} is not documented"
            if param.param_type_name == "argument":
                assert f"`{param.metavar or param.name.upper()}`" in section, f"stepskip {name}: {param.name}"


def test_the_pages_ask_for_every_generated_section() -> None:
    asked = set()
    for page in DOCS.glob("*.md"):
        asked |= set(re.findall(r"^<!-- generated: ([a-z-]+) -->", page.read_text(encoding="utf-8"), re.M))
    assert asked == set(hook.GENERATORS)


def test_the_module_map_lists_every_module() -> None:
    table = hook.module_map()
    for path in (hook.SRC / "stepskip").rglob("*.py"):
        if path.name != "_version.py":
            assert f"| `{path.relative_to(hook.SRC).as_posix()}` |" in table, path
