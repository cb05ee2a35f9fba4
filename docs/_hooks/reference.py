"""The docs site's generated sections: written from the code at build time, so they cannot drift from it.

An mkdocs hook (``hooks:`` in ``mkdocs.yml``). A page asks for a section with a line of its own::

    <!-- generated: config-reference -->

and :func:`on_page_markdown` replaces it with the section's Markdown. The sections:

* ``config-reference`` — every key of ``skip.<role>``: type, default, allowed values and the text of
  the config dataclasses' docstrings (``Args:``), the stage roles' keys, and each role's defaults;
* ``cli-reference`` — every ``stepskip`` command from its typer definition: usage, arguments,
  options, help text and examples;
* ``launcher-usage`` — the verl launcher's own ``--help``;
* ``format-versions`` — the storage formats, and the version and size bound of every file a reader checks;
* ``fingerprint-keys`` — the config keys a run's fingerprint holds by default;
* ``metrics`` — the counters of ``SkipManager.stats()``;
* ``module-map`` — every module of the package with the first line of its docstring.

A field without a description, or a page naming a section that does not exist, fails the build.
The functions also run on their own (the tests call them): ``python docs/_hooks/reference.py NAME``
prints a section.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
if str(SRC) not in sys.path:  # document this checkout's code, whatever else is installed
    sys.path.insert(0, str(SRC))

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->[ \t]*$", re.M)


class DocsBuildError(Exception):
    """A generated section cannot be written: the code lacks what the page needs."""


# --------------------------------------------------------------------------- docstrings


def _args_section(doc: str | None) -> dict[str, str]:
    """``name: text`` items of a Google-style ``Args:`` block, continuation lines joined."""
    out: dict[str, str] = {}
    if not doc:
        return out
    lines = inspect.cleandoc(doc).splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Args:")
    except StopIteration:
        return out
    item_indent: int | None = None
    name = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent == 0:
            break  # the next section (Example:, Returns: ...)
        if item_indent is None:
            item_indent = indent
        match = re.match(r"\s*(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
        if indent == item_indent and match:
            name = match[1]
            out[name] = match[2].strip()
        elif name is not None:
            out[name] = f"{out[name]} {line.strip()}"
    return out


def _rst_to_md(text: str) -> str:
    """Docstring markup as Markdown: ``x`` and :role:`x` become `x`."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _prose(text: str) -> str:
    """Plain text safe in Markdown: outside `code` spans, < > & are entities and * is literal."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = (parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("*", "\\*"))
    return "".join(parts)


def _cell(text: str) -> str:
    """Text for a table cell: prose, on one line, with its pipes escaped."""
    return _prose(text).replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------------- configuration


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise DocsBuildError(f"field {f.name} has no default")


def _yaml(value: Any) -> str:
    """A default as it is written in a YAML config."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _choices(cls: type, f: dataclasses.Field[Any]) -> list[str]:
    """The values a string-valued key accepts, read from the code that validates it."""
    from stepskip import _policies as policies
    from stepskip._entries import CONFIG_FORMATS

    if f.name == "action":
        return list(cls.allowed_actions)  # type: ignore[attr-defined]
    if f.name == "format":
        return list(CONFIG_FORMATS)
    if f.name == "kind":
        return ["stage"]
    # a key that takes names defaults to a member of its option's enum (declared str, as OmegaConf
    # schemas check a config's values against the declared type)
    default = _default(f)
    if isinstance(default, policies.Choice):
        return [m.value for m in type(default)]
    return []


_TYPE_NAMES = {"list[Any]": "list", "dict[str, Any]": "mapping", "int | None": "int or null",
               "int | str | None": "int, size string or null"}


def _type_name(cls: type, f: dataclasses.Field[Any]) -> str:
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if _choices(cls, f):
        return "str"
    return _TYPE_NAMES.get(annotation, annotation)


def _field_docs(cls: type) -> dict[str, str]:
    """Each field's description: the ``Args:`` of the class and of its bases, the class's own first."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        docs.update(_args_section(klass.__dict__.get("__doc__")))
    return docs


def _field_table(cls: type, names: list[str]) -> list[str]:
    docs = _field_docs(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name in names:
        f = fields[name]
        text = docs.get(name)
        if not text:
            raise DocsBuildError(f"{cls.__module__}.{cls.__qualname__}.{name} has no description: add it to the "
                                 "class docstring's Args: section")
        choices = _choices(cls, f)
        if choices:
            text = f"{text.rstrip('.')}. One of: {', '.join(f'`{c}`' for c in choices)}."
        default = _yaml(_default(f)).replace("|", "\\|")
        rows.append(f"| `{name}` | {_type_name(cls, f)} | `{default}` | {_cell(_rst_to_md(text))} |")
    return rows


def config_classes() -> list[type]:
    """Every role config class the docs describe: the shared base, the stage roles and each role's own."""
    from stepskip.config import SkipRoleConfig, StageSkipConfig
    from stepskip.integrations._trl_config import TrlGenerateConfig
    from stepskip.roles import SKIP_REGISTRY

    classes: list[type] = [SkipRoleConfig, StageSkipConfig]
    for skip_cls in SKIP_REGISTRY.values():
        if skip_cls.config_class not in classes:
            classes.append(skip_cls.config_class)
    if TrlGenerateConfig not in classes:
        classes.append(TrlGenerateConfig)
    return classes


def _roles() -> list[tuple[str, str, type]]:
    """(role, what it caches, config class) of the built-in roles and the integrations' roles."""
    from stepskip.integrations._trl_config import TrlGenerateConfig
    from stepskip.roles import SKIP_REGISTRY

    out = []
    for name, skip_cls in SKIP_REGISTRY.items():
        doc = (inspect.getdoc(skip_cls) or "").split("\n\n")[0].replace("\n", " ")
        out.append((name, doc, skip_cls.config_class))
    if "trl_generate" not in SKIP_REGISTRY:  # registered when stepskip.integrations.trl is imported (needs trl)
        out.append(("trl_generate", "TRL's `GRPOTrainer._generate_single_turn` (registered by "
                    "`stepskip.integrations.trl`).", TrlGenerateConfig))
    return out


#: Modules whose classes are imported from a public module by users.
_PUBLIC_MODULES = {"stepskip.integrations._trl_config": "stepskip.integrations.trl"}


def _public_name(cls: type) -> str:
    return f"{_PUBLIC_MODULES.get(cls.__module__, cls.__module__)}.{cls.__qualname__}"


def config_reference() -> str:
    """The ``skip.<role>`` keys, generated from the config dataclasses."""
    from stepskip.config import SkipRoleConfig, StageSkipConfig

    shared = [f.name for f in dataclasses.fields(SkipRoleConfig) if f.init]
    stage_only = [f.name for f in dataclasses.fields(StageSkipConfig) if f.init and f.name not in shared]
    out = ["### Keys of every role", "",
           f"Generated from `{SkipRoleConfig.__module__}.{SkipRoleConfig.__qualname__}`.", ""]
    out += _field_table(SkipRoleConfig, shared)
    out += ["", "### Stage roles (`kind: stage`)", "",
            "A section under a name no registered role has declares a generic stage role with `kind: stage`; "
            f"it takes every key above and these (`{StageSkipConfig.__module__}.{StageSkipConfig.__qualname__}`):",
            ""]
    out += _field_table(StageSkipConfig, stage_only)
    out += ["", "### Roles and their defaults", "",
            "Each role reads its section with its own config class; where a class changes a default, the "
            "table says so.", "",
            "| role | what it caches | config class | defaults that differ |", "|---|---|---|---|"]
    base = {f.name: _default(f) for f in dataclasses.fields(SkipRoleConfig)}
    for name, doc, cls in _roles():
        differ = [f"`{f.name}: {_yaml(_default(f))}`" for f in dataclasses.fields(cls)
                  if f.name in base and _default(f) != base[f.name]]
        out.append(f"| `{name}` | {_cell(_rst_to_md(doc))} | `{_public_name(cls)}` | "
                   f"{', '.join(differ) or '—'} |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- command line


def _clean_help(text: str) -> tuple[list[str], list[str]]:
    """A command's docstring as (paragraphs, example lines), rich markup removed."""
    text = inspect.cleandoc(text or "")
    paragraphs, examples = [], []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if lines and re.sub(r"\[/?[a-z ]*\]", "", lines[0]).strip() == "Examples":
            examples += [line.strip() for line in lines[1:] if line.strip()]
            continue
        paragraphs.append(_prose(_rst_to_md(" ".join(line.strip() for line in lines))))
    return [p for p in paragraphs if p], examples


def _param_type(param: Any) -> str:
    """What an option takes: a flag, one of a few values, a metavar or the annotation's type."""
    if getattr(param, "is_flag", False):
        return "flag"
    descriptor = getattr(param, "type_descriptor", None)
    annotation = getattr(descriptor, "annotation", None)
    if annotation is None and hasattr(param, "type"):  # a plain click parameter
        annotation = getattr(param.type, "choices", None) and enum.Enum("Choice", {c: c for c in param.type.choices})
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value}`" for m in annotation)
    if param.metavar:
        return f"`{param.metavar}`"
    args = getattr(annotation, "__args__", None)
    if args:  # list[str] of a repeatable option
        annotation = args[0]
    return {int: "int", str: "text", float: "number"}.get(annotation, getattr(annotation, "__name__", "text"))


def _param_default(param: Any) -> str:
    default = param.default
    if default is None or (getattr(param, "is_flag", False) and default is False) or default == ():
        return "—"
    if isinstance(default, enum.Enum):
        default = default.value
    return f"`{default}`"


def _command_section(name: str, command: Any, parent: Any) -> list[str]:
    ctx = command.context_class(command, info_name=name, parent=parent)
    paragraphs, examples = _clean_help(command.help or "")
    pieces = " ".join(command.collect_usage_pieces(ctx))
    out = [f"### `stepskip {name}`", "", *sum(([p, ""] for p in paragraphs), []),
           "```text", f"stepskip {name} {pieces}".rstrip(), "```", ""]
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [p for p in command.params if p.param_type_name == "option" and p.name != "help"]
    if arguments:
        out += ["| argument | required | default | description |", "|---|---|---|---|"]
        for p in arguments:
            out.append(f"| `{p.metavar or p.name.upper()}` | "
                       f"{'yes' if p.required else 'no'} | {_param_default(p)} | "
                       f"{_cell(getattr(p, 'help', None) or '')} |")
        out.append("")
    if options:
        out += ["| option | value | default | description |", "|---|---|---|---|"]
        for p in options:
            names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
            value = _param_type(p) + (" (repeatable)" if p.multiple else "")
            out.append(f"| {names} | {value} | {_param_default(p)} | {_cell(p.help or '')} |")
        out.append("")
    if examples:
        out += ["Examples:", "", "```text", *examples, "```", ""]
    return out


def cli_reference() -> str:
    """Every ``stepskip`` command, generated from the typer definitions in ``stepskip.cli``."""
    import typer.main

    from stepskip.cli.app import app

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="stepskip")
    paragraphs, _ = _clean_help(group.help or "")
    out = ["### Global options", "", *sum(([p, ""] for p in paragraphs), []),
           "```text", f"stepskip {' '.join(group.collect_usage_pieces(root))}", "```", "",
           "| option | description |", "|---|---|"]
    for p in group.params:
        if p.param_type_name == "option":
            out.append(f"| {', '.join(f'`{o}`' for o in p.opts)} | {_cell(p.help or '')} |")
    out.append("")
    for name in group.list_commands(root):  # type: ignore[attr-defined]
        out += _command_section(name, group.get_command(root, name), root)  # type: ignore[attr-defined]
    return "\n".join(out)


def command_names() -> list[str]:
    """The names of the ``stepskip`` commands, as the command line defines them."""
    import typer.main

    from stepskip.cli.app import app

    group = typer.main.get_command(app)
    return list(group.list_commands(group.context_class(group)))  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- the rest


def launcher_usage() -> str:
    """``python -m stepskip.integrations.verl --help``, as the launcher prints it."""
    from stepskip.integrations.verl.__main__ import USAGE

    return "```text\n" + USAGE.rstrip() + "\n```\n"


def module_map() -> str:
    """Every module of ``src/stepskip`` with the first line of its docstring, package by package."""
    package = SRC / "stepskip"
    out = ["| module | what it does |", "|---|---|"]
    for path in sorted(package.rglob("*.py"), key=lambda p: p.relative_to(package).parts):
        if path.name == "_version.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not doc:
            raise DocsBuildError(f"{path.relative_to(ROOT)} has no module docstring")
        first = " ".join(doc.split("\n\n")[0].split())
        rel = path.relative_to(SRC).as_posix()
        out.append(f"| `{rel}` | {_cell(_rst_to_md(first))} |")
    return "\n".join(out) + "\n"


def _module_constants(relative: str) -> dict[str, Any]:
    """The module-level constants of a module, read from its source (no import: the codecs import torch)."""
    tree = ast.parse((SRC / relative).read_text(encoding="utf-8"))
    found: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if isinstance(node.value, ast.Constant):
                found[name] = node.value.value
            elif isinstance(node.value, ast.Name) and node.value.id in found:
                found[name] = found[node.value.id]
    return found


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} bytes"


def format_versions() -> str:
    """The storage formats and every versioned file of a cache, with the versions and bounds readers hold."""
    from stepskip import _manifest as manifest
    from stepskip._matching import hints
    from stepskip._storage import meta as store
    from stepskip._entries import FORMATS

    safe = _module_constants("stepskip/_formats/safe.py")
    out = ["| `format` in meta.json | selected by `format:` | written for | pickle | data files |",
           "|---|---|---|---|---|"]
    for spec in FORMATS.values():
        out.append(f"| `{spec.name}` | `{spec.option}` | {'V1 inner entries' if spec.v1 else 'entries'} | "
                   f"{'yes' if spec.uses_pickle else 'no'} | {', '.join(f'`{f}`' for f in spec.files)} |")
    tree_versions = {safe["VERSION"]: "plain trees", safe["ROWS_VERSION"]: "packed ragged number rows",
                     safe["INLINE_VERSION"]: "trimmed tensors of few rows with inline runs",
                     safe["SHARED_VERSION"]: "object columns whose rows share items"}
    if max(tree_versions) != safe["READ_VERSION"]:
        raise DocsBuildError("stepskip/_formats/safe.py reads a data.json version the docs do not describe")
    out += ["", "| file | version field | versions this stepskip reads | size bound |", "|---|---|---|---|",
            f"| `meta.json` | — | — | {_size(store.META_MAX_BYTES)} |",
            f"| `data.json` (`format: safe`) | `version` | 1 to {safe['READ_VERSION']} "
            f"({'; '.join(f'{v}: {what}' for v, what in sorted(tree_versions.items()))}) | read for the size "
            "`meta.json` records |",
            f"| `step.json` (V1 step manifest) | `stepskip_manifest` | {manifest.MANIFEST_VERSION} | "
            f"{_size(manifest.MANIFEST_MAX_BYTES)} |",
            f"| `.stepskip-index/*{hints.TABLE_SUFFIX}` (digest table) | header magic "
            f"`{hints.TABLE_MAGIC.decode()}` and version | {hints.TABLE_VERSION} | {_size(hints.TABLE_MAX_BYTES)} |",
            f"| `.stepskip-index/*.json` (hint document) | `stepskip_hints` | {hints.HINTS_VERSION} | "
            f"{_size(hints.HINTS_MAX_BYTES)} |",
            "", f"A V1 step holds at most {store.MAX_INNER_ENTRIES} inner entries."]
    return "\n".join(out) + "\n"


def metrics() -> str:
    """The counters of ``SkipManager.stats()``, as the stats module names them."""
    from stepskip._stats import STAT_NAMES
    from stepskip._reading.layers import REPLAY_FROM_COUNTER, source_counter

    return ("Counters, per role: " + ", ".join(f"`{name}`" for name in STAT_NAMES) + "; a role with layered caches "
            f"adds `{source_counter(0)}`, `{source_counter(1)}` ... (hits read from each of its `sources`) and "
            f"`{REPLAY_FROM_COUNTER}` (hits read from its `replay_from` run).\n")


def fingerprint_keys() -> str:
    """The config keys of verl's whose values make up a run's fingerprint by default."""
    from stepskip._identity import VERL_FINGERPRINT_KEYS

    return "\n".join(f"- `{key}`" for key in VERL_FINGERPRINT_KEYS) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "fingerprint-keys": fingerprint_keys,
    "metrics": metrics,
    "format-versions": format_versions,
    "config-reference": config_reference,
    "cli-reference": cli_reference,
    "launcher-usage": launcher_usage,
    "module-map": module_map,
}


def expand(markdown: str, where: str = "page") -> str:
    """``markdown`` with every ``<!-- generated: NAME -->`` line replaced by its section."""

    def section(match: re.Match[str]) -> str:
        name = match[1]
        if name not in GENERATORS:
            raise DocsBuildError(f"{where} asks for the generated section {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    return MARKER.sub(section, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    """The mkdocs hook: expand the generated sections of a page."""
    from mkdocs.exceptions import PluginError

    try:
        return expand(markdown, page.file.src_uri)
    except DocsBuildError as err:
        raise PluginError(str(err)) from None


if __name__ == "__main__":
    print(GENERATORS[sys.argv[1]]())
