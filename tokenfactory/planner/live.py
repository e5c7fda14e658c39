"""Live doctor: read a running server's Prometheus /metrics (twice, a few seconds apart, to see rates) and
explain a slowdown in plain words, with the numbers as evidence. The server may be ours, vLLM, SGLang or
llama.cpp: dialects.py maps each one's metric names to the quantities the rules read and names its own flags.

Each rule in LIVE_RULES reads a `Window` (two snapshots: counters become deltas and rates,
histograms become means over the window) and returns Findings. With one snapshot only (interval 0)
the rules fall back to the totals since the server started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenfactory.planner.dialects import DIALECTS, FRACTIONS, TOKENFACTORY, Dialect, detect
from tokenfactory.planner.doctor import Finding
from tokenfactory.planner.units import count, ms, pct

Rows = tuple[tuple[frozenset[tuple[str, str]], float], ...]


class MetricsUnavailable(ValueError):
    """The URL could not be read as Prometheus text; the message says why, in one line."""


@dataclass(frozen=True)
class Snapshot:
    """Sample name -> (labels, value) pairs, as scraped at `time_s` (time.monotonic), in one server's dialect."""

    time_s: float
    samples: Mapping[str, Rows]
    dialect: Dialect = TOKENFACTORY

    def _rows(self, quantity: str, suffix: str = "") -> Rows | None:
        for name in self.dialect.samples(quantity):
            if name + suffix in self.samples:
                return self.samples[name + suffix]
        return None

    def value(self, name: str, **labels: str) -> float | None:
        """The quantity `name` (our name, e.g. kv_cache_usage_perc) as this server exports it, summed over the samples
        matching `labels` (a fraction: the largest); None when the server does not export it."""
        suffix = next((s for s in ("_sum", "_count") if name.endswith(s) and name not in self.dialect.names), "")
        rows = self._rows(name.removesuffix(suffix), suffix) if suffix else self._rows(name)
        if rows is None:
            return None
        want = set(labels.items())
        values = [v for lbl, v in rows if want <= lbl and not any(k == "le" for k, _ in lbl)]
        if not values:
            return None
        return max(values) if name in FRACTIONS else sum(values)

    def label_values(self, name: str, label: str) -> list[str]:
        return sorted({v for lbl, _ in self._rows(name) or () for k, v in lbl if k == label})


def parse_metrics(text: str, time_s: float) -> Snapshot:
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, list[tuple[frozenset[tuple[str, str]], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.setdefault(s.name, []).append((frozenset(s.labels.items()), float(s.value)))
    except ValueError as e:
        raise MetricsUnavailable(f"the response is not Prometheus text: {e}") from None
    return Snapshot(time_s, {k: tuple(v) for k, v in samples.items()}, detect(set(samples)) or TOKENFACTORY)


def scrape(url: str, timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> Snapshot:
    """GET {url}/metrics (or url itself if it ends in /metrics)."""
    import httpx

    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    try:
        response = httpx.get(target, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise MetricsUnavailable(f"cannot reach {target}: {e.__class__.__name__}: {e or 'no answer'}") from None
    if response.status_code != 200:
        raise MetricsUnavailable(f"{target} answered HTTP {response.status_code}, not metrics")
    snap = parse_metrics(response.text, clock())
    if detect(set(snap.samples)) is None:
        known = ", ".join(d.prefix for d in DIALECTS)
        raise MetricsUnavailable(f"{target} serves no tokenfactory: metrics, nor those of vLLM, SGLang or llama.cpp "
                                 f"(none of {known}); is it an LLM server with metrics on?")
    return snap


@dataclass(frozen=True)
class Window:
    """What happened between two snapshots (or since start-up, when `before` is None)."""

    after: Snapshot
    before: Snapshot | None = None

    @property
    def seconds(self) -> float:
        return self.after.time_s - self.before.time_s if self.before else 0.0

    def gauge(self, name: str, **labels: str) -> float | None:
        return self.after.value(name, **labels)

    def delta(self, name: str, **labels: str) -> float | None:
        """Counter increase over the window (the total when there is no window)."""
        now = self.after.value(name, **labels)
        if now is None:
            return None
        then = self.before.value(name, **labels) if self.before else None
        return now - (then or 0.0) if now >= (then or 0.0) else now  # a restart resets counters

    def rate(self, name: str, **labels: str) -> float | None:
        d = self.delta(name, **labels)
        return d / self.seconds if d is not None and self.seconds > 0 else None

    def mean(self, histogram: str) -> float | None:
        """Mean of a histogram over the window: delta(sum) / delta(count)."""
        total, n = self.delta(histogram + "_sum"), self.delta(histogram + "_count")
        return total / n if total is not None and n else None

    @property
    def dialect(self) -> Dialect:
        return self.after.dialect

    def flag(self, lever: str) -> str:
        return self.dialect.flag(lever)

    def earlier_mean(self, histogram: str) -> float | None:
        """Mean of a histogram over everything before the window."""
        if self.before is None:
            return None
        total, n = self.before.value(histogram + "_sum"), self.before.value(histogram + "_count")
        return total / n if total is not None and n else None

    def earlier_ratio(self, num: str, den: str) -> float | None:
        """num/den accumulated before the window: the baseline a rising or falling rate is judged by."""
        if self.before is None:
            return None
        n, d = self.before.value(num), self.before.value(den)
        return n / d if n is not None and d else None

    def window_ratio(self, num: str, den: str) -> float | None:
        n, d = self.delta(num), self.delta(den)
        return n / d if n is not None and d else None


Rule = Callable[[Window], list[Finding]]

KV_FULL = 0.90  # kv_cache_usage_perc at which the cache counts as full
PREFILL_HEAVY = 0.75  # share of computed tokens that are prompt tokens
LOW_OCCUPANCY = 0.25  # running / max_num_seqs below which the batch is nearly empty
HIT_RATE_DROP = 0.5  # the window's prefix-cache hit rate below half the earlier one
JOULES_RISE = 1.25  # the window's J/token above 125% of the earlier one


def kv_pressure(w: Window) -> list[Finding]:
    usage = w.gauge("kv_cache_usage_perc")
    preempted = w.delta("num_preemptions_total")
    if usage is None or usage < KV_FULL or not preempted:
        return []
    span = f"in the last {ms(w.seconds)}" if w.before else "since start-up"
    itl_then, itl_now = w.earlier_mean("inter_token_latency_seconds"), w.mean("inter_token_latency_seconds")
    slower = (f"; the inter-token latency went from {ms(itl_then)} to {ms(itl_now)}"
              if itl_then is not None and itl_now is not None and itl_now > 1.2 * itl_then else "")
    evidence = {"kv_cache_usage": usage, "preemptions": preempted, "window_s": w.seconds}
    if itl_now is not None:
        evidence["inter_token_latency_s"] = itl_now
    if itl_then is not None:
        evidence["inter_token_latency_before_s"] = itl_then
    return [Finding("warning", f"The KV cache is {pct(usage)} full and {count(preempted)} sequences were "
                    f"preempted {span}{slower} ({w.dialect.name}): long contexts do not fit together, so sequences "
                    f"are evicted and recomputed. Lower {w.flag('max_num_seqs')}, lower {w.flag('max_model_len')}, "
                    f"use an 8-bit KV cache ({w.flag('kv_cache_dtype')}: about twice the tokens), or give the cache "
                    "more memory "
                    f"({w.flag('kv_memory')}, a larger card or quantized weights).", evidence)]


def prefill_heavy(w: Window) -> list[Finding]:
    prompt, gen = w.delta("prompt_tokens_total"), w.delta("generation_tokens_total")
    if not prompt or gen is None or prompt / (prompt + gen) < PREFILL_HEAVY:
        return []
    itl, ttft = w.mean("inter_token_latency_seconds"), w.mean("time_to_first_token_seconds")
    budget = w.gauge("max_num_batched_tokens")
    detail = f"; mean inter-token latency {ms(itl)}" if itl is not None else ""
    detail += f", mean TTFT {ms(ttft)}" if ttft is not None else ""
    flag = w.flag("max_num_batched_tokens")
    chunk = (f"lower {flag} from {count(budget)} to about {count(max(256, budget // 4))}"
             if budget else f"set {flag} to 512-2,048")
    evidence = {"prompt_tokens": prompt, "generation_tokens": gen}
    if itl is not None:
        evidence["inter_token_latency_s"] = itl
    if budget is not None:
        evidence["max_num_batched_tokens"] = budget
    return [Finding("warning", f"Prefill-heavy traffic: {pct(prompt / (prompt + gen))} of computed tokens are "
                    f"prompt tokens ({count(prompt)} prompt vs {count(gen)} generated){detail}. Long prefills "
                    f"stall the decoding sequences; enable chunked prefill and {chunk} so every step keeps "
                    f"decoding, and use {w.flag('prefix_caching')} for shared prompt prefixes.", evidence)]


def queueing(w: Window) -> list[Finding]:
    waiting, running = w.gauge("num_requests_waiting"), w.gauge("num_requests_running")
    queue = w.mean("request_queue_time_seconds")
    if not waiting and (queue is None or queue < 0.5):
        return []
    limit = w.gauge("max_num_seqs")
    usage = w.gauge("kv_cache_usage_perc")
    evidence = {k: v for k, v in (("waiting", waiting), ("running", running), ("queue_time_s", queue),
                                  ("max_num_seqs", limit), ("kv_cache_usage", usage)) if v is not None}
    at_limit = limit is not None and running is not None and running >= limit
    if at_limit and usage is not None and usage < 0.7:
        fix = (f"the batch is at max_num_seqs ({count(limit)}) while the KV cache is only {pct(usage)} full: "
               f"raise {w.flag('max_num_seqs')}")
    elif usage is not None and usage >= KV_FULL:
        fix = f"the KV cache is {pct(usage)} full: add replicas or give the cache more memory"
    else:
        fix = "the server is at capacity: add replicas or a faster card"
    wait = f", mean queue time {ms(queue)}" if queue is not None else ""
    return [Finding("warning", f"Requests are queueing: {count(waiting or 0)} waiting, {count(running or 0)} "
                    f"running{wait}; {fix}.", evidence)]


def low_occupancy(w: Window) -> list[Finding]:
    running, limit = w.gauge("num_requests_running"), w.gauge("max_num_seqs")
    waiting = w.gauge("num_requests_waiting") or 0.0
    if running is None or not limit or waiting > 0 or running / limit >= LOW_OCCUPANCY:
        return []
    gen = w.rate("generation_tokens_total")
    rate = f", generating {count(gen)} tokens/s" if gen is not None else ""
    evidence = {"running": running, "max_num_seqs": limit}
    if gen is not None:
        evidence["generation_tokens_per_s"] = gen
    return [Finding("info", f"Low batch occupancy: {count(running)} of {count(limit)} sequence slots in use and "
                    f"nothing waiting{rate}. Each step still reads all the weights, so tokens/s per card and "
                    "J/token are far from what this card can do: send more concurrent requests, or serve this "
                    "load with fewer replicas or a smaller card.", evidence)]


def _hit_rates(w: Window) -> tuple[float, float] | None:
    """(hit rate before the window, in it): from the hit and query counters, else the server's own gauge."""
    now = w.window_ratio("prefix_cache_hits_total", "prefix_cache_queries_total")
    then = w.earlier_ratio("prefix_cache_hits_total", "prefix_cache_queries_total")
    if now is None and w.before is not None:
        then, now = w.before.value("prefix_cache_hit_rate"), w.gauge("prefix_cache_hit_rate")
    return (then, now) if then is not None and now is not None else None


def prefix_hit_rate_falling(w: Window) -> list[Finding]:
    rates = _hit_rates(w)
    if rates is None or rates[0] < 0.1 or rates[1] >= HIT_RATE_DROP * rates[0]:
        return []
    then, now = rates
    return [Finding("warning", f"The prefix-cache hit rate fell from {pct(then)} to {pct(now)} over the last "
                    f"{ms(w.seconds)}: requests stopped sharing prefixes (a changed system prompt or "
                    "template?), or KV pressure evicts cached prefixes. Keep shared prompt prefixes "
                    "byte-identical and check the KV cache usage.",
                    {"hit_rate_before": then, "hit_rate_window": now, "window_s": w.seconds})]


def _joules_per_token(w: Window, labels: dict[str, str]) -> tuple[float, float] | None:
    """(J/token before the window, J/token in it) from the energy counter, else from the
    joules_per_output_token gauge read at both ends."""
    if w.before is None:
        return None
    gen = w.delta("generation_tokens_total")
    joules = w.delta("energy_joules_total", **labels)
    joules_then = w.before.value("energy_joules_total", **labels)
    tokens_then = w.before.value("generation_tokens_total")
    if joules and gen and joules_then is not None and tokens_then:
        return joules_then / tokens_then, joules / gen
    then, now = w.before.value("joules_per_output_token", **labels), w.gauge("joules_per_output_token", **labels)
    return (then, now) if then and now is not None else None


def joules_rising(w: Window) -> list[Finding]:
    out = []
    sources = (w.after.label_values("energy_joules_total", "source")
               or w.after.label_values("joules_per_output_token", "source") or [""])
    for source in sources:
        labels = {"source": source} if source else {}
        pair = _joules_per_token(w, labels)
        if pair is None or pair[1] < JOULES_RISE * pair[0]:
            continue
        then, now = pair
        watts = w.gauge("power_watts", **labels)
        running = w.gauge("num_requests_running")
        evidence = {"joules_per_token_before": then, "joules_per_token_window": now}
        if watts is not None:
            evidence["power_w"] = watts
        out.append(Finding("warning", f"Energy per output token rose from {then:.3f} J to {now:.3f} J "
                           f"({source or 'all sources'}) over the last {ms(w.seconds)}"
                           + (f" at {count(watts)} W" if watts is not None else "")
                           + (f" with {count(running)} sequences running" if running is not None else "")
                           + ": fewer tokens per step (a smaller batch), more prefill or preemption work per "
                           "output token, or a hotter card. Raise the batch occupancy and check the prefill and "
                           "preemption findings.", evidence))
    return out


LIVE_RULES: tuple[Rule, ...] = (kv_pressure, prefill_heavy, queueing, low_occupancy, prefix_hit_rate_falling,
                                joules_rising)


def diagnose(after: Snapshot, before: Snapshot | None = None) -> list[Finding]:
    window = Window(after, before)
    findings = [f for rule in LIVE_RULES for f in rule(window)]
    if not findings:
        gen = window.rate("generation_tokens_total")
        running = window.gauge("num_requests_running")
        evidence = {k: v for k, v in (("running", running), ("generation_tokens_per_s", gen)) if v is not None}
        findings.append(Finding("info", f"No slowdown found ({window.dialect.name}): "
                                + (f"{count(running)} sequences running, " if running is not None else "")
                                + (f"{count(gen)} tokens/s generated." if gen is not None
                                   else "counters read once (use --interval for rates)."), evidence))
    return findings


def diagnose_url(url: str, interval_s: float = 5.0, timeout_s: float = 5.0,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> list[Finding]:
    """Scrape `url`, wait `interval_s`, scrape again, and diagnose the window between (`sleep` and `clock` are
    the real ones unless a test passes its own)."""
    first = scrape(url, timeout_s, clock)
    if interval_s <= 0:
        return diagnose(first)
    sleep(interval_s)
    return diagnose(scrape(url, timeout_s, clock), first)
