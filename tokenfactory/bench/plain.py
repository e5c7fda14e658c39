"""A plain load generator, to check the harness: closed loop, one blocking `http.client` connection per
client thread, streaming completions read line by line, output tokens from the server's own usage.

`bench machine` runs it just before and just after the harness (bench/runner.py: asyncio, aiohttp, per-token
timing, memory and energy sampling) on the same server, prompt lengths and client count: if the harness's output
tok/s and the mean of the two plain runs differ by more than HARNESS_TOLERANCE, the harness is what is being
measured, not the server, and the figures say so. Nothing here is shared with the harness but the prompts.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

HARNESS_TOLERANCE = 0.05


def _one(host: str, port: int, body: dict[str, Any], timeout_s: float) -> int:
    """Send one streaming completion; its completion tokens (from the final usage chunk)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        tokens = 0
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            usage = json.loads(line[5:]).get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
        return tokens
    finally:
        conn.close()


def served_model(base_url: str) -> str:
    """The first model the server lists (GET /v1/models), as the harness asks for it."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=30)
    try:
        conn.request("GET", "/v1/models")
        data = json.loads(conn.getresponse().read())
        return str(data["data"][0]["id"])
    finally:
        conn.close()


def closed_loop(base_url: str, model: str, prompts: Sequence[str], max_tokens: int, clients: int,
                timeout_s: float = 600.0) -> dict[str, Any]:
    """Every prompt once, `clients` at a time; output tok/s over the wall time of the whole run."""
    parts = urlsplit(base_url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    queue = list(enumerate(prompts))
    lock = threading.Lock()
    counts: list[int] = []
    errors: list[str] = []

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                _, prompt = queue.pop(0)
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            try:
                n = _one(host, port, body, timeout_s)
            except (OSError, RuntimeError, ValueError) as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                counts.append(n)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {"clients": clients, "requests": len(prompts), "completed": len(counts), "errors": errors[:3],
            "output_tokens": sum(counts), "elapsed_s": round(elapsed, 3),
            "output_throughput": round(sum(counts) / elapsed, 2) if elapsed > 0 else None}


def harness_check(harness_tok_s: float | None, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The harness's figure against the plain generator's for the same server and load: the mean of the plain
    runs that bracket the harness's, one just before it and one just after (on a host whose speed drifts, two
    measurements one after the other move apart by the drift; the mean of the two around the harness cancels a
    steady one)."""
    each = [r.get("output_throughput") for r in runs]
    theirs = statistics.fmean(each) if each and all(each) else None
    ratio = harness_tok_s / theirs if harness_tok_s and theirs else None
    return {"harness_tok_s": harness_tok_s, "plain_tok_s": None if theirs is None else round(theirs, 2),
            "plain_tok_s_each": each, "ratio": None if ratio is None else round(ratio, 3),
            "tolerance": HARNESS_TOLERANCE, "met": ratio is not None and abs(ratio - 1) <= HARNESS_TOLERANCE,
            "plain": list(runs)}
