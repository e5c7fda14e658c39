"""Start a real `tokenfactory serve` subprocess on a free loopback port, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


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

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        return stop_process(self.proc, sig, timeout)


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


def start_server(tmp: Path, *args: str, timeout: float = 180) -> Server:
    port = free_port()
    data_dir = tmp / "data"
    log_path = tmp / f"server-{port}.log"
    cmd = [sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
           "--kv-cache-memory", "256MiB", "--max-model-len", "2048", "--log-level", "warning", *args]
    log = open(log_path, "w")  # noqa: SIM115 - the child writes to it for its whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
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
