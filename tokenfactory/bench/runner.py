"""One benchmark run against one target: probe, warm up, load, measure, and assemble a RunResult.

    probe_target ─ warm_up ─ scrape /metrics ─ power.start ─┬─ run_load ──────────┬─ scrape ─ power.stop
                                                             └─ Sampler (memory) ──┘
    -> latency figures (figures.py) + memory + energy + cost -> RunResult (results.py)

Nothing here raises for a faulty target: an unreachable URL or a refused key gives an "aborted"
RunResult whose `reasons` say why, and failed requests give a "partial" one.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from tokenfactory.bench.client import (
    RequestSample,
    SamplingOptions,
    Target,
    TargetInfo,
    probe_target,
    stream_session,
)
from tokenfactory.bench.datasets import BenchRequest, DatasetConfig
from tokenfactory.bench.figures import failures_by_reason, latency_figures
from tokenfactory.bench.loadgen import LoadConfig, LoadOutcome, NullProgress, RichProgress, run_load, warm_up
from tokenfactory.bench.probes import (
    EnergyWindow,
    LocalPower,
    MemoryTrace,
    Sampler,
    Scrape,
    find_listening_pid,
    is_loopback,
    metric_by_label,
    metric_sum,
    scrape,
    server_energy,
)
from tokenfactory.bench.results import RunResult

TIMESERIES_GAUGES = ("tokenfactory:num_requests_running", "tokenfactory:num_requests_waiting",
                     "tokenfactory:kv_cache_usage_perc", "tokenfactory:power_watts", "process_resident_memory_bytes")


@dataclass(frozen=True)
class BenchSpec:
    """Everything one run needs besides its requests."""

    target: Target
    dataset: DatasetConfig
    load: LoadConfig
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    slo: dict[str, float] = field(default_factory=dict)
    power_source: str = "auto"  # a meter source name, or "none"
    server_pid: int | None = None
    device_profile: str | None = None  # prices.toml [devices] key; None: matched, else "cpu"
    sample_interval_s: float = 1.0
    progress: bool = True
    tokenizer_source: str = ""


async def run_bench(spec: BenchSpec, requests: Sequence[BenchRequest], warmup: Sequence[BenchRequest] = (),
                    tokenizer: Any = None) -> RunResult:
    """Run `requests` against spec.target; a fault of the target gives an aborted or partial result."""
    import httpx

    timeout = httpx.Timeout(spec.load.request_timeout_s, connect=10.0)
    # httpx for the few plain GETs (/v1/models, /metrics); the streamed requests go through `stream_session`
    # (aiohttp: a fraction of httpx's CPU per streamed token, which on a small machine the server would lose).
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client, \
            stream_session(spec.load.request_timeout_s) as session:
        info = await probe_target(client, spec.target.base_url, spec.target.api_key)
        if info.error_kind:
            return _aborted(spec, requests, info, info.error or info.error_kind)
        target = _resolved(spec.target, info)
        if not target.model:
            return _aborted(spec, requests, info, f"{target.base_url}/v1/models lists no model; pass --model")
        warm = await warm_up(session, target, warmup, spec.sampling)
        fatal = next((s for s in warm if s.error_kind in ("connect", "auth")), None)
        if fatal is not None:
            return _aborted(spec, requests, info, f"warm-up failed: {fatal.error}", target)
        return await _measure(spec, target, info, client, session, requests, tokenizer, warm)


async def _measure(spec: BenchSpec, target: Target, info: TargetInfo, client: Any, session: Any,
                   requests: Sequence[BenchRequest], tokenizer: Any, warm: list[RequestSample]) -> RunResult:
    """`client` (httpx) for the GETs: /metrics and the memory sampler; `session` (aiohttp) for the streams."""
    pid = spec.server_pid or (find_listening_pid(target.base_url) if is_loopback(target.base_url) else None)
    before = await scrape(client, target.base_url, target.headers())
    power = LocalPower(spec.power_source, pid) if spec.power_source != "none" else None
    sampler = Sampler(client, target.base_url, target.headers(), pid, before is not None, spec.sample_interval_s)
    stop = asyncio.Event()
    sampling_task = asyncio.create_task(sampler.run(stop))
    if power is not None:
        power.start()
    progress = RichProgress(len(requests), target.label or target.model) if spec.progress else None
    try:
        if progress is not None:
            with progress:
                outcome = await run_load(session, target, requests, spec.sampling, spec.load, progress)
        else:
            outcome = await run_load(session, target, requests, spec.sampling, spec.load, NullProgress())
    finally:
        stop.set()
        await sampling_task
    local = power.stop(outcome.duration_s) if power is not None else None
    if power is not None:
        power.close()
    if local is not None and not is_loopback(target.base_url):
        local = replace(local, basis=f"THIS machine, not the remote server at {target.base_url}: {local.basis}")
    after = await scrape(client, target.base_url, target.headers())
    count_missing_output(outcome.samples, tokenizer)
    return assemble(spec, target, info, outcome, sampler.trace, before, after, local, pid, warm)


def count_missing_output(samples: Sequence[RequestSample], tokenizer: Any) -> None:
    """Output tokens of successful requests whose server sent no usage: counted from the text (vllm does so)."""
    for s in samples:
        if s.success and s.output_tokens is None:
            if tokenizer is not None:
                s.output_tokens = len(tokenizer.encode(s.text, add_special_tokens=False))
                s.output_tokens_source = "tokenizer"
            else:
                s.output_tokens, s.output_tokens_source = s.num_chunks, "chunks"


def assemble(spec: BenchSpec, target: Target, info: TargetInfo, outcome: LoadOutcome, trace: MemoryTrace,
             before: Scrape | None, after: Scrape | None, local: EnergyWindow | None,
             pid: int | None, warm: list[RequestSample]) -> RunResult:
    samples = outcome.samples
    figures = latency_figures(samples, outcome.duration_s, spec.slo)
    figures |= trace.figures()
    figures |= server_token_counts(before, after)
    figures |= energy_figures(samples, before, after, trace, local, outcome.duration_s, figures["total_output_tokens"])
    figures |= cost_figures(samples, figures, spec.device_profile)
    figures["concurrency"] = spec.load.concurrency if spec.load.request_rate is None else \
        max(round(figures.get("mean_concurrency") or 1), 1)
    figures["power_w"] = figures.get("avg_power_w")  # the name `plan --calibrate` reads
    failed = [s for s in samples if not s.success]
    status = "aborted" if outcome.aborted else ("partial" if failed else "complete")
    reasons = [f"sending stopped early: {outcome.aborted}"] if outcome.aborted else []
    if failed:
        reasons.append(f"{len(failed)} of {len(samples)} requests failed")
    return RunResult(
        name="", label=target.label or target.model, status=status, reasons=reasons,
        config=run_config(spec, target, figures, pid), environment=environment(info, outcome),
        figures=figures, failures=failures_by_reason(samples), samples=[s.to_json() for s in samples],
        timeseries=timeseries(trace))


def server_token_counts(before: Scrape | None, after: Scrape | None) -> dict[str, Any]:
    """Tokens our server counted during the run (its /metrics counters' deltas), for cross-checking."""
    out: dict[str, Any] = {"server_prompt_tokens": None, "server_generation_tokens": None}
    if before is None or after is None:
        return out
    for key, name in (("server_prompt_tokens", "tokenfactory:prompt_tokens_total"),
                      ("server_generation_tokens", "tokenfactory:generation_tokens_total")):
        a, b = metric_sum(after.samples, name), metric_sum(before.samples, name)
        out[key] = int(a - b) if a is not None and b is not None else None
    return out


def energy_figures(samples: Sequence[RequestSample], before: Scrape | None, after: Scrape | None,
                   trace: MemoryTrace, local: EnergyWindow | None, seconds: float,
                   output_tokens: int) -> dict[str, Any]:
    """J/token and watts: the server's own figures when it reports them, else the local source's window."""
    ok = [s for s in samples if s.success]
    power_samples = [v for _, m in trace.metrics for v in metric_by_label(m, "tokenfactory:power_watts", "source")
                     .values()]
    window = server_energy([s.usage_extra for s in ok], before, after, power_samples, seconds) if ok else None
    origin = "server"
    if window is None:
        window, origin = local, "local"
    if window is None or window.joules is None:
        return {"energy_joules": None, "avg_power_w": None, "joules_per_output_token": None,
                "attributed_joules_per_output_token": None, "energy_source": None, "energy_scope": None,
                "energy_origin": None,
                "energy_basis": local.basis if local is not None else "power measurement off (--power-source none)"}
    per_token = (lambda j: j / output_tokens if output_tokens and j is not None else None)
    return {"energy_joules": window.joules, "avg_power_w": window.watts,
            "joules_per_output_token": per_token(window.joules),
            "attributed_joules_per_output_token": per_token(window.attributed_joules),
            "energy_source": window.source, "energy_scope": window.scope, "energy_origin": origin,
            "energy_basis": window.basis}


def cost_figures(samples: Sequence[RequestSample], figures: dict[str, Any], device_profile: str | None) -> \
        dict[str, Any]:
    """USD for the run and per million output tokens: the server's usage.cost_usd, else the meter's prices."""
    ok = [s for s in samples if s.success]
    output = figures["total_output_tokens"]
    costs = [s.usage_extra.get("cost_usd") for s in ok]
    if ok and all(isinstance(c, int | float) for c in costs):
        total, basis = float(sum(costs)), "server usage.cost_usd"
    else:
        try:
            from tokenfactory.meter.prices import load_prices

            prices = load_prices(device=device_profile)
        except (ImportError, ValueError, FileNotFoundError) as e:
            return {"cost_usd": None, "usd_per_million_output_tokens": None, "cost_basis": f"no prices: {e}"}
        device = prices.device_cost_usd(figures["duration_s"])
        joules = figures.get("energy_joules")
        energy = prices.energy_cost_usd(joules) if joules is not None else None
        total = device + (energy or 0.0)
        basis = f"meter prices: {prices.describe()}; device time = run duration" + \
            ("" if energy is not None else "; energy unknown, so device time only")
    per_million = total / output * 1e6 if output else None
    return {"cost_usd": total, "usd_per_million_output_tokens": per_million, "cost_basis": basis}


def run_config(spec: BenchSpec, target: Target, figures: dict[str, Any], pid: int | None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "target": {"base_url": target.base_url, "model": target.model, "endpoint": target.endpoint,
                   "label": target.label, "api_key": "(set)" if target.api_key else None},
        "model": target.model,
        "dataset": asdict(spec.dataset),
        "load": asdict(spec.load),
        "sampling": asdict(spec.sampling),
        "slo_s": spec.slo,
        "power_source": spec.power_source,
        "server_pid": pid,
        "tokenizer": spec.tokenizer_source,
    }
    for key, figure in (("prompt_tokens", "mean_prompt_tokens"), ("output_tokens", "mean_output_tokens")):
        if figures.get(figure) is not None:  # top-level fields `plan --calibrate` reads
            config[key] = figures[figure]
    return config


def environment(info: TargetInfo, outcome: LoadOutcome | None) -> dict[str, Any]:
    from tokenfactory import __version__
    from tokenfactory.meter.modelled import cpu_model_name

    started = dt.datetime.fromtimestamp(outcome.started_at, dt.UTC).isoformat() if outcome else None
    return {"tokenfactory_version": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "hostname": platform.node(), "cpu_model": cpu_model_name(),
            "num_cpus": os.cpu_count(), "started_at_utc": started,
            "server": {"owned_by": info.owned_by, "root": info.root, "max_model_len": info.max_model_len,
                       "models": list(info.model_ids), "machine_profile": info.machine_profile}}


def timeseries(trace: MemoryTrace) -> list[dict[str, Any]]:
    rows = []
    for t, samples in trace.metrics:
        row: dict[str, Any] = {"t_s": round(t, 3)}
        for name in TIMESERIES_GAUGES:
            value = metric_sum(samples, name)
            if value is not None:
                row[name] = value
        rows.append(row)
    return rows


def _resolved(target: Target, info: TargetInfo) -> Target:
    """The model (first of /v1/models) and label (the server's owned_by, else the model) when not given."""
    model = target.model or (info.model_ids[0] if info.model_ids else "")
    return replace(target, model=model, label=target.label or info.owned_by or model)


def _aborted(spec: BenchSpec, requests: Sequence[BenchRequest], info: TargetInfo, reason: str,
             target: Target | None = None) -> RunResult:
    target = target or spec.target
    samples = [RequestSample(r.index, r.prompt_len, r.output_len, error_kind="not_sent", error=f"not sent: {reason}")
               for r in requests]
    figures = latency_figures(samples, 0.0, spec.slo)
    return RunResult(name="", label=target.label or target.model, status="aborted",
                     reasons=[f"no request was sent: {reason}"], config=run_config(spec, target, figures, None),
                     environment=environment(info, None), figures=figures,
                     failures=failures_by_reason(samples), samples=[s.to_json() for s in samples])
