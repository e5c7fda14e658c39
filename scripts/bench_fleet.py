"""The fleet's figures on this machine (docs/benchmarks.md, "Fleet"); writes results/bench-fleet.json.

On 2 cores the replicas share the CPU, so fleet throughput is not the figure. What is:
  1. routing overhead: TTFT p50 of a request sent straight to a server, against the same request through a
     gateway whose only replica is that server (`--replicas 0 --backend URL`): the difference is what the
     gateway adds (auth off, tokenize, admit, route, proxy, settle). Requests alternate between the two paths,
     each with its own fresh prompt, so drift and the prefix cache favour neither. And the same for our own
     replicas: one engine in the server's process against it in a child process behind the fleet.
  2. the routing decision alone: `RoutingPolicy.choose` per policy, 2..64 replicas, 512-token prompts.
  3. prefix-hit rate by policy: 2 local replicas, a shared-prefix workload (4 system prompts of ~400 tokens,
     48 requests, 4 in flight), the fleet's prefix-cache hits over queries from /metrics.
  4. joules per output token by router at low load (2 streams on 2 replicas), from the responses' usage.

    python scripts/bench_fleet.py [--out results/bench-fleet.json] [--requests 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.server_util import read_metric, start_server  # noqa: E402 - the tests' server starter
from tokenfactory.fleet.router import (  # noqa: E402
    PREFIX_BLOCK_TOKENS,
    ReplicaView,
    RouteRequest,
    StepModel,
    make_router,
)
from tokenfactory.meter.modelled import cpu_model_name  # noqa: E402

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def ttft(http: httpx.AsyncClient, url: str, text: str) -> float:
    body = {"prompt": text, "max_tokens": 2, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data:") and '"text"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no token came back")
    return first


def alternating_ttfts(url_a: str, url_b: str, num_requests: int, seed: int) -> tuple[list[float], list[float]]:
    """TTFTs of the same kind of request to two servers, one at a time, alternating which goes first, each with a
    fresh 60-word prompt (so neither gains from the prefix cache or from drift); both paths warmed first."""
    rng = random.Random(seed)

    async def run() -> tuple[list[float], list[float]]:
        a, b = [], []
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(6):
                await ttft(http, url_a, prompt(rng, 60))
                await ttft(http, url_b, prompt(rng, 60))
            for i in range(num_requests):
                pair = [(url_a, a), (url_b, b)]
                for url, out in (pair if i % 2 == 0 else pair[::-1]):
                    out.append(await ttft(http, url, prompt(rng, 60)))
        return a, b
    return asyncio.run(run())


def routing_overhead(tmp: Path, num_requests: int) -> dict:
    """An external server straight, against the same server behind the gateway (`--replicas 0 --backend`)."""
    backend = start_server(tmp / "backend")
    gateway = start_server(tmp / "gateway", "--replicas", "0", "--backend", backend.url + "/v1")
    try:
        direct, through = alternating_ttfts(backend.url, gateway.url, num_requests, seed=0)
    finally:
        gateway.stop()
        backend.stop()
    p50_direct, p50_through = statistics.median(direct), statistics.median(through)
    return {"num_requests": num_requests, "prompt_words": 60, "max_tokens": 2,
            "ttft_p50_direct_ms": round(p50_direct * 1e3, 2),
            "ttft_p50_through_gateway_ms": round(p50_through * 1e3, 2),
            "added_ttft_p50_ms": round((p50_through - p50_direct) * 1e3, 2),
            "ttft_p90_direct_ms": round(statistics.quantiles(direct, n=10)[-1] * 1e3, 2),
            "ttft_p90_through_gateway_ms": round(statistics.quantiles(through, n=10)[-1] * 1e3, 2)}


def replica_overhead(tmp: Path, num_requests: int) -> dict:
    """Our own replicas: one engine in the server's process against the same engine behind the fleet in a child
    process (`--replicas 2`, ties going round, so each request finds an idle replica), 1 thread each."""
    single = start_server(tmp / "single", "--threads", "1")
    fleet = start_server(tmp / "fleet", "--replicas", "2", "--threads", "1", timeout=300)
    try:
        inproc, replica = alternating_ttfts(single.url, fleet.url, num_requests, seed=4)
    finally:
        fleet.stop()
        single.stop()
    a, b = statistics.median(inproc), statistics.median(replica)
    return {"num_requests": num_requests, "threads_per_engine": 1, "ttft_p50_in_process_ms": round(a * 1e3, 2),
            "ttft_p50_process_replica_ms": round(b * 1e3, 2), "added_ttft_p50_ms": round((b - a) * 1e3, 2)}


def decision_time() -> dict:
    rng = random.Random(1)
    out = {}
    for policy_name in ("least-work", "prefix", "energy"):
        for n in (2, 8, 64):
            policy = make_router(policy_name)
            views = [ReplicaView(f"r{i}", "m", rng.randint(0, 32), 0, 64, rng.randint(0, 20000), rng.randint(0, 32),
                                 50.0, 300.0, StepModel()) for i in range(n)]
            prompts = [[rng.randrange(49152) for _ in range(512)] for _ in range(50)]
            for p in prompts:  # the prefix index holds what was sent before
                policy.routed(RouteRequest("w", "m", p, 64), f"r{rng.randrange(n)}")
            t0 = time.perf_counter()
            for i in range(200):
                request = RouteRequest(str(i), "m", prompts[i % 50], 64)
                policy.routed(request, policy.choose(request, views).replica_id)
            out[f"{policy_name}/{n}"] = round((time.perf_counter() - t0) / 200 * 1e6, 1)
    return {"us_per_decision": out, "prompt_tokens": 512, "prefix_block_tokens": PREFIX_BLOCK_TOKENS}


def prefix_hit_rates(tmp: Path) -> dict:
    rng = random.Random(2)
    prefixes = [f"You are assistant {k}. " + prompt(rng, 380) for k in range(4)]
    result = {}
    for router in ("least-work", "prefix"):
        server = start_server(tmp / router, "--replicas", "2", "--router", router, timeout=300)
        try:
            q0 = read_metric(server.url, "tokenfactory:prefix_cache_queries_total")
            h0 = read_metric(server.url, "tokenfactory:prefix_cache_hits_total")

            async def load(url: str) -> list[float]:
                sem, ttfts = asyncio.Semaphore(4), []
                async with httpx.AsyncClient(timeout=120) as http:
                    async def one(i: int) -> None:
                        async with sem:
                            ttfts.append(await ttft(http, url, prefixes[i % 4] + f" Question {i}: why?"))
                    await asyncio.gather(*[one(i) for i in range(48)])
                return ttfts
            ttfts = asyncio.run(load(server.url))
            queries = read_metric(server.url, "tokenfactory:prefix_cache_queries_total") - q0
            hits = read_metric(server.url, "tokenfactory:prefix_cache_hits_total") - h0
            result[router] = {"prefix_hit_rate": round(hits / queries, 4), "prompt_tokens": int(queries),
                              "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1)}
        finally:
            server.stop()
    return {"replicas": 2, "num_prefixes": 4, "num_requests": 48, "concurrency": 4, "by_router": result}


def energy_by_router(tmp: Path) -> dict:
    """Low load (2 streams) on 2 local replicas: joules per output token as the ledger has them, by router.
    The source is this machine's (modelled here: TDP x (0.1 + 0.9 load^3)), so say which."""
    rng = random.Random(3)
    result = {}
    for router in ("least-work", "energy"):
        server = start_server(tmp / f"energy-{router}", "--replicas", "2", "--router", router, timeout=300)
        try:
            async def load(url: str) -> list[dict]:
                sem = asyncio.Semaphore(2)
                async with httpx.AsyncClient(timeout=120) as http:
                    async def one() -> dict:
                        async with sem:
                            body = {"prompt": prompt(rng, 40), "max_tokens": 48, "ignore_eos": True}
                            return (await http.post(url + "/v1/completions", json=body)).json()["usage"]
                    return await asyncio.gather(*[one() for _ in range(16)])
            usages = asyncio.run(load(server.url))
            joules = sum(u["energy_joules"] for u in usages if u.get("energy_joules") is not None)
            tokens = sum(u["completion_tokens"] for u in usages)
            replicas = httpx.get(server.url + "/fleet/replicas").json()["data"]
            result[router] = {"joules_per_output_token": round(joules / tokens, 5), "energy_source":
                              sorted({u.get("energy_source") for u in usages}),
                              "routed": {r["replica_id"]: r["num_routed"] for r in replicas}}
        finally:
            server.stop()
    return {"replicas": 2, "concurrency": 2, "num_requests": 16, "output_tokens": 48, "by_router": result}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "bench-fleet.json"))
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--only", default=None, help="comma-separated parts: backend,replica,decision,prefix,energy")
    args = ap.parse_args()
    parts = set(args.only.split(",")) if args.only else {"backend", "replica", "decision", "prefix", "energy"}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for sub in ("backend", "gateway", "single", "fleet", "least-work", "prefix", "energy-least-work",
                    "energy-energy"):
            (tmp / sub).mkdir()
        result: dict = {"machine": {"cpu": cpu_model_name(), "num_cpus": os.cpu_count()},
                        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                              text=True, cwd=ROOT).stdout.strip()}
        for name, part, run in (("routing_overhead", "backend", lambda: routing_overhead(tmp, args.requests)),
                                ("replica_overhead", "replica", lambda: replica_overhead(tmp, args.requests)),
                                ("decision", "decision", decision_time),
                                ("prefix", "prefix", lambda: prefix_hit_rates(tmp)),
                                ("energy", "energy", lambda: energy_by_router(tmp))):
            if part in parts:
                result[name] = run()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
