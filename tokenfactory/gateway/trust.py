"""Loopback trust that a web page cannot borrow (the server without `--auth`).

Without `--auth` the server trusts whoever reaches it, and a few routes (`/fleet/*`, `/dashboard/events`)
trust a loopback client only. A web page open in the operator's browser is such a client: it can send a
cross-site `POST` (a form, a `fetch` in `no-cors` mode) to `http://127.0.0.1:8000`, and with DNS rebinding
(attacker.example resolving to 127.0.0.1) its requests even become same-origin, so it can read the answers.
`LoopbackTrust`, an ASGI middleware, refuses both before any route runs (403 in OpenAI's error shape):

    Host     must name this machine the way no rebinding can: an IP literal, `localhost` (or a name under
             `.localhost`), or a name given with `--allowed-host`; checked on every route but /health and
             /metrics (probes and scrapers may use a service name)
    Origin   when present, its host must be loopback, the request's own Host (same origin), or an allowed
             host; `Origin: null` (a sandboxed frame, a file) is refused
    Sec-Fetch-Site
             `cross-site` is refused (browsers send it on every request; other clients send none)

The Origin and Sec-Fetch-Site checks apply to every route that changes state (any method but GET, HEAD and
OPTIONS) or returns data (every GET but /health, /metrics and the dashboard's static page and files).
Clients that are not browsers (curl, the openai library, Prometheus) send neither header and pass. With
`--auth` the middleware is not installed: a bearer key is never attached by a browser on its own.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers: any Host, no browser checks
STATIC_PREFIXES = ("/dashboard/static/",)  # the page's own files: no data in them
STATIC_PATHS = ("/dashboard",)


def host_of(authority: str) -> str:
    """The host part of a Host header or an origin's netloc (no port, no brackets), lower case."""
    authority = authority.strip().lower()
    if authority.startswith("["):  # [::1]:8000
        return authority[1:authority.find("]")] if "]" in authority else authority[1:]
    if authority.count(":") == 1:
        return authority.split(":", 1)[0]
    return authority  # a bare IPv6 literal, or no port


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback_host(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TrustSettings:
    """`allowed_hosts`: names besides IP literals and localhost that may appear in Host and Origin
    (`--allowed-host`, e.g. a Kubernetes service name); `"*"` turns the Host check off."""

    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts if h.strip()))

    def host_allowed(self, host: str) -> bool:
        return ("*" in self.allowed_hosts or is_ip_literal(host) or is_loopback_host(host)
                or host in self.allowed_hosts)

    def origin_allowed(self, origin: str, request_host: str) -> bool:
        if origin == "null":
            return False
        host = host_of(urlsplit(origin).netloc) if "://" in origin else ""
        return bool(host) and (is_loopback_host(host) or host == request_host or host in self.allowed_hosts)


def refusal(code: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "permission_error", "param": None,
                                 "code": code}}).encode()


class LoopbackTrust:
    """Pure ASGI: refuse what only a web page in someone's browser would send (see the module doc)."""

    def __init__(self, app: ASGIApp, settings: TrustSettings = TrustSettings(),
                 on_refusal: Callable[[int], None] = lambda status: None) -> None:
        self.app, self.settings, self.on_refusal = app, settings, on_refusal

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = _headers(scope.get("headers", ()))
        why = self.check(scope.get("method", "GET"), path, headers)
        if why is None:
            return await self.app(scope, receive, send)
        self.on_refusal(403)
        body = refusal(*why)
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def check(self, method: str, path: str, headers: dict[str, str]) -> tuple[str, str] | None:
        """(code, message) of the refusal, or None: the request may go on."""
        request_host = host_of(headers.get("host", ""))
        if request_host and not self.settings.host_allowed(request_host):
            return ("host_not_allowed", f"this server runs without --auth and answers only requests addressed to "
                    f"this machine (an IP address or localhost), not to {request_host!r}: a web page can make its "
                    "own name point here (DNS rebinding). Start the server with --allowed-host NAME to accept "
                    "that name, or with --auth")
        if method in SAFE_METHODS and (path in STATIC_PATHS or path.startswith(STATIC_PREFIXES)):
            return None
        origin = headers.get("origin")
        if origin is not None and not self.settings.origin_allowed(origin.strip().lower(), request_host):
            return ("cross_site_request", f"this server runs without --auth and refuses requests a web page on "
                    f"another site sends from a browser (Origin: {origin.strip()[:100]}); call it from a program, "
                    "or start the server with --auth and send an API key")
        if headers.get("sec-fetch-site", "").strip().lower() == "cross-site":
            return ("cross_site_request", "this server runs without --auth and refuses requests a web page on "
                    "another site sends from a browser (Sec-Fetch-Site: cross-site); call it from a program, or "
                    "start the server with --auth and send an API key")
        return None


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The headers this module reads (a repeated one: its first value, as browsers send each once)."""
    wanted = {b"host", b"origin", b"sec-fetch-site"}
    found: dict[str, str] = {}
    for name, value in raw:
        name = name.lower()
        if name in wanted and name.decode() not in found:
            found[name.decode()] = value.decode("latin-1")
    return found
