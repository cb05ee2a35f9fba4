"""A fault-injecting HTTP proxy for object-store tests: real sockets between the client and a real server.

The proxy listens on 127.0.0.1 and forwards each request to the upstream server (the moto S3 server)
over a connection of its own, one request per connection (it asks both sides to close after the
answer, so that every request is seen, and judged, on its own). A test switches what it does to the
requests it selects, at any moment, by calling :meth:`FaultProxy.fault`:

* ``pass``: forwarded, the answer relayed;
* ``drop``: the connection is reset as soon as the request's head has arrived, with no answer;
* ``hang``: no answer at all until the fault is lifted or the proxy stops, so the client's own (short)
  read timeout is what ends the request: nothing here waits for a duration;
* ``503``: answered ``503 Service Unavailable`` with an S3 error body, never forwarded.

Every request is counted (method, path and query), so the proxy also shows what a run costs on the store.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

MODES = ("pass", "drop", "hang", "503")

_UNAVAILABLE = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>ServiceUnavailable</Code>"
                b"<Message>Service Unavailable (fault proxy)</Message><RequestId>faultproxy</RequestId></Error>")


@dataclass(frozen=True)
class Request:
    """One request as the proxy saw it."""

    method: str
    target: str  # the path and query
    mode: str  # what the proxy did with it

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


class FaultProxy:
    """See the module. Use as a context manager (:func:`fault_proxy`), or call :meth:`start` and :meth:`stop`.

    Args:
        upstream: ``(host, port)`` of the server requests are forwarded to.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.requests: list[Request] = []
        self._mode = "pass"
        self._select: Callable[[str, str], bool] = lambda method, target: True
        self._lock = threading.Lock()
        self._lifted = threading.Event()  # set whenever a fault is lifted or replaced: hanging requests end
        self._stopped = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._lifted.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close(sock)
        self._thread.join(30)

    def fault(self, mode: str, select: Callable[[str, str], bool] | None = None) -> None:
        """From now on, do ``mode`` to the requests ``select(method, target)`` accepts (all without one);
        the others pass. ``fault("pass")`` lifts every fault (hanging requests are then closed unanswered)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        with self._lock:
            self._mode = mode
            self._select = select or (lambda method, target: True)
            previous, self._lifted = self._lifted, threading.Event()
        previous.set()

    def counts(self, *, mode: str | None = None) -> Counter[str]:
        """Requests by ``METHOD path`` (those the proxy did ``mode`` to, with one)."""
        with self._lock:
            return Counter(f"{r.method} {r.path}" for r in self.requests if mode is None or r.mode == mode)

    def total(self) -> int:
        with self._lock:
            return len(self.requests)

    # ------------------------------------------------------------------ inside

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.add(client)
            threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            head, rest = _read_head(client)
            if head is None:
                return
            method, target = _request_line(head)
            with self._lock:
                mode = self._mode if self._select(method, target) else "pass"
                lifted = self._lifted
                self.requests.append(Request(method, target, mode))
            if mode == "drop":  # reset, not a polite close: the client sees the connection fail, at once
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                return
            if mode == "hang":
                lifted.wait()
                return
            if mode == "503":
                _drain_body(client, head, rest)
                client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(_UNAVAILABLE) + _UNAVAILABLE)
                return
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._sockets.add(upstream)
            upstream.sendall(_closing(head) + rest)
            # the body goes up on a thread of its own (a 100-continue upload waits for the server's go-ahead);
            # the answer comes down until the server closes after it, and then both sides are closed
            threading.Thread(target=_pump, args=(client, upstream), name="fault-proxy-up", daemon=True).start()
            _pump(upstream, client)
        except OSError:
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    _close(sock)
                    with self._lock:
                        self._sockets.discard(sock)


@contextmanager
def fault_proxy(endpoint: str) -> Iterator[FaultProxy]:
    """A started :class:`FaultProxy` in front of ``endpoint`` (``http://host:port``), stopped afterwards."""
    host, port = endpoint.rsplit("//", 1)[-1].rsplit(":", 1)
    proxy = FaultProxy((host, int(port))).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def _read_head(sock: socket.socket) -> tuple[bytes | None, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", rest


def _request_line(head: bytes) -> tuple[str, str]:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    return (parts[0], parts[1]) if len(parts) >= 2 else ("?", "?")


def _header(head: bytes, name: bytes) -> bytes | None:
    for line in head.split(b"\r\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            return value.strip()
    return None


def _closing(head: bytes) -> bytes:
    """The request head asking the server to close the connection after its answer."""
    lines = [line for line in head.split(b"\r\n") if line and not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


def _drain_body(sock: socket.socket, head: bytes, rest: bytes) -> None:
    """Read the body a request announced, unless it waits for a ``100 Continue`` it will not get."""
    if (_header(head, b"expect") or b"").lower() == b"100-continue":
        return
    length = int(_header(head, b"content-length") or 0)
    remaining = length - len(rest)
    while remaining > 0:
        chunk = sock.recv(min(remaining, 65536))
        if not chunk:
            return
        remaining -= len(chunk)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            chunk = source.recv(65536)
            if not chunk:
                break
            sink.sendall(chunk)
    except OSError:
        pass
    try:
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
