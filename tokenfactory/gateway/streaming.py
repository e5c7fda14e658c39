"""Server-sent events that a client cannot hold hostage.

`EventStream` is the response of every streamed request (Starlette's StreamingResponse without its
two gaps for us):

- A client that stops reading fills the socket; uvicorn's `send` then waits for it to drain. Each send
  here has a deadline (`send_timeout_s`): past it the client is dropped, the body generator is closed
  (which aborts its engine requests and settles them as aborted, billed for what was made) and the
  connection closed. Together with the engine's coalescing streams (async_engine.OutputStream), a slow
  reader holds one pending output and one socket buffer, never a growing queue.
- The body generator is always closed and `on_close` always awaited, whether the body ran to its end,
  failed, was cut by a disconnect, or never started (the client left before the first byte): settlement
  has one place to happen.

A response given `direct` hands it the connection's `DirectWriter` (direct.py) before the body starts, where
the connection allows one: chunks may then also be written from the engine's thread between the loop's sends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenfactory.gateway.direct import DirectWriter

logger = logging.getLogger(__name__)


class EventStream(StreamingResponse):

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[str], Awaitable[None]],
                 send_timeout_s: float, direct: Callable[[DirectWriter], bool] | None = None) -> None:
        """`on_close(how)` with how in {"finished", "disconnected", "slow_reader", "failed"}; `direct(writer)`
        before the body starts, where the connection can take direct writes (False: the body will not use it)."""
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close, self.send_timeout_s = on_close, send_timeout_s
        self.direct = direct
        self.writer: DirectWriter | None = None
        self._sending_since: float | None = None  # the loop's time the pending send began; None between sends
        self._dropped = False  # the deadline's timer cancelled the stream
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        if self.direct is not None and (writer := DirectWriter.attach(scope)) is not None:
            if self.direct(writer):
                self.writer = writer
            else:
                writer.close()
        streaming = asyncio.ensure_future(self._stream(send, loop))
        listening = asyncio.ensure_future(self._wait_for_disconnect(receive))
        self._timer = loop.call_later(self.send_timeout_s, self._check_deadline, loop, streaming)
        how = "failed"
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
            if streaming.done() and not streaming.cancelled():
                error = streaming.exception()
                how = "finished" if error is None else how
                if error is not None:
                    logger.error("a streamed response failed", exc_info=error)
            else:
                how = "slow_reader" if self._dropped else "disconnected"
        finally:
            if self.writer is not None:
                self.writer.close()
            if self._timer is not None:
                self._timer.cancel()
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close(how)

    async def _stream(self, send: Send, loop: asyncio.AbstractEventLoop) -> None:
        await self._send(send, loop, {"type": "http.response.start", "status": self.status_code,
                                      "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await self._send(send, loop, {"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        if self.writer is not None:
            self.writer.close()  # before the end: a connection uvicorn closes then is not held open by its copy
        await self._send(send, loop, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send: Send, loop: asyncio.AbstractEventLoop, message: dict) -> None:
        writer = self.writer
        if writer is not None:
            writer.loop_sending()
        self._sending_since = loop.time()  # no await between this and the send: only a send can be timed out
        await send(message)
        self._sending_since = None
        if writer is not None:
            writer.loop_sent()

    def _check_deadline(self, loop: asyncio.AbstractEventLoop, streaming: asyncio.Future) -> None:
        """The send deadline's one timer (a deadline per chunk, asyncio.timeout's, cost the event loop a timer
        handle and its cancellation every token): due `send_timeout_s` after the pending send began, or after now
        when none is pending (a later send cannot be late before then). A send still pending when it is due drops
        the client: its task is cancelled, as a timeout would."""
        since, now = self._sending_since, loop.time()
        if since is not None and now - since >= self.send_timeout_s:
            logger.warning("a streaming client took no data for %.0f s: dropping it and aborting its request",
                           self.send_timeout_s)
            self._dropped = True
            streaming.cancel()
            return
        self._timer = loop.call_at((now if since is None else since) + self.send_timeout_s,
                                   self._check_deadline, loop, streaming)

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


def sse(chunk: dict, include_usage: bool = False) -> str:
    if include_usage and "usage" not in chunk:
        chunk = {**chunk, "usage": None}
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
