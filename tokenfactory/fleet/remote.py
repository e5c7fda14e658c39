"""An engine in another process or on Ray, behind the same `EngineClient` as the in-process one.

The host (fleet/process.py, fleet/ray_replica.py) runs `engine.worker.serve_worker`; between it and this
client a `Transport` carries the client's messages one way and `WorkerEvents` batches the other. A receiver
thread reads the batches: each output goes to its request's `OutputStream` (one pending, merged if the reader
is slow), each step's `StepStats` to the step listeners (the gateway's meter), the snapshot to `stats()`.

A worker that is gone (the process died, the actor was killed, the pipe broke) or silent past
`hang_timeout_s` (it heartbeats every 0.5 s while idle, and at least every 50 ms while busy) is dead: every
open stream ends with `EngineDeadError` naming the replica and why, so the fleet can re-route the requests that
had no output yet and end the others with a clear error, never a hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tokenfactory.engine.client import (
    AbortRequest,
    AddRequest,
    ClientBase,
    Control,
    DirectOutputs,
    DrainReplica,
    EngineStats,
    Message,
    Shutdown,
    WorkerEvents,
    WorkerReady,
)
from tokenfactory.engine.output_stream import OutputStream, RequestAborted, RequestFailed, read_outputs
from tokenfactory.types import RequestOutput

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """The worker's side of the transport is gone."""


class Transport(Protocol):
    """Messages to one worker and its event batches back. `recv` is called by one thread only."""

    def send(self, message: Message) -> None:
        """Queue a message for the worker; raises WorkerLost when it is gone."""
        ...

    def recv(self, timeout_s: float) -> WorkerEvents | None:
        """The next batch, or None if none came within `timeout_s`; raises WorkerLost when it is gone."""
        ...

    def close(self, timeout_s: float) -> None:
        """Ask the worker to stop (after a Shutdown was sent), and free the transport."""
        ...

    def kill(self) -> None:
        """Stop the worker now (a hung one)."""
        ...


@dataclass
class _Whole:
    """A request's state rebuilt from the worker's deltas (engine/worker.py's compact_output)."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list | None = None  # sent with the first output
    index_to_ids: dict[int, list[int]] = field(default_factory=dict)
    index_to_text: dict[int, str] = field(default_factory=dict)
    index_to_logprobs: dict[int, list] = field(default_factory=dict)

    def rebuild(self, out: RequestOutput) -> RequestOutput:
        outputs = []
        for c in out.outputs:
            ids = self.index_to_ids.setdefault(c.index, [])
            ids.extend(c.token_ids_delta)
            text = c.text if c.finished else self.index_to_text.get(c.index, "") + c.text_delta
            self.index_to_text[c.index] = text
            logprobs = None
            if c.logprobs_delta is not None:
                logprobs = self.index_to_logprobs.setdefault(c.index, [])
                logprobs.extend(c.logprobs_delta)
                logprobs = list(logprobs)
            outputs.append(dataclasses.replace(c, text=text, token_ids=list(ids), logprobs=logprobs))
        return dataclasses.replace(out, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids, outputs=outputs,
                                   prompt_logprobs=self.prompt_logprobs)


class RemoteEngine(ClientBase):
    """An EngineClient over a Transport (see the module's docstring). `ready.facts` carry where it runs (the
    host adds its pid and node before constructing it)."""

    def __init__(self, name: str, transport: Transport, ready: WorkerReady, hang_timeout_s: float = 10.0,
                 kind: str = "process") -> None:
        super().__init__(ready.info, ready.tokenizer, ready.facts)
        self.name, self.kind = name, kind
        self._transport = transport
        self._stats = ready.stats
        self.hang_timeout_s = hang_timeout_s
        self.streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}
        self._wholes: dict[str, _Whole] = {}  # the receiver's; a closing stream pops its own (atomic)
        self._lock = threading.Lock()  # streams: added by the event loop, read by the receiver
        self._num_in_flight_adds = 0  # sent, not yet reflected in a snapshot
        self._last_event_time = time.monotonic()
        self._receiver = threading.Thread(target=self._receive, name=f"replica-{name}-recv", daemon=True)

    # -- EngineClient ------------------------------------------------------------------------------------

    def start(self) -> None:
        if not self._receiver.is_alive():
            self._receiver.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._dead_reason is None:
            try:
                self._transport.send(Shutdown())
            except WorkerLost:
                pass
        self._fail_all(f"replica {self.name} was shut down")
        if self._receiver.is_alive() and self._receiver is not threading.current_thread():
            self._receiver.join(min(timeout, 2.0))  # it stops within one poll; then nothing reads the pipe we close
        self._transport.close(timeout)

    def kill(self, reason: str) -> None:
        """Stop the worker now and fail its streams (a hung replica)."""
        self._fail_all(reason)
        self._transport.kill()

    def send(self, message: Control) -> None:
        if self._dead_reason is not None or isinstance(message, DrainReplica):
            return
        try:
            self._transport.send(message)
        except WorkerLost as e:
            self._fail_all(f"replica {self.name} is gone: {e}")

    def stats(self) -> EngineStats:
        s = self._stats
        return dataclasses.replace(s, num_waiting=s.num_waiting + self._num_in_flight_adds, alive=self.is_alive,
                                   dead_reason=self._dead_reason)

    def generate(self, request: AddRequest,
                 direct: DirectOutputs | None = None) -> AsyncIterator[RequestOutput]:
        # `direct` (EngineClient.generate): not taken: outputs come from the receiver thread through the loop.
        stream = OutputStream()

        def start() -> None:
            loop = asyncio.get_running_loop()
            with self._lock:
                if self._dead_reason is not None:
                    stream.put(RequestFailed(request.request_id, self._dead_reason, fatal=True))
                    return
                self.streams[request.request_id] = (loop, stream)
            self._num_in_flight_adds += 1
            try:
                self._transport.send(request)
            except WorkerLost as e:
                self._fail_all(f"replica {self.name} is gone: {e}")

        def abort() -> bool:
            with self._lock:
                known = request.request_id in self.streams
            if known:
                self.send(AbortRequest(request.request_id))  # the worker answers in its batch's `aborted`
            return known and self._dead_reason is None

        def close() -> None:
            with self._lock:
                self.streams.pop(request.request_id, None)
            self._wholes.pop(request.request_id, None)

        return read_outputs(stream, start, close, abort)

    # -- receiver thread ---------------------------------------------------------------------------------

    def _receive(self) -> None:
        try:
            while self._dead_reason is None:
                batch = self._transport.recv(min(1.0, self.hang_timeout_s))
                now = time.monotonic()
                if batch is None:
                    if now - self._last_event_time > self.hang_timeout_s:
                        self.kill(f"replica {self.name} hung: no word from it in {self.hang_timeout_s:g} s")
                    continue
                self._last_event_time = now
                self._apply(batch)
        except WorkerLost as e:
            self._fail_all(f"replica {self.name} died: {e}")
            self._transport.close(1.0)  # reap it (a dead child stays a zombie until joined)
        except Exception as e:  # noqa: BLE001 - the receiver must never die silently and hang the streams
            logger.exception("replica %s: receiver failed", self.name)
            self._fail_all(f"replica {self.name}: its receiver failed: {type(e).__name__}: {e}")

    def _apply(self, batch: WorkerEvents) -> None:
        for step in batch.steps:  # before the batch's outputs: the meter has a request's steps before its end
            self.publish_step(step)
        if batch.stats is not None:
            self._stats = batch.stats
            self._num_in_flight_adds = 0
        for failure in batch.failures:
            self._wholes.pop(failure.request_id, None)
            self._deliver(failure.request_id, failure)
        for compact in batch.outputs:
            whole = self._wholes.get(compact.request_id)
            if whole is None:
                whole = self._wholes[compact.request_id] = _Whole(compact.prompt, compact.prompt_token_ids,
                                                                  compact.prompt_logprobs)
            out = whole.rebuild(compact)
            if out.finished:
                del self._wholes[out.request_id]
            self._deliver(out.request_id, out)
        for request_id in batch.aborted:  # after this batch's steps: the meter has all of the request's work
            self._wholes.pop(request_id, None)
            self._deliver(request_id, RequestAborted(request_id))
        if batch.dead_reason is not None:
            self._fail_all(f"replica {self.name}: {batch.dead_reason}")

    def _deliver(self, request_id: str, item: RequestOutput | RequestFailed | RequestAborted) -> None:
        with self._lock:
            target = self.streams.get(request_id)
        if target is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self._wholes.pop(request_id, None)
                self.send(AbortRequest(request_id))  # nobody is listening any more
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put, item)
        except RuntimeError:  # the event loop is closed
            pass

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead_reason is None:
                self._dead_reason = reason
            targets = list(self.streams.items())
        for request_id, (loop, stream) in targets:
            try:
                loop.call_soon_threadsafe(stream.put, RequestFailed(request_id, reason, fatal=True))
            except RuntimeError:
                pass
