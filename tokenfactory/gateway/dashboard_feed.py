"""The dashboard's data: one point a second from the engine client's snapshots and the meter, an hour kept.

A sampler thread reads only what is already published — `EngineClient.stats()` (an immutable snapshot),
`Meter.totals()` (one lock) and the server's latency histograms — never live engine state, and the step
loop does nothing for it. Each point is computed from two samples: the newest and the one `window`
samples before it (10 s at a point a second), so rates are counter deltas over a trailing window, as
Prometheus' rate(x[10s]) (a per-second rate of prefill-sized steps would be all spikes):

    tokens_in_s, tokens_out_s   Δ prompt tokens / Δt, Δ generated tokens / Δt                   [token/s]
    watts                       the meter's trailing average power (null when it cannot measure)  [W]
    joules_per_token            watts · Δt / Δ generated tokens (idle included: what a token cost) [J/token]
    usd_per_mtok                (usd_per_hour / 3600 · devices + watts · psu · pue / 3.6e6 · usd_per_kwh)
                                / tokens_out_s · 1e6: the machine's running cost per million tokens out
    busy, idle                  Δ busy device-seconds / (Δt · devices), capped at 1 (a step's time
                                lands when it ends); idle = 1 − busy                               [0..1]
    ttft/tpot p50, p99          histogram_quantile over the window's bucket deltas
                                (Prometheus' linear interpolation inside a bucket)                [s]

Replicas: each engine behind the client (`EngineClient.replica_states()`: one for a single engine, one per
replica for a fleet) gets an entry per point, the same fields for each, and the totals summed. Memory comes
from each one's `EngineFacts` (weight and KV bytes), null where a client cannot know them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Histogram

from tokenfactory.engine.client import EngineClient, EngineFacts, EngineStats
from tokenfactory.meter.attribution import Meter, MeterTotals
from tokenfactory.meter.prices import Prices


@dataclass(frozen=True)
class Replica:
    name: str
    stats: EngineStats
    facts: EngineFacts | None


@dataclass(frozen=True)
class Sample:
    wall: float  # time.time(), for the charts' x axis
    monotonic: float
    replicas: tuple[Replica, ...]
    meter: MeterTotals | None
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)
    tpot_buckets: tuple[tuple[float, float], ...]


def replicas_of(engine: EngineClient) -> tuple[Replica, ...]:
    """One Replica per engine behind the client, from its replica states."""
    return tuple(Replica(s.replica_id, s.stats, s.facts) for s in engine.replica_states())


def buckets(histogram: Histogram) -> tuple[tuple[float, float], ...]:
    """Cumulative bucket counts summed over the histogram's label sets."""
    le_to_count: dict[float, float] = {}
    for family in histogram.collect():
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                le_to_count[le] = le_to_count.get(le, 0.0) + s.value
    return tuple(sorted(le_to_count.items()))


def quantile(q: float, before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile of the observations between two readings of the same histogram (None: none)."""
    le_to_before = dict(before)
    counts = [(le, c - le_to_before.get(le, 0.0)) for le, c in after]
    if not counts or counts[-1][1] <= 0:
        return None
    rank, prev_le, prev_count = q * counts[-1][1], 0.0, 0.0
    for le, count in counts:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # in the +Inf bucket: the largest finite bound, as Prometheus does
            return prev_le + (le - prev_le) * ((rank - prev_count) / (count - prev_count) if count > prev_count
                                               else 1.0)
        prev_le, prev_count = le, count
    return prev_le


def _rate(delta: float, dt: float) -> float:
    return delta / dt if dt > 0 else 0.0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def replica_point(prev: Replica | None, cur: Replica, dt: float) -> dict[str, Any]:
    """A replica's fields over the window since `prev` (None: a replica new in it, rates 0)."""
    s, p = cur.stats, prev.stats if prev is not None else cur.stats
    spec, pspec = s.speculative, p.speculative
    acceptance = (_ratio(spec.num_accepted_tokens - pspec.num_accepted_tokens,
                         spec.num_draft_tokens - pspec.num_draft_tokens) if spec and pspec else None)
    kv_bytes = cur.facts.kv_bytes if cur.facts is not None else None
    return {
        "name": cur.name, "alive": s.alive,
        "tokens_in_s": _rate(s.num_prompt_tokens_total - p.num_prompt_tokens_total, dt),
        "tokens_out_s": _rate(s.num_generation_tokens_total - p.num_generation_tokens_total, dt),
        "running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_cache_usage,
        "preemptions": s.num_preemptions - p.num_preemptions,
        "prefix_hit_rate": _ratio(s.num_prefix_hits - p.num_prefix_hits, s.num_prefix_queries - p.num_prefix_queries),
        "spec_acceptance": acceptance,
        "weight_bytes": cur.facts.weight_bytes if cur.facts is not None else None,
        "kv_used_bytes": kv_bytes * s.kv_cache_usage if kv_bytes is not None else None,
        "kv_free_bytes": kv_bytes * (1.0 - s.kv_cache_usage) if kv_bytes is not None else None,
    }


def meter_point(prev: MeterTotals, cur: MeterTotals, dt: float, tokens_out: float, prices: Prices,
                num_devices: int) -> dict[str, Any]:
    """Power, J/token, $/Mtok and busy/idle shares over the window (module docstring)."""
    # The meter's own average over its readings' timestamps: counters read at steps and ticks, not at this
    # sample's time, would skew a short window's Δenergy / Δt by up to a tick.
    watts = cur.current_watts
    measured = watts is not None and bool(cur.energy_joules_by_source)
    usd_per_s = prices.device.usd_per_hour / 3600.0 * num_devices + (
        prices.energy_cost_usd(watts) if watts is not None else 0.0)
    tokens_out_s = _rate(tokens_out, dt)
    return {
        "watts": watts, "energy_source": cur.source if measured else None,
        "joules_per_token": _ratio(watts * dt, tokens_out) if measured else None,
        "usd_per_mtok": usd_per_s / tokens_out_s * 1e6 if tokens_out_s > 0 else None,
        **busy_idle(prev, cur, dt * num_devices),
    }


def busy_idle(before: MeterTotals, after: MeterTotals, device_seconds: float) -> dict[str, float | None]:
    """Shares of `device_seconds` spent in steps and idle. A step's time is counted when it ends, so a step
    longer than the span would exceed it: the busy share is capped at 1 and idle is the rest."""
    busy = _ratio(after.busy_device_seconds - before.busy_device_seconds, device_seconds)
    if busy is None:
        return {"busy": None, "idle": None}
    busy = min(max(busy, 0.0), 1.0)
    return {"busy": busy, "idle": 1.0 - busy}


def make_point(start: Sample, cur: Sample, prices: Prices | None, num_devices: int = 1) -> dict[str, Any]:
    """The dashboard's point at `cur`: rates, shares and latencies over the window [start, cur]."""
    dt = cur.monotonic - start.monotonic
    name_to_start = {r.name: r for r in start.replicas}
    replicas = [replica_point(name_to_start.get(r.name), r, dt) for r in cur.replicas]
    point: dict[str, Any] = {"t": cur.wall, "replicas": replicas}
    for name in ("tokens_in_s", "tokens_out_s", "running", "waiting", "preemptions"):
        point[name] = sum(r[name] for r in replicas)
    for name in ("weight_bytes", "kv_used_bytes", "kv_free_bytes"):
        values = [r[name] for r in replicas if r[name] is not None]
        point[name] = sum(values) if values else None
    total_blocks = sum(r.stats.num_kv_blocks for r in cur.replicas)
    point["kv_usage"] = (sum(r.stats.num_kv_blocks - r.stats.num_free_kv_blocks for r in cur.replicas)
                         / total_blocks if total_blocks else 0.0)
    hits = [(r["prefix_hit_rate"]) for r in replicas if r["prefix_hit_rate"] is not None]
    point["prefix_hit_rate"] = sum(hits) / len(hits) if hits else None
    accepts = [r["spec_acceptance"] for r in replicas if r["spec_acceptance"] is not None]
    point["spec_acceptance"] = sum(accepts) / len(accepts) if accepts else None
    if cur.meter is not None and start.meter is not None and prices is not None:
        point |= meter_point(start.meter, cur.meter, dt, point["tokens_out_s"] * dt, prices, num_devices)
    for name, attr in (("ttft", "ttft_buckets"), ("tpot", "tpot_buckets")):
        for q in (50, 99):
            point[f"{name}_p{q}"] = quantile(q / 100, getattr(start, attr), getattr(cur, attr))
    return point


class DashboardFeed:
    """Samples every `interval_s` on its own thread and keeps `history_s` of points; readers take the points
    after a sequence number (`since`), so a page that falls behind costs nothing but its own catch-up."""

    def __init__(self, engine: EngineClient, ttft: Histogram, tpot: Histogram, meter: Meter | None = None,
                 interval_s: float = 1.0, history_s: float = 3600.0, window: int = 10,
                 wall: Callable[[], float] = time.time, clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.meter, self.interval_s = engine, meter, interval_s
        self._ttft, self._tpot, self._wall, self._clock = ttft, tpot, wall, clock
        self._lock = threading.Lock()
        self._points: deque[tuple[int, dict[str, Any]]] = deque(maxlen=max(int(history_s / interval_s), 1))
        self._samples: deque[Sample] = deque(maxlen=window + 1)
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> DashboardFeed:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dashboard-feed", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def sample(self) -> Sample:
        return Sample(self._wall(), self._clock(), replicas_of(self.engine),
                      self.meter.totals() if self.meter is not None else None,
                      buckets(self._ttft), buckets(self._tpot))

    def tick(self) -> dict[str, Any] | None:
        """Take a sample and append its point (the first sample only sets the baseline)."""
        cur = self.sample()
        with self._lock:
            prev = self._samples[-1] if self._samples else None
            self._samples.append(cur)
            if prev is None:
                return None
            prices = self.meter.prices if self.meter is not None else None
            point = make_point(self._samples[0], cur, prices)
            self._seq += 1
            self._points.append((self._seq, point))
            return point

    def points_after(self, seq: int) -> tuple[int, list[dict[str, Any]]]:
        """The points newer than `seq` and the newest sequence number."""
        with self._lock:
            return self._seq, [p for s, p in self._points if s > seq]

    def _loop(self) -> None:
        self.tick()
        while not self._stop.wait(self.interval_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a failed sample skips one point, never the feed
                continue
