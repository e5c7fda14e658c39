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
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


class SlowReaderError(TimeoutError):
    """The client did not take a chunk within the send deadline."""


class EventStream(StreamingResponse):

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[str], Awaitable[None]],
                 send_timeout_s: float) -> None:
        """`on_close(how)` with how in {"finished", "disconnected", "slow_reader", "failed"}."""
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close, self.send_timeout_s = on_close, send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self._stream(send))
        listening = asyncio.ensure_future(self._wait_for_disconnect(receive))
        how = "failed"
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
            if streaming.done() and not streaming.cancelled():
                error = streaming.exception()
                how = "finished" if error is None else "slow_reader" if isinstance(error, SlowReaderError) else how
                if error is not None and how == "failed":
                    logger.error("a streamed response failed", exc_info=error)
            else:
                how = "disconnected"
        finally:
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close(how)

    async def _stream(self, send: Send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            await self._send(send, {"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send: Send, message: dict) -> None:
        try:  # asyncio.timeout runs the send in this task; wait_for made a task for every chunk
            async with asyncio.timeout(self.send_timeout_s):
                await send(message)
        except TimeoutError:
            logger.warning("a streaming client took no data for %.0f s: dropping it and aborting its request",
                           self.send_timeout_s)
            raise SlowReaderError from None

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


def sse(chunk: dict, include_usage: bool = False) -> str:
    if include_usage and "usage" not in chunk:
        chunk = {**chunk, "usage": None}
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
