"""Benchmark: bulk-insert a million ledger rows, then time single commits and the usage queries.

    python -m tokenfactory.bench.ledger --rows 1000000 --out results/bench-ledger.json

Fixed seed; rows spread over 90 days, 50 tenants and 6 models, 5 % without energy. Each query runs
once to warm the page cache, then `--repeat` times; the JSON keeps the median and the max (seconds).
`--url` benchmarks another database (e.g. PostgreSQL) instead of a fresh SQLite file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tokenfactory.meter.ledger import Ledger, LedgerRow, utc_now

NUM_TENANTS, MODELS, SPAN_DAYS = 50, ("llama-3.1-8b", "llama-3.1-70b", "qwen2.5-7b", "qwen2.5-72b",
                                      "mistral-7b", "smollm2-135m"), 90


def synthetic_rows(num_rows: int, seed: int, end: dt.datetime) -> Iterator[LedgerRow]:
    rng = random.Random(seed)
    span_s = SPAN_DAYS * 86400
    for i in range(num_rows):
        completion = rng.randint(1, 1024)
        measured = rng.random() >= 0.05
        joules = completion * rng.uniform(0.05, 2.0) if measured else None
        device_s = completion * rng.uniform(0.002, 0.03)
        cost_device = device_s / 3600 * 2.99
        cost_energy = joules * 0.13 / 3.6e6 if joules is not None else None
        yield LedgerRow(
            request_id=f"req-{i:08d}", model=rng.choice(MODELS), tenant=f"tenant-{rng.randrange(NUM_TENANTS):02d}",
            status="finished" if rng.random() < 0.97 else "aborted", prompt_tokens=rng.randint(1, 4096),
            completion_tokens=completion, cached_tokens=rng.randint(0, 512), energy_joules=joules,
            energy_source="nvml" if measured else None, energy_scope="gpu" if measured else None,
            device_seconds=device_s, cost_device_usd=cost_device, cost_energy_usd=cost_energy,
            cost_usd=cost_device + cost_energy if cost_energy is not None else None,
            ttft_s=rng.uniform(0.01, 0.5), latency_s=rng.uniform(0.1, 30.0),
            created_at=end - dt.timedelta(seconds=rng.uniform(0, span_s)),
        )


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "max_s": max(samples)}


def run(num_rows: int, url: str | None, repeat: int, seed: int) -> dict[str, Any]:
    workdir = None if url else tempfile.TemporaryDirectory(prefix="bench-ledger-")
    ledger = Ledger.open(workdir.name if workdir else None, url)
    now = utc_now()
    start = time.perf_counter()
    written = ledger.record_many(synthetic_rows(num_rows, seed, now), batch_size=20_000)
    insert_s = time.perf_counter() - start
    commit_samples = []
    for i in range(200):
        row = LedgerRow(f"single-{i}", MODELS[0], "finished", 10, 10, created_at=now)
        t0 = time.perf_counter()
        ledger.record(row)
        commit_samples.append(time.perf_counter() - t0)
    day, week = now - dt.timedelta(days=1), now - dt.timedelta(days=7)
    queries = {
        "totals_all": lambda: ledger.totals(),
        "totals_since_1d": lambda: ledger.totals(since=day),
        "totals_since_7d": lambda: ledger.totals(since=week),
        "group_by_day_all": lambda: ledger.totals(group_by="day"),
        "group_by_tenant_all": lambda: ledger.totals(group_by="tenant"),
        "group_by_model_all": lambda: ledger.totals(group_by="model"),
        "group_by_day_since_7d": lambda: ledger.totals(since=week, group_by="day"),
        "group_by_tenant_since_1d": lambda: ledger.totals(since=day, group_by="tenant"),
        "find_one_request": lambda: ledger.find(f"req-{num_rows // 2:08d}"),
    }
    result = {
        "rows": ledger.count(),
        "database": ledger.engine.dialect.name,
        "insert": {"rows": written, "seconds": insert_s, "rows_per_s": written / insert_s},
        "record_commit": {"median_s": statistics.median(commit_samples),
                          "p99_s": sorted(commit_samples)[int(0.99 * len(commit_samples)) - 1]},
        "queries": {name: timed(fn, repeat) for name, fn in queries.items()},
        "machine": {"python": platform.python_version(), "processor": platform.processor(),
                    "platform": platform.platform()},
        "seed": seed,
    }
    ledger.close()
    if workdir:
        workdir.cleanup()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--url", default=None, help="database URL (default: a fresh SQLite file in a temp dir)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/bench-ledger.json"))
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    result = run(args.rows, args.url, args.repeat, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
