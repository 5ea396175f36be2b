"""What keeps other web pages and oversized requests away from the explorer: a plain ASGI
middleware in front of the app (:class:`Guard`).

A page on another site can make the user's browser send requests to ``127.0.0.1``; the browser
only keeps it from *reading* the answers, and even that holds only if the server checks who it
is talking to. So every request must pass, in this order:

1. **Host** (against DNS rebinding: a page at ``attacker.example`` whose name is re-pointed to
   127.0.0.1 becomes "same origin" with the server, but its requests still carry
   ``Host: attacker.example``): only the names the server listens as, on its port, are answered;
   others get 400. See :class:`AllowedHosts`.
2. **Size**: a declared ``Content-Length`` over :data:`MAX_BODY_BYTES` gets 413 before a byte of
   the body is read; a body without one (chunked) is read only until it passes the limit.
3. **JSON only** for the ``POST`` endpoints (every endpoint that loads or runs a model is one):
   the ``Content-Type`` must be ``application/json``. A cross-site ``<form>``, ``<img>`` or a
   ``fetch`` without CORS can only send ``text/plain``, form types or no type at all;
   ``application/json`` needs a CORS preflight, which this server never grants. This was chosen
   over a per-server token (as Jupyter does) because the explorer is a local tool with no login:
   scripts and ``curl`` keep working with a plain JSON POST, and there is no secret to copy
   around or leak in the address bar.

Every answer (errors included) carries ``X-Content-Type-Options: nosniff`` and, unless it sets
its own (the page does), the Content-Security-Policy :data:`API_POLICY`, so a JSON answer opened
as a document can run nothing.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BODY_BYTES = 1_000_000  # the largest valid request written compactly is about 0.6 MB (a generate prompt)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("0.0.0.0", "::", "")
# an API answer opened as a page may load, run or frame nothing
API_POLICY = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
# a Host header: a DNS name or IPv4 address, or an IPv6 address in brackets, then an optional port
HOST_HEADER = re.compile(r"(?P<name>[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{1,5}))?")


@dataclass(frozen=True)
class AllowedHosts:
    """The ``Host`` names the server answers to: ``names`` (lower case, IPv6 without brackets),
    each on the port the request arrived on unless ``ports`` gives it one, and, when the server
    listens on every address (``--host 0.0.0.0``), any IP address.

    An IP address in ``Host`` cannot come from DNS rebinding (that needs a name the attacker owns),
    so accepting every one is safe where the server is meant to be reached from other machines.
    """

    names: frozenset[str]
    ports: tuple[tuple[str, int], ...] = ()
    any_ip: bool = False

    @classmethod
    def listening_on(cls, host: str = "127.0.0.1", extra: Sequence[str] = ()) -> AllowedHosts:
        """The hosts of a server listening on ``host``: the loopback names, ``host`` itself, and
        ``extra`` (``NAME`` or ``NAME:PORT``, e.g. a reverse proxy's name or a forwarded port);
        on a wildcard address also this machine's host name and any IP address."""
        wildcard = host in WILDCARD_ADDRESSES
        names = {*LOOPBACK_NAMES, *([socket.gethostname()] if wildcard else []), *([] if wildcard else [host])}
        ports = []
        for given in extra:
            name, port = split_host(given)
            if port is None:
                names.add(name)
            else:
                ports.append((name, port))
        return cls(frozenset(name.lower().strip("[]") for name in names), tuple(ports), wildcard)

    def allows(self, header: str, server_port: int | None) -> bool:
        """Whether a request with ``Host: header`` that arrived on ``server_port`` is answered."""
        try:
            name, port = split_host(header)
        except ValueError:
            return False
        port = 80 if port is None else port
        if (name, port) in self.ports:
            return True
        on_our_port = server_port is None or port == server_port
        return on_our_port and (name in self.names or (self.any_ip and _is_ip(name)))

    def describe(self) -> str:
        bracketed = lambda name: f"[{name}]" if ":" in name else name  # IPv6, as written in a Host header
        shown = sorted(map(bracketed, self.names)) + [f"{bracketed(name)}:{port}" for name, port in self.ports]
        return ", ".join(shown) + (" and any IP address" if self.any_ip else "")


def split_host(value: str) -> tuple[str, int | None]:
    """``"Localhost:8765"`` -> ``("localhost", 8765)``, ``"[::1]"`` -> ``("::1", None)``;
    ValueError for anything that is not a host name or address with an optional port."""
    match = HOST_HEADER.fullmatch(value.strip())
    if not match or (match["port"] and int(match["port"]) > 65535):
        raise ValueError(f"not a host name with an optional port: {value!r}")
    return match["name"].lower().strip("[]"), int(match["port"]) if match["port"] else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == "application/json"


class Guard:
    """ASGI middleware: checks Host, body size and Content-Type, then adds the security headers.

    ``json_paths``: the paths of the POST endpoints, whose bodies must be JSON and are read here
    (up to the limit); a POST elsewhere is left to the app (which answers 405 or 404).
    """

    def __init__(self, app: ASGIApp, hosts: AllowedHosts, json_paths: frozenset[str],
                 max_body: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.hosts = hosts
        self.json_paths = json_paths
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = self._with_headers(scope, send)
        refusal = self._refusal(scope)
        if refusal is None and self._takes_json(scope):
            receive, too_large = await _read_body(receive, self.max_body)
            refusal = self._too_large() if too_large else None
        if refusal is not None:
            await refusal(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        """The answer to a request refused on its headers alone, or None."""
        host = _header(scope, b"host") or ""
        server = scope.get("server")
        if not self.hosts.allows(host, server[1] if server else None):
            return _problem(400, f"this server does not answer as host {host!r}; it answers as "
                                 f"{self.hosts.describe()} (attnscope serve --allow-host NAME adds one)")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return self._too_large()
        if self._takes_json(scope) and not _is_json(_header(scope, b"content-type")):
            return _problem(415, "send the body as JSON, with the header Content-Type: application/json")
        return None

    def _takes_json(self, scope: Scope) -> bool:
        return scope["method"] == "POST" and scope["path"] in self.json_paths

    def _too_large(self) -> JSONResponse:
        return _problem(413, f"the request body is larger than {self.max_body:,} bytes")

    @staticmethod
    def _with_headers(scope: Scope, send: Send) -> Send:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {name.lower() for name, _ in headers}
                headers.append((b"x-content-type-options", b"nosniff"))
                if b"content-security-policy" not in names:  # pages (/, /docs) bring their own
                    headers.append((b"content-security-policy", API_POLICY.encode()))
                message = {**message, "headers": headers}
            await send(message)

        return send_with_headers


def _problem(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status)


async def _read_body(receive: Receive, limit: int) -> tuple[Receive, bool]:
    """Read the request body, but no further than ``limit`` bytes: ``(receive, too_large)``,
    where ``receive`` hands the app the body read (as one message), then the rest of the
    conversation (a disconnect). Never holds more than ``limit`` bytes plus one chunk."""
    chunks: list[bytes] = []
    size, more, last = 0, True, None
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: let the app see it
            last = message
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > limit:
            return receive, True
    queued = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}, *([last] if last else [])]

    async def replay() -> Message:
        return queued.pop(0) if queued else await receive()

    return replay, False
