"""What a client does cannot hurt the server: a streaming client that stops reading is dropped, its
request aborted and billed, and the server's memory stays flat; clients that vanish right before a
SIGTERM still get their ledger rows; a request is settled once, however its callers are cancelled."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from tests.server_util import raw_request, start_server
from tokenfactory.meter.attribution import RequestEnergy
from tokenfactory.service.accounting import Settled
from tokenfactory.service.settlement import Settlement

MODEL = "SmolLM2-135M-Instruct"


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def ledger_rows(data_dir) -> list[tuple[str, str, int]]:
    with sqlite3.connect(data_dir / "ledger.db") as db:
        return db.execute("select request_id, status, completion_tokens from requests").fetchall()


@pytest.mark.slow
def test_a_client_that_stops_reading_is_dropped_aborted_and_billed(tmp_path) -> None:
    server = start_server(tmp_path, "--stream-send-timeout", "2", "--send-buffer", "4096")  # fills in ~100 chunks
    try:
        httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "warm", "max_tokens": 2})
        rss_before = rss_bytes(server.proc.pid)
        body = {"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 1500, "n": 2, "logprobs": 5,
                "ignore_eos": True, "stream": True}
        stalled = raw_request(server.port, body, rcvbuf=4096)  # reads nothing from here on
        started = time.monotonic()
        # Meanwhile another client is served as usual.
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200
        deadline = time.monotonic() + 90
        while not any(status == "aborted" for _, status, _ in ledger_rows(server.data_dir)):
            assert time.monotonic() < deadline, "the stalled stream was never dropped"
            time.sleep(0.2)
        waited = time.monotonic() - started
        [(_, _, made)] = [row for row in ledger_rows(server.data_dir) if row[1] == "aborted"]
        assert 0 < made < 2 * 1500, made  # billed for what was made before the drop, not the whole request
        assert server.metric("tokenfactory:num_requests_running") == 0
        assert server.metric("tokenfactory:kv_cache_usage_perc") == 0
        assert rss_bytes(server.proc.pid) - rss_before < 64 << 20
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
        # The connection is closed by the server: reading now drains the buffers, then ends.
        stalled.settimeout(10)
        while stalled.recv(1 << 16):
            pass
        stalled.close()
        assert waited < 60
    finally:
        server.stop()


@pytest.mark.slow
def test_sigterm_writes_the_rows_of_clients_that_just_left(tmp_path) -> None:
    server = start_server(tmp_path)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    socks = [raw_request(server.port, body) for _ in range(6)]
    for s in socks:  # each sees its stream begin, then hangs up
        s.settimeout(30)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
    for s in socks:
        s.close()
    assert server.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
    rows = ledger_rows(server.data_dir)
    assert len(rows) == 6 and {status for _, status, _ in rows} == {"aborted"}
    assert len({rid for rid, _, _ in rows}) == 6


class SlowAccounting:
    """An accounting whose ledger write waits until released (a row being written when the client leaves)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    async def settle_request(self, request_id, engine_ids, finals, status, tenant="anonymous", model=None):
        self.calls += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        return Settled(ENERGY)


ENERGY = RequestEnergy("cmpl-1", 1.0, "constant", "system", 1.0, 1.0, 0.1, 1e9, 1, 1, 0.0, 0.0, 0.0)


class Held:
    def __init__(self) -> None:
        self.settled: list = []
        self.tenant = "t"

    def settle(self, finals, energy, credit=None) -> None:
        self.settled.append(energy)


def test_a_request_is_settled_once_when_its_caller_is_cancelled_mid_write() -> None:
    accounting, held = SlowAccounting(), Held()
    pending: set = set()

    async def main() -> dict:
        settlement = Settlement(accounting, pending, "cmpl-1", [SimpleNamespace(request_id="cmpl-1-0")],  # type: ignore[arg-type]
                                held)  # type: ignore[arg-type]
        caller = asyncio.ensure_future(settlement.settle([None], "finished"))
        await asyncio.sleep(0.05)
        caller.cancel()  # the client disconnects while its row is being written
        settlement.start([None], "aborted")  # ... and the disconnect path settles too
        accounting.release.set()
        assert settlement.task is not None
        return await settlement.task

    assert asyncio.run(main()) is ENERGY
    assert not pending  # done, so no longer awaited at shutdown
    assert accounting.calls == 1 and held.settled == [ENERGY]
