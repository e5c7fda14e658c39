"""Connection limits for `tokenfactory serve`: what uvicorn has, set; what it lacks, added.

uvicorn bounds connections (`limit_concurrency`), idle keep-alive connections and the size of a request
head, but a client that opens a connection and sends its head one byte every few seconds (slowloris)
holds the connection forever, and so does one that announces a body and trickles it. Two small pieces
close that, each on the hook uvicorn offers for it:

- `protocol_class(settings)`: a subclass of uvicorn's `H11Protocol`, passed as uvicorn's `http=`. A
  request head must be complete within `header_timeout_s` of its first byte (or of the connection's
  opening); a body nobody reads (the response already sent) must end within `body_timeout_s`. Past
  either, the connection is closed. It also answers uvicorn's own refusals in OpenAI's error shape: a
  head over the size cap (431), a malformed head (400), more than `limit_concurrency` (503).
- `wrap_app(app, settings)`: an ASGI middleware; a request's whole body must arrive within
  `body_timeout_s` of its head, or the client gets 408 and the connection closes.

A slow *reader* (the response side) is the app's to bound, not this module's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenfactory.gateway.direct import TRANSPORT_KEY

logger = logging.getLogger("tokenfactory.limits")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class LimitSettings:
    """The server's connection limits; `docs/server.md` ("Limits") gives each default and why."""

    limit_concurrency: int | None = 1024  # open connections or running requests beyond this: 503
    backlog: int = 2048  # connections the kernel queues before the server accepts them
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    header_timeout_s: float = 10.0  # from a request head's first byte (or the connection) to its end
    body_timeout_s: float = 30.0  # from the end of the head to the end of the body
    max_header_bytes: int = 16 << 10  # a request line and headers beyond this: 431
    # The kernel's send buffer per connection (SO_SNDBUF): without it Linux grows a socket that a client
    # does not read up to tcp_wmem's maximum (4 MiB), per connection, before the server sees back-pressure.
    send_buffer_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1 (or None: no limit), got {self.limit_concurrency}")
        if self.send_buffer_bytes < 4096:
            raise ValueError(f"send_buffer_bytes must be >= 4096, got {self.send_buffer_bytes}")
        if self.backlog < 1 or self.max_header_bytes < 1024:
            raise ValueError(f"backlog must be >= 1 and max_header_bytes >= 1024, got {self.backlog} and "
                             f"{self.max_header_bytes}")

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `uvicorn.run` (the concurrency limit is the protocol's, in OpenAI's shape)."""
        return {"http": protocol_class(self), "backlog": self.backlog, "timeout_keep_alive": self.timeout_keep_alive_s,
                "h11_max_incomplete_event_size": self.max_header_bytes}

    def describe(self) -> str:
        """One banner line."""
        limit = "no connection limit" if self.limit_concurrency is None else f"{self.limit_concurrency} connections"
        return (f"{limit}; head {self.header_timeout_s:g} s and {self.max_header_bytes} bytes, body "
                f"{self.body_timeout_s:g} s, keep-alive {self.timeout_keep_alive_s:g} s, send buffer "
                f"{self.send_buffer_bytes >> 10} KiB")


def error_body(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "param": None, "code": code}}).encode()


def error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes the connection, for writing raw."""
    body = error_body(status, message, code)
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on what a client owes: a request head, or an unread body."""

    settings = LimitSettings()  # replaced per server by `protocol_class`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # uvicorn's check answers in text/plain; `_gate` answers in JSON
        self.app = self._gate(self.app)
        self._deadline: asyncio.TimerHandle | None = None
        self._owed: str | None = None  # "head" or "body": what the armed deadline waits for

    def _gate(self, app: ASGIApp) -> ASGIApp:
        """uvicorn's `limit_concurrency` rule (connections or tasks), checked as the request starts."""
        limit = self.settings.limit_concurrency

        async def gated(scope: Scope, receive: Receive, send: Send) -> None:
            # This request's task is already in `tasks`, hence `>` where uvicorn (checking before) has `>=`.
            if limit is not None and (len(self.connections) >= limit or len(self.tasks) > limit):
                logger.warning("more than %d connections or requests: 503", limit)
                await send_error(send, 503, f"the server is at its limit of {limit} concurrent connections; "
                                 "retry shortly", "overloaded", [(b"retry-after", b"1")])
                return
            await app(scope, receive, send)

        return gated

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # bounded kernel memory for a client that stops reading
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.settings.send_buffer_bytes)
        super().connection_made(transport)
        # Each request's scope["state"] is a copy of this: its stream may write chunks directly (direct.py).
        self.app_state = {**self.app_state, TRANSPORT_KEY: transport}
        self._track_deadline()  # a connection that never sends a byte is a head that never ends

    def data_received(self, data: bytes) -> None:
        if self._head_over_cap(data):
            cap = self.settings.max_header_bytes
            self._refuse(error_bytes(431, "Request Header Fields Too Large", f"the request line and headers are "
                                     f"larger than the server's limit of {cap} bytes",
                                     "request_header_fields_too_large"))
            return
        super().data_received(data)
        self._track_deadline()

    def _head_over_cap(self, data: bytes) -> bool:
        """Whether the head being received is over the cap, counted here: h11's own cap
        (`max_incomplete_event_size`) only bounds a head still incomplete, not one that arrives whole."""
        if self.conn.their_state is not h11.IDLE:
            return False
        received = self.conn.trailing_data[0] + data
        cap = self.settings.max_header_bytes
        return len(received) > cap and received.find(b"\r\n\r\n", 0, cap + 4) == -1

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _what_is_owed(self) -> str | None:
        conn = self.conn
        if conn.their_state is h11.IDLE:
            return "head"
        if conn.our_state is h11.DONE and conn.their_state is h11.SEND_BODY:
            return "body"  # answered without reading the body (404, 405, 413): uvicorn drains it forever
        return None

    def _track_deadline(self) -> None:
        """Arm the deadline when the client starts owing something; keep it while it still owes that.

        Not re-armed on every byte: trickling one byte at a time must not push the deadline back.
        """
        owed = self._what_is_owed()
        if owed == self._owed:
            return
        self._cancel_deadline()
        if owed is not None and not self.transport.is_closing():
            timeout = self.settings.header_timeout_s if owed == "head" else self.settings.body_timeout_s
            self._owed, self._deadline = owed, self.loop.call_later(timeout, self._on_deadline, owed, timeout)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._owed = None, None

    def _on_deadline(self, owed: str, timeout: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closing %s: its request %s did not arrive within %g s", self.client, owed, timeout)
        if owed == "head" and self.conn.trailing_data[0]:  # a client that sent part of a head is told why
            self.transport.write(error_bytes(408, "Request Timeout", f"the request head did not arrive within "
                                             f"{timeout:g} s", "request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head h11 refused, in OpenAI's shape."""
        self._refuse(error_bytes(400, "Bad Request", f"invalid HTTP request: {msg}", "invalid_http"))

    def _refuse(self, response: bytes) -> None:
        self._cancel_deadline()
        self.transport.write(response)
        self.transport.close()


def protocol_class(settings: LimitSettings) -> type[LimitedH11Protocol]:
    """A `LimitedH11Protocol` bound to these settings (uvicorn builds the protocol itself, from the class)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"settings": settings})


async def send_error(send: Send, status: int, message: str, code: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_body(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyDeadline:
    """The whole request body must arrive within `timeout_s` of its head, or the client gets 408.

    A deadline for the whole body, not per read: a per-read timeout is what a trickling client defeats.
    On expiry this middleware answers itself and tells the app the client left (`http.disconnect`), so the
    app needs no knowledge of it; what the app then sends is dropped.
    """

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        state = {"body_done": False, "timed_out": False, "started": False}

        async def timed_receive() -> Message:
            if state["timed_out"]:
                return {"type": "http.disconnect"}
            if state["body_done"]:
                return await receive()  # the app waiting for a disconnect: no deadline on that
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                state["timed_out"] = True
                if not state["started"]:
                    await send_error(send, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                                     "request_timeout")
                return {"type": "http.disconnect"}
            state["body_done"] = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            if not state["timed_out"]:
                state["started"] = True
                await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not state["timed_out"]:
                raise
            logger.debug("the app's reaction to a body timeout, already answered with 408", exc_info=True)


def wrap_app(app: ASGIApp, settings: LimitSettings) -> ASGIApp:
    """The app with the body deadline around it (the head deadline is the protocol's)."""
    return BodyDeadline(app, settings.body_timeout_s)


def raise_fd_limit(settings: LimitSettings, reserve: int = 256) -> str | None:
    """Lift the soft open-files limit so `limit_concurrency` sockets fit; a warning when the hard one is short.

    Past the limit, accept() fails with EMFILE and asyncio stops accepting for a second at a time, for
    everyone: worse than the clean 503 the limit gives.
    """
    if settings.limit_concurrency is None:
        return None
    needed = settings.limit_concurrency + reserve  # model files, the ledger, the kernel cache, pipes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return None
    new_soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
    if new_soft < needed:
        return (f"open files are limited to {hard} (ulimit -Hn), fewer than --limit-concurrency "
                f"{settings.limit_concurrency} + {reserve}; connections past it fail to be accepted")
    return None
