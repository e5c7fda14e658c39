"""A private PostgreSQL cluster in a temporary directory, for tests that need a real server (and, for the
fault tests, to stop and start it under load). Skips when the server binaries or psycopg are missing."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.server_util import free_port

# Debian keeps the server binaries off PATH, under /usr/lib/postgresql/<version>/bin: take the newest.
INITDB = shutil.which("initdb") or max(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                                       key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
                                       default="/usr/lib/postgresql/15/bin/initdb")


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root: drop to the postgres user when we are root.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


class PostgresCluster:
    def __init__(self) -> None:
        if not Path(INITDB).exists():
            pytest.skip("PostgreSQL server binaries are not installed (Debian package postgresql)")
        pytest.importorskip("psycopg")
        # Not under pytest's temporary root: that is private to root, and the server runs as postgres.
        self.root = Path(tempfile.mkdtemp(prefix="tokenfactory-pg-"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.sock.mkdir()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sock, "postgres")
        self.bindir = Path(INITDB).resolve().parent
        subprocess.run(_as_postgres([INITDB, "-D", str(self.data), "-U", "tf", "--auth=trust", "-E", "UTF8"]),
                       check=True, capture_output=True)
        self.port = free_port()
        self.url = f"postgresql+psycopg://tf@127.0.0.1:{self.port}/postgres"
        self.server: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        import sqlalchemy as sa

        self.server = subprocess.Popen(_as_postgres([
            str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.sock),
            "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                engine = sa.create_engine(self.url)
                engine.connect().close()
                engine.dispose()
                return
            except sa.exc.OperationalError:
                if time.monotonic() > deadline or self.server.poll() is not None:
                    self.server.kill()
                    pytest.fail("the PostgreSQL test cluster did not start")
                time.sleep(0.2)

    def stop(self, fast: bool = True) -> None:
        """pg_ctl stop: "fast" (aborts open transactions, closes connections) or "immediate" (a crash:
        recovery runs at the next start). runuser does not pass signals on, so pg_ctl sends them."""
        if self.server is None:
            return
        subprocess.run(_as_postgres([str(self.bindir / "pg_ctl"), "-D", str(self.data), "stop", "-w",
                                     "-m", "fast" if fast else "immediate"]), check=True, capture_output=True)
        self.server.wait(30)
        self.server = None

    def remove(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(30)
            self.server = None
        shutil.rmtree(self.root, ignore_errors=True)
