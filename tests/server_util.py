"""Start a real `tokenfactory serve` subprocess on a free loopback port, for tests; or the gateway app in
this process (`start_gateway`) over any engine client, such as tests/fake_engine.py's."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


def until(cond: Callable[[], bool], timeout_s: float = 20.0, what: str = "the condition") -> None:
    """Poll `cond` until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def raw_request(port: int, body: dict, rcvbuf: int | None = None) -> socket.socket:
    """POST `body` to /v1/completions on a raw socket (`rcvbuf`: a small receive window, set before connecting);
    the caller reads the response, or does not."""
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small window
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    data_dir: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metric(self, name: str) -> float:
        """Sum of a metric's samples in /metrics."""
        total, found = 0.0, False
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"{name} not in /metrics"
        return total

    def ledger_rows(self, request_id: str | None = None) -> list[dict[str, Any]]:
        return ledger_rows(self.data_dir / "ledger.db", request_id)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        return stop_process(self.proc, sig, timeout)


def ledger_rows(path: Path, request_id: str | None = None) -> list[dict[str, Any]]:
    """The ledger's rows (one request's, or all) straight from its SQLite file."""
    with sqlite3.connect(path) as conn:
        conn.row_factory = sqlite3.Row
        where, args = ("WHERE request_id = ?", (request_id,)) if request_id else ("", ())
        return [dict(r) for r in conn.execute(f"SELECT * FROM requests {where} ORDER BY id", args)]


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
    """Signal a child server and wait for it; SIGKILL it if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_server(tmp: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> Server:
    """`env`: the server's whole environment (default: this process's)."""
    port = free_port()
    data_dir = tmp / "data"
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
           "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--log-level", "warning", *args]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})
    server = Server(proc, port, data_dir, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{server.log()}")


def read_metric(url: str, name: str) -> float:
    """Sum of a metric's samples in a server's /metrics."""
    total, found = 0.0, False
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


@dataclass
class Gateway:
    """The real gateway app under uvicorn in a thread of this process, over any EngineClient."""

    server: Any  # uvicorn.Server
    thread: threading.Thread
    port: int
    engine: Any  # the EngineClient
    ledger_path: Path
    store: Any  # TenantStore | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        return read_metric(self.url, name)

    def ledger_rows(self, request_id: str | None = None) -> list[dict[str, Any]]:
        return ledger_rows(self.ledger_path, request_id)

    def stop(self, timeout: float = 15) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_gateway(engine: Any, data_dir: Path, *, auth: bool = False, max_waiting: int = 64,  # noqa: ANN401
                  max_body_bytes: int = 200_000, model_name: str = "fake-tiny", watts: float = 100.0,
                  timeout: float = 20, batch: Any = None, limits: Any = None,  # noqa: ANN401 - BatchSettings
                  stream_send_timeout_s: float = 30.0, direct_stream_writes: bool = True) -> Gateway:
    """Wire the gateway as `tokenfactory serve` does (serve/wiring.py wire_app): a Meter on a constant power source
    hearing the engine's steps, a SQLite ledger in `data_dir`, Admission (and with `auth`, a TenantStore
    on the ledger's database), limits.wrap_app (`limits`: a LimitSettings, default its defaults), the Batch API
    (with `batch`'s settings); start `engine` and serve on a free loopback port."""
    import uvicorn

    from tokenfactory.engine.client import SetTenantWeight
    from tokenfactory.gateway.app import ServerSettings
    from tokenfactory.gateway.limits import LimitSettings, wrap_app
    from tokenfactory.meter.attribution import Meter
    from tokenfactory.meter.ledger import LEDGER_FILENAME, Ledger
    from tokenfactory.meter.power import ConstantSource
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.serve.wiring import wire_app
    from tokenfactory.service.accounting import Accounting
    from tokenfactory.service.admission import Admission
    from tokenfactory.service.tenancy import Tenancy
    from tokenfactory.tenants.store import TenantStore

    meter = Meter(ConstantSource(watts), engine.info.config, load_prices(None)).start()
    engine.subscribe_steps(meter.on_step)
    ledger = Ledger.open(data_dir)
    accounting = Accounting(meter, ledger, model_name)
    store = TenantStore(ledger.engine) if auth else None
    tenancy = Tenancy(store, Admission(ledger, max_waiting=max_waiting),
                      lambda tenant, weight: engine.send(SetTenantWeight(tenant, weight)))

    def shutdown() -> None:
        engine.shutdown()
        meter.close()
        accounting.close()

    settings = ServerSettings(served_model_name=model_name, max_waiting=max_waiting, max_body_bytes=max_body_bytes,
                              stream_send_timeout_s=stream_send_timeout_s, direct_stream_writes=direct_stream_writes)
    app = wire_app(engine, settings, accounting, tenancy, on_shutdown=shutdown, batch=batch)
    engine.start()
    limits, port = limits or LimitSettings(), free_port()
    config = uvicorn.Config(wrap_app(app, limits), host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=5, **limits.uvicorn_kwargs())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the gateway did not start on port {port}")
        time.sleep(0.01)
    return Gateway(server, thread, port, engine, data_dir / LEDGER_FILENAME, store)
