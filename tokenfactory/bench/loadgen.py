"""Arrivals and the send loop: closed loop at a fixed concurrency, or open loop at a request rate.

Open loop (vllm bench serve's `get_request`): inter-arrival gaps are Gamma(shape=burstiness,
scale=1/(rate·burstiness)) — burstiness 1 is a Poisson process, < 1 burstier, > 1 more even — then
rescaled so the last arrival is at exactly num_requests / rate seconds. `--concurrency` with a rate caps
the requests in flight, as vllm's --max-concurrency does. Closed loop: every request is due at 0 and
the cap alone paces them.

A fatal failure (nothing listens, the key is refused: FATAL_ERROR_KINDS) stops the sending: requests
not yet sent are recorded as failed with kind `not_sent`, and the run is marked aborted. Ctrl-C does
the same, and marks the requests it cut off in flight as `interrupted`.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenfactory.bench.client import FATAL_ERROR_KINDS, RequestSample, SamplingOptions, Target, send_request
from tokenfactory.bench.datasets import BenchRequest
from tokenfactory.types import ParameterError


@dataclass(frozen=True)
class LoadConfig:
    concurrency: int | None = 1  # requests in flight at most; None: no cap (open loop only)
    request_rate: float | None = None  # requests/s; None: closed loop
    burstiness: float = 1.0
    warmup: int = 0  # requests sent (one at a time) before the measured run
    seed: int = 0
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ParameterError("concurrency", f"--concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is None and self.concurrency is None:
            raise ParameterError("concurrency", "give --concurrency (closed loop) or --request-rate (open loop)")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ParameterError("request_rate", f"--request-rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ParameterError("burstiness", f"--burstiness must be > 0, got {self.burstiness}")
        if self.warmup < 0:
            raise ParameterError("warmup", f"--warmup must be >= 0, got {self.warmup}")
        if not self.request_timeout_s > 0:
            raise ParameterError("request_timeout", f"--request-timeout must be > 0, got {self.request_timeout_s}")

    @property
    def describe(self) -> str:
        if self.request_rate is None:
            return f"closed loop, concurrency {self.concurrency}"
        cap = f", at most {self.concurrency} in flight" if self.concurrency else ""
        return f"open loop, {self.request_rate:g} req/s, burstiness {self.burstiness:g}{cap}"


def arrival_times(num_requests: int, rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is due (all 0 for a closed loop)."""
    if rate is None or num_requests == 0:
        return [0.0] * num_requests
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    times, t = [], 0.0
    for _ in range(num_requests):
        t += rng.gammavariate(burstiness, theta)
        times.append(t)
    scale = (num_requests / rate) / times[-1]  # vllm: pin the total to N / rate
    return [x * scale for x in times]


class Progress(Protocol):
    """What the send loop reports as it goes; the null object ignores it all."""

    def chunk(self) -> None: ...

    def done(self, sample: RequestSample) -> None: ...


class NullProgress:
    def chunk(self) -> None:
        pass

    def done(self, sample: RequestSample) -> None:
        pass


class RichProgress:
    """A rich progress bar: requests done, live output chunks/s (≈ tokens/s), errors."""

    def __init__(self, total: int, label: str) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rate]} tok/s"), TextColumn("{task.fields[errors]}"),
                                  TimeElapsedColumn(), transient=False)
        self._task = self._progress.add_task(label, total=total, rate="0.0", errors="0 errors")
        self._chunks, self._errors, self._t0 = 0, 0, time.perf_counter()

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def _refresh(self, advance: int = 0) -> None:
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        self._progress.update(self._task, advance=advance, rate=f"{self._chunks / elapsed:,.1f}",
                              errors=f"{self._errors} error{'s' if self._errors != 1 else ''}")

    def chunk(self) -> None:
        self._chunks += 1
        if self._chunks % 8 == 0:
            self._refresh()

    def done(self, sample: RequestSample) -> None:
        self._errors += not sample.success
        self._refresh(advance=1)


@dataclass
class LoadOutcome:
    samples: list[RequestSample]
    duration_s: float  # start of sending to the last response (vllm's benchmark_duration)
    started_at: float  # time.time() at the first send
    aborted: str | None = None  # why sending stopped early, if it did


def _not_sent(request: BenchRequest, reason: str) -> RequestSample:
    return RequestSample(request.index, request.prompt_len, request.output_len, error_kind="not_sent",
                         error=f"not sent: {reason}")


async def warm_up(client: Any, target: Target, requests: Sequence[BenchRequest], sampling: SamplingOptions) -> \
        list[RequestSample]:
    """Send the warm-up requests one at a time; their samples are returned but not part of the run."""
    t0 = time.perf_counter()
    return [await send_request(client, target, r, sampling, t0) for r in requests]


async def run_load(client: Any, target: Target, requests: Sequence[BenchRequest], sampling: SamplingOptions,
                   load: LoadConfig, progress: Progress) -> LoadOutcome:
    """Send every request on its schedule, at most `load.concurrency` in flight; collect the samples."""
    due = arrival_times(len(requests), load.request_rate, load.burstiness, load.seed)
    cap = asyncio.Semaphore(load.concurrency) if load.concurrency else None
    samples: dict[int, RequestSample] = {}
    abort: list[str] = []
    t0, wall0 = time.perf_counter(), time.time()

    async def one(request: BenchRequest) -> None:
        try:
            sample = await send_request(client, target, request, sampling, t0, progress.chunk)
        except asyncio.CancelledError:  # Ctrl-C while in flight
            samples[request.index] = RequestSample(request.index, request.prompt_len, request.output_len,
                                                   error_kind="interrupted", error="interrupted while in flight")
            raise
        finally:
            if cap is not None:
                cap.release()
        samples[request.index] = sample
        progress.done(sample)
        if sample.error_kind in FATAL_ERROR_KINDS and not abort:
            abort.append(sample.error or sample.error_kind or "fatal error")

    tasks = []
    try:
        for request, at in zip(requests, due, strict=True):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if cap is not None:
                await cap.acquire()
            if abort:
                if cap is not None:
                    cap.release()
                break
            tasks.append(asyncio.create_task(one(request)))
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:  # Ctrl-C: keep what finished, mark the rest
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        abort.append("interrupted")
    duration = time.perf_counter() - t0  # vllm's benchmark_duration: start of sending to the last response
    reason = abort[0] if abort else None
    for request in requests:
        if request.index not in samples:
            samples[request.index] = _not_sent(request, reason or "interrupted")
            progress.done(samples[request.index])
    return LoadOutcome([samples[r.index] for r in requests], duration, wall0, reason)
