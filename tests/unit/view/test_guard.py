"""No other origin reads the cache through ``stepskip view``: raw requests over real sockets to a real server,
with forged ``Host`` and ``Origin`` headers, the browser's ``Sec-Fetch-*`` headers, methods other than GET,
and the per-launch token of a server that listens on every address (0.0.0.0, reached here via 127.0.0.1).

A browser cannot be told to forge these headers, so a socket stands in for the page that would send them:
``Host: attacker.example`` is what a browser sends after a site rebinds its name to 127.0.0.1."""

from __future__ import annotations

import hmac
import http.client
import json
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_caches import SAFE_RUN
from interrupts import view_command
from view_helpers import tree_state

import stepskip.view.guard as guard_module
from stepskip.errors import SkipConfigError
from stepskip.view.data import ViewSource
from stepskip.view.guard import CONTENT_SECURITY_POLICY, Guard, check_token, host_name
from stepskip.view.server import ViewServer, make_server


class Answer:
    def __init__(self, status: int, headers: http.client.HTTPMessage, body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    @property
    def has_data(self) -> bool:
        return SAFE_RUN.encode() in self.body or b'"runs"' in self.body

    def cookies(self) -> list[str]:
        return self.headers.get_all("Set-Cookie") or []


def ask(port: int, path: str = "/api/runs", *, host: str | None = "127.0.0.1", method: str = "GET",
        headers: dict[str, str] | None = None, connect: str = "127.0.0.1") -> Answer:
    """One request with exactly the given ``Host`` (None: no Host header at all) and headers."""
    conn = http.client.HTTPConnection(connect, port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        res = conn.getresponse()
        return Answer(res.status, res.headers, res.read())
    finally:
        conn.close()


def raw(port: int, request: bytes) -> tuple[int, bytes]:
    """A request written byte for byte: the status of the answer and the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    return int(answer.split(b" ", 2)[1]), answer


def serving(server: ViewServer) -> Iterator[ViewServer]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def local(view_cache) -> Iterator[ViewServer]:
    """The default: bound to 127.0.0.1, no token."""
    before = tree_state(view_cache)
    yield from serving(make_server(ViewSource(str(view_cache)), "127.0.0.1", 0))
    assert tree_state(view_cache) == before


@pytest.fixture(scope="module")
def everywhere(view_cache) -> Iterator[ViewServer]:
    """Bound to 0.0.0.0: a random token is asked for."""
    yield from serving(make_server(ViewSource(str(view_cache)), "0.0.0.0", 0))


# ------------------------------------------------------------------ the host name


@pytest.mark.parametrize("host", [
    "attacker.example", "attacker.example:{port}", "ATTACKER.example:{port}", "127.0.0.1.attacker.example:{port}",
    "localhost.attacker.example:{port}", "localhost.", "localhost.:{port}", "evil.localhost:{port}",
    "127.0.0.1:{port}@attacker.example", "127.0.0.1@attacker.example", "[::1].attacker.example:{port}",
    "[::1]attacker.example", "127.0.0.1:{port}:{port}", "127.0.0.1:abc", "127.0.0.1:{port} attacker.example",
    "192.168.1.20:{port}", "10.0.0.1", "0.0.0.0:{port}", "[::]:{port}", "[fe80::1]:{port}", "2130706433:{port}",
    "0x7f000001:{port}", "127.1:{port}", "[attacker.example]:{port}", "[::1", "", " ",
])
def test_a_foreign_host_name_gets_nothing(local, host):
    """What a browser sends once a site has pointed its own name at 127.0.0.1: refused, no data, any path."""
    for path in ("/api/runs", f"/api/step?run={SAFE_RUN}&role=rollout&step=1", "/", "/static/app.js"):
        answer = ask(local.port, path, host=host.format(port=local.port))
        assert answer.status == 421, (host, path, answer.status)
        assert not answer.has_data and b"use strict" not in answer.body and b"<main" not in answer.body
        assert json.loads(answer.body)["kind"] == "host"


@pytest.mark.parametrize("host", [
    "127.0.0.1", "127.0.0.1:{port}", "localhost", "localhost:{port}", "LocalHost:{port}", "127.5.6.7:{port}",
    "[::1]", "[::1]:{port}", "::1", "[::ffff:127.0.0.1]:{port}", "localhost:1234", "127.0.0.1:",
])
def test_this_machine_s_own_names_are_answered(local, host):
    """Loopback addresses and localhost, with or without a port (a forwarded port changes it: ssh -L)."""
    answer = ask(local.port, host=host.format(port=local.port))
    assert answer.status == 200 and SAFE_RUN in [r["name"] for r in json.loads(answer.body)["runs"]]


def test_a_request_without_a_host_or_with_two_is_refused(local):
    port = local.port
    for request in (b"GET /api/runs HTTP/1.0\r\n\r\n", b"GET /api/runs HTTP/1.1\r\nConnection: close\r\n\r\n",
                    b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: attacker.example\r\n\r\n",
                    b"GET /api/runs HTTP/1.1\r\nHost: attacker.example\r\nHost: 127.0.0.1\r\n\r\n",
                    b"GET /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n"):
        status, answer = raw(port, request)
        assert status == 421 and SAFE_RUN.encode() not in answer, request


def test_an_absolute_request_target_is_refused(local):
    """A proxy-style target names its own host, which the Host check would not see."""
    for target in (f"http://attacker.example:{local.port}/api/runs", f"http://127.0.0.1:{local.port}/api/runs"):
        status, answer = raw(local.port, f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        assert status == 400 and SAFE_RUN.encode() not in answer
    status, answer = raw(local.port, b"GET //attacker.example/api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 404 and SAFE_RUN.encode() not in answer  # a path, not a host and a path


def test_an_ipv6_loopback_server(view_cache):
    try:
        server = make_server(ViewSource(str(view_cache)), "::1", 0)
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here ({err})")
    for running in serving(server):
        assert running.token is None and running.urls() == [f"http://[::1]:{running.port}/"]
        assert ask(running.port, host=f"[::1]:{running.port}", connect="::1").status == 200
        assert ask(running.port, host=f"attacker.example:{running.port}", connect="::1").status == 421


# ------------------------------------------------------------------ the origin


@pytest.mark.parametrize("origin", [
    "http://attacker.example", "http://attacker.example:{port}", "null", "http://127.0.0.1:1",
    "https://127.0.0.1:{port}", "http://localhost:{port}", "http://127.0.0.1:{port}.attacker.example", "",
])
def test_a_request_from_another_origin_is_refused(local, origin):
    port = local.port
    answer = ask(port, host=f"127.0.0.1:{port}", headers={"Origin": origin.format(port=port)})
    assert answer.status == 403 and not answer.has_data and json.loads(answer.body)["kind"] == "origin"
    assert answer.headers.get("Access-Control-Allow-Origin") is None


def test_a_request_from_the_page_itself_is_answered(local):
    port = local.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        answer = ask(port, host=host, headers={"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin",
                                               "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"})
        assert answer.status == 200 and answer.has_data
        assert answer.headers.get("Access-Control-Allow-Origin") is None
    two = ask(port, headers={"Origin": "http://127.0.0.1"}, host="127.0.0.1")
    assert two.status == 200


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
@pytest.mark.parametrize(("mode", "dest"), [("no-cors", "script"), ("no-cors", "image"), ("cors", "empty"),
                                            ("navigate", "iframe"), ("no-cors", "style")])
def test_another_site_s_page_cannot_embed_or_fetch(local, site, mode, dest):
    """``<script src>``, ``<img>``, ``fetch`` or a frame from another site (or another port: same-site) sends no
    Origin on a GET; the browser's Sec-Fetch-Site says where it came from."""
    answer = ask(local.port, headers={"Sec-Fetch-Site": site, "Sec-Fetch-Mode": mode, "Sec-Fetch-Dest": dest})
    assert answer.status == 403 and not answer.has_data


def test_following_a_link_from_another_site_opens_the_page(local):
    """A top-level navigation shows the page to the user, not to the linking site."""
    answer = ask(local.port, "/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
                                           "Sec-Fetch-Dest": "document"})
    assert answer.status == 200 and b'<main id="app">' in answer.body


# ------------------------------------------------------------------ headers and methods


def test_every_answer_keeps_other_origins_out(local):
    port = local.port
    answers = {
        "page": ask(port, "/"), "script": ask(port, "/static/app.js"), "data": ask(port),
        "missing": ask(port, "/nothing"), "bad request": ask(port, "/api/step?run=x"),
        "post": ask(port, method="POST"), "host": ask(port, host="attacker.example"),
        "origin": ask(port, headers={"Origin": "http://attacker.example"}),
        "unknown method": ask(port, method="PROPFIND"), "head": ask(port, method="HEAD"),
    }
    assert [answers[k].status for k in answers] == [200, 200, 200, 404, 400, 405, 421, 403, 501, 200]
    for what, answer in answers.items():
        h = answer.headers
        assert h["X-Content-Type-Options"] == "nosniff", what
        assert h["X-Frame-Options"] == "DENY", what
        assert h["Content-Security-Policy"] == CONTENT_SECURITY_POLICY, what
        assert h["Cross-Origin-Resource-Policy"] == "same-origin", what
        assert h["Referrer-Policy"] == "no-referrer", what
        assert h["Cache-Control"] == "no-store", what
        assert not [n for n in h.keys() if n.lower().startswith("access-control-")], what
        assert "Python" not in (h["Server"] or ""), what
    csp = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert csp["default-src"] == "'none'" and csp["script-src"] == "'self'" and csp["frame-ancestors"] == "'none'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY
    assert answers["head"].body == b""


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
def test_only_reads_are_answered(local, method):
    answer = ask(local.port, method=method, headers={"Content-Length": "0", "Origin": f"http://127.0.0.1:{local.port}",
                                                     "Access-Control-Request-Method": "GET"},
                 host=f"127.0.0.1:{local.port}")
    assert answer.status == 405 and answer.headers["Allow"] == "GET, HEAD" and not answer.has_data
    assert answer.headers.get("Access-Control-Allow-Origin") is None
    assert ask(local.port, method=method, host="attacker.example").status == 421
    status, whole = raw(local.port, b"PROPFIND /api/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 501 and SAFE_RUN.encode() not in whole


# ------------------------------------------------------------------ the token


def test_a_server_on_every_address_asks_for_a_token(everywhere):
    token, port = everywhere.token, everywhere.port
    assert token and len(token) >= 43 and check_token(token) == token
    assert not everywhere.loopback
    local_url, named_url = everywhere.urls()
    assert local_url == f"http://127.0.0.1:{port}/?token={token}"
    assert named_url == f"http://{socket.gethostname()}:{port}/?token={token}"
    for path in ("/", "/api/runs", "/static/app.js", f"/api/step?run={SAFE_RUN}&role=rollout&step=1"):
        answer = ask(port, path)
        assert answer.status == 403 and json.loads(answer.body)["kind"] == "token" and not answer.has_data
        assert b"use strict" not in answer.body and answer.cookies() == []


@pytest.mark.parametrize("how", ["query", "empty query", "cookie", "bearer", "prefix", "longer", "non-ascii",
                                 "other port's cookie", "cookie as a parameter"])
def test_a_wrong_token_gets_nothing(everywhere, how):
    token, port = everywhere.token, everywhere.port
    assert token is not None
    wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
    path, headers = {
        "query": (f"/api/runs?token={wrong}", {}),
        "empty query": ("/api/runs?token=", {}),
        "cookie": ("/api/runs", {"Cookie": f"stepskip-view-{port}={wrong}"}),
        "bearer": ("/api/runs", {"Authorization": f"Bearer {wrong}"}),
        "prefix": (f"/api/runs?token={token[:20]}", {}),
        "longer": (f"/api/runs?token={token}x", {}),
        "non-ascii": ("/api/runs?token=t%C3%B6k%C3%A9n", {"Authorization": "Bearer tökén".encode().decode("latin-1")}),
        "other port's cookie": ("/api/runs", {"Cookie": f"stepskip-view-{port + 1}={token}"}),
        "cookie as a parameter": (f"/api/runs?stepskip-view-{port}={token}", {}),
    }[how]
    answer = ask(port, path, headers=headers)
    assert answer.status == 403 and not answer.has_data and answer.cookies() == []


def test_the_right_token_once_then_its_cookie(everywhere):
    token, port = everywhere.token, everywhere.port
    first = ask(port, f"/?token={token}")
    assert first.status == 200 and b'<main id="app">' in first.body
    [cookie] = first.cookies()
    name_value, *attributes = [part.strip() for part in cookie.split(";")]
    assert name_value == f"stepskip-view-{port}={token}"
    assert {"HttpOnly", "SameSite=Strict", "Path=/"} <= set(attributes)
    assert not any(a.lower().startswith(("domain", "samesite=none", "samesite=lax")) for a in attributes)
    # the page's own requests then carry only the cookie
    for path in ("/static/app.js", "/api/runs", f"/api/step?run={SAFE_RUN}&role=rollout&step=2&limit=2"):
        answer = ask(port, path, headers={"Cookie": f"other=1; {name_value}; more=2"})
        assert answer.status == 200 and answer.cookies() == [], path
    runs = ask(port, headers={"Cookie": name_value})
    assert runs.has_data
    assert ask(port, headers={"Authorization": f"Bearer {token}"}).has_data
    assert ask(port, headers={"Authorization": f"token {token}"}).has_data
    assert ask(port, f"/api/runs?token={token}").has_data


def test_the_token_does_not_open_a_foreign_host_name(everywhere):
    token, port = everywhere.token, everywhere.port
    for host in (f"attacker.example:{port}", "localhost.", f"evil.localhost:{port}"):
        answer = ask(port, f"/api/runs?token={token}", host=host)
        assert answer.status == 421 and not answer.has_data and answer.cookies() == []
    assert ask(port, f"/api/runs?token={token}", headers={"Origin": "http://attacker.example"}).status == 403


def test_a_server_on_every_address_answers_to_its_addresses_and_names(everywhere):
    """Another machine reaches it by an address of this machine or by its name (the socket is the same)."""
    token, port = everywhere.token, everywhere.port
    for host in (f"192.168.1.20:{port}", f"[fe80::1]:{port}", f"{socket.gethostname()}:{port}", f"localhost:{port}"):
        answer = ask(port, f"/api/runs?token={token}", host=host)
        assert answer.status == 200 and answer.has_data, host


def _lan_address() -> str | None:
    """An address of this machine other than a loopback one (a UDP socket's route; nothing is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.254", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_a_server_on_a_lan_address_asks_for_a_token(view_cache):
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no address other than loopback ones")
    for server in serving(make_server(ViewSource(str(view_cache)), address, 0)):
        token, port = server.token, server.port
        assert token and not server.loopback and server.urls() == [f"http://{address}:{port}/?token={token}"]
        assert ask(port, host=f"{address}:{port}", connect=address).status == 403
        assert ask(port, f"/api/runs?token={token}", host=f"{address}:{port}", connect=address).has_data
        for host in (f"attacker.example:{port}", f"192.0.2.77:{port}"):  # not its address, not a name of it
            assert ask(port, f"/api/runs?token={token}", host=host, connect=address).status == 421


def test_each_launch_has_its_own_token(view_cache):
    source = ViewSource(str(view_cache))
    tokens = set()
    for _ in range(3):
        server = make_server(source, "0.0.0.0", 0)
        tokens.add(server.token)
        server.server_close()
    assert len(tokens) == 3 and None not in tokens


def test_tokens_are_compared_in_constant_time(everywhere, monkeypatch):
    """Every candidate (query, cookie, header) goes through hmac.compare_digest, never ``==``."""
    seen: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(guard_module.hmac, "compare_digest", spy)
    token, port = everywhere.token, everywhere.port
    assert token is not None
    assert ask(port, "/api/runs?token=nope", headers={"Cookie": f"stepskip-view-{port}={token}"}).status == 200
    assert (b"nope", token.encode()) in seen and (token.encode(), token.encode()) in seen


def test_a_chosen_token_is_asked_for_even_on_loopback(view_cache):
    chosen = "correct-horse-battery-staple"
    for server in serving(make_server(ViewSource(str(view_cache)), "127.0.0.1", 0, token=chosen)):
        assert server.loopback and server.urls() == [f"http://127.0.0.1:{server.port}/?token={chosen}"]
        assert ask(server.port).status == 403
        assert ask(server.port, f"/api/runs?token={chosen}").has_data


@pytest.mark.parametrize("token", ["", "short", "has space in it ok?", "semi;colon-and-more-chars", "x" * 257,
                                   "tökén-with-enough-chars"])
def test_an_unusable_chosen_token_is_refused_before_listening(view_cache, token):
    with pytest.raises(SkipConfigError, match="16 to 256 characters"):
        make_server(ViewSource(str(view_cache)), "0.0.0.0", 0, token=token)


def test_host_names_are_parsed_strictly():
    assert host_name("[::1]:80") == "::1" and host_name("::1") == "::1" and host_name("LOCALHOST:1") == "localhost"
    for bad in ("", "[::1", "[x]:1", "a:b", "a:1:2", "a:123456", "127.0.0.1:8765\x00"):
        assert host_name(bad) is None, bad
    guard = Guard.for_bind("127.0.0.1", "127.0.0.1", 8765)
    assert guard.token is None and not guard.any_address


# ------------------------------------------------------------------ the command


def test_the_view_command_on_every_address_prints_a_url_with_its_token(view_cache):
    with view_command(view_cache, "--port", "0", "--host", "0.0.0.0") as view:
        url, port = view.url, view.port
        other = view.proc.stdout.readline()
        assert f"http://{socket.gethostname()}:" in other and "?token=" in other
        note = view.proc.stderr.readline()
        assert "0.0.0.0" in note and "token" in note
        token = url.split("?token=")[1]
        assert url == f"http://127.0.0.1:{port}/?token={token}" and len(token) >= 43
        assert ask(port).status == 403
        assert ask(port, f"/api/runs?token={token}").has_data


def test_the_view_command_refuses_a_short_token(view_cache):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
    from cli_run import stepskip

    result = stepskip("view", view_cache, "--host", "0.0.0.0", "--port", "0", "--token", "abc")
    assert result.code == 2 and "--token" in result.err and "16 to 256 characters" in result.err
