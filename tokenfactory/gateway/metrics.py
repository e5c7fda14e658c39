"""Prometheus metrics, under vLLM's names with our prefix (`vllm:` -> `tokenfactory:`), so operators'
dashboards carry over. Each metric is documented in docs/metrics.md.

Engine-side counts (running, waiting, KV usage, token and prefix-cache counters, preemptions) come from
the engine client's latest statistics snapshot (`EngineClient.stats()`, immutable, published by the
engine's thread), so a scrape never reads live engine state and the step loop does no metrics work;
per-request latencies are observed by the server when a request finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenfactory.engine.client import EngineClient, EngineStats, GrammarMetrics, SpeculativeMetrics
from tokenfactory.meter.attribution import Meter
from tokenfactory.meter.ledger import Ledger
from tokenfactory.meter.utilisation import DeviceUsage, from_totals
from tokenfactory.types import RequestOutput

if TYPE_CHECKING:
    from tokenfactory.service.admission import Admission

P = "tokenfactory:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0)


class EngineCollector(Collector):
    """The engine-side series of every served model (one engine, or one fleet per model), one row per model."""

    def __init__(self, engine: EngineClient, model_name: str,
                 models: Mapping[str, EngineClient] | None = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.models = {model_name: engine, **(models or {})}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snaps = [(name, engine.stats()) for name, engine in self.models.items()]
        labels = ["model_name"]

        def family(cls: type, name: str, doc: str, value: Callable[[EngineStats], float]
                   ) -> GaugeMetricFamily | CounterMetricFamily:
            f = cls(P + name, doc, labels=labels)
            for model_name, s in snaps:
                f.add_metric([model_name], value(s))
            return f

        def gauge(name: str, doc: str, value: Callable[[EngineStats], float]) -> GaugeMetricFamily:
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> CounterMetricFamily:
            return family(CounterMetricFamily, name, doc, value)

        yield gauge("engine_alive", "1 while the engine steps; 0 once it stopped (alerts: a replica down).",
                    lambda s: float(s.alive))
        yield gauge("num_requests_running", "Sequences in the running batch.", lambda s: s.num_running)
        yield gauge("num_requests_waiting", "Sequences and requests waiting to be scheduled.",
                    lambda s: s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (0..1).", lambda s: s.kv_cache_usage)
        yield gauge("kv_cache_num_blocks", "KV-cache blocks in the pool.", lambda s: s.num_kv_blocks)
        yield gauge("max_num_seqs", "Configured cap on running sequences.", lambda s: s.max_num_seqs)
        yield gauge("max_num_batched_tokens", "Configured token budget per step.", lambda s: s.max_num_batched_tokens)
        yield counter("prompt_tokens", "Prompt tokens processed (cache hits included).",
                      lambda s: s.num_prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", lambda s: s.num_generation_tokens_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.num_prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda s: s.num_prefix_hits)
        yield counter("num_preemptions", "Sequences preempted (by recompute) for lack of KV blocks.",
                      lambda s: s.num_preemptions)
        yield counter("engine_steps", "Engine steps run.", lambda s: s.num_steps)
        yield counter("requests_failed_alone", "Requests the engine failed alone (fault isolation).",
                      lambda s: s.num_failed_requests)
        model_name, s = snaps[0]  # the default model's (a fleet reports no speculative figures of its own)
        if s.speculative is not None:
            yield from speculative_metrics(s.speculative, model_name)
        grammars = [(name, snap.grammar) for name, snap in snaps if snap.grammar is not None]
        if grammars:
            yield from grammar_metrics(grammars)


def grammar_metrics(per_model: list[tuple[str, GrammarMetrics]]) -> Iterator[CounterMetricFamily]:
    """Structured outputs (engine/grammar.py): constrained requests, compiles, the cache, failures, forced tokens,
    and the steps speculative decoding stepped aside for."""
    for name, doc, value in (
            ("structured_output_requests", "Requests under a grammar (JSON schema, regex, choice, tools, ...).",
             lambda g: g.num_requests),
            ("structured_output_compiles", "Grammars compiled (cache misses).", lambda g: g.num_compiles),
            ("structured_output_cache_hits", "Grammars found compiled in the cache.", lambda g: g.num_cache_hits),
            ("structured_output_failures", "Requests failed for their grammar (invalid, too costly, too slow).",
             lambda g: g.num_failures),
            ("structured_output_compile_seconds", "Seconds spent compiling grammars.", lambda g: g.compile_seconds),
            ("structured_output_forced_tokens", "Output tokens a grammar forced (appended without a decode step).",
             lambda g: g.num_forced_tokens),
            ("structured_output_spec_skipped", "Sequence steps speculative decoding stepped aside for (constrained).",
             lambda g: g.num_spec_skipped)):
        c = CounterMetricFamily(P + name, doc, labels=["model_name"])
        for model_name, g in per_model:
            c.add_metric([model_name], value(g))
        yield c


def speculative_metrics(m: SpeculativeMetrics, model_name: str) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Speculative decoding (vLLM's spec_decode names where they exist): counters, acceptance by draft
    position, the estimated time saved, and the current on/off decision with the evidence behind it."""
    labels, values = ["model_name", "method"], [model_name, m.method]
    for name, doc, value in (
            ("spec_decode_num_drafts", "Verified drafts (one per sequence and step).", m.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", m.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", m.num_accepted_tokens),
            ("spec_decode_num_emitted_tokens", "Tokens emitted by speculative steps (accepted + one).",
             m.num_emitted_tokens),
            ("spec_decode_time_saved_seconds", "Estimated decode time saved (can be negative).", m.time_saved_s)):
        c = CounterMetricFamily(P + name, doc, labels=labels)
        c.add_metric(values, value)
        yield c
    by_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the draft (0 = first).",
                                 labels=[*labels, "position"])
    drafted = CounterMetricFamily(P + "spec_decode_num_draft_tokens_per_pos",
                                  "Draft tokens verified, by position in the draft.", labels=[*labels, "position"])
    for pos, (acc, dr) in enumerate(zip(m.accepted_by_position, m.drafted_by_position, strict=True)):
        by_pos.add_metric([*values, str(pos)], acc)
        drafted.add_metric([*values, str(pos)], dr)
    yield by_pos
    yield drafted
    for name, doc, value in (
            ("spec_decode_enabled", "1 while drafting pays at the current batch size (the decision).",
             float(m.enabled)),
            ("spec_decode_acceptance_rate", "Per-token draft acceptance, exponentially weighted (evidence).",
             m.acceptance_rate),
            ("spec_decode_break_even_acceptance", "Least acceptance at which drafting pays at the current batch.",
             m.break_even_acceptance),
            ("spec_decode_break_even_batch", "Largest batch at which drafting pays at the current acceptance.",
             m.break_even_batch),
            ("spec_decode_batch_size", "Batch size the decision was last taken at.", m.batch_size),
            ("spec_decode_step_base_seconds", "Cost model: a plain decode step at the current batch.",
             m.step_base_s),
            ("spec_decode_step_per_token_seconds", "Cost model: verification seconds per draft token at the "
             "current batch (k drafts each).", m.step_per_token_s),
            ("spec_decode_draft_per_token_seconds", "Cost model: proposer seconds per draft token.",
             m.draft_per_token_s),
            ("spec_decode_num_speculative_tokens", "Configured most draft tokens per step.",
             m.num_speculative_tokens)):
        g = GaugeMetricFamily(P + name, doc, labels=labels)
        g.add_metric(values, value)
        yield g
    c = CounterMetricFamily(P + "spec_decode_decision_changes", "Times the on/off decision changed.", labels=labels)
    c.add_metric(values, m.num_decision_changes)
    yield c


class MeterCollector(Collector):
    """Energy and cost from the meter. Each energy figure is labelled with its source (nvml, rapl,
    modelled, constant) and scope (gpu, cpu-package, machine); a figure the source cannot give is absent,
    never 0."""

    def __init__(self, meter: Meter) -> None:
        self.meter = meter

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        t = self.meter.totals()
        labels = ["source", "scope"]
        energy = CounterMetricFamily(P + "energy_joules", "Energy read from the power source since start-up.",
                                     labels=labels)
        for source, joules in t.energy_joules_by_source.items():
            energy.add_metric([source, t.scope], joules)
        yield energy
        for name, doc, value in (
                ("idle_energy_joules", "Energy spent between steps, not attributed to requests.", t.idle_joules),
                ("attributed_energy_joules", "Energy attributed to requests.", t.attributed_joules)):
            c = CounterMetricFamily(P + name, doc, labels=labels)
            if value is not None:
                c.add_metric([t.source, t.scope], value)
            yield c
        for name, doc, value in (
                ("power_watts", "Average power over the last few seconds.", t.current_watts),
                ("joules_per_output_token", "Attributed joules per generated token, finished requests.",
                 t.joules_per_output_token)):
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            if value is not None:
                g.add_metric([t.source, t.scope], value)
            yield g
        cost = CounterMetricFamily(P + "cost_usd", "Cost of finished requests by component (device time, energy).",
                                   labels=["component"])
        cost.add_metric(["device"], t.cost_device_usd)
        if t.cost_energy_usd is not None:
            cost.add_metric(["energy"], t.cost_energy_usd)
        yield cost
        yield from utilisation_metrics(from_totals(t))


def utilisation_metrics(u: DeviceUsage) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Device utilisation joined to tokens and power (meter/utilisation.py), labelled by device; energy by
    state (busy, idle) carries its source and is absent when not measured."""
    for name, doc, value in (
            ("device_busy_seconds", "Device-seconds spent in engine steps.", u.busy_device_seconds),
            ("device_idle_seconds", "Device-seconds with no step running.", u.idle_device_seconds),
            ("device_idle_cost_usd", "Idle device time and idle energy, priced.", u.idle_cost_usd)):
        c = CounterMetricFamily(P + name, doc, labels=["device"])
        c.add_metric([u.device], value)
        yield c
    energy = CounterMetricFamily(P + "device_energy_joules", "Energy by device state (busy: in steps).",
                                 labels=["device", "state", "source"])
    for state, joules in (("busy", u.busy_joules), ("idle", u.idle_joules)):
        if joules is not None and u.energy_source is not None:
            energy.add_metric([u.device, state, u.energy_source], joules)
    yield energy
    tokens = CounterMetricFamily(P + "device_tokens", "Tokens computed in steps, by kind (prefill, decode).",
                                 labels=["device", "kind"])
    tokens.add_metric([u.device, "prefill"], u.num_prefill_tokens)
    tokens.add_metric([u.device, "decode"], u.num_decode_tokens)
    yield tokens
    for name, doc, value in (
            ("device_utilisation", "Busy share of device time since start-up (0..1).", u.utilisation),
            ("device_joules_per_token", "Busy joules per token computed.", u.joules_per_token)):
        g = GaugeMetricFamily(P + name, doc, labels=["device"])
        if value is not None:
            g.add_metric([u.device], value)
        yield g


class LedgerCollector(Collector):
    """Rows the database refused and where they are: journalled, replayed, still waiting. Read from the
    ledger's memory (Ledger.status), never from the database, so a scrape cannot hang on a held lock."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.ledger.status()
        yield CounterMetricFamily(P + "ledger_rows_journalled", "Ledger rows sent to the journal because the "
                                  "database refused them or was slow.", value=s.num_journalled_total)
        yield CounterMetricFamily(P + "ledger_rows_replayed", "Journalled ledger rows since found in the database.",
                                  value=s.num_replayed_total)
        yield GaugeMetricFamily(P + "ledger_rows_pending", "Ledger rows waiting in the journal for the database.",
                                value=s.num_pending)
        yield GaugeMetricFamily(P + "ledger_degraded", "1 while ledger rows go to the journal instead of the "
                                "database.", value=float(s.degraded))


class AdmissionCollector(Collector):
    """What admission holds right now (Admission.snapshot): all of it returns to 0 when the server is idle,
    so a gauge that stays up is a leaked reservation."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.admission.snapshot()
        yield GaugeMetricFamily(P + "admission_queued", "Prompts holding admission queue slots (admitted, no "
                                "output yet).", value=s.num_queued)
        yield GaugeMetricFamily(P + "admission_max_waiting", "Queue slots in all (503 past them).",
                                value=s.max_waiting)
        yield GaugeMetricFamily(P + "admission_in_flight", "API requests admitted and not yet settled.",
                                value=s.num_in_flight)
        reserved = GaugeMetricFamily(P + "admission_reserved_budget", "Budget reserved by requests in flight, by "
                                     "unit (tokens, joules, usd).", labels=["unit"])
        for unit, value in s.unit_to_reserved.items():
            reserved.add_metric([unit], value)
        yield reserved
        yield CounterMetricFamily(P + "admission_orphaned", "Reservations released because their owner dropped "
                                  "them (a bug; charged in full).", value=s.num_orphaned)


class ServerMetrics:
    def __init__(self, engine: EngineClient, model_name: str, meter: Meter | None = None,
                 ledger: Ledger | None = None, *, admission: Admission | None = None,
                 models: Mapping[str, EngineClient] | None = None, baseline: tuple[str, float] | None = None) -> None:
        """`baseline`: a saved bench run's name and joules per output token (deploy/'s regression alert)."""
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name, models))
        if baseline is not None:
            Gauge(P + "baseline_joules_per_output_token", "Joules per output token of the saved bench run this "
                  "server was started with (serve --baseline): the J/token regression alert's reference.",
                  ["run"], registry=self.registry).labels(baseline[0]).set(baseline[1])
        if admission is not None:
            self.registry.register(AdmissionCollector(admission))
        if meter is not None:
            self.registry.register(MeterCollector(meter))
        if ledger is not None:
            self.registry.register(LedgerCollector(ledger))
        labels = ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(P + name, doc, labels, buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first generated token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first being scheduled.")
        token_buckets = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.", token_buckets)
        self.gen_len = hist("request_generation_tokens", "Generated tokens of finished requests.", token_buckets)
        self.success = Counter(P + "request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.errors = Counter(P + "request_errors", "Requests refused or failed, by HTTP status.",
                              ["model_name", "status"], registry=self.registry)


class LatencyObserver:
    """The request service's observer (service.RequestObserver) that fills the latency histograms: per output
    event the inter-token latency (spread over the tokens it carries), and once a request finishes its TTFT,
    E2E, queue time, lengths and finish reasons; `on_end` forgets a request. On the event loop, and on the engine's
    thread for direct outputs: each call is a few single dict operations and a histogram observation (which takes
    the histogram's lock), safe from either thread."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.request_id_to_last_output: dict[str, float] = {}
        self.model_to_itl: dict[str, Histogram] = {}  # the histogram's child per model, not `labels()` per token

    def on_output(self, model: str, out: RequestOutput) -> None:
        now = time.monotonic()
        new_tokens = sum(len(c.token_ids_delta) for c in out.outputs)
        last = self.request_id_to_last_output.get(out.request_id)
        if last is not None and new_tokens:
            if (itl := self.model_to_itl.get(model)) is None:
                itl = self.model_to_itl[model] = self.metrics.itl.labels(model)
            itl.observe((now - last) / new_tokens)
        self.request_id_to_last_output[out.request_id] = now
        if out.finished:
            self.request_id_to_last_output.pop(out.request_id, None)
            self._finished(model, out)

    def on_end(self, request_id: str) -> None:
        self.request_id_to_last_output.pop(request_id, None)

    def _finished(self, model: str, out: RequestOutput) -> None:
        m, metrics = out.metrics, self.metrics
        if m is not None:
            for hist, value in ((metrics.ttft, m.ttft), (metrics.e2e, m.e2e_latency), (metrics.queue, m.queue_time)):
                if value is not None:
                    hist.labels(model).observe(value)
        metrics.prompt_len.labels(model).observe(len(out.prompt_token_ids))
        metrics.gen_len.labels(model).observe(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            metrics.success.labels(model, str(c.finish_reason)).inc()
