"""/health latency while 32 streams load the engine: is the HTTP side ever stalled by a step?

    python scripts/health_latency.py http://127.0.0.1:8000      # prints JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx

MODEL = "SmolLM2-135M-Instruct"


async def stream(client: httpx.AsyncClient, i: int) -> None:
    body = {"model": MODEL, "prompt": f"Story {i}: once", "max_tokens": 96, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            pass


async def main(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        streams = [asyncio.create_task(stream(client, i)) for i in range(32)]
        await asyncio.sleep(1.0)  # the streams are running
        latencies = []
        for _ in range(40):
            start = time.perf_counter()
            await client.get("/health")
            latencies.append((time.perf_counter() - start) * 1000)
            await asyncio.sleep(0.1)
        await asyncio.gather(*streams)
    latencies.sort()
    return {"health_ms_p50": latencies[len(latencies) // 2], "health_ms_p90": latencies[int(len(latencies) * 0.9)],
            "health_ms_max": latencies[-1]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
