"""The local web app of ``stepskip view``: JSON data endpoints over a :class:`~stepskip.view.data.ViewSource`
and the page itself (``view/static``), served by the standard library's threading HTTP server.

The server only answers GET (and HEAD); it never writes to the cache. Requests name runs, roles
and steps by their listed names (see :mod:`stepskip.view.data`), static files by a fixed set of
names; nothing in a URL becomes a path. Before any of that, :mod:`stepskip.view.guard` decides whether
the request may be answered at all: only under the server's own host name, never for another web
site's page, and with the per-launch token when the server listens on an address other machines reach.

Endpoints (all JSON):
    ``/api/runs``; ``/api/step?run=R&role=O&step=N&offset=&limit=&sort=&desc=1&filter=reward0&filter=lenmax&q=``;
    ``/api/stats?run=&role=&step=``; ``/api/trend?run=&role=``;
    ``/api/compare?run=&role=&step=&run2=&role2=&step2=&offset=&limit=``;
    ``/api/tokens?run=&role=&step=&row=&column=`` (one trajectory's per-token log-probs);
    ``/api/follow`` (the listing's version and the runs being written: what ``--follow`` polls).

Example:
    >>> server = make_server(ViewSource("~/.verl/rollout_dump"), "127.0.0.1", 0)  # doctest: +SKIP
    >>> server.serve_forever()  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import math
import socket
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from stepskip.view.data import EntryProblem, ViewError, ViewSource
from stepskip.view.guard import SECURITY_HEADERS, Guard, check_token, is_loopback

__all__ = ["STATIC_FILES", "ViewServer", "handle_api", "make_server", "static_file"]

logger = logging.getLogger(__name__)

#: The files the page is made of: the only names ``/static/...`` serves.
STATIC_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css",
                "chart.umd.min.js": "text/javascript"}


def static_file(name: str) -> bytes:
    """The bytes of one of the page's files (package data of ``stepskip.view``)."""
    return resources.files("stepskip.view").joinpath("static").joinpath(name).read_bytes()


def _json_safe(value: Any) -> Any:
    """NaN and infinities become None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _one(params: dict[str, list[str]], name: str, default: str | None = None) -> str | None:
    values = params.get(name)
    return values[-1] if values else default


def _int(params: dict[str, list[str]], name: str, default: int) -> int:
    text = _one(params, name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ViewError(f"{name}={text!r} is not a whole number") from None


def _required(params: dict[str, list[str]], name: str) -> str:
    value = _one(params, name)
    if value is None:
        raise ViewError(f"missing query parameter {name!r}")
    return value


def handle_api(source: ViewSource, path: str, params: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
    """Answer one data request: ``(HTTP status, JSON body)``; errors become ``{"error": ..., "kind": ...}``.

    Args:
        source: the cache being viewed.
        path: the endpoint (``/api/runs``, ``/api/step`` ...).
        params: the decoded query (``urllib.parse.parse_qs``).
    """
    try:
        if path == "/api/runs":
            if _one(params, "refresh") == "1":
                source.refresh()
            return 200, source.listing()
        if path == "/api/step":
            return 200, source.step_page(
                _required(params, "run"), _required(params, "role"), _required(params, "step"),
                offset=_int(params, "offset", 0), limit=_int(params, "limit", 50), sort=_one(params, "sort"),
                desc=_one(params, "desc") == "1", filters=[f for f in params.get("filter", []) if f],
                q=_one(params, "q", "") or "")
        if path == "/api/stats":
            return 200, source.step_stats(_required(params, "run"), _required(params, "role"),
                                          _required(params, "step"))
        if path == "/api/follow":
            return 200, source.follow()
        if path == "/api/tokens":
            return 200, source.token_strip(_required(params, "run"), _required(params, "role"),
                                           _required(params, "step"), _required(params, "row"),
                                           _one(params, "column") or None)
        if path == "/api/trend":
            return 200, source.trend(_required(params, "run"), _required(params, "role"))
        if path == "/api/compare":
            a = (_required(params, "run"), _required(params, "role"), _required(params, "step"))
            b = (_one(params, "run2") or a[0], _one(params, "role2") or a[1], _required(params, "step2"))
            return 200, source.compare(a, b, offset=_int(params, "offset", 0), limit=_int(params, "limit", 20))
        return 404, {"error": f"no endpoint {path}", "kind": "not-found"}
    except EntryProblem as err:
        return err.status, {"error": str(err), "kind": err.kind}
    except ViewError as err:
        return err.status, {"error": str(err), "kind": "request"}
    except Exception as err:  # the app stays up whatever one entry does; the reason is shown, logged in full
        logger.exception("request %s failed", path)
        return 500, {"error": f"{type(err).__name__}: {err}", "kind": "internal"}


class _Handler(BaseHTTPRequestHandler):
    server: ViewServer
    server_version = "stepskip-view"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        logger.debug("%s " + format, self.address_string(), *args)

    def end_headers(self) -> None:
        # here rather than in _send: the base class's own error answers (a malformed request) get them too
        for name, value in SECURITY_HEADERS:
            self.send_header(name, value)
        super().end_headers()

    def _send(self, status: int, body: bytes, content_type: str, extra: Sequence[tuple[str, str]] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error(self, status: int, message: str, kind: str, extra: Sequence[tuple[str, str]] = ()) -> None:
        self._send(status, json.dumps({"error": message, "kind": kind}).encode(), "application/json", extra)

    def _admitted(self) -> bool:
        """Whether this request may be answered; if not, the refusal has been sent."""
        if not self.path.startswith("/"):  # a proxy's absolute URL: its host would bypass the Host check
            self._send_error(400, "the request target must be a path (/...)", "request")
            return False
        headers = {name: self.headers.get_all(name) or [] for name in set(self.headers.keys())}
        refusal = self.server.guard.refusal(self.path, headers)
        if refusal is not None:
            logger.info("refused %s %s from %s: %s", self.command, self.path.partition("?")[0],
                        self.address_string(), refusal.kind)
            self._send_error(refusal.status, refusal.message, refusal.kind)
            return False
        return True

    def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        if not self._admitted():
            return
        cookie = self.server.guard.cookie_to_set(self.path)
        extra = [("Set-Cookie", cookie)] if cookie else []
        path, _, query = self.path.partition("?")  # not urlsplit: "//name/..." is a path here, not a host
        if path.startswith("/api/"):
            status, answer = handle_api(self.server.source, path, parse_qs(query, keep_blank_values=True))
            data = json.dumps(_json_safe(answer), allow_nan=False).encode()
            self._send(status, data, "application/json", extra)
            return
        name = "index.html" if path in ("/", "/index.html") else path.removeprefix("/static/")
        if path != "/" and not path.startswith("/static/") and path != "/index.html":
            name = ""
        if name not in STATIC_FILES:  # a fixed set of names: "..", "%2F" and absolute paths are just unknown
            self._send(404, b'{"error": "not found"}', "application/json", extra)
            return
        body = static_file(name)
        if name == "index.html":
            body = body.replace(b"<!--DATA-->", b"")
        self._send(HTTPStatus.OK, body, STATIC_FILES[name] + "; charset=utf-8", extra)

    def do_POST(self) -> None:  # noqa: N802 (read-only: nothing is ever accepted)
        if self._admitted():
            self._send_error(405, "read-only: only GET and HEAD are answered", "method", [("Allow", "GET, HEAD")])

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = do_POST  # noqa: N815


class ViewServer(ThreadingHTTPServer):
    """The server of ``stepskip view``: :func:`make_server` builds it; ``serve_forever`` runs it.

    Args:
        source: the cache being viewed.
        host: the address (or name) to listen on.
        port: the port (0: any free one).
        token: the token requests must carry; None: a random one when ``host`` is not a loopback address,
            none otherwise.

    Example:
        >>> server = ViewServer(ViewSource("/tmp/dump"), "127.0.0.1", 0)  # doctest: +SKIP
        >>> server.urls()  # doctest: +SKIP
        ['http://127.0.0.1:41233/']
    """

    daemon_threads = True

    def __init__(self, source: ViewSource, host: str, port: int, token: str | None = None) -> None:
        if token is not None:
            check_token(token)  # before listening: a refused token never opens the port
        if ":" in host:  # an IPv6 address (::1)
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.source = source
        self.given_host = host
        self.guard = Guard.for_bind(host, str(self.server_address[0]), self.port, token)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.server_address[1])

    @property
    def loopback(self) -> bool:
        """Whether it listens on a loopback address only (no other machine can connect)."""
        return is_loopback(str(self.server_address[0]))

    @property
    def token(self) -> str | None:
        """The token requests must carry (None: none is asked for)."""
        return self.guard.token

    def urls(self) -> list[str]:
        """Where a browser opens the page, token included: the first on this machine, then by this machine's name.

        Returns:
            One URL, or two for a server listening on every address.
        """
        query = f"?token={self.token}" if self.token else ""
        if self.guard.any_address:
            local = "[::1]" if self.address_family == socket.AF_INET6 else "127.0.0.1"
            hosts = [local, socket.gethostname()]
        else:
            hosts = [f"[{self.given_host}]" if ":" in self.given_host else self.given_host]
        return [f"http://{host}:{self.port}/{query}" for host in hosts]


def make_server(source: ViewSource, host: str = "127.0.0.1", port: int = 8765,
                token: str | None = None) -> ViewServer:
    """An HTTP server for ``source`` bound to ``host:port`` (port 0: any free port); call ``serve_forever``.

    Bound to an address other than a loopback one, the server asks every request for a token (``token``,
    or a random one): :meth:`ViewServer.urls` carry it.

    Args:
        source: the cache to serve.
        host: the address to listen on.
        port: the port (0: any free one).
        token: the token to ask for; None: a random one for a non-loopback ``host``, none otherwise.

    Returns:
        The server, listening but not yet serving.

    Example:
        >>> server = make_server(ViewSource("/tmp/dump"), port=0)  # doctest: +SKIP
        >>> server.server_address[1] > 0  # doctest: +SKIP
        True
    """
    return ViewServer(source, host, port, token)
