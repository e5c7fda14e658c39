"""One request's outputs on the way to the event loop: at most one pending item, a slow reader's merged.

The engine side (a thread, or a replica's receiver) calls `put` through `loop.call_soon_threadsafe`; the
request's handler awaits `get`. When the reader has not taken the last output yet, the next is merged into
it (the newest whole state, the deltas joined), so a client that reads slowly costs one output's memory
whatever its speed, never a queue of copies. A `RequestFailed` is final. A reader that leaves early asks the
engine to abort and waits (bounded) for its `RequestAborted`: the engine has dropped the request and every step
it ran for it has reached the step listeners, so the meter settles an aborted request with all its work too.
No torch: any EngineClient may use it.

Direct outputs (`OutputStream.direct`, the in-process engine's): while the reader waits with nothing pending and
nothing on its way through the loop, the engine thread may hand a non-final output to the reader's `direct`
callable instead, which consumes it there (the HTTP layer writes its chunk to the socket) or declines it (it then
comes through the loop as usual). On a machine with few cores, waking the event loop for every token and running
its per-token Python takes the CPU the engine's threads compute on; the direct path takes neither. Order holds:
an output goes direct only when every earlier one has been read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenfactory.engine.client import DirectOutputs, EngineDeadError, RequestError, RequestFailed
from tokenfactory.types import RequestOutput

__all__ = ["OutputStream", "RequestAborted", "RequestFailed", "merge_outputs", "read_outputs"]

logger = logging.getLogger(__name__)


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

    def __init__(self, direct: DirectOutputs | None = None) -> None:
        self.pending: RequestOutput | RequestFailed | None = None
        self.ready = asyncio.Event()
        self.num_merged = 0
        self.direct = direct
        self.num_direct = 0
        self._lock = threading.Lock()  # the engine thread's `offer` against the reader's waiting and disarming
        self._in_flight = 0  # items `posted` and not yet `put`: on their way through the event loop
        self._waiting = False  # the reader waits with nothing pending or in flight

    def posted(self) -> None:
        """The engine side is sending an item through the event loop (`put_posted` takes it there)."""
        with self._lock:
            self._in_flight += 1
            self._waiting = False

    def put_posted(self, item: RequestOutput | RequestFailed | RequestAborted) -> None:
        with self._lock:
            self._in_flight -= 1
        self.put(item)

    def offer(self, out: RequestOutput) -> bool:
        """Engine thread: `out` to the reader's `direct` callable, when the reader waits for it with nothing
        pending or in flight and `out` is not final. False: send it through the loop as usual."""
        if self.direct is None or not self._waiting or out.finished:
            return False
        with self._lock:
            direct = self.direct
            if direct is None or not self._waiting or self._in_flight or self.pending is not None:
                return False
            try:
                taken = direct(out)
            except Exception:  # the direct path is an optimisation: its failure sends the rest the usual way
                logger.exception("a direct output consumer failed; the request's outputs go through the loop")
                self.direct = None
                return False
        self.num_direct += taken
        return taken

    def disarm(self) -> None:
        """No more direct outputs; one being consumed finishes first."""
        with self._lock:
            self.direct = None
            self._waiting = False

    def put(self, item: RequestOutput | RequestFailed | RequestAborted) -> None:
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_outputs(self.pending, item)
            self.num_merged += 1
        elif isinstance(self.pending, RequestFailed):
            return  # a failure is final
        self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | RequestFailed | RequestAborted:
        if self.pending is None and self.direct is not None:
            with self._lock:
                self._waiting = self.pending is None and not self._in_flight
        try:
            await self.ready.wait()
        finally:
            self._waiting = False
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
            stream.disarm()
            try:
                if not finished and abort():
                    await stream.wait_aborted(ABORT_WAIT_S)
            finally:
                close()

    return outputs()
