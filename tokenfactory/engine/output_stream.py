"""One request's outputs on the way to the event loop: at most one pending item, a slow reader's merged.

The engine side (a thread, or a replica's receiver) calls `put` through `loop.call_soon_threadsafe`; the
request's handler awaits `get`. When the reader has not taken the last output yet, the next is merged into
it (the newest whole state, the deltas joined), so a client that reads slowly costs one output's memory
whatever its speed, never a queue of copies. A `RequestFailed` is final. A reader that leaves early asks the
engine to abort and waits (bounded) for its `RequestAborted`: the engine has dropped the request and every step
it ran for it has reached the step listeners, so the meter settles an aborted request with all its work too.
No torch: any EngineClient may use it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenfactory.engine.client import EngineDeadError, RequestError, RequestFailed
from tokenfactory.types import RequestOutput

__all__ = ["OutputStream", "RequestAborted", "RequestFailed", "merge_outputs", "read_outputs"]


@dataclass(frozen=True)
class RequestAborted:
    """The engine's word that it dropped a request its reader left (after that request's steps were heard)."""

    request_id: str


def merge_outputs(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new`'s state with the deltas of both (an output the reader has not taken yet, then the next)."""
    by_index = {c.index: c for c in old.outputs}
    merged = []
    for c in new.outputs:
        o = by_index.get(c.index)
        if o is None:
            merged.append(c)
            continue
        logprobs = None if c.logprobs_delta is None else (o.logprobs_delta or []) + c.logprobs_delta
        merged.append(dataclasses.replace(c, text_delta=o.text_delta + c.text_delta,
                                          token_ids_delta=o.token_ids_delta + c.token_ids_delta,
                                          logprobs_delta=logprobs))
    return dataclasses.replace(new, outputs=merged)


class OutputStream:
    """One request's outputs, for the event loop: at most one pending item (see the module's docstring)."""

    def __init__(self) -> None:
        self.pending: RequestOutput | RequestFailed | None = None
        self.ready = asyncio.Event()
        self.num_merged = 0

    def put(self, item: RequestOutput | RequestFailed | RequestAborted) -> None:
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_outputs(self.pending, item)
            self.num_merged += 1
        elif isinstance(self.pending, RequestFailed):
            return  # a failure is final
        self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | RequestFailed | RequestAborted:
        await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        assert item is not None
        return item

    async def wait_aborted(self, timeout_s: float) -> bool:
        """Until the engine's RequestAborted (or a failure: it holds nothing of the request either); the outputs
        made meanwhile are dropped. False after `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                while not isinstance(await self.get(), RequestAborted | RequestFailed):
                    pass
        except TimeoutError:
            return False
        return True


ABORT_WAIT_S = 10.0  # how long a reader that left waits for the engine's RequestAborted (a long step, a hang)


def read_outputs(stream: OutputStream, start: Callable[[], None], close: Callable[[], None],
                 abort: Callable[[], bool]) -> AsyncIterator[RequestOutput]:
    """A request's outputs from its stream, as an EngineClient's `generate` yields them: `start()` (register the
    stream, send the request) runs at the first iteration, not before; a failure raises RequestError, or
    EngineDeadError when fatal. Leaving early calls `abort()` (send the engine an AbortRequest; True when it will
    answer with RequestAborted) and waits for that answer, at most ABORT_WAIT_S; `close()` (forget the stream)
    always runs after a start."""

    async def outputs() -> AsyncIterator[RequestOutput]:
        start()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, RequestFailed):
                    finished = True  # the engine holds nothing of it any more
                    if item.fatal:
                        raise EngineDeadError(item.message)
                    raise RequestError(item.message, item.param)
                if isinstance(item, RequestAborted):  # not asked for: the engine dropped it (it is shutting down)
                    raise EngineDeadError(f"the engine dropped request {item.request_id}")
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            try:
                if not finished and abort():
                    await stream.wait_aborted(ABORT_WAIT_S)
            finally:
                close()

    return outputs()
