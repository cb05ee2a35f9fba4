"""Headless Chromium (Debian's ``chromium`` package) for the view's browser tests: installed when missing,
driven from the command line (``--dump-dom`` for the rendered page, ``--screenshot`` for a picture).

``--virtual-time-budget`` lets the page run its scripts, fetches and chart drawing before the DOM is
dumped; the page marks ``<body data-ready="1">`` when a view is complete, and the tests check it.
(A module of its own, not conftest.py: several test folders have a conftest.)
"""

from __future__ import annotations

import json
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


class LivePage:
    """One page held open in headless Chromium, driven over the DevTools protocol on a pipe
    (``--remote-debugging-pipe``: commands on fd 3, answers on fd 4, each a JSON text ending in NUL).

    The test changes the cache while the page stays open, then waits for what the page does about it:
    :meth:`wait` evaluates a script that returns a Promise, and returns what it resolves to. Nothing
    here waits on a clock; ``LIMIT_S`` only ends a test whose page never answers.
    """

    LIMIT_S = 120

    def __init__(self, binary: str, profile: Path) -> None:
        import fcntl

        self._commands_r, self._commands_w = os.pipe()
        self._answers_r, self._answers_w = os.pipe()
        ends = (fcntl.fcntl(self._commands_r, fcntl.F_DUPFD, 10), fcntl.fcntl(self._answers_w, fcntl.F_DUPFD, 10))

        def as_fd_3_and_4() -> None:  # in the child, before exec: where Chromium looks for the pipe
            os.dup2(ends[0], 3)
            os.dup2(ends[1], 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", "--window-size=1280,900", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4, *ends), preexec_fn=as_fd_3_and_4)
        for fd in (*ends, self._commands_r, self._answers_w):
            os.close(fd)
        self._buffer = b""
        self._next = 0
        self.events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=self.session)

    def _message(self) -> dict:
        import select

        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._answers_r], [], [], self.LIMIT_S)
            assert ready, "Chromium did not answer"
            chunk = os.read(self._answers_r, 1 << 20)
            assert chunk, "Chromium closed its DevTools pipe"
            self._buffer += chunk
        text, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(text)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._commands_w, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._message()
            if answer.get("id") == self._next:
                assert "error" not in answer, answer["error"]
                return answer["result"]
            self.events.append(answer)

    def open(self, url: str) -> None:
        """Navigate, and return once the page's load event fired."""
        self.events = [e for e in self.events if e.get("method") != "Page.loadEventFired"]
        self.call("Page.navigate", session=self.session, url=url)
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._message())

    def wait(self, promise: str):
        """The value a script's Promise resolves to (the script runs in the page)."""
        result = self.call("Runtime.evaluate", session=self.session, expression=promise, awaitPromise=True,
                           returnByValue=True)
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def close(self) -> None:
        for fd in (self._commands_w, self._answers_r):
            os.close(fd)
        self.proc.terminate()
        self.proc.wait(timeout=60)
