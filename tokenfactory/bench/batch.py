"""Does a batch job stay out of interactive traffic's way? Interactive TTFT with and without a large batch job
running on the same server, and the batch job's tokens/s while they share it (issue #19's bench).

    tokenfactory serve --power-source modelled &          # any server with the Batch API
    python -m tokenfactory.bench.batch --base-url http://127.0.0.1:8000 --json batch-bench.json

1. Interactive alone: `tokenfactory bench serve`'s closed loop (bench/serve.py, its dataset, warm-up and
   figures) at --concurrency clients.
2. A batch job of --batch-lines lines (--batch-output-len tokens each) is submitted through the Batch API
   (POST /v1/files, /v1/batches); once its first lines finished, the same interactive load runs again
   while the job goes on. Its output tokens are read from GET /v1/batches/{id} before and after that
   window: the batch tokens/s while it shares the machine. The job is cancelled at the end.

3. The interactive load alone once more after the job is cancelled; the baseline is the mean of the two
   runs alone, so a machine whose speed drifts (shared cores) shows it instead of hiding in the ratio.

The result is JSON: TTFT p50/p99 (ms) all three ways, the ratio with/without (goal: within 1.2), and the
batch tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx


def batch_lines(num_lines: int, output_len: int, seed: int) -> bytes:
    lines = []
    for i in range(num_lines):
        body = {"messages": [{"role": "user", "content": f"Write a short story about the number {seed + i}."}],
                "max_tokens": output_len, "temperature": 0.0}
        lines.append(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def start_job(client: httpx.Client, num_lines: int, output_len: int, seed: int) -> str:
    upload = client.post("/v1/files", files={"file": ("bench.jsonl", batch_lines(num_lines, output_len, seed))},
                         data={"purpose": "batch"})
    upload.raise_for_status()
    job = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"})
    job.raise_for_status()
    return job.json()["id"]


def job_state(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    r = client.get(f"/v1/batches/{batch_id}")
    r.raise_for_status()
    return r.json()


def interactive(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:  # noqa: ANN401
    """One `bench serve` run at args.concurrency; its figures."""
    from tokenfactory.bench.serve import bench_spec, run_one

    spec = bench_spec(args, args.base_url, "interactive", args.concurrency, None)
    result = run_one(args, spec, tokenizer)
    figures = {"status": result.status, **{k: result.figures.get(k) for k in (
        "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput", "completed")}}
    print(f"interactive: {json.dumps(figures)}", file=sys.stderr, flush=True)  # each phase as it ends
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenfactory.bench.datasets import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    alone = interactive(args, tokenizer)
    with httpx.Client(base_url=args.base_url.rstrip("/").removesuffix("/v1"), timeout=60, trust_env=False) as client:
        batch_id = start_job(client, args.batch_lines, args.batch_output_len, args.seed)
        deadline = time.monotonic() + 300
        while job_state(client, batch_id)["request_counts"]["completed"] < 1:  # the job is really running
            if time.monotonic() > deadline:
                raise RuntimeError(f"batch {batch_id} finished no line in 300 s")
            time.sleep(0.2)
        before, t0 = job_state(client, batch_id), time.monotonic()
        shared = interactive(args, tokenizer)
        after, t1 = job_state(client, batch_id), time.monotonic()
        client.post(f"/v1/batches/{batch_id}/cancel")
        while job_state(client, batch_id)["status"] != "cancelled":  # the machine quiet again
            time.sleep(0.2)
    alone_after = interactive(args, tokenizer)  # the same load alone again: how much the machine drifts
    batch_tokens = after["usage"]["output_tokens"] - before["usage"]["output_tokens"]
    baseline = {k: (alone[k] + alone_after[k]) / 2 if alone.get(k) and alone_after.get(k) else None
                for k in ("median_ttft_ms", "p99_ttft_ms")}
    ratio = {k: shared[k] / baseline[k] if baseline[k] and shared.get(k) is not None else None for k in baseline}
    return {"interactive_alone": alone, "interactive_with_batch": shared, "interactive_alone_after": alone_after,
            "ttft_baseline_ms": baseline, "ttft_ratio": ratio,
            "ttft_within_20_percent": all(r is not None and r <= 1.2 for r in ratio.values()),
            "batch": {"id": batch_id, "lines": args.batch_lines, "output_len": args.batch_output_len,
                      "lines_done_in_window": after["request_counts"]["completed"]
                      - before["request_counts"]["completed"],
                      "output_tokens_in_window": batch_tokens, "window_s": t1 - t0,
                      "output_tokens_per_s": batch_tokens / (t1 - t0) if t1 > t0 else None,
                      "energy_joules": after.get("tokenfactory", {}).get("energy_joules"),
                      "energy_sources": after.get("tokenfactory", {}).get("energy_sources")},
            "config": {"concurrency": args.concurrency, "num_prompts": args.num_prompts,
                       "input_len": args.input_len, "output_len": args.output_len}}


def main(argv: list[str] | None = None) -> int:
    from tokenfactory.bench.serve import add_arguments

    p = argparse.ArgumentParser(prog="python -m tokenfactory.bench.batch", description=__doc__.split("\n")[0])
    add_arguments(p)  # bench serve's: target, workload, load, measurement
    p.add_argument("--batch-lines", type=int, default=2000, help="lines of the batch job (more than the window needs)")
    p.add_argument("--batch-output-len", type=int, default=64, help="max_tokens of each batch line")
    p.add_argument("--json", default=None, help="also write the result to this file")
    p.set_defaults(concurrency=8, num_prompts=48, input_len=128, output_len=32)
    args = p.parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
