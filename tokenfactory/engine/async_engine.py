"""The engine in its own thread, and an asyncio face for the server.

The step loop runs in a dedicated thread so the HTTP event loop never waits on a forward pass and a
slow client never stalls a step (PyTorch releases the GIL inside its kernels, so both make progress on
a 2-core machine). The two sides talk only through typed messages: the event loop puts `AddRequest` /
`AbortRequest` into the engine's inbox; the engine thread hands each `RequestOutput` back to the
request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
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
    """Sent to a request's stream when the engine could not take it or crashed while serving it."""

    request_id: str
    message: str


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.inbox: queue.SimpleQueue[AddRequest | AbortRequest | None] = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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
        stream: asyncio.Queue = asyncio.Queue()
        self.streams[request.request_id] = (asyncio.get_running_loop(), stream)
        self.num_added += 1
        self.inbox.put(request)
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, RequestFailed):
                    raise EngineDeadError(item.message)
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
                        self._deliver(out.request_id, out)
                        if out.finished:
                            for listener in self.finish_listeners:
                                listener(out)
        except BaseException as e:  # the engine is broken: fail every open stream, never hang them
            self.dead_reason = f"the engine stopped: {type(e).__name__}: {e}"
            logger.exception("engine loop crashed")
            for request_id in list(self.streams):
                self._deliver(request_id, RequestFailed(request_id, self.dead_reason))

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

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed) -> None:
        target = self.streams.get(request_id)
        if target is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self.engine.abort_request(request_id)  # nobody is listening any more
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the event loop is closed
            self.engine.abort_request(request_id)
