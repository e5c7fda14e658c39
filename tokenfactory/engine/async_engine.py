"""The engine in its own thread, and an asyncio face for the server.

The step loop runs in a dedicated thread so the HTTP event loop never waits on a forward pass and a
slow client never stalls a step (PyTorch releases the GIL inside its kernels, so both make progress on
a 2-core machine). The two sides talk only through typed messages: the event loop puts `AddRequest` /
`AbortRequest` into the engine's inbox; the engine thread hands each `RequestOutput` back to the
request's stream with `call_soon_threadsafe`.

Back-pressure: a stream holds at most one pending output. When the reader has not taken the last one
yet, the next is merged into it (the newest whole state, the deltas joined), so a client that reads
slowly costs one output's memory whatever its speed, and never a queue of copies. A request the engine
fails alone (engine/faults.py) ends its own stream with `RequestError`; only an engine that stopped
ends every stream, with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tokenfactory.engine.engine import LLMEngine
from tokenfactory.types import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    prompt: str | None
    params: SamplingParams
    arrival_time: float
    tenant: str
    priority: int


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class RequestFailed:
    """Sent to a request's stream when the engine could not take it, failed it, or stopped (`fatal`)."""

    request_id: str
    message: str
    fatal: bool = False


class EngineDeadError(RuntimeError):
    """The engine stopped: every request fails until a restart."""


class RequestError(RuntimeError):
    """The engine failed this request alone; it goes on serving the others."""


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

    def put(self, item: RequestOutput | RequestFailed) -> None:
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_outputs(self.pending, item)
            self.num_merged += 1
        elif isinstance(self.pending, RequestFailed):
            return  # a failure is final
        self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | RequestFailed:
        await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        assert item is not None
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[AddRequest | AbortRequest | None] = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        # Each counter is written by one thread only, so their difference needs no lock.
        self.num_added = 0  # by the event loop
        self.num_taken = 0  # by the engine thread
        self.dead_reason: str | None = None
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tokenfactory-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.inbox.put(None)
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.dead_reason is None

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self.num_added - self.num_taken

    async def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as steps produce them. Leaving the iterator early
        (the client went away, the task was cancelled) aborts the request and frees its blocks."""
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        stream = OutputStream()
        self.streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self.num_added += 1
        self.inbox.put(request)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, RequestFailed):
                    finished = True  # the engine holds nothing of it any more
                    raise (EngineDeadError if item.fatal else RequestError)(item.message)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.streams.pop(request.request_id, None)
            if not finished:
                self.inbox.put(AbortRequest(request.request_id))

    # -- engine thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests)
                if self.engine.has_unfinished_requests:
                    for out in self.engine.step():
                        if out.error is not None:
                            self._deliver(out.request_id, RequestFailed(out.request_id, out.error))
                            continue
                        self._deliver(out.request_id, out)
                        if out.finished:
                            for listener in self.finish_listeners:
                                listener(out)
        except BaseException as e:  # the engine itself is broken: fail every open stream, never hang them
            self.dead_reason = f"the engine stopped: {type(e).__name__}: {e}"
            logger.exception("engine loop crashed")
            for request_id in list(self.streams):
                self._deliver(request_id, RequestFailed(request_id, self.dead_reason, fatal=True))

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if msg is None:
                return
            if isinstance(msg, AbortRequest):
                self.engine.abort_request(msg.request_id)
                continue
            self.num_taken += 1
            if msg.request_id not in self.streams:
                continue  # the client left before the engine saw the request
            try:
                self.engine.add_request({"prompt_token_ids": msg.prompt_token_ids}, msg.params, msg.request_id,
                                        arrival_time=msg.arrival_time, tenant=msg.tenant, priority=msg.priority)
                state = self.engine.requests[msg.request_id]
                state.prompt = msg.prompt
            except ValueError as e:
                self._deliver(msg.request_id, RequestFailed(msg.request_id, str(e)))
            except Exception as e:  # noqa: BLE001 - a request that cannot be added fails alone
                logger.exception("request %s could not be added", msg.request_id)
                self.engine.abort_request(msg.request_id)
                self._deliver(msg.request_id, RequestFailed(msg.request_id, f"the engine could not take this "
                                                            f"request: {type(e).__name__}: {e}"))

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed) -> None:
        target = self.streams.get(request_id)
        if target is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self.engine.abort_request(request_id)  # nobody is listening any more
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the event loop is closed
            self.engine.abort_request(request_id)
