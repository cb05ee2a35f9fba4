"""Headless Chromium (Debian's ``chromium`` package) for the view's browser tests: installed when missing,
driven from the command line (``--dump-dom`` for the rendered page, ``--screenshot`` for a picture).

``--virtual-time-budget`` lets the page run its scripts, fetches and chart drawing before the DOM is
dumped; the page marks ``<body data-ready="1">`` when a view is complete, and the tests check it.
(A module of its own, not conftest.py: several test folders have a conftest.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "view"
#: Virtual milliseconds the page may run before the DOM is dumped (not wall time: nothing waits on a clock).
BUDGET_MS = 20000


def find_chromium() -> str:
    """The chromium binary; installs Debian's package when it is missing (and we may), else skips."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            subprocess.run(["apt-get", "update", "-qq"], env=env, check=True, capture_output=True, timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, check=True,
                           capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as err:
            pytest.skip(f"headless Chromium is not installed and `apt-get install chromium` failed ({err}); "
                        "install Debian's chromium package to run the browser tests")
        if path := shutil.which("chromium"):
            return path
    pytest.skip("headless Chromium is not installed (and cannot be installed here: not root or no apt-get); "
                "install Debian's chromium package to run the browser tests")


class Browser:
    def __init__(self, binary: str, profile: Path) -> None:
        self.binary = binary
        self.profile = profile

    def _run(self, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
        args = [self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--hide-scrollbars", f"--user-data-dir={self.profile}",
                f"--virtual-time-budget={BUDGET_MS}", "--window-size=1280,900", *flags, url]
        return subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)

    def dom(self, url: str, *flags: str) -> Page:
        """The page's DOM after its scripts ran; what the page logged to its console is in ``Page.console``."""
        result = self._run(url, "--dump-dom", "--enable-logging=stderr", "--v=0", *flags)
        assert result.returncode == 0 and result.stdout, result.stderr[-2000:]
        page = Page(result.stdout)
        page.console = [line for line in result.stderr.splitlines() if ":CONSOLE" in line]
        return page

    def screenshot(self, url: str, name: str) -> Path:
        """A PNG of the page, saved as a test artifact under tests/artifacts/view/."""
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        result = self._run(url, f"--screenshot={path}")
        assert result.returncode == 0 and path.exists() and path.stat().st_size > 5000, result.stderr[-2000:]
        return path


class _Node:
    def __init__(self, tag: str, attrs: dict[str, str], parent: _Node | None) -> None:
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: list[_Node] = []
        self.text_parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.text_parts) + "".join(c.text for c in self.children)

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()

    def find_all(self, tag: str | None = None, **attrs: str) -> list[_Node]:
        return [n for n in self.walk() if (tag is None or n.tag == tag)
                and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())]

    def find(self, tag: str | None = None, **attrs: str) -> _Node:
        found = self.find_all(tag, **attrs)
        assert found, f"no <{tag} {attrs}> in the page"
        return found[0]


VOID = {"br", "img", "input", "meta", "link", "hr", "col", "source"}


class Page(HTMLParser):
    """The dumped DOM as a small tree (standard library only)."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.html = html
        #: The console messages of the page (errors, blocked loads and Content-Security-Policy violations).
        self.console: list[str] = []
        self.root = _Node("#root", {}, None)
        self.current = self.root
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = _Node(tag, {k: v or "" for k, v in attrs}, self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_endtag(self, tag: str) -> None:
        node = self.current
        while node is not self.root and node.tag != tag:
            node = node.parent  # type: ignore[assignment]
        if node is not self.root:
            self.current = node.parent  # type: ignore[assignment]

    def handle_data(self, data: str) -> None:
        self.current.text_parts.append(data)

    @property
    def body(self) -> _Node:
        return self.root.find("body")

    def ready(self) -> bool:
        return self.body.attrs.get("data-ready") == "1"

    def table_rows(self, table_id: str) -> list[dict[str, str]]:
        """Cells of a table by their column (``data-col``), one dict per data row."""
        table = self.root.find("table", id=table_id)
        return [{td.attrs.get("data-col", str(i)): td.text for i, td in enumerate(tr.find_all("td"))}
                for tr in table.find_all("tr") if tr.find_all("td")]
