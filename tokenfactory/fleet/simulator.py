"""A discrete-event simulation of a fleet serving a trace, with the gateway's own routing policy
(`fleet/router.py`) and autoscaler (`fleet/autoscaler.py`: the same `Controller`, over `SimPool`) making every
decision: only the replicas are modelled (fleet/sim_model.py: the planner's step time and power).

A simulated replica does what the engine's scheduler does, at the granularity of its steps: each step, running
sequences decode one token, and the rest of the token budget prefills waiting prompts in arrival order
(chunked), up to `max_num_seqs` and the KV capacity; a sequence's first token comes at the end of the step
that finishes its prompt. Steps with no prompt work and no finish between them are taken as one *run* of k
equal steps (k up to the next finish), so an hour of decoding is a handful of events, not a million; an
arrival mid-run cuts the run at the end of the step under way, as the real scheduler would admit it there.

    decoding sequences: generated_i = counter − join_i + 1, finishing when counter = join_i + output_i − 1
    (one shared step counter per replica, heaps of finish counters: a run costs O(log B), not O(B))

Energy per replica: each step's modelled power x its time (busy), idle watts while ready or draining with
nothing to do (idle), idle watts through each cold start (charged to the fleet, as its minutes are rented).
Dollars: on-demand rent for every replica-hour provisioned (starting to stopped), which pays for the power too
(the planner's one way: a rented card's rate includes its electricity). The energy's own price at the wall
(energy / PSU efficiency x PUE x $/kWh, the defaults of meter/prices.toml) is reported beside it: what owning the
same fleet would pay for power.
This file is past 400 lines because the event loop, the replica and the pool share one clock and one queue.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenfactory.fleet.autoscaler import AutoscalerConfig, Controller, LatencyWindow, ReplicaLoad, make_autoscaler
from tokenfactory.fleet.router import ReplicaView, RouteRequest, RoutingPolicy, StepModel, make_router
from tokenfactory.fleet.sim_model import ReplicaSpec
from tokenfactory.fleet.traces import SimRequest
from tokenfactory.meter.prices import shared_defaults


@dataclass
class _Seq:
    index: int
    req: SimRequest
    expected_out: int  # the router's expectation of its output (RouteRequest.expected_tokens − prompt)
    prompt_left: int
    join: int = 0  # the replica's step counter when it started decoding
    first_token_s: float | None = None
    replica: str = ""


@dataclass
class SimReplica:
    replica_id: str
    spec: ReplicaSpec
    state: str  # starting | ready | draining | stopped
    started_s: float
    ready_s: float
    stopped_s: float | None = None
    waiting: deque[_Seq] = field(default_factory=deque)
    prefilling: deque[_Seq] = field(default_factory=deque)
    seqs: dict[int, _Seq] = field(default_factory=dict)  # decoding
    finish_heap: list[tuple[int, int]] = field(default_factory=list)  # (counter, seq index)
    exhaust_heap: list[int] = field(default_factory=list)  # counters at which an expected output is used up
    counter: int = 0
    sum_prompt: int = 0
    sum_join: int = 0
    contributing: int = 0  # decoding sequences with expected output left (the router's outstanding work)
    outstanding_tokens: int = 0
    kv_reserved: int = 0
    busy: bool = False
    idle_since: float = 0.0
    run_start: float = 0.0
    run_dt: float = 0.0
    run_k: int = 0
    run_power: float = 0.0
    run_decode: bool = False
    run_chunks: list[tuple[_Seq, int]] = field(default_factory=list)
    version: int = 0
    busy_j: float = 0.0
    idle_j: float = 0.0
    cold_j: float = 0.0
    num_tokens: int = 0
    num_runs: int = 0
    step_model: StepModel = field(default_factory=StepModel)
    view: ReplicaView | None = None  # the router's view, until r changes

    @property
    def num_running(self) -> int:
        return len(self.seqs) + len(self.prefilling)

    @property
    def num_outstanding(self) -> int:
        return self.num_running + len(self.waiting)

    def context_mean(self) -> float:
        n = len(self.seqs)
        return (self.sum_prompt + n * (self.counter + 1) - self.sum_join) / n if n else 0.0


@dataclass(frozen=True)
class SimConfig:
    specs: Sequence[ReplicaSpec]  # the kinds of replica; the first is the initial fleet's
    replicas: int = 1  # at the start (and always, with no autoscaler)
    router: str = "least-work"
    sticky: bool = False
    autoscaler: str | None = None  # slo | energy | None (a static fleet)
    scaling: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    tick_s: float = 1.0
    sample_s: float = 60.0
    usd_per_kwh: float = field(default_factory=lambda: shared_defaults().usd_per_kwh)  # meter/prices.toml's
    pue: float = field(default_factory=lambda: shared_defaults().pue)
    psu_efficiency: float = field(default_factory=lambda: shared_defaults().psu_efficiency)
    latency_window_s: float = 60.0
    client_overhead_s: float = 0.0  # HTTP, tokenization, IPC: added to every TTFT and end-to-end latency


@dataclass(frozen=True)
class Sample:
    time_s: float
    replicas: int  # provisioned (starting + ready + draining)
    ready: int
    arrivals_per_s: float
    tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    power_w: float


class SimPool:
    """The simulator's replicas as the autoscaler `Controller`'s `ReplicaPool`."""

    def __init__(self, sim: Simulation) -> None:
        self.sim, self.model = sim, "sim"
        self._last_tokens: dict[str, tuple[float, int]] = {}

    def loads(self, now: float) -> list[ReplicaLoad]:
        out = []
        for r in self.sim.live():
            prev_t, prev_n = self._last_tokens.get(r.replica_id, (now, r.num_tokens))
            self._last_tokens[r.replica_id] = (now, r.num_tokens)
            rate = (r.num_tokens - prev_n) / (now - prev_t) if now > prev_t else 0.0
            b = max(r.num_running, 1)
            seconds, watts = r.spec.step.cost(b, r.context_mean(), 0.0, 0.0)
            out.append(ReplicaLoad(r.replica_id, r.state, r.spec.name, r.num_running, len(r.waiting),
                                   r.spec.max_num_seqs, r.kv_reserved / max(r.spec.kv_capacity_tokens, 1),
                                   r.num_outstanding, rate, watts * seconds / b))
        return out

    def start(self, option: str) -> str:
        return self.sim.start_replica(option)

    def drain(self, replica_id: str) -> None:
        self.sim.replicas[replica_id].state, self.sim._ready = "draining", None

    def undrain(self, replica_id: str) -> None:
        r = self.sim.replicas[replica_id]
        if r.state == "draining":
            r.state, self.sim._ready = "ready", None

    def stop(self, replica_id: str) -> None:
        self.sim.stop_replica(replica_id)


ARRIVAL, RUN_END, READY, TICK, SAMPLE, WAKE = range(6)
OBSERVE_EVERY = 64  # runs between the router's step-time samples (its least-squares fit costs O(256) a sample)


class Simulation:
    """One run of a trace through a fleet; `run()` returns a `SimResult`."""

    def __init__(self, config: SimConfig, trace: Sequence[SimRequest]) -> None:
        if not config.specs:
            raise ValueError("a simulation needs at least one replica spec")
        self.config, self.trace = config, trace
        self.spec_by_name = {s.name: s for s in config.specs}
        self.router: RoutingPolicy = make_router(config.router, config.sticky)
        self.replicas: dict[str, SimReplica] = {}
        self.events: list[tuple[float, int, int, str, int]] = []  # (time, order, kind, replica id, version)
        self.num_events = 0
        self.now = 0.0
        self.held: deque[_Seq] = deque()
        self.latency = LatencyWindow(config.latency_window_s)
        self.controller: Controller | None = None
        if config.autoscaler is not None:
            policy = make_autoscaler(config.autoscaler, config.scaling, [s.option for s in config.specs])
            self.controller = Controller(policy, SimPool(self), self.latency, held=lambda: len(self.held))
        self.ttft = np.full(len(trace), np.nan)
        self.tpot = np.full(len(trace), np.nan)
        self.e2e = np.full(len(trace), np.nan)
        self.samples: list[Sample] = []
        self._window = _Window()
        self._num_started = 0
        self._retired: list[SimReplica] = []
        self._tokens_at_sample = 0
        self._prefill_rates: dict[str, float] = {}
        self._mean_prompt = max(1.0, sum(r.prompt_tokens for r in trace) / max(len(trace), 1))
        self._ready: list[SimReplica] | None = None  # the routable replicas; None: membership changed
        if config.autoscaler is None and config.replicas < 1:
            raise ValueError("a static fleet needs --replicas >= 1")
        for _ in range(config.replicas):
            r = self._new_replica(config.specs[0], 0.0, ready=True)
            self.replicas[r.replica_id] = r

    # -- the event queue -------------------------------------------------------------------------------

    def push(self, time_s: float, kind: int, replica_id: str = "", version: int = 0) -> None:
        self.num_events += 1
        heapq.heappush(self.events, (time_s, self.num_events, kind, replica_id, version))

    def run(self) -> SimResult:
        duration = self.trace[-1].arrival_s if self.trace else 0.0
        if self.controller is not None:
            self.push(self.config.tick_s, TICK)
        self.push(self.config.sample_s, SAMPLE)
        i, n = 0, len(self.trace)
        while True:
            next_arrival = self.trace[i].arrival_s if i < n else math.inf
            if self.events and self.events[0][0] < next_arrival:  # arrivals first at equal times
                t, _, kind, rid, version = heapq.heappop(self.events)
                if kind in (TICK, SAMPLE) and i >= n and self._idle():
                    break
                self.now = t
                self._dispatch(kind, rid, version)
            elif i < n:
                self.now = next_arrival
                self.arrive(i)
                i += 1
            else:
                break
        return self._result(max(self.now, duration))

    def _idle(self) -> bool:
        return not self.held and all(not r.busy and not r.waiting for r in self.replicas.values())

    def _dispatch(self, kind: int, replica_id: str, version: int) -> None:
        if kind == RUN_END:
            r = self.replicas.get(replica_id)
            if r is not None and r.busy and r.version == version:
                self.end_run(r)
        elif kind == WAKE:
            r = self.replicas.get(replica_id)
            if r is not None and r.version == version:
                self.plan_run(r)
        elif kind == READY:
            self._on_ready(self.replicas[replica_id])
        elif kind == TICK:
            assert self.controller is not None
            self.controller.tick(self.now)
            self.push(self.now + self.config.tick_s, TICK)
        else:
            self._sample()
            self.push(self.now + self.config.sample_s, SAMPLE)

    # -- the gateway: routing ------------------------------------------------------------------------------

    def arrive(self, index: int) -> None:
        req = self.trace[index]
        route = RouteRequest(str(index), "sim", _Prompt(req.prompt_tokens, index), req.output_tokens, req.user)
        seq = _Seq(index, req, route.expected_tokens - req.prompt_tokens, req.prompt_tokens)
        self._window.arrivals += 1
        if not self._route(seq, route):
            self.held.append(seq)

    def _route(self, seq: _Seq, route: RouteRequest) -> bool:
        if self._ready is None:
            self._ready = [r for r in self.replicas.values() if r.state == "ready"]
        if not self._ready:
            return False
        decision = self.router.choose(route, [r.view if r.view is not None else self._view(r) for r in self._ready])
        self.router.routed(route, decision.replica_id)
        r = self.replicas[decision.replica_id]
        r.view = None
        seq.replica = r.replica_id
        r.waiting.append(seq)
        r.outstanding_tokens += seq.prompt_left + seq.expected_out
        if not r.busy:  # its loop wakes up and takes what is in the inbox then: every arrival of this instant
            self._charge_idle(r)
            r.busy, r.run_decode, r.version = True, False, r.version + 1
            self.push(self.now, WAKE, r.replica_id, r.version)
        elif r.run_decode and r.run_k > 1:  # cut the run at the end of the step under way
            done = int((self.now - r.run_start) / r.run_dt)
            if done + 1 < r.run_k:
                r.run_k, r.version = done + 1, r.version + 1
                self.push(r.run_start + r.run_k * r.run_dt, RUN_END, r.replica_id, r.version)
        return True

    def _view(self, r: SimReplica) -> ReplicaView:
        """What `Replica.view` gives the router, kept until r changes (the event that changes it clears it)."""
        rate = self._prefill_rates.get(r.spec.name)
        if rate is None:
            rate = self._prefill_rates[r.spec.name] = r.spec.prefill_tokens_per_s(self._mean_prompt)
        r.view = ReplicaView(r.replica_id, "sim", r.num_running, len(r.waiting), r.spec.max_num_seqs,
                             r.outstanding_tokens, r.num_outstanding, r.spec.idle_w, r.spec.busy_w, r.step_model, rate)
        return r.view

    # -- a replica's steps ---------------------------------------------------------------------------------

    def plan_run(self, r: SimReplica) -> None:
        """The next step (or run of equal decode steps) from r's state at `now`; idle when there is none."""
        spec = r.spec
        while (r.waiting and r.num_running < spec.max_num_seqs
               and r.kv_reserved + r.waiting[0].req.prompt_tokens + r.waiting[0].req.output_tokens
               <= spec.kv_capacity_tokens):
            seq = r.waiting.popleft()
            r.kv_reserved += seq.req.prompt_tokens + seq.req.output_tokens
            r.prefilling.append(seq)
        r.run_chunks = []
        if r.prefilling:
            budget, prefill, completing, prompt = spec.max_num_batched_tokens - len(r.seqs), 0, 0, 0
            for seq in r.prefilling:
                if budget <= 0:
                    break
                chunk = min(seq.prompt_left, budget)
                r.run_chunks.append((seq, chunk))
                budget, prefill = budget - chunk, prefill + chunk
                completing += chunk == seq.prompt_left
                prompt = max(prompt, seq.req.prompt_tokens)
            k, (dt, watts) = 1, spec.step.cost(len(r.seqs) + completing, r.context_mean(), prefill, prompt)
            r.run_decode = False
        elif r.seqs:
            nxt = r.finish_heap[0][0]
            if r.exhaust_heap:
                nxt = min(nxt, r.exhaust_heap[0])
            k = max(nxt - r.counter, 1)
            dt, watts = spec.step.cost(len(r.seqs), r.context_mean() + k / 2, 0.0, 0.0)
            r.run_decode = True
        else:
            r.busy, r.idle_since = False, self.now
            return
        r.busy, r.run_start, r.run_dt, r.run_k, r.run_power = True, self.now, dt, k, watts
        r.version += 1
        self.push(self.now + k * dt, RUN_END, r.replica_id, r.version)

    def end_run(self, r: SimReplica) -> None:
        k, r.view = r.run_k, None
        r.busy_j += r.run_power * r.run_dt * k
        r.num_runs += 1
        if r.num_runs % OBSERVE_EVERY == 1:  # what Fleet._on_step does for every step: O(window) a call
            r.step_model.observe(max(len(r.seqs) + len(r.run_chunks), 1), r.run_dt)
        r.counter += k
        r.num_tokens += len(r.seqs) * k
        r.outstanding_tokens -= r.contributing * k
        while r.exhaust_heap and r.exhaust_heap[0] <= r.counter:
            heapq.heappop(r.exhaust_heap)
            r.contributing -= 1
        while r.finish_heap and r.finish_heap[0][0] <= r.counter:
            _, index = heapq.heappop(r.finish_heap)
            self._finish(r, r.seqs.pop(index))
        for seq, chunk in r.run_chunks:
            seq.prompt_left -= chunk
            r.outstanding_tokens -= chunk
            if seq.prompt_left == 0:
                r.prefilling.remove(seq)
                self._first_token(r, seq)
        self.plan_run(r)

    def _first_token(self, r: SimReplica, seq: _Seq) -> None:
        seq.first_token_s, seq.join = self.now, r.counter
        r.num_tokens += 1
        self.ttft[seq.index] = self.now - seq.req.arrival_s + self.config.client_overhead_s
        if seq.expected_out > 0:
            r.outstanding_tokens -= 1
        left = min(seq.expected_out, seq.req.output_tokens) - 1
        if left > 0:
            r.contributing += 1
            heapq.heappush(r.exhaust_heap, r.counter + left)
        if seq.req.output_tokens <= 1:
            self._finish(r, seq)
            return
        r.seqs[seq.index] = seq
        r.sum_prompt += seq.req.prompt_tokens
        r.sum_join += seq.join
        heapq.heappush(r.finish_heap, (seq.join + seq.req.output_tokens - 1, seq.index))

    def _finish(self, r: SimReplica, seq: _Seq) -> None:
        assert seq.first_token_s is not None
        out = seq.req.output_tokens
        if out > 1:
            r.sum_prompt -= seq.req.prompt_tokens
            r.sum_join -= seq.join
            self.tpot[seq.index] = (self.now - seq.first_token_s) / (out - 1)
        self.e2e[seq.index] = self.now - seq.req.arrival_s + self.config.client_overhead_s
        r.kv_reserved -= seq.req.prompt_tokens + out
        self.latency.observe(self.now, float(self.ttft[seq.index]),
                             float(self.tpot[seq.index]) if out > 1 else None)
        self._window.finished.append((float(self.ttft[seq.index]), float(self.tpot[seq.index])))

    # -- membership (the autoscaler's pool calls these) ------------------------------------------------------

    def _new_replica(self, spec: ReplicaSpec, now: float, ready: bool) -> SimReplica:
        rid = f"s{self._num_started}"
        self._num_started += 1
        ready_s = now if ready else now + spec.cold_start_s
        return SimReplica(rid, spec, "ready" if ready else "starting", now, ready_s, idle_since=now)

    def start_replica(self, option: str) -> str:
        spec = self.spec_by_name.get(option, self.config.specs[0])
        r = self._new_replica(spec, self.now, ready=False)
        self.replicas[r.replica_id] = r
        self.push(r.ready_s, READY, r.replica_id)
        return r.replica_id

    def _on_ready(self, r: SimReplica) -> None:
        if r.state != "starting":
            return
        r.cold_j += r.spec.idle_w * (self.now - r.started_s)
        r.state, r.idle_since, self._ready = "ready", self.now, None
        while self.held:  # requests held with no replica, in arrival order
            seq = self.held.popleft()
            self._route(seq, RouteRequest(str(seq.index), "sim", _Prompt(seq.req.prompt_tokens, seq.index),
                                          seq.req.output_tokens, seq.req.user))

    def stop_replica(self, replica_id: str) -> None:
        r = self.replicas.pop(replica_id)
        if r.state == "starting":
            r.cold_j += r.spec.idle_w * (self.now - r.started_s)
        else:
            self._charge_idle(r)
        r.state, r.stopped_s, self._ready = "stopped", self.now, None
        self.router.forget(replica_id)
        self._retired.append(r)

    def live(self) -> list[SimReplica]:
        return list(self.replicas.values())

    def _charge_idle(self, r: SimReplica) -> None:
        if r.state in ("ready", "draining") and not r.busy:
            r.idle_j += r.spec.idle_w * max(self.now - max(r.idle_since, r.ready_s), 0.0)
            r.idle_since = self.now

    # -- results ---------------------------------------------------------------------------------------------

    def _sample(self) -> None:
        w, self._window = self._window, _Window()
        reps = self.live()
        tokens = sum(r.num_tokens for r in reps) + sum(r.num_tokens for r in self._retired)
        ttfts = [a for a, _ in w.finished]
        tpots = [b for _, b in w.finished if not math.isnan(b)]
        power = sum(r.run_power if r.busy else r.spec.idle_w for r in reps)
        self.samples.append(Sample(
            self.now, len(reps), sum(r.state == "ready" for r in reps), w.arrivals / self.config.sample_s,
            (tokens - self._tokens_at_sample) / self.config.sample_s,
            _pct(ttfts, 50), _pct(ttfts, 99), _pct(tpots, 99), power))
        self._tokens_at_sample = tokens

    def _result(self, end_s: float) -> SimResult:
        self.now = end_s
        for r in self.live():
            if r.state == "starting":
                r.cold_j += r.spec.idle_w * (end_s - r.started_s)
            else:
                self._charge_idle(r)
        everyone = self.live() + self._retired
        hours = sum(((r.stopped_s if r.stopped_s is not None else end_s) - r.started_s) / 3600 for r in everyone)
        rent = sum(((r.stopped_s if r.stopped_s is not None else end_s) - r.started_s) / 3600 * r.spec.usd_per_hour
                   for r in everyone)
        return SimResult(self.config, len(self.trace), self.ttft, self.tpot, self.e2e, end_s,
                         sum(r.num_tokens for r in everyone), sum(r.busy_j for r in everyone),
                         sum(r.idle_j for r in everyone), sum(r.cold_j for r in everyone), hours, rent,
                         tuple(self.samples), self.num_events, self._decisions())

    def _decisions(self) -> tuple[str, ...]:
        if self.controller is None:
            return ()
        return tuple(f"{d.time:9.0f} s  {d.action:4} -> {d.replicas:3}  {d.reason}" for d in self.controller.decisions)


@dataclass
class _Window:
    arrivals: int = 0
    finished: list[tuple[float, float]] = field(default_factory=list)


class _Prompt(Sequence[int]):
    """A prompt of n tokens whose ids the simulation does not know: the router sees its length, and ids of its
    own (`salt`: the request's index), so the prefix policy finds nothing shared between requests."""

    def __init__(self, n: int, salt: int) -> None:
        self.n, self.base = n, -(salt + 1) * 1_000_003

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # noqa: ANN001, ANN204 - Sequence's overloads
        if isinstance(i, slice):
            return [self.base - j for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.base - (i % self.n)


def _pct(values: Sequence[float], p: float) -> float | None:
    return float(np.percentile(values, p)) if len(values) else None


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    num_requests: int
    ttft: np.ndarray
    tpot: np.ndarray
    e2e: np.ndarray
    duration_s: float
    num_tokens: int  # output tokens
    busy_j: float
    idle_j: float
    cold_start_j: float
    replica_hours: float
    rent_usd: float
    samples: tuple[Sample, ...]
    num_events: int
    decisions: tuple[str, ...]

    @property
    def energy_j(self) -> float:
        return self.busy_j + self.idle_j + self.cold_start_j

    def summary(self) -> dict[str, float | int | str | None]:
        done = ~np.isnan(self.e2e)
        slo = self.config.scaling.slo
        ttft_ok = self.ttft[done] <= slo.ttft_s
        tpot_ok = np.nan_to_num(self.tpot[done], nan=0.0) <= slo.tpot_s
        met = ttft_ok & tpot_ok
        mtok = self.num_tokens / 1e6
        kwh = self.energy_j / 3.6e6
        energy_usd = kwh / self.config.psu_efficiency * self.config.pue * self.config.usd_per_kwh  # at the wall
        def pct(a: np.ndarray, p: float) -> float | None:
            a = a[~np.isnan(a)]
            return float(np.percentile(a, p)) if len(a) else None
        provisioned = [s.replicas for s in self.samples]
        return {
            "router": self.config.router, "autoscaler": self.config.autoscaler or "static",
            "requests": self.num_requests, "completed": int(done.sum()), "duration_s": self.duration_s,
            "ttft_p50_s": pct(self.ttft, 50), "ttft_p99_s": pct(self.ttft, 99),
            "tpot_p50_s": pct(self.tpot, 50), "tpot_p99_s": pct(self.tpot, 99),
            "e2e_p50_s": pct(self.e2e, 50),
            "output_tokens_per_s": self.num_tokens / self.duration_s if self.duration_s else None,
            "slo_attainment": float(met.mean()) if done.any() else None,
            "goodput_requests_per_s": float(met.sum()) / self.duration_s if self.duration_s else None,
            "replicas_min": min(provisioned, default=self.config.replicas),
            "replicas_mean": self.replica_hours * 3600 / self.duration_s if self.duration_s else None,
            "replicas_max": max(provisioned, default=self.config.replicas),
            "replica_hours": self.replica_hours,
            "energy_kwh": kwh, "energy_source": "modelled", "busy_kwh": self.busy_j / 3.6e6,
            "idle_kwh": self.idle_j / 3.6e6, "cold_start_kwh": self.cold_start_j / 3.6e6,
            "idle_energy_share": (self.idle_j + self.cold_start_j) / self.energy_j if self.energy_j else None,
            "joules_per_token": self.energy_j / self.num_tokens if self.num_tokens else None,
            "kwh_per_mtok": kwh / mtok if mtok else None,
            "usd_per_mtok": self.rent_usd / mtok if mtok else None,  # on-demand rent, power included
            "energy_usd_per_mtok": energy_usd / mtok if mtok else None,  # the power bill if the fleet were owned
            "rent_usd": self.rent_usd, "events": self.num_events, "scale_changes": len(self.decisions),
        }
