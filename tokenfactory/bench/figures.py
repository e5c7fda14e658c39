"""The latency and throughput figures of a run, defined as `vllm bench serve` defines them
(vllm/benchmarks/serve.py, `calculate_metrics`), and the direction in which each one is better.

Over the successful requests, with D the run's duration (first send to last response, seconds):

    TTFT        time from sending to the first token chunk
    TPOT        (e2e - TTFT) / (output_tokens - 1), per request with at least 2 output tokens
    ITL         every gap between consecutive token chunks, all requests pooled
    E2EL        time from sending to the last token chunk
    request_throughput      completed / D                               [req/s]
    output_throughput       Σ output_tokens / D                         [tok/s]
    total_token_throughput  (Σ prompt_tokens + Σ output_tokens) / D     [tok/s]
    request_goodput         requests meeting every SLO / D              [req/s]  (only with --slo)

A request meets the SLO when each given bound holds: ttft <= bound, tpot <= bound (a request with one
output token has TPOT 0 here, as in vllm), e2el <= bound. mean, median (p50), p90 and p99 use
numpy.percentile's linear interpolation; latencies are reported in milliseconds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenfactory.bench.client import RequestSample
from tokenfactory.types import ParameterError

LATENCY_FIGURES = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "p90", "p99")
SLO_KEYS = ("ttft", "tpot", "e2el")
_SLO_ITEM = re.compile(r"^\s*(ttft|tpot|e2el)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")

Figures = dict[str, Any]


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=500ms,tpot=50ms,e2el=2s' -> {'ttft': 0.5, 'tpot': 0.05, 'e2el': 2.0} (seconds; bare numbers are ms)."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for item in text.split(","):
        match = _SLO_ITEM.match(item)
        if not match:
            raise ParameterError("slo", f"--slo items must look like ttft=500ms, tpot=50ms or e2el=2s "
                                        f"(keys: {', '.join(SLO_KEYS)}); got {item.strip()!r}")
        key, value, unit = match.group(1), float(match.group(2)), match.group(3) or "ms"
        slo[key] = value / 1000.0 if unit == "ms" else value
    return slo


def percentile(values: Sequence[float], q: float) -> float | None:
    """numpy.percentile's default (linear) interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarise(name: str, values_s: Sequence[float]) -> Figures:
    """mean/median/p90/p99 (and std) of `values_s` seconds, as `<stat>_<name>_ms`; None when empty."""
    if not values_s:
        return {f"{stat}_{name}_ms": None for stat in (*STATISTICS, "std")}
    mean = sum(values_s) / len(values_s)
    std = (sum((v - mean) ** 2 for v in values_s) / len(values_s)) ** 0.5
    values = {"mean": mean, "median": percentile(values_s, 50), "p90": percentile(values_s, 90),
              "p99": percentile(values_s, 99), "std": std}
    return {f"{stat}_{name}_ms": v * 1000.0 for stat, v in values.items()}


def meets_slo(sample: RequestSample, slo: dict[str, float]) -> bool:
    tpot = sample.tpot_s if sample.tpot_s is not None else 0.0  # one output token: TPOT 0, as vllm
    measured = {"ttft": sample.ttft_s, "tpot": tpot, "e2el": sample.e2e_s}
    return all(measured[key] is not None and measured[key] <= bound for key, bound in slo.items())


def mean_concurrency(samples: Sequence[RequestSample], duration_s: float) -> float | None:
    """Little's law: Σ request time in flight / D (the average number of requests in flight)."""
    busy = sum(s.e2e_s for s in samples if s.success and s.e2e_s is not None)
    return busy / duration_s if duration_s > 0 else None


def peak_concurrency(samples: Sequence[RequestSample]) -> int:
    """Most successful requests in flight at once (half-open intervals [start, start + e2e))."""
    events = sorted([(s.start_s, 1) for s in samples if s.success and s.e2e_s is not None]
                    + [(s.start_s + s.e2e_s, -1) for s in samples if s.success and s.e2e_s is not None])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def latency_figures(samples: Sequence[RequestSample], duration_s: float, slo: dict[str, float]) -> Figures:
    """Counts, throughputs, goodput and latency statistics of one run (see the module docstring)."""
    ok = [s for s in samples if s.success]
    output = sum(s.output_tokens or 0 for s in ok)
    prompt = sum(s.prompt_tokens if s.prompt_tokens is not None else s.prompt_len for s in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    figures: Figures = {
        "num_requests": len(samples),
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "cached_prompt_tokens": sum(s.cached_tokens for s in ok if s.cached_tokens is not None)
        if any(s.cached_tokens is not None for s in ok) else None,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output),
        "total_token_throughput": per_s(prompt + output),
        "request_goodput": per_s(sum(meets_slo(s, slo) for s in ok)) if slo else None,
        "mean_concurrency": mean_concurrency(ok, duration_s),
        "peak_concurrency": peak_concurrency(ok),
        "mean_prompt_tokens": prompt / len(ok) if ok else None,
        "mean_output_tokens": output / len(ok) if ok else None,
    }
    figures |= summarise("ttft", [s.ttft_s for s in ok if s.ttft_s is not None])
    figures |= summarise("tpot", [s.tpot_s for s in ok if s.tpot_s is not None])
    figures |= summarise("itl", [gap for s in ok for gap in s.itl_s])
    figures |= summarise("e2el", [s.e2e_s for s in ok if s.e2e_s is not None])
    return figures


def failures_by_reason(samples: Sequence[RequestSample]) -> dict[str, int]:
    """'kind: message' -> count, for the failed requests."""
    out: dict[str, int] = {}
    for s in samples:
        if not s.success:
            key = f"{s.error_kind}: {s.error}"
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


@dataclass(frozen=True)
class FigureSpec:
    label: str
    unit: str
    better: str | None  # "higher" | "lower" | None (informational)


def _latency_specs() -> dict[str, FigureSpec]:
    names = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
    return {f"{stat}_{key}_ms": FigureSpec(f"{stat} {label}", "ms", "lower")
            for key, label in names.items() for stat in STATISTICS}


# The figures that compare and report show, in order, with the direction that is better.
FIGURE_SPECS: dict[str, FigureSpec] = {
    "completed": FigureSpec("completed requests", "", "higher"),
    "failed": FigureSpec("failed requests", "", "lower"),
    "request_throughput": FigureSpec("request throughput", "req/s", "higher"),
    "request_goodput": FigureSpec("goodput (meets every SLO)", "req/s", "higher"),
    "output_throughput": FigureSpec("output token throughput", "tok/s", "higher"),
    "total_token_throughput": FigureSpec("total token throughput", "tok/s", "higher"),
    **_latency_specs(),
    "server_rss_peak_bytes": FigureSpec("server resident memory, peak", "MiB", "lower"),
    "device_memory_peak_bytes": FigureSpec("device memory, peak", "MiB", "lower"),
    "avg_power_w": FigureSpec("average power", "W", None),
    "joules_per_output_token": FigureSpec("energy per output token", "J/tok", "lower"),
    "attributed_joules_per_output_token": FigureSpec("energy per output token, attributed by the server", "J/tok",
                                                     "lower"),
    "usd_per_million_output_tokens": FigureSpec("cost per million output tokens", "USD", "lower"),
    "cached_prompt_tokens": FigureSpec("prompt tokens from the prefix cache", "tok", None),
    "mean_concurrency": FigureSpec("mean requests in flight", "", None),
}


def display_value(name: str, value: Any) -> str:
    if value is None:
        return "—"
    spec = FIGURE_SPECS.get(name)
    if spec is not None and spec.unit == "MiB":
        return f"{value / 2**20:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1 else f"{value:,.2f}"
    return str(value)
