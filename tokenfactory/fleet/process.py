"""A replica in a local process: the embedded fleet's default (`serve --replicas N`), nothing to install.

The child is started with `spawn` (a fresh interpreter: no copy of the parent's threads or OpenMP state),
loads the model itself, builds and warms the engine on its main thread, sends a `WorkerReady`, then runs
`serve_worker` over its end of a pipe. It ignores SIGINT (the gateway stops it with a `Shutdown` after
draining) and exits when the pipe closes, so a gateway that dies takes no orphan with it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import signal
import threading
from typing import TYPE_CHECKING

from tokenfactory.engine.client import Message, Shutdown, WorkerEvents, WorkerReady
from tokenfactory.fleet.remote import RemoteEngine, WorkerLost

if TYPE_CHECKING:
    from tokenfactory.config import EngineConfig

logger = logging.getLogger(__name__)


class ProcessTransport:
    """A pipe to a child process (see fleet/remote.py's Transport)."""

    def __init__(self, process: multiprocessing.process.BaseProcess,
                 conn: multiprocessing.connection.Connection) -> None:
        self.process, self.conn = process, conn
        self._send_lock = threading.Lock()  # the event loop and the receiver (aborts) both send
        self._close_lock = threading.Lock()  # the receiver reaps a dead child while shutdown may close too

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, message: Message) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError) as e:
            raise WorkerLost(f"process {self.process.pid} is gone ({type(e).__name__})") from e

    def recv(self, timeout_s: float) -> WorkerEvents | None:
        try:
            if not self.conn.poll(timeout_s):
                return None
            return self.conn.recv()
        except (OSError, EOFError) as e:
            code = self.process.exitcode
            raise WorkerLost(f"process {self.process.pid} exited" + (f" with code {code}" if code is not None
                                                                       else "")) from e

    def close(self, timeout_s: float) -> None:
        """Join (then kill) the child and close the pipe; idempotent, and safe from two threads at once."""
        with self._close_lock:
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
            if not self.conn.closed:
                self.conn.close()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()


def start_process_replica(name: str, config: EngineConfig, threads: int | None = None,
                          hang_timeout_s: float = 10.0, ready_timeout_s: float = 600.0) -> RemoteEngine:
    """Start a child process with an engine for `config`; returns once it is ready (raises if it cannot be)."""
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    process = ctx.Process(target=_child_main, args=(child_conn, config, threads), name=f"tokenfactory-{name}",
                          daemon=True)
    process.start()
    child_conn.close()
    transport = ProcessTransport(process, parent_conn)
    try:
        first = transport.recv(ready_timeout_s)
    except WorkerLost as e:
        transport.close(1)
        raise RuntimeError(f"replica {name} could not start: {e}") from e
    if not isinstance(first, WorkerReady):
        reason = first.dead_reason if isinstance(first, WorkerEvents) else f"not ready in {ready_timeout_s:g} s"
        transport.kill()
        transport.close(1)
        raise RuntimeError(f"replica {name} could not start: {reason}")
    where = dataclasses.replace(first.facts, pid=process.pid)
    return RemoteEngine(name, transport, dataclasses.replace(first, facts=where), hang_timeout_s, kind="process")


def _child_main(conn: multiprocessing.connection.Connection, config: EngineConfig, threads: int | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s[replica]: %(message)s")
    try:
        engine = build_engine(config, threads)
    except BaseException as e:  # noqa: BLE001 - told to the parent, which refuses to start
        conn.send(WorkerEvents(dead_reason=f"{type(e).__name__}: {e}"))
        return
    from tokenfactory.engine.worker import serve_worker, worker_ready

    conn.send(worker_ready(engine))

    def recv(timeout_s: float | None) -> list[Message]:
        messages: list[Message] = []
        try:
            if conn.poll(timeout_s):
                messages.append(conn.recv())
                while conn.poll(0):
                    messages.append(conn.recv())
        except (OSError, EOFError):  # the gateway is gone: stop
            messages.append(Shutdown())
        return messages

    def emit(events: WorkerEvents) -> None:
        try:
            conn.send(events)
        except (OSError, ValueError):
            pass  # the gateway is gone; the next recv says so

    serve_worker(engine, recv, emit)


def build_engine(config: EngineConfig, threads: int | None):  # noqa: ANN201 - LLMEngine (torch, lazily)
    """The engine for a replica host, built and warmed up on the calling thread (the one that steps it)."""
    import torch

    from tokenfactory.engine.engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    engine = LLMEngine(config)
    engine.warmup()
    return engine
