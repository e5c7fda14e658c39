"""The engine in its own thread: the in-process `EngineClient` (client.py).

The step loop runs in a dedicated thread so the HTTP event loop never waits on a forward pass and a
slow client never stalls a step (PyTorch releases the GIL inside its kernels, so both make progress on
a 2-core machine). The two sides talk only through the client's typed messages: the event loop puts
`AddRequest`, `AbortRequest`, `SetTenantWeight`, `ChargeEnergy` and `Shutdown` into the engine's inbox;
the engine thread hands each `RequestOutput` back to the request's stream with `call_soon_threadsafe`
and publishes an immutable `EngineStats` snapshot after its steps (at most every `STATS_INTERVAL_S`, and
whenever it goes idle), which `stats()` returns without touching the engine.

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
import time
from collections.abc import AsyncIterator, Callable

from tokenfactory.engine.client import (
    AbortRequest,
    AddRequest,
    ChargeEnergy,
    EngineDeadError,
    EngineStats,
    Message,
    ModelInfo,
    RequestError,
    SetTenantWeight,
    Shutdown,
)
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.output_stream import OutputStream, RequestFailed, read_outputs
from tokenfactory.engine.worker import EngineWorker
from tokenfactory.models.tokenizer import Tokenizer
from tokenfactory.types import RequestOutput

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05

__all__ = ["AbortRequest", "AddRequest", "AsyncEngine", "EngineDeadError", "OutputStream", "RequestError"]


class AsyncEngine:
    """The in-process EngineClient: an LLMEngine stepped by its own thread.

    `launch(factory)` builds and warms the engine up on that thread, and is what a server should use: with
    libgomp, once one thread has run a parallel region, parallel regions from another thread run in a
    second team that stalls against the first (measured on 2 cores, SmolLM2 single-stream decode at 2
    threads: 107 tok/s stepped where it was built, 49 tok/s built in the main thread and stepped in
    another). `AsyncEngine(engine)` wraps an engine built by the caller (tests, notebooks)."""

    @classmethod
    def launch(cls, factory: Callable[[], LLMEngine], warmup: bool = True, timeout: float | None = None
               ) -> AsyncEngine:
        """Build the engine with `factory` on the engine thread, warm it up there, and start stepping; returns
        once it is ready. An exception from building or warming up is raised here."""
        client = cls.__new__(cls)
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                engine = factory()
                if warmup:
                    engine.warmup()
                client._setup(engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failed.append(e)
                return
            finally:
                ready.set()
            client._loop()

        client._thread = threading.Thread(target=run, name="tokenfactory-engine", daemon=True)
        client._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"the engine was not built within {timeout} s")
        if failed:
            client._thread.join()
            raise failed[0]
        return client

    def __init__(self, engine: LLMEngine) -> None:
        self._setup(engine)
        self._thread = threading.Thread(target=self._loop, name="tokenfactory-engine", daemon=True)

    def _setup(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._worker = EngineWorker(engine)
        self._info = engine.info
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        # Each counter is written by one thread only, so their difference needs no lock.
        self.num_added = 0  # by the event loop
        self.num_taken = 0  # by the engine thread
        self._dead_reason: str | None = None
        self.finish_listeners: list[Callable[[RequestOutput], None]] = []
        self._stats = engine.stats()
        self._stats_time = 0.0

    # -- the client's side (any thread) -------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer  # immutable after load; the gateway tokenizes on its side

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def engine(self) -> LLMEngine:
        """The engine itself, for the composition root's start-up banner (immutable facts: capacity, device,
        weights); its running state belongs to the engine thread alone."""
        return self._engine

    @property
    def facts(self) -> dict[str, object]:
        """What does not change while it runs, as the fleet's workers report it (WorkerReady.facts): the
        dashboard's memory split (weights, KV cache) reads it."""
        cap = self._engine.capacity
        return {"device": str(self._engine.device), "weight_bytes": self._engine.weight_bytes,
                "kv_bytes": cap.total_bytes, "kv_blocks": cap.num_blocks, "kv_tokens": cap.num_tokens}

    def start(self) -> None:
        """Start stepping (an engine from `launch` is already stepping)."""
        if not self._thread.is_alive():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.inbox.put(Shutdown())
        self._thread.join(timeout)

    def send(self, message: SetTenantWeight | ChargeEnergy | AbortRequest) -> None:
        self.inbox.put(message)

    def stats(self) -> EngineStats:
        s = self._stats
        waiting = s.num_waiting + self.num_added - self.num_taken  # requests still in the inbox count too
        return dataclasses.replace(s, num_waiting=waiting, alive=self.is_alive, dead_reason=self._dead_reason)

    def generate(self, request: AddRequest) -> AsyncIterator[RequestOutput]:
        """Queue a request (at the first iteration) and yield its outputs as steps produce them. Leaving the
        iterator early (the client went away, the task was cancelled) aborts the request and frees its blocks."""
        stream = OutputStream()

        def start() -> None:
            if not self.is_alive:
                raise EngineDeadError(self._dead_reason or "the engine is not running")
            self.streams[request.request_id] = (asyncio.get_running_loop(), stream)
            self.num_added += 1
            self.inbox.put(request)

        def close(finished: bool) -> None:
            self.streams.pop(request.request_id, None)
            if not finished:
                self.inbox.put(AbortRequest(request.request_id))

        return read_outputs(stream, start, close)

    # -- engine thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self._engine
        try:
            while self._drain_inbox(block=not engine.has_unfinished_requests):
                if engine.has_unfinished_requests:
                    outputs, failures = self._worker.step()
                    self._deliver_step([(f.request_id, f) for f in failures] +
                                       [(out.request_id, out) for out in outputs])
                    for out in outputs:
                        if out.finished:
                            for listener in self.finish_listeners:
                                listener(out)
                self._publish_stats(force=not engine.has_unfinished_requests)
        except BaseException as e:  # the engine itself is broken: fail every open stream, never hang them
            self._dead_reason = f"the engine stopped: {type(e).__name__}: {e}"
            logger.exception("engine loop crashed")
        self._publish_stats(force=True)
        reason = self._dead_reason or "the engine was shut down"
        for request_id in list(self.streams):
            self._deliver(request_id, RequestFailed(request_id, reason, fatal=True))

    def _publish_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats, self._stats_time = self._engine.stats(), now

    def _drain_inbox(self, block: bool) -> bool:
        """Apply the waiting messages (waiting up to 0.5 s for one when `block`); False on Shutdown."""
        while True:
            try:
                msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                return True
            block = False
            if isinstance(msg, Shutdown):
                return False
            if isinstance(msg, AddRequest):
                self.num_taken += 1
                if msg.request_id not in self.streams:
                    continue  # the client left before the engine saw the request
            if (failure := self._worker.apply(msg)) is not None:
                self._deliver(failure.request_id, failure)

    def _deliver_step(self, items: list[tuple[str, RequestOutput | RequestFailed]]) -> None:
        """A step's outputs, one `call_soon_threadsafe` per event loop rather than one per request: each call
        wakes the loop (a write to its self-pipe) and takes the GIL from this thread, 32 times a step at 32
        streams."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput | RequestFailed]]] = {}
        for request_id, item in items:
            target = self.streams.get(request_id)
            if target is None:
                if isinstance(item, RequestOutput) and not item.finished:
                    self._engine.abort_request(request_id)  # nobody is listening any more
                continue
            by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the event loop is closed
                for _, item in pairs:
                    if isinstance(item, RequestOutput):
                        self._engine.abort_request(item.request_id)

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed) -> None:
        target = self.streams.get(request_id)
        if target is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self._engine.abort_request(request_id)  # nobody is listening any more
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the event loop is closed
            self._engine.abort_request(request_id)


def _put_all(pairs: list[tuple[OutputStream, RequestOutput | RequestFailed]]) -> None:
    for stream, item in pairs:
        stream.put(item)
