"""`python -m tokenfactory.bench.grammar served`: structured outputs through the server, at 1, 8 and 32 clients.

Each client sends its requests one after another (closed loop) to /v1/chat/completions: under
`response_format` json_schema (the order schema), or plain (no constraint; `ignore_eos`, as many tokens as
the constrained answers averaged, so both make the same work). Output tokens per wall second, joules per
output token from the answers' own `usage` (the server's meter: its `energy_source` says nvml, rapl or
modelled), forced tokens, and the share of answers that validate. Goal (issue 27): the schema at most 5%
slower than plain at 8 clients. Schema and plain alternate within each round; medians over rounds.

With no --url, a `tokenfactory serve` is started on a free loopback port (--server-args are its flags), and
stopped at the end.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenfactory.bench.grammar_engine import ORDER_PROMPT
from tokenfactory.bench.grammar_libs import ORDER_SCHEMA, valid_order_share


def _body(model: str | None, constrained: bool, max_tokens: int, seed: int, temperature: float) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": ORDER_PROMPT}], "max_tokens": max_tokens,
                            "temperature": temperature, "seed": seed}
    if model:
        body["model"] = model
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
    else:
        body["ignore_eos"] = True
    return body


async def _load(url: str, model: str | None, clients: int, per_client: int, constrained: bool, max_tokens: int,
                temperature: float, seed: int) -> dict[str, Any]:
    import httpx

    answers: list[dict[str, Any]] = []

    async def client(c: int, http: httpx.AsyncClient) -> None:
        for k in range(per_client):
            r = await http.post(url + "/v1/chat/completions",
                                json=_body(model, constrained, max_tokens, seed + c * 1000 + k, temperature))
            r.raise_for_status()
            answers.append(r.json())

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 4)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        seconds = time.perf_counter() - start
    usage = [a["usage"] for a in answers]
    choices = [a["choices"][0] for a in answers]
    texts = [c["message"]["content"] for c in choices]
    # A constrained answer cut by max_tokens ("length") is a prefix of valid JSON, not valid JSON.
    finished = [c["message"]["content"] for c in choices if c["finish_reason"] != "length"]
    tokens = sum(u["completion_tokens"] for u in usage)
    joules = [u.get("energy_joules") for u in usage]
    total_j = None if any(j is None for j in joules) else sum(joules)
    return {"seconds": seconds, "requests": len(answers), "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "joules": total_j, "joules_per_token": None if total_j is None else total_j / tokens,
            "energy_source": "+".join(sorted({u.get("energy_source") or "none" for u in usage})),
            "forced_tokens": sum(u.get("forced_tokens") or 0 for u in usage),
            "valid_share": valid_order_share(texts) if constrained else None,
            "cut_by_max_tokens": len(texts) - len(finished),
            "valid_share_of_finished": valid_order_share(finished) if constrained else None}


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        out[key] = statistics.median(values) if numeric else value
    return out


def measure(url: str, args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for clients in args.clients:
        per_client = max(1, args.requests // clients)
        schema_runs, plain_runs = [], []
        for r in range(args.rounds):
            seed = 7919 * r
            schema = asyncio.run(_load(url, args.served_model, clients, per_client, True, args.max_tokens,
                                       args.temperature, seed))
            mean_tokens = max(1, schema["output_tokens"] // max(schema["requests"], 1))
            plain = asyncio.run(_load(url, args.served_model, clients, per_client, False, mean_tokens,
                                      args.temperature, seed))
            schema_runs.append(schema)
            plain_runs.append(plain)
        row = {"schema": _median_runs(schema_runs), "plain": _median_runs(plain_runs)}
        row["schema_vs_plain_tok_s"] = row["schema"]["output_tok_s"] / row["plain"]["output_tok_s"]
        out[f"clients_{clients}"] = row
    return out


def run(args: Any) -> dict[str, Any]:
    from tokenfactory.bench.compare import ServerProcess, free_port

    if args.url is not None:
        return {"url": args.url, "clients": measure(args.url.rstrip("/"), args)}
    port = free_port()
    data_dir = Path(tempfile.mkdtemp(prefix="tokenfactory-bench-grammar-"))
    command = [sys.executable, "-m", "tokenfactory.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
               "--log-level", "warning", *shlex.split(args.server_args)]
    server = ServerProcess("tokenfactory", command, data_dir / "server.log", dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        problem = server.wait_ready(url, 900)
        if problem is not None:
            raise RuntimeError(f"the server did not start: {problem}\n{server.log_tail()}")
        # One request of each kind first: the first grammar builds the tokenizer's view, the first step warms up.
        asyncio.run(_load(url, args.served_model, 1, 1, True, 32, args.temperature, 0))
        return {"server_args": args.server_args, "clients": measure(url, args)}
    finally:
        server.stop()
