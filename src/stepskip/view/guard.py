"""Who may read a cache through ``stepskip view``: the checks every request passes before it is answered.

A page on another web site must not read the cache, even though the browser that shows it also
reaches ``127.0.0.1``. Three checks keep it out:

* **The host name.** A site can point its own name at ``127.0.0.1`` once its page is loaded (DNS
  rebinding); the browser then treats the view as that site and lets its page read the answers. The
  browser still names the site in ``Host``, so a request is answered only when ``Host`` is the bound
  address, ``localhost`` or a loopback address. A server other machines reach also answers to this
  machine's own names, and one bound to every address (``0.0.0.0``) to any address literal: a
  rebound name never arrives as an address. Anything else is refused with 421.
* **The origin.** A request whose ``Origin`` is another origin, or that the browser marks as sent by
  another site's page (``Sec-Fetch-Site``) other than by following a link, is refused with 403.
* **A token, when other machines can connect.** A server bound to an address other than a loopback
  one asks for a per-launch random token: from the URL's query (``?token=...``, as printed when
  the server starts; the answer then sets it as an ``HttpOnly``, ``SameSite=Strict`` cookie so the
  page's own requests carry it), from that cookie, or from ``Authorization: Bearer <token>``.
  Tokens are compared in constant time.

Every answer also carries headers that keep other origins' pages from framing, embedding or
sniffing it (:data:`SECURITY_HEADERS`); none allows a cross-origin read.

Example:
    >>> guard = Guard.for_bind("127.0.0.1", "127.0.0.1", 8765)
    >>> guard.refusal("/api/runs", {"Host": ["localhost:8765"]}) is None
    True
    >>> guard.refusal("/api/runs", {"Host": ["attacker.example:8765"]}).status
    421
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs

from stepskip.errors import SkipConfigError

__all__ = ["CONTENT_SECURITY_POLICY", "SECURITY_HEADERS", "Guard", "Refusal", "check_token", "host_name", "is_loopback",
           "new_token"]

#: The page runs only its own files: scripts and styles from this server, data from its own API, no
#: frames, forms, plug-ins or base-URL changes; no other page may frame it.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

#: Sent with every answer, refusals included.
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("Content-Security-Policy", CONTENT_SECURITY_POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("X-Frame-Options", "DENY"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
)

#: Letters, digits and ``-._~``: a token travels in a URL, a cookie and a header unchanged.
_TOKEN_TEXT = re.compile(r"[A-Za-z0-9._~-]{16,256}")
_PORT = re.compile(r"(:[0-9]{0,5})?")
_LOCAL_NAMES = frozenset({"localhost"})


def new_token() -> str:
    """A fresh random token for one launch (256 bits, URL- and cookie-safe).

    Returns:
        The token.

    Example:
        >>> len(new_token()) >= 43
        True
    """
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    """``token`` when it can serve as a view token; else :class:`~stepskip.errors.SkipConfigError` saying why.

    Args:
        token: a token chosen by the user (``stepskip view --token``).

    Returns:
        The token, unchanged.

    Example:
        >>> check_token("correct-horse-battery-staple")
        'correct-horse-battery-staple'
    """
    if not _TOKEN_TEXT.fullmatch(token):
        raise SkipConfigError(f"view token {token!r}: a token needs 16 to 256 characters among letters, digits and "
                              "'-', '_', '.', '~' (it travels in the URL and a cookie); leave it out to get a "
                              "random one")
    return token


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback(address: str) -> bool:
    """Whether ``address`` (a listening socket's address) is a loopback one: only this machine connects to it.

    Args:
        address: an IPv4 or IPv6 address (a name is not resolved: it is not a loopback address).

    Returns:
        True for 127.0.0.0/8 and ::1 (also as ::ffff:127.x.y.z).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("::1"), is_loopback("0.0.0.0"), is_loopback("192.168.1.20")
        (True, True, False, False)
    """
    parsed = _address(address.partition("%")[0])
    return parsed is not None and parsed.is_loopback


def host_name(header: str) -> str | None:
    """The host of a ``Host`` header, lower case, an IPv6 address without brackets; None when it is malformed.

    Args:
        header: the header's value (``127.0.0.1:8765``, ``[::1]:8765``, ``localhost``).

    Returns:
        The host without its port, or None.

    Example:
        >>> host_name("[::1]:8765"), host_name("LocalHost"), host_name("127.0.0.1:80@attacker.example")
        ('::1', 'localhost', None)
    """
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        host, rest = value[1:end], value[end + 1:]
        if _address(host) is None:
            return None
    elif value.count(":") > 1:  # an IPv6 address without brackets: malformed, but no name to rebind
        host, rest = value, ""
        if _address(host) is None:
            return None
    else:
        host, colon, port = value.partition(":")
        rest = colon + port
    if not host or not _PORT.fullmatch(rest):
        return None
    return host


@dataclass(frozen=True)
class Refusal:
    """Why a request is not answered: the HTTP status and a message for the person at the browser.

    Args:
        status: 421 (a host name the server does not answer to) or 403 (another origin, no token).
        message: what happened and what to do.
        kind: ``host``, ``origin`` or ``token``.

    Example:
        >>> Refusal(421, "wrong host name", "host").status
        421
    """

    status: int
    message: str
    kind: str


@dataclass(frozen=True)
class Guard:
    """The checks of one server: the host names it answers to and the token it asks for (None: none).

    Build it with :meth:`for_bind` from the address the server listens on.

    Args:
        names: host names (lower case) accepted in ``Host``.
        addresses: address literals accepted in ``Host`` besides loopback ones.
        any_address: every address literal is accepted (a server bound to all addresses).
        token: the token every request must carry, or None.
        cookie: the name of the cookie that keeps the token (one per port: cookies ignore ports).

    Example:
        >>> guard = Guard.for_bind("0.0.0.0", "0.0.0.0", 8765)
        >>> guard.token is not None
        True
        >>> guard.refusal("/", {"Host": ["127.0.0.1:8765"]}).status
        403
        >>> guard.refusal("/?token=" + guard.token, {"Host": ["127.0.0.1:8765"]}) is None
        True
    """

    names: frozenset[str]
    addresses: frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]
    any_address: bool
    token: str | None
    cookie: str

    @classmethod
    def for_bind(cls, given: str, bound: str, port: int, token: str | None = None) -> Guard:
        """The guard of a server started with ``--host given`` and listening on ``bound:port``.

        Args:
            given: the host as the user gave it (an address or a name).
            bound: the address the socket listens on.
            port: the port it listens on.
            token: a token the user chose; None: a random one when ``bound`` is not a loopback address.

        Returns:
            The guard.
        """
        address = _address(bound.partition("%")[0])
        loopback = is_loopback(bound)
        names = set(_LOCAL_NAMES) | {given.strip().lower().strip("[]")}
        addresses = {address} if address is not None else set()
        if not loopback:
            names |= _machine_names()
            if token is None:
                token = new_token()
        if token is not None:
            check_token(token)
        return cls(frozenset(names), frozenset(addresses), address is not None and address.is_unspecified,
                   token, f"stepskip-view-{port}")

    def host_allowed(self, header: str) -> bool:
        """Whether a request whose ``Host`` is ``header`` is for this server under a name it answers to.

        Args:
            header: the ``Host`` header's value.

        Returns:
            True when the name is accepted.
        """
        host = host_name(header)
        if host is None:
            return False
        address = _address(host)
        if address is None:
            return host in self.names
        return address.is_loopback or self.any_address or address in self.addresses

    def refusal(self, target: str, headers: Mapping[str, Sequence[str]]) -> Refusal | None:
        """Why the request for ``target`` with ``headers`` is refused, or None when it may be answered.

        Args:
            target: the request target (path and query).
            headers: every value of each header, by its name (``{"Host": ["127.0.0.1:8765"]}``).

        Returns:
            The refusal, or None.
        """
        get = {name.lower(): list(values) for name, values in headers.items()}
        hosts = get.get("host", [])
        if len(hosts) != 1 or not self.host_allowed(hosts[0]):
            return Refusal(421, "this server answers only to the address it was started on (open the URL "
                           "stepskip view printed, or http://localhost:<port>/)", "host")
        origins = get.get("origin", [])
        if len(origins) > 1 or (origins and origins[0].strip().lower() != "http://" + hosts[0].strip().lower()):
            return Refusal(403, "requests from another web site's page are refused", "origin")
        site = " ".join(get.get("sec-fetch-site", [])).strip().lower()
        followed_link = (" ".join(get.get("sec-fetch-mode", [])).strip().lower() == "navigate"
                         and " ".join(get.get("sec-fetch-dest", ["document"])).strip().lower() == "document")
        if site in ("cross-site", "same-site") and not followed_link:
            return Refusal(403, "requests from another web site's page are refused", "origin")
        if not self._token_given(target, get):
            return Refusal(403, "this server asks for the token it printed when it started: open the URL "
                           "with ?token=... that stepskip view printed", "token")
        return None

    def cookie_to_set(self, target: str) -> str | None:
        """A ``Set-Cookie`` value keeping the token when ``target``'s query carries the right one; else None.

        Args:
            target: the request target (path and query).

        Returns:
            The header's value, or None.
        """
        if self.token is None or not _any_matches(_query_tokens(target), self.token):
            return None
        return f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"

    def _token_given(self, target: str, headers: Mapping[str, Sequence[str]]) -> bool:
        if self.token is None:
            return True
        given = _query_tokens(target)
        for line in headers.get("cookie", []):
            for pair in line.split(";"):
                name, eq, value = pair.strip().partition("=")
                if eq and name == self.cookie:
                    given.append(value.strip())
        for line in headers.get("authorization", []):
            scheme, _, value = line.strip().partition(" ")
            if scheme.lower() in ("bearer", "token"):
                given.append(value.strip())
        return _any_matches(given, self.token)


def _any_matches(given: list[str], token: str) -> bool:
    # bytes: compare_digest refuses str with characters outside ASCII, which a request may carry; a list,
    # not a generator: every candidate is compared, none skipped once one matched
    expected = token.encode()
    return any([hmac.compare_digest(g.encode("utf-8", "surrogateescape"), expected) for g in given])


def _query_tokens(target: str) -> list[str]:
    query = target.partition("?")[2].partition("#")[0]
    return parse_qs(query, keep_blank_values=True).get("token", [])


def _machine_names() -> set[str]:
    """This machine's own names: another machine's browser reaches a server bound to all addresses by them."""
    names = set()
    for lookup in (socket.gethostname, socket.getfqdn):
        try:
            names.add(lookup().strip().lower())
        except OSError:
            continue
    return {n for n in names if n}
