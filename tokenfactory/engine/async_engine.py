"""The engine in its own thread: the in-process `EngineClient` (client.py).

The step loop runs in a dedicated thread so the HTTP event loop never waits on a forward pass and a
slow client never stalls a step (PyTorch releases the GIL inside its kernels, so both make progress on
a 2-core machine). The two sides talk only through the client's typed messages: the event loop puts
`AddRequest`, `AbortRequest`, `SetTenantWeight`, `ChargeEnergy` and `Shutdown` into the engine's inbox;
the engine thread hands each `RequestOutput` back to the request's stream with `call_soon_threadsafe`
and publishes an immutable `EngineStats` snapshot after its steps (at most every `STATS_INTERVAL_S`, and
whenever it goes idle), which `stats()` returns without touching the engine.

Step listeners (`subscribe_steps`: the meter, which reads a power source) run on a notifier thread, never on
the engine's: the engine thread hands the steps' `StepStats` over with the final outputs and failures they made
(steps that end nothing at most every `NOTICE_INTERVAL_S`, and whenever it goes idle), and the notifier calls the
listeners (each guarded: one that raises is logged, the engine goes on) before it delivers them, so a request's
final output reaches its stream only after the meter has seen its last step.
Outputs that are not final go straight to their streams: streaming latency does not wait for the meter. A
stream whose reader gave `generate` a `direct` consumer may take them on the engine thread instead, while its
reader waits (output_stream.py): the event loop is then not woken for them at all.

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
    ClientBase,
    Control,
    DirectOutputs,
    DrainReplica,
    EngineDeadError,
    EngineStats,
    Message,
    RequestError,
    Shutdown,
)
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.engine.output_stream import OutputStream, RequestAborted, RequestFailed, read_outputs
from tokenfactory.engine.worker import EngineWorker, engine_facts
from tokenfactory.types import RequestOutput, StepStats

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05
NOTICE_INTERVAL_S = 0.05  # steps that end nothing reach the step listeners at least this often

__all__ = ["AbortRequest", "AddRequest", "AsyncEngine", "EngineDeadError", "OutputStream", "RequestError"]


# What the engine thread hands the notifier: steps, then the (request id, final output, failure or abort's
# acknowledgement) they ended.
_End = RequestOutput | RequestFailed | RequestAborted
_Notice = tuple[tuple[StepStats, ...], list[tuple[str, _End]]]


class AsyncEngine(ClientBase):
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
        super().__init__(engine.info, engine.tokenizer, engine_facts(engine))
        self._engine = engine
        self._worker = EngineWorker(engine)
        self.inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        # Each counter is written by one thread only, so their difference needs no lock.
        self.num_added = 0  # by the event loop
        self.num_taken = 0  # by the engine thread
        self._steps: list[StepStats] = []  # the engine thread's, since its last hand-over
        engine.step_listeners.append(self._steps.append)
        self._notices: queue.SimpleQueue[_Notice | None] = queue.SimpleQueue()
        self._notifier = threading.Thread(target=self._notify, name="tokenfactory-engine-listeners", daemon=True)
        self._handed_at = 0.0
        self._stats = engine.stats()
        self._stats_time = 0.0

    # -- the client's side (any thread) -------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead_reason is None

    def start(self) -> None:
        """Start stepping (an engine from `launch` is already stepping)."""
        if not self._thread.is_alive():
            self._thread.start()

    def subscribe_steps(self, listener: Callable[[StepStats], None]) -> None:
        if not self._notifier.is_alive():
            self._notifier.start()  # before the engine thread can see a listener (it then hands steps over)
        super().subscribe_steps(listener)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.inbox.put(Shutdown())
        self._thread.join(timeout)
        if self._notifier.is_alive() and not self._thread.is_alive():
            self._notifier.join(timeout)

    def send(self, message: Control) -> None:
        if not isinstance(message, DrainReplica):  # one engine has no replica to drain
            self.inbox.put(message)

    def stats(self) -> EngineStats:
        s = self._stats
        waiting = s.num_waiting + self.num_added - self.num_taken  # requests still in the inbox count too
        return dataclasses.replace(s, num_waiting=waiting, alive=self.is_alive, dead_reason=self._dead_reason)

    def generate(self, request: AddRequest, direct: DirectOutputs | None = None) -> AsyncIterator[RequestOutput]:
        """Queue a request (at the first iteration) and yield its outputs as steps produce them. Leaving the
        iterator early (the client went away, the task was cancelled) aborts the request and frees its blocks.
        `direct`: offered non-final outputs on the engine thread while the reader waits (output_stream.py)."""
        stream = OutputStream(direct)

        def start() -> None:
            if not self.is_alive:
                raise EngineDeadError(self._dead_reason or "the engine is not running")
            self.streams[request.request_id] = (asyncio.get_running_loop(), stream)
            self.num_added += 1
            self.inbox.put(request)

        def abort() -> bool:
            self.inbox.put(AbortRequest(request.request_id))
            return self.is_alive  # the engine thread answers with RequestAborted (_drain_inbox)

        def close() -> None:
            self.streams.pop(request.request_id, None)

        return read_outputs(stream, start, close, abort)

    # -- engine thread ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        engine = self._engine
        try:
            while self._drain_inbox(block=not engine.has_unfinished_requests):
                if engine.has_unfinished_requests:
                    self._step()
                elif self._steps and self._notifier.is_alive():
                    self._hand_over([])  # idle: the listeners hear every step before the engine waits
                self._publish_stats(force=not engine.has_unfinished_requests)
        except BaseException as e:  # the engine itself is broken: fail every open stream, never hang them
            self._dead_reason = f"the engine stopped: {type(e).__name__}: {e}"
            logger.exception("engine loop crashed")
        self._publish_stats(force=True)
        reason = self._dead_reason or "the engine was shut down"
        ends: list[tuple[str, _End]] = [
            (request_id, RequestFailed(request_id, reason, fatal=True)) for request_id in list(self.streams)]
        if self._notifier.is_alive():  # after the finals it still holds: a request that finished stays finished
            self._hand_over(ends)
            self._notices.put(None)
        else:
            for request_id, item in ends:
                self._deliver(request_id, item)

    def _step(self) -> None:
        """One step; its outputs to their streams, its steps and what it ended through the notifier."""
        outputs, failures = self._worker.step()
        items: list[tuple[str, _End]] = [(f.request_id, f) for f in failures]
        items += [(out.request_id, out) for out in outputs]
        if not self._step_listeners:  # nobody to hear the steps: everything straight to the streams
            self._steps.clear()
            self._deliver_step(items)
            return
        self._deliver_step([(rid, item) for rid, item in items if isinstance(item, RequestOutput)
                            and not item.finished])
        ends = [(rid, item) for rid, item in items if not isinstance(item, RequestOutput) or item.finished]
        if ends or time.monotonic() - self._handed_at >= NOTICE_INTERVAL_S:
            self._hand_over(ends)

    def _hand_over(self, ends: list[tuple[str, _End]]) -> None:
        """The steps since the last hand-over, then `ends`, to the notifier (engine thread). Waking it every step cost
        a single stream ~0.16 ms a token (its wake-up and its turn at the GIL, on 2 cores): steps without an end
        wait for the next end, for NOTICE_INTERVAL_S, or for the engine to go idle."""
        steps = tuple(self._steps)
        self._steps.clear()
        self._handed_at = time.monotonic()
        self._notices.put((steps, ends))

    def _notify(self) -> None:
        """The notifier thread: each hand-over's steps to the listeners, then its finals to their streams (all
        that waits at once: a notifier that fell behind catches up in one go)."""
        while True:
            batch = [self._notices.get()]
            try:
                while True:
                    batch.append(self._notices.get_nowait())
            except queue.Empty:
                pass
            for notice in batch:
                if notice is None:
                    return
                steps, ends = notice
                for step in steps:
                    self.publish_step(step)
                self._deliver_step(ends, abort_orphans=False)  # this thread never touches the engine

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
            if isinstance(msg, AbortRequest):  # after the steps it ran, which the notifier may still hold
                self._end(msg.request_id, RequestAborted(msg.request_id))

    def _end(self, request_id: str, item: _End) -> None:
        """An end outside a step (an abort's answer), in order with what the notifier holds."""
        if self._notifier.is_alive():
            self._hand_over([(request_id, item)])
        else:
            self._put(request_id, item)

    def _deliver_step(self, items: list[tuple[str, _End]], abort_orphans: bool = True) -> None:
        """A step's outputs, one `call_soon_threadsafe` per event loop rather than one per request: each call
        wakes the loop (a write to its self-pipe) and takes the GIL from this thread, 32 times a step at 32
        streams. `abort_orphans` (the engine thread only): abort a request nobody listens to any more."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, _End]]] = {}
        for request_id, item in items:
            target = self.streams.get(request_id)
            if target is None:
                if abort_orphans and isinstance(item, RequestOutput) and not item.finished:
                    self._engine.abort_request(request_id)  # nobody is listening any more
                continue
            stream = target[1]
            if isinstance(item, RequestOutput) and stream.offer(item):
                continue  # consumed on this thread: the loop is not woken for it
            stream.posted()
            by_loop.setdefault(target[0], []).append((stream, item))
        for loop, pairs in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the event loop is closed
                for _, item in pairs:
                    if abort_orphans and isinstance(item, RequestOutput):
                        self._engine.abort_request(item.request_id)

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed) -> None:
        """On the engine thread: to the stream, or abort the request when nobody is listening any more."""
        if not self._put(request_id, item) and isinstance(item, RequestOutput) and not item.finished:
            self._engine.abort_request(request_id)

    def _put(self, request_id: str, item: _End) -> bool:
        """Into the request's stream (any thread); False when it has none or its event loop is closed."""
        target = self.streams.get(request_id)
        if target is None:
            return False
        loop, stream = target
        stream.posted()
        try:
            loop.call_soon_threadsafe(stream.put_posted, item)
        except RuntimeError:  # the event loop is closed
            return False
        return True


def _put_all(pairs: list[tuple[OutputStream, _End]]) -> None:
    for stream, item in pairs:
        stream.put_posted(item)
