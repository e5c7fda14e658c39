"""The ledger on a real PostgreSQL server (a private cluster started in a temporary directory), through the
same SQLAlchemy code as SQLite: record, find, totals with grouping, concurrent writers."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.server_util import free_port
from tokenfactory.meter.ledger import Ledger, LedgerRow

pytestmark = pytest.mark.slow

INITDB = shutil.which("initdb") or "/usr/lib/postgresql/15/bin/initdb"


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root: drop to the postgres user when we are root.
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def postgres_url() -> str:
    if not Path(INITDB).exists():
        pytest.skip("PostgreSQL server binaries are not installed (Debian package postgresql)")
    pytest.importorskip("psycopg")
    # Not under pytest's temporary root: that is private to root, and the server runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="tokenfactory-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    bindir = Path(INITDB).resolve().parent
    subprocess.run(_as_postgres([INITDB, "-D", str(data), "-U", "tf", "--auth=trust", "-E", "UTF8"]), check=True,
                   capture_output=True)
    port = free_port()
    server = subprocess.Popen(_as_postgres([str(bindir / "postgres"), "-D", str(data), "-p", str(port),
                                            "-k", str(sock), "-c", "listen_addresses=127.0.0.1"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"postgresql+psycopg://tf@127.0.0.1:{port}/postgres"
    import sqlalchemy as sa

    deadline = time.monotonic() + 30
    while True:
        try:
            sa.create_engine(url).connect().close()
            break
        except sa.exc.OperationalError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("the PostgreSQL test cluster did not start")
            time.sleep(0.3)
    yield url
    server.terminate()
    server.wait(30)
    shutil.rmtree(root, ignore_errors=True)


def row(i: int, tenant: str = "a", model: str = "m") -> LedgerRow:
    return LedgerRow(request_id=f"r{i}", model=model, status="finished", prompt_tokens=10, completion_tokens=i,
                     tenant=tenant, energy_joules=0.5, energy_source="modelled", energy_scope="cpu-package",
                     cost_usd=0.001, cost_energy_usd=0.0001, cost_device_usd=0.0009)


def test_ledger_on_postgresql(postgres_url) -> None:
    ledger = Ledger(postgres_url)
    try:
        ledger.record(row(1))
        [found] = ledger.find("r1")
        assert found.completion_tokens == 1 and found.energy_source == "modelled"

        def writer(k: int) -> None:
            for j in range(10):
                ledger.record(row(100 + 10 * k + j, tenant=f"t{k % 2}"))

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ledger.count() == 41
        [total] = ledger.totals()
        assert total.num_requests == 41 and total.energy_joules == pytest.approx(41 * 0.5)
        by_tenant = {t.key: t.num_requests for t in ledger.totals(group_by="tenant")}
        assert by_tenant == {"a": 1, "t0": 20, "t1": 20}
    finally:
        ledger.close()
    reopened = Ledger(postgres_url)
    try:
        assert reopened.count() == 41
    finally:
        reopened.close()
