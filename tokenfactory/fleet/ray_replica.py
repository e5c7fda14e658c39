"""A replica as a Ray actor (`serve --ray [ADDRESS]`): Ray places it with its CPU/GPU resources, keeps its
process, and tells us when it dies; the engine inside runs the same `serve_worker` as a local process.

Inside the actor a thread of our own builds, warms up and steps the engine (AsyncEngine.launch says why it
must be one thread); Ray's threads only move data: `send(seq, messages)` puts messages in the worker's inbox
(in `seq` order: a threaded actor does not promise the order of calls), and `poll(timeout)` returns the
batches made since the last poll, or nothing after `timeout` (so a hung engine is silent, not heartbeating).
On this side, `RayTransport` keeps one poll in flight and turns a dead actor into `WorkerLost`.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
from typing import TYPE_CHECKING, Any

from tokenfactory.engine.client import Message, Shutdown, WorkerEvents, WorkerReady
from tokenfactory.fleet.remote import RemoteEngine, WorkerLost

if TYPE_CHECKING:
    from tokenfactory.config import EngineConfig


class EngineActorImpl:
    """The actor's body (wrapped by `ray.remote` in `actor_class`)."""

    def __init__(self, config: EngineConfig, threads: int | None) -> None:
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._events: queue.SimpleQueue[WorkerEvents | WorkerReady] = queue.SimpleQueue()
        self._next_seq, self._held = 0, {}
        self._order = threading.Lock()
        threading.Thread(target=self._run, args=(config, threads), name="tokenfactory-engine", daemon=True).start()

    def _run(self, config: EngineConfig, threads: int | None) -> None:
        from tokenfactory.engine.worker import serve_worker, worker_ready
        from tokenfactory.fleet.process import build_engine

        try:
            engine = build_engine(config, threads)
        except BaseException as e:  # noqa: BLE001 - told to the driver, which refuses to start the replica
            self._events.put(WorkerEvents(dead_reason=f"{type(e).__name__}: {e}"))
            return
        self._events.put(worker_ready(engine))

        def recv(timeout_s: float | None) -> list[Message]:
            messages = []
            try:
                messages.append(self._inbox.get(timeout=timeout_s) if timeout_s else self._inbox.get_nowait())
                while True:
                    messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

        serve_worker(engine, recv, self._events.put)

    def ready(self, timeout_s: float) -> WorkerReady | WorkerEvents | None:
        try:
            return self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def send(self, seq: int, messages: list[Message]) -> None:
        with self._order:
            self._held[seq] = messages
            while self._next_seq in self._held:
                for m in self._held.pop(self._next_seq):
                    self._inbox.put(m)
                self._next_seq += 1

    def poll(self, timeout_s: float) -> list[WorkerEvents]:
        batches = []
        try:
            batches.append(self._events.get(timeout=timeout_s))
            while True:
                batches.append(self._events.get_nowait())
        except queue.Empty:
            return batches

    def pid(self) -> int:
        import os

        return os.getpid()


_ACTOR_CLASS: Any = None


def actor_class() -> Any:
    """`EngineActorImpl` as a Ray actor class (Ray imported only when a Ray fleet is asked for)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        _ACTOR_CLASS = ray.remote(max_concurrency=4)(EngineActorImpl)
    return _ACTOR_CLASS


class RayTransport:
    """Messages to an engine actor, its batches back (see fleet/remote.py's Transport)."""

    POLL_S = 0.5

    def __init__(self, actor: Any) -> None:
        import ray

        self._ray, self.actor = ray, actor
        self._seq = itertools.count()
        self._seq_lock = threading.Lock()
        self._poll: Any = None
        self._pending: list[WorkerEvents] = []

    def send(self, message: Message) -> None:
        with self._seq_lock:  # the sequence numbers in the order the calls are submitted
            self.actor.send.remote(next(self._seq), [message])

    def recv(self, timeout_s: float) -> WorkerEvents | None:
        if self._pending:
            return self._pending.pop(0)
        if self._poll is None:
            self._poll = self.actor.poll.remote(self.POLL_S)
        done, _ = self._ray.wait([self._poll], timeout=timeout_s)
        if not done:
            return None
        ref, self._poll = self._poll, None
        try:
            batches = self._ray.get(ref)
        except self._ray.exceptions.RayError as e:
            raise WorkerLost(f"the Ray actor is gone ({type(e).__name__})") from e
        if not batches:
            return None  # the actor is there, the engine said nothing: silence counts toward a hang
        self._pending = list(batches[1:])
        return batches[0]

    def close(self, timeout_s: float) -> None:
        try:
            self._ray.get(self.actor.poll.remote(0.0), timeout=min(timeout_s, 5.0))
        except Exception:  # noqa: BLE001, S110 - it is being stopped either way
            pass
        self.kill()

    def kill(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001, S110 - already gone
            pass


def start_ray_replica(name: str, config: EngineConfig, threads: int | None = None, num_cpus: float = 1.0,
                      num_gpus: float = 0.0, hang_timeout_s: float = 10.0, ready_timeout_s: float = 600.0
                      ) -> RemoteEngine:
    """Place an engine actor with its resources; returns once its engine is ready (raises if it cannot be)."""
    import ray

    actor = actor_class().options(num_cpus=num_cpus, num_gpus=num_gpus, name=None).remote(config, threads)
    transport = RayTransport(actor)
    try:
        first = ray.get(actor.ready.remote(ready_timeout_s), timeout=ready_timeout_s + 60)
    except ray.exceptions.RayError as e:
        transport.kill()
        raise RuntimeError(f"replica {name} could not start on Ray: {e}") from e
    if not isinstance(first, WorkerReady):
        transport.kill()
        reason = first.dead_reason if isinstance(first, WorkerEvents) else f"not ready in {ready_timeout_s:g} s"
        raise RuntimeError(f"replica {name} could not start on Ray: {reason}")
    where = dataclasses.replace(first.facts, pid=ray.get(actor.pid.remote()), node="ray")
    return RemoteEngine(name, transport, dataclasses.replace(first, facts=where), hang_timeout_s, kind="ray")


__all__ = ["EngineActorImpl", "RayTransport", "Shutdown", "actor_class", "start_ray_replica"]
