"""A streamed response's chunks written from the engine's thread straight to the client's socket.

Each streamed token otherwise wakes the event loop and runs its way through the request service's events,
the chunk's rendering, Starlette's and uvicorn's `send` and h11's framing: ~0.3 ms of CPU a token here, and on a
machine with two cores that CPU is taken from the engine's two compute threads, which then wait for each other
at their next barrier (docs/benchmarks.md, issue 29). With a `DirectWriter` the engine's thread renders a plain
delta and writes its chunk itself, in one non-blocking `send`, while the event loop has nothing of its own to
send on that connection; the loop is not woken at all.

How the two writers of one connection stay in order:
- The event loop writes the response's head, its opening chunks and everything at the end (`loop_sending` /
  `loop_sent` around each of its sends); the engine's thread may write only while `ready`: after the loop's
  last send finished with nothing left in the transport's buffer, and only while the stream's reader waits for
  its next output with nothing pending (engine/output_stream.py), so every earlier chunk is out.
- A write the socket does not take at all (its buffer is full: a slow reader) is declined, and that output goes
  the usual way, through the loop's send and its deadline. A write it takes in part hands the rest to the loop's
  transport (`call_soon_threadsafe`), ahead of anything the loop sends later; a failed write (the client left)
  is declined, and the loop finds out as it would.
- The writer holds its own duplicate of the socket's descriptor, so a connection the loop closes cannot be
  reused under it; `close` (the response's end, however it ends) releases it under the same lock as a write.

Only where it is exact: the connection is our h11 protocol's (gateway/limits.py puts the transport in the
request's scope), HTTP/1.1 with a chunked body (h11's framing, reproduced by `frame`), and not TLS.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import MutableMapping
from typing import Any

TRANSPORT_KEY = "tokenfactory.transport"  # in the scope's "state": the connection's transport (limits.py)


def frame(body: bytes) -> bytes:
    """One chunk of a chunked HTTP/1.1 body, as h11 frames `Data`."""
    return b"%x\r\n%b\r\n" % (len(body), body)


class DirectWriter:
    """Writes one streamed response's chunks from any thread while the event loop has nothing to send."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, sock: socket.socket) -> None:
        self._loop, self._transport, self._sock = loop, transport, sock
        self._lock = threading.Lock()
        self._ready = False  # the loop's sends are all out and the writer is open
        self._open = True
        self.num_written = 0  # chunks this writer wrote (not the loop)

    @classmethod
    def attach(cls, scope: MutableMapping[str, Any]) -> DirectWriter | None:
        """A writer for this request's connection, or None where direct writes would not be exact."""
        transport = (scope.get("state") or {}).get(TRANSPORT_KEY)
        if transport is None or scope.get("http_version") != "1.1" or transport.is_closing():
            return None
        if transport.get_extra_info("sslcontext") is not None:
            return None
        sock = transport.get_extra_info("socket")
        if sock is None:
            return None
        try:
            own = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return None
        own.setblocking(False)  # already so: the flag belongs to the shared open file
        return cls(asyncio.get_running_loop(), transport, own)

    def loop_sending(self) -> None:
        """The event loop is about to send on this connection: no direct writes until `loop_sent`."""
        with self._lock:
            self._ready = False

    def loop_sent(self) -> None:
        """The event loop's send returned: direct writes may go on once the transport's buffer is empty."""
        with self._lock:
            self._ready = self._open and self._transport.get_write_buffer_size() == 0

    def write(self, body: bytes) -> bool:
        """Any thread: `body` as the response's next chunk; False when it was not written (then send it the
        usual way)."""
        data = frame(body)
        with self._lock:
            if not self._ready:
                return False
            try:
                sent = self._sock.send(data)
            except BlockingIOError:
                return False
            except OSError:  # the client left: the loop finds out on its own
                self._ready = False
                return False
            self.num_written += 1
            if sent < len(data):  # the rest through the loop's transport, before anything it sends later
                self._ready = False
                self._loop.call_soon_threadsafe(_write_rest, self._transport, data[sent:])
            return True

    def close(self) -> None:
        """No more direct writes (a write under way finishes first); the descriptor is released."""
        with self._lock:
            if self._open:
                self._open = self._ready = False
                self._sock.close()


def _write_rest(transport: asyncio.Transport, data: bytes) -> None:
    if not transport.is_closing():
        transport.write(data)
