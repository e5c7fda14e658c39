"""No completed response without its ledger row: SIGKILL the server under load, then every response a
client saw complete (a full JSON body, or a stream up to `[DONE]`) has its row in the ledger."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from tests.server_util import start_server
from tokenfactory.meter.ledger import Ledger

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


def test_sigkill_under_load_loses_no_completed_row(tmp_path) -> None:
    server = start_server(tmp_path)
    completed: list[str] = []

    async def plain(c: httpx.AsyncClient, i: int) -> None:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": f"Item {i}:", "max_tokens": 4 + i % 24,
                                                  "ignore_eos": True})
        if r.status_code == 200:
            completed.append(r.json()["id"])

    async def streamed(c: httpx.AsyncClient, i: int) -> None:
        request_id, done = None, False
        async with c.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 4 + i % 20,
                "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    request_id = json.loads(line[6:])["id"]
        if done:
            completed.append(request_id)

    async def load() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            tasks = [asyncio.ensure_future((plain if i % 2 else streamed)(c, i)) for i in range(40)]
            while len(completed) < 12:
                await asyncio.sleep(0.01)
            server.proc.send_signal(signal.SIGKILL)
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(load())
    assert server.proc.wait(30) == -signal.SIGKILL
    assert 12 <= len(completed) < 40, "the kill should land mid-load"
    ledger = Ledger.open(server.data_dir, create=False)
    try:
        missing = [rid for rid in completed if not ledger.find(rid)]
        assert not missing, f"{len(missing)} completed responses have no ledger row: {missing[:3]}"
        [row] = ledger.find(completed[0])
        assert row.status == "finished" and row.completion_tokens > 0
        assert row.energy_source is not None and row.energy_joules is not None
    finally:
        ledger.close()
    # The server comes back on the same ledger and keeps appending to it.
    again = start_server(tmp_path)
    try:
        r = httpx.post(again.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                       timeout=60)
        usage = httpx.get(again.url + "/v1/usage").json()["data"][0]
        assert usage["num_requests"] >= len(completed) + 1 and r.status_code == 200
    finally:
        again.stop()
