"""Served single stream against offline, in interleaved pairs: `bench machine`'s served-single-stream goal.

On a shared VM a single stream's decode speed drifts by more than the goal's 5% within minutes (issue 29, run 25:
an offline single stream of 180.7 tok/s, then 154.4 three minutes later). So the goal is not read off runs minutes
apart, but off neighbours seconds apart, as scripts/served_pairs.py and served_floor_probe.py measure:

    a worker process holds our engine (built as `bench offline` builds it) and waits on a pipe between rounds
    round i:  the offline single stream, then one streamed request to our server through the harness's client
              (odd rounds the other way round, so a steady drift favours neither side)

A round's ratio is the served decode rate (1 / TPOT: the harness's, `bench serve`'s definition) over the offline
one ((n - 1) tokens over the time from the first decode step to the last: `bench offline`'s); the goal is the
median of the rounds' ratios. While the worker decodes the server is idle, and while the server serves the worker
blocks on its pipe. Run as a module, this file is the worker: `bench offline`'s options, then "go" lines on stdin,
one JSON line out for each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from tokenfactory.bench.datasets import BenchRequest

WORKER_MODULE = "tokenfactory.bench.pairs"


def worker_command(offline_argv: list[str]) -> list[str]:
    return [sys.executable, "-m", WORKER_MODULE, *offline_argv]


def worker(argv: list[str]) -> int:
    """The offline side: build and warm the engine, decode one single stream untimed (`bench offline`'s follows
    its throughput run), say ready; then one single stream per "go" line, its figures as a JSON line."""
    from tokenfactory.bench import offline

    # The pipe carries the protocol alone: whatever else writes to standard output (Python or C) goes to stderr.
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}")
    offline.add_arguments(parser)
    args = parser.parse_args(argv)
    engine = offline.build_engine(args)
    offline.single_stream_engine(engine, args)
    print(json.dumps({"ready": True}), file=protocol, flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        print(json.dumps(offline.single_stream_engine(engine, args)), file=protocol, flush=True)
    return 0


class OfflineWorker:
    """The worker process, started and ready; `decode_tok_s` runs one offline single stream in it."""

    def __init__(self, command: list[str], log: IO[str]) -> None:
        self.log = log
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        self._read()

    def decode_tok_s(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._read()["decode_tokens_per_s"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the offline worker exited with {self.proc.wait()}; its output is in {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _rounds(worker: OfflineWorker, base_url: str, model: str, requests: list[BenchRequest]) \
        -> list[dict[str, float]]:
    from tokenfactory.bench.client import SamplingOptions, Target, send_request, stream_session

    target, sampling = Target(base_url, model), SamplingOptions(ignore_eos=True)
    rounds = []
    async with stream_session(600.0) as session:
        for i, request in enumerate(requests):
            offline = worker.decode_tok_s() if i % 2 == 0 else None  # blocks the loop: nothing else runs on it
            sample = await send_request(session, target, request, sampling, time.perf_counter())
            if sample.tpot_s is None:
                raise RuntimeError(f"a paired request failed: {sample.error or 'fewer than two output tokens'}")
            if offline is None:
                offline = worker.decode_tok_s()
            served = 1.0 / sample.tpot_s
            rounds.append({"offline_decode_tok_s": round(offline, 1), "served_decode_tok_s": round(served, 1),
                           "ratio": round(served / offline, 4)})
    return rounds


def measure(offline_argv: list[str], base_url: str, model: str, requests: list[BenchRequest], log: Path) \
        -> dict[str, Any]:
    """One round per request (at least one); the medians, each round, and the worker's command (offline
    options as `bench offline` takes them)."""
    from tokenfactory.bench.client import run_async

    if not requests:
        raise ValueError("pairs need at least one request")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        worker = OfflineWorker(worker_command(offline_argv), out)
        try:
            rounds = run_async(_rounds(worker, base_url, model, requests))
        finally:
            worker.close()
    ratios = [r["ratio"] for r in rounds]
    return {"rounds": rounds, "ratio": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "offline_decode_tok_s": round(statistics.median(r["offline_decode_tok_s"] for r in rounds), 1),
            "served_decode_tok_s": round(statistics.median(r["served_decode_tok_s"] for r in rounds), 1)}


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
