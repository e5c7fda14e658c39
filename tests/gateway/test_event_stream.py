"""EventStream's send deadline and its close, over a plain ASGI send/receive (the real-HTTP slow reader is in
test_hardening_server.py): a send pending past the deadline drops the client; a slow but moving reader whose
whole stream outlasts the deadline many times is served to the end; a disconnect is a disconnect. Deadlines
are tenths of a second on the loop's clock, with margins of hundreds of milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from tokenfactory.gateway.streaming import EventStream

Message = dict


class Body:
    """A body generator that records how far it got and whether it was closed."""

    def __init__(self, chunks: int) -> None:
        self.chunks, self.yielded, self.closed = chunks, 0, False

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            for i in range(self.chunks):
                self.yielded += 1
                yield f"data: {i}\n\n"
        finally:
            self.closed = True


def run(stream_of: Callable[[Callable[[str], Awaitable[None]]], EventStream],
        send: Callable[[Message], Awaitable[None]],
        receive: Callable[[], Awaitable[Message]] | None = None) -> tuple[list[str], float]:
    """The stream run to its close; (the close's `how`s, the loop time it took)."""
    hows: list[str] = []

    async def on_close(how: str) -> None:
        hows.append(how)

    async def never_disconnects() -> Message:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def main() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with asyncio.timeout(20):  # a deadline that never fires fails here, not by hanging
            await stream_of(on_close)({"type": "http"}, receive or never_disconnects, send)
        return loop.time() - started

    return hows, asyncio.run(main())


def test_a_send_pending_past_the_deadline_drops_the_client_and_closes_the_body() -> None:
    body, sent = Body(1000), []

    async def send(message: Message) -> None:
        if len(sent) == 3:  # the client stops reading: this send never completes
            await asyncio.Event().wait()
        sent.append(message)

    hows, took = run(lambda on_close: EventStream(body.__aiter__(), on_close, send_timeout_s=0.3), send)
    assert hows == ["slow_reader"]
    assert 0.3 <= took < 2.0, took
    assert body.closed and body.yielded < 10
    assert len(sent) == 3


def test_a_slow_reader_that_keeps_reading_is_served_to_the_end() -> None:
    body, sent = Body(20), []

    async def send(message: Message) -> None:  # each send well inside the deadline, all of them far past it
        await asyncio.sleep(0.05)
        sent.append(message)

    hows, took = run(lambda on_close: EventStream(body.__aiter__(), on_close, send_timeout_s=0.4), send)
    assert hows == ["finished"]
    assert took > 2 * 0.4  # the stream as a whole outlasted the deadline: it is per send
    assert len(sent) == 22 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert body.closed


def test_a_disconnect_closes_the_stream_as_disconnected() -> None:
    body, sent = Body(1000), []
    gone = asyncio.Event()

    async def send(message: Message) -> None:
        sent.append(message)
        if len(sent) == 5:
            gone.set()
        await asyncio.sleep(0)

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    hows, _ = run(lambda on_close: EventStream(body.__aiter__(), on_close, send_timeout_s=30), send, receive)
    assert hows == ["disconnected"]
    assert body.closed and body.yielded < 1000


def test_a_body_that_fails_closes_as_failed() -> None:
    async def failing() -> AsyncIterator[str]:
        yield "data: 0\n\n"
        raise RuntimeError("the body broke")

    async def send(message: Message) -> None:
        return None

    hows, _ = run(lambda on_close: EventStream(failing(), on_close, send_timeout_s=30), send)
    assert hows == ["failed"]
