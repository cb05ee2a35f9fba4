"""The README and the docs pages hold together: code blocks that compile, configs that validate, links
that lead somewhere, a README short enough to read, and no page naming a document outside the repo.

The docs site's own build (``mkdocs build --strict``, a leg of ``make test``) checks the links between
its pages, their anchors and the navigation; these checks cover what it does not read (the README)
and what it cannot know (that a snippet is valid Python or a valid ``skip`` section).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from doc_blocks import DOCS, README, ROOT, blocks, pages, reference_hook

from stepskip import SkipConfigError, SkipManagerConfig

PAGES = pages()
#: What a page must not name: documents that live outside this repository.
OUTSIDE = [re.compile(p) for p in (r"\bSPEC(\.md)?\b", r"\bNOTES(\.md)?\b", r"\bseed's\b", r"§",
                                   r"\bissue \d+", r"\bthe seed\b(?! of)")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_compiles(page: Path) -> None:
    for i, body in enumerate(blocks(page, "python")):
        compile(body, f"{page.name} python block {i + 1}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_skip_section_shown_is_a_valid_config(page: Path) -> None:
    for body in blocks(page, "yaml"):
        config = yaml.safe_load(body)
        if isinstance(config, dict) and "skip" in config:
            SkipManagerConfig.from_section(config["skip"])  # raises SkipConfigError naming the bad key


def test_the_yaml_check_would_catch_a_bad_key() -> None:
    with pytest.raises(SkipConfigError, match="stepz"):
        SkipManagerConfig.from_section(yaml.safe_load("rollout:\n  enable: true\n  stepz: [1]\n"))


def test_the_readme_is_a_ten_minute_read() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_the_readme_says_how_to_install_without_the_package_index() -> None:
    text = README.read_text(encoding="utf-8")
    assert "not on the package index" in text
    for command in ("pip install torch==2.13.0", "pip install -c constraints.txt -e .", "make demo", "make test"):
        assert command in text, command


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_lead_to_files_of_the_repo(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"
        assert ROOT in path.parents, f"{page.name} links to {target}, outside the repository"


def test_every_docs_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        assert f": {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("page", [*PAGES, *sorted((ROOT / "examples").glob("*"))], ids=lambda p: p.name)
def test_no_page_names_a_document_outside_the_repo(page: Path) -> None:
    text = reference_hook().expand(page.read_text(encoding="utf-8"), page.name)  # generated sections too
    for pattern in OUTSIDE:
        found = pattern.search(text)
        context = text[max(0, found.start() - 80):found.end() + 80] if found else ""
        assert found is None, f"{page.name} names {found.group(0)!r}: {context!r}"


#: The same for code and comments: a ``SPEC`` or ``NOTES`` file, a section sign, a numbered issue.
OUTSIDE_IN_CODE = re.compile(r"\bSPEC(\.md| §)|\bNOTES\.md\b|\bseed's\b|\bseed §|§\d|\bissue \d+")
CODE = [path for folder in ("src", "tests", "benchmarks", "tools", "examples")
        for path in sorted((ROOT / folder).rglob("*")) if path.suffix in (".py", ".yaml", ".toml", ".sh")]


def test_no_source_file_names_a_document_outside_the_repo() -> None:
    own = Path(__file__).resolve()
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path in CODE if path.resolve() != own
             for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if OUTSIDE_IN_CODE.search(line)]
    assert found == [], "code or comments cite a document outside the repo:\n" + "\n".join(found)
