"""`serve --autoscaler slo` on the bundled model, as a user runs it: load rises and a second local replica is
started and used; load stops and it is drained and stopped, with every stream finished and one ledger row per
request; the decisions are in GET /fleet/autoscaler and /metrics."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import httpx
import openai
import pytest

from tests.server_util import Server, start_server
from tokenfactory.cli import main

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def replicas(server: Server) -> dict[str, dict]:
    return {r["replica_id"]: r for r in httpx.get(server.url + "/fleet/replicas", timeout=10).json()["data"]}


def wait_for(predicate, timeout_s: float, what: str) -> None:  # noqa: ANN001 - a no-argument callable
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


async def load(url: str, stop: asyncio.Event, concurrency: int) -> list[tuple[str, str | None, int]]:
    """Streams from `concurrency` clients until `stop`: (request id, finish reason, chunks with text)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    done: list[tuple[str, str | None, int]] = []

    async def one_client(i: int) -> None:
        while not stop.is_set():
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to twenty, client {i}."}],
                max_tokens=48, temperature=0, stream=True)
            rid, reason, chunks = "", None, 0
            async for chunk in stream:
                rid = chunk.id
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks += 1
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
            done.append((rid, reason, chunks))
    await asyncio.gather(*[one_client(i) for i in range(concurrency)])
    await client.close()
    return done


def test_load_starts_a_second_replica_that_is_used_then_drained_and_stopped(tmp_path, capsys) -> None:  # noqa: ANN001
    server = start_server(tmp_path, "--replicas", "1", "--autoscaler", "slo", "--min-replicas", "1",
                          "--max-replicas", "2", "--autoscale-target-seqs", "1", "--scale-up-delay", "0",
                          "--scale-down-delay", "3", "--autoscale-interval", "0.5", "--max-num-seqs", "4",
                          timeout=300)
    try:
        assert set(replicas(server)) == {"p0"}

        async def scenario() -> list[tuple[str, str | None, int]]:
            stop = asyncio.Event()
            task = asyncio.create_task(load(server.url, stop, concurrency=4))
            await asyncio.to_thread(wait_for, lambda: replicas(server).get("a0", {}).get("num_routed", 0) >= 2,
                                    240, "a0 to be started and routed requests")
            stop.set()
            return await task
        done = asyncio.run(scenario())
        wait_for(lambda: set(replicas(server)) == {"p0"}, 60, "a0 to be drained and stopped")
        status = httpx.get(server.url + "/fleet/autoscaler", timeout=10).json()
        actions = [d["action"] for d in status["recent"]]
        assert actions[:1] == ["up"] and "down" in actions and status["num_stopped"] == 1
        assert status["cold_starts"][0]["ok"] and status["cold_starts"][0]["seconds"] > 0
        assert server.metric("tokenfactory:autoscaler_decisions_total") >= 2
        assert main(["fleet", "status", "--url", server.url]) == 0
        shown = capsys.readouterr().out
        assert "autoscaler: slo, 1..2 replicas" in shown and "up   -> 2" in shown and "cold start a0" in shown
        # No lost stream: each one finished with a reason and text; one ledger row per request, a0's included.
        assert done and all(reason in ("stop", "length") and chunks > 0 for _, reason, chunks in done)
        with sqlite3.connect(server.data_dir / "ledger.db") as db:
            rows = db.execute("select request_id, status, replica from requests").fetchall()
        assert sorted(r[0] for r in rows) == sorted(rid for rid, _, _ in done)
        assert {r[1] for r in rows} == {"finished"} and {"p0", "a0"} <= {r[2] for r in rows}
    finally:
        server.stop()


def test_scale_to_zero_and_back_with_the_cold_start_measured(tmp_path) -> None:
    """--min-replicas 0: once idle past the scale-down delay the last replica is drained and stopped (the
    server stays healthy); the next request is held while a replica starts, and its TTFT carries the cold
    start, which /fleet/autoscaler reports."""
    server = start_server(tmp_path, "--autoscaler", "slo", "--min-replicas", "0", "--max-replicas", "1",
                          "--scale-down-delay", "2", "--autoscale-interval", "0.5", timeout=300)
    try:
        wait_for(lambda: replicas(server) == {}, 60, "the idle fleet to scale to zero")
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
                       timeout=180)
        waited = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        auto = httpx.get(server.url + "/fleet/autoscaler", timeout=10).json()
        cold = [c for c in auto["cold_starts"] if c["ok"]]
        assert cold and waited >= cold[-1]["seconds"] * 0.5  # the request waited through the replica's start
        assert set(replicas(server)) == {cold[-1]["replica_id"]}
        with sqlite3.connect(server.data_dir / "ledger.db") as db:
            assert db.execute("select status, replica from requests").fetchall() == [("finished",
                                                                                     cold[-1]["replica_id"])]
    finally:
        server.stop()
