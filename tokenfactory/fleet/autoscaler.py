"""Autoscaling: how many replicas of a model to run. A policy reads the fleet's signals and returns its choice
as data (`ScaleDecision(model, replicas, reason)`); a `Controller` applies it to a `ReplicaPool` (the real
fleet's, fleet/scaling_pool.py, or the simulator's, fleet/simulator.py: the same policy and controller code).

    FleetSignals ──policy.decide──► ScaleDecision ──Controller.apply──► pool.start / undrain / drain / stop
    (replicas' snapshots: queue, KV, tokens/s, J/token; TTFT/TPOT percentiles over a window; held requests)

    slo      (default) enough replicas that each runs at most `up_utilisation` of the concurrency it can serve
             within the SLO (the planner's largest batch whose step meets the TPOT target); one more at once
             when TTFT or TPOT breaks the SLO (at a load above the band's floor: below it, more replicas would
             not help), the KV cache is nearly full or requests queue; fewer when the
             load would fit in fewer at `down_utilisation` (the gap between the two is the hysteresis band).
    energy   the same SLO guard, but packs replicas to `pack_utilisation` of that concurrency before adding one
             (a busy replica makes a token for fewer joules than two half-idle ones: the step's weight read
             and idle power are shared by more sequences), drains the least efficient replica (highest J/token)
             first, and adds the option with the lowest predicted $/Mtok.

Stability, whatever the policy: a change must be wanted for `up_delay_s` (up) or `down_delay_s` (down) without
interruption, and no scale-down comes within `down_delay_s` of the last change, so input that flaps faster than
the delays changes nothing. The one exception is a request held with no replica at all (scale from zero): that
starts one at once; the cold start is measured by the pool and charged (its seconds at idle power).
The file passes 400 lines because the nouns, the policies, the delays and the controller are one decision's
path, read together; the real pool is in fleet/scaling_pool.py, the simulated one in fleet/simulator.py.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SLO:
    """Latency targets at a percentile (TTFT: time to first token; TPOT: time per output token)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.2
    percentile: float = 99.0

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO targets must be > 0, got ttft {self.ttft_s}, tpot {self.tpot_s}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"SLO percentile must be in (0, 100], got {self.percentile}")


@dataclass(frozen=True)
class ReplicaOption:
    """A kind of replica the controller can start, with what the planner predicts of it."""

    name: str
    device: str
    idle_watts: float
    busy_watts: float
    target_seqs: int  # the concurrency it serves within the SLO (planner: largest batch meeting the TPOT target)
    tokens_per_s: float  # output tokens/s at that concurrency
    usd_per_hour: float = 0.0  # rent (0: owned, energy only)
    usd_per_kwh: float = 0.15

    @property
    def usd_per_mtok(self) -> float:
        """(rent + busy energy) per hour / tokens per hour, in $ per million output tokens."""
        per_hour = self.usd_per_hour + self.busy_watts / 1000.0 * self.usd_per_kwh
        return per_hour / max(self.tokens_per_s * 3600.0, 1e-9) * 1e6


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as a policy sees it: its latest snapshot and what the pool knows of it."""

    replica_id: str
    state: str  # starting | ready | draining
    option: str  # the ReplicaOption it was started as
    num_running: int
    num_waiting: int
    max_num_seqs: int
    kv_cache_usage: float
    num_outstanding: int  # requests routed there and not finished
    tokens_per_s: float  # generated, since the previous tick
    joules_per_token: float | None  # predicted at its current batch (None: not known)

    @property
    def load(self) -> int:
        return max(self.num_running + self.num_waiting, self.num_outstanding)


@dataclass(frozen=True)
class FleetSignals:
    """What a policy decides on, taken at `time` (the controller's clock)."""

    model: str
    time: float
    replicas: tuple[ReplicaLoad, ...]
    ttft_s: float | None = None  # at the SLO's percentile over the window; None: no request finished in it
    tpot_s: float | None = None
    num_held: int = 0  # requests the gateway holds because no replica can take them (scale from zero)

    @property
    def active(self) -> list[ReplicaLoad]:
        return [r for r in self.replicas if r.state in ("starting", "ready")]

    @property
    def load(self) -> int:
        """Sequences in the fleet (running, waiting, routed) plus the held requests."""
        return sum(r.load for r in self.replicas) + self.num_held


@dataclass(frozen=True)
class ScaleDecision:
    """The policy's choice: run `replicas` (starting + ready) of `model`. Scaling down names which to drain;
    scaling up names the option to start. `action` is up | down | hold."""

    model: str
    replicas: int
    reason: str
    action: str = "hold"
    drain: tuple[str, ...] = ()
    option: str | None = None
    time: float = 0.0


@dataclass(frozen=True)
class AutoscalerConfig:
    min_replicas: int = 1
    max_replicas: int = 4
    slo: SLO = field(default_factory=SLO)
    up_utilisation: float = 0.8  # of the SLO concurrency, above which the slo policy adds a replica
    down_utilisation: float = 0.4  # below which (as if one fewer) it removes one
    pack_utilisation: float = 0.95  # the energy policy's fill level before it adds one
    pack_down_utilisation: float = 0.7  # and below which (as if one fewer) it consolidates
    kv_high: float = 0.9
    waiting_per_replica: float = 4.0  # queued sequences per replica that count as a breach
    up_delay_s: float = 10.0
    down_delay_s: float = 60.0
    interval_s: float = 1.0  # the controller's tick

    def __post_init__(self) -> None:
        if self.min_replicas < 0 or self.max_replicas < max(self.min_replicas, 1):
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        if not (0 < self.down_utilisation < self.up_utilisation <= 1.5
                and 0 < self.pack_down_utilisation < self.pack_utilisation <= 1.5):
            raise ValueError("need 0 < down_utilisation < up_utilisation (the hysteresis band), and the same "
                             "for the pack levels")
        if self.up_delay_s < 0 or self.down_delay_s < 0 or self.interval_s <= 0:
            raise ValueError("the scaling delays must be >= 0 and the interval > 0")


class AutoscalerPolicy(Protocol):
    """Decides on `signals`; may keep state between calls (the delays) but changes nothing outside itself:
    the controller applies the decision. `decide` is called at non-decreasing `signals.time`."""

    name: str
    config: AutoscalerConfig

    def decide(self, signals: FleetSignals) -> ScaleDecision: ...


@dataclass(frozen=True)
class Proposal:
    """What a policy would run now, before the delays, and why."""

    replicas: int
    reason: str
    urgent: bool = False  # a request is held with no replica: no delay


class Stabilizer:
    """The delays: a direction must be wanted without interruption for its delay, and a scale-down waits
    `down_delay_s` after any change. Shared by every policy, so none can flap."""

    def __init__(self, config: AutoscalerConfig) -> None:
        self.config = config
        self.direction = "hold"
        self.since = 0.0
        self.last_change: float | None = None

    def gate(self, current: int, proposal: Proposal, now: float) -> tuple[bool, str]:
        """(apply it now, why not when not)."""
        direction = "up" if proposal.replicas > current else "down" if proposal.replicas < current else "hold"
        if direction != self.direction:
            self.direction, self.since = direction, now
        if direction == "hold" or proposal.urgent:
            return direction != "hold", ""
        delay = self.config.up_delay_s if direction == "up" else self.config.down_delay_s
        waited = now - self.since
        if direction == "down" and self.last_change is not None:
            waited = min(waited, now - self.last_change)
        if waited + 1e-9 < delay:
            return False, f"wants {proposal.replicas} ({proposal.reason}); {waited:.0f} of its {delay:g} s delay"
        return True, ""

    def changed(self, now: float) -> None:
        self.last_change, self.direction, self.since = now, "hold", now


def _percent(x: float) -> str:
    return f"{100 * x:.0f}%"


class SLODriven:
    """Headroom within the SLO (see the module's docstring)."""

    name = "slo"

    def __init__(self, config: AutoscalerConfig, options: Sequence[ReplicaOption]) -> None:
        if not options:
            raise ValueError("an autoscaler needs at least one replica option")
        self.config, self.options = config, list(options)
        self.stabilizer = Stabilizer(config)

    def target_seqs(self, signals: FleetSignals) -> float:
        """Mean SLO concurrency of the active replicas (of the default option when there are none)."""
        by_name = {o.name: o for o in self.options}
        caps = [by_name[r.option].target_seqs if r.option in by_name else r.max_num_seqs for r in signals.active]
        return sum(caps) / len(caps) if caps else float(self.add_option().target_seqs)

    def add_option(self) -> ReplicaOption:
        return self.options[0]

    def breach(self, signals: FleetSignals) -> str | None:
        """The first SLO guard that fires, as a reason; None when all hold."""
        slo, active = self.config.slo, signals.active
        p = f"p{self.config.slo.percentile:g}"
        if signals.ttft_s is not None and signals.ttft_s > slo.ttft_s:
            return f"TTFT {p} {signals.ttft_s:.2f} s > SLO {slo.ttft_s:g} s"
        if signals.tpot_s is not None and signals.tpot_s > slo.tpot_s:
            return f"TPOT {p} {signals.tpot_s * 1000:.0f} ms > SLO {slo.tpot_s * 1000:.0f} ms"
        ready = [r for r in active if r.state == "ready"]
        if ready and max(r.kv_cache_usage for r in ready) > self.config.kv_high:
            return f"KV cache {_percent(max(r.kv_cache_usage for r in ready))} > {_percent(self.config.kv_high)}"
        waiting = sum(r.num_waiting for r in ready) + signals.num_held
        if ready and waiting > self.config.waiting_per_replica * len(ready):
            return f"{waiting} requests queued on {len(ready)} replicas"
        return None

    def propose(self, signals: FleetSignals) -> Proposal:
        cfg, n, load = self.config, len(signals.active), signals.load
        if n == 0:
            if signals.num_held:
                return Proposal(max(cfg.min_replicas, 1), f"{signals.num_held} requests held with no replica", True)
            return Proposal(cfg.min_replicas, "no replica and no demand")
        cap = self.target_seqs(signals)
        up_at = self.up_fill() * cap
        why = self.breach(signals)
        if why is not None and why.startswith(("TTFT", "TPOT")) and load <= self.down_fill() * cap * n:
            why = None  # slow at a load below the band: not for want of replicas (a cold start's tail, one long prompt)
        if why is not None:
            if any(r.state == "starting" for r in signals.active):  # its cold start is the remedy under way
                return Proposal(max(n, math.ceil(load / up_at)), f"{why}; a replica is starting")
            return Proposal(max(n + 1, math.ceil(load / up_at)), why)
        if load > up_at * n:
            return Proposal(math.ceil(load / up_at), f"load {load} seqs > {_percent(self.up_fill())} of {n} x "
                            f"{cap:.0f} (the SLO concurrency)")
        fewer = math.ceil(load / (self.down_fill() * cap)) if load else 0
        if fewer < n:
            return Proposal(fewer, f"load {load} seqs fits {fewer} replicas at {_percent(self.down_fill())} of "
                            f"{cap:.0f}")
        return Proposal(n, f"load {load} seqs on {n} replicas is within the band")

    def up_fill(self) -> float:
        return self.config.up_utilisation

    def down_fill(self) -> float:
        return self.config.down_utilisation

    def drain_order(self, signals: FleetSignals) -> list[ReplicaLoad]:
        """Which replicas to drain first: starting ones (no work lost), then the least loaded."""
        return sorted(signals.active, key=lambda r: (r.state != "starting", r.load, r.replica_id))

    def decide(self, signals: FleetSignals) -> ScaleDecision:
        cfg, n = self.config, len(signals.active)
        proposal = self.propose(signals)
        target = min(max(proposal.replicas, cfg.min_replicas), cfg.max_replicas)
        if target == n and proposal.replicas != n:
            bound = "max" if proposal.replicas > n else "min"
            return ScaleDecision(signals.model, n, f"{proposal.reason}; held at --{bound}-replicas {n}",
                                 time=signals.time)
        apply, why_not = self.stabilizer.gate(n, Proposal(target, proposal.reason, proposal.urgent), signals.time)
        if not apply:
            return ScaleDecision(signals.model, n, why_not or proposal.reason, time=signals.time)
        self.stabilizer.changed(signals.time)
        if target > n:
            return ScaleDecision(signals.model, target, proposal.reason, "up", option=self.add_option().name,
                                 time=signals.time)
        drain = tuple(r.replica_id for r in self.drain_order(signals)[: n - target])
        return ScaleDecision(signals.model, target, proposal.reason, "down", drain=drain, time=signals.time)


class EnergyAware(SLODriven):
    """Consolidates: fill replicas to `pack_utilisation` of their SLO concurrency, drain the least efficient
    first, add the cheapest per token (see the module's docstring)."""

    name = "energy"

    def up_fill(self) -> float:
        return self.config.pack_utilisation

    def down_fill(self) -> float:
        return self.config.pack_down_utilisation

    def add_option(self) -> ReplicaOption:
        return min(self.options, key=lambda o: (o.usd_per_mtok, o.name))

    def drain_order(self, signals: FleetSignals) -> list[ReplicaLoad]:
        def key(r: ReplicaLoad) -> tuple[bool, float, int, str]:
            jpt = r.joules_per_token if r.joules_per_token is not None else math.inf
            return (r.state != "starting", -jpt, r.load, r.replica_id)
        return sorted(signals.active, key=key)


AUTOSCALERS: dict[str, Callable[[AutoscalerConfig, Sequence[ReplicaOption]], AutoscalerPolicy]] = {
    "slo": SLODriven, "energy": EnergyAware}


def make_autoscaler(name: str, config: AutoscalerConfig, options: Sequence[ReplicaOption]) -> AutoscalerPolicy:
    if name not in AUTOSCALERS:
        raise ValueError(f"unknown autoscaler {name!r}; choose one of {', '.join(AUTOSCALERS)}")
    return AUTOSCALERS[name](config, options)


# -- applying decisions -------------------------------------------------------------------------------------


class ReplicaPool(Protocol):
    """What a controller changes. `start` returns at once with the new replica's id: it shows in `loads()` as
    `starting` until it can take requests. `stop` is called only for a drained replica with nothing
    outstanding, so no stream is cut. None of them may raise for a replica id that `loads()` listed."""

    model: str

    def loads(self, now: float) -> list[ReplicaLoad]: ...

    def start(self, option: str) -> str: ...

    def drain(self, replica_id: str) -> None: ...

    def undrain(self, replica_id: str) -> None: ...

    def stop(self, replica_id: str) -> None: ...


class LatencyWindow:
    """TTFT and TPOT observations over the last `window_s` (at most the last `max_samples` of each), at a
    percentile: the SLO signal. Bounded so a tick costs the same at 10 or 10,000 requests a second. Fed from
    replicas' receiver threads and read by the controller's, hence the lock."""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self.ttft: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self.tpot: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()

    def observe(self, now: float, ttft_s: float | None, tpot_s: float | None) -> None:
        with self._lock:
            if ttft_s is not None:
                self.ttft.append((now, ttft_s))
            if tpot_s is not None:
                self.tpot.append((now, tpot_s))

    def percentile(self, which: str, now: float, p: float) -> float | None:
        samples = self.ttft if which == "ttft" else self.tpot
        with self._lock:
            while samples and samples[0][0] < now - self.window_s:
                samples.popleft()
            values = sorted(v for _, v in samples)
        if not values:
            return None
        return values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))]


class Controller:
    """Applies a policy's decisions to a pool each `tick(now)` (the clock is the caller's: a test's fake one, the
    simulator's, or `time.monotonic` in `run`), and stops drained replicas once they have nothing outstanding.
    Every decision that changes something is logged and kept; all are counted by action."""

    def __init__(self, policy: AutoscalerPolicy, pool: ReplicaPool, latency: LatencyWindow | None = None,
                 held: Callable[[], int] | None = None, max_log: int = 1024) -> None:
        self.policy, self.pool = policy, pool
        self.latency = latency if latency is not None else LatencyWindow()
        self.held = held if held is not None else (lambda: 0)
        self.decisions: deque[ScaleDecision] = deque(maxlen=max_log)  # the ones that changed something
        self.last: ScaleDecision | None = None
        self.num_by_action: Counter[str] = Counter()
        self.num_stopped = 0

    def signals(self, now: float) -> FleetSignals:
        p = self.policy.config.slo.percentile
        return FleetSignals(self.pool.model, now, tuple(self.pool.loads(now)),
                            self.latency.percentile("ttft", now, p), self.latency.percentile("tpot", now, p),
                            self.held())

    def tick(self, now: float) -> ScaleDecision:
        signals = self.signals(now)
        decision = self.policy.decide(signals)
        self.apply(decision, signals)
        self.finish_drains(signals)
        self.last = decision
        self.num_by_action[decision.action] += 1
        if decision.action != "hold":
            self.decisions.append(decision)
            logger.info("autoscaler %s: %s %s -> %d replicas: %s", self.policy.name, decision.model,
                        decision.action, decision.replicas, decision.reason)
        return decision

    def apply(self, decision: ScaleDecision, signals: FleetSignals) -> None:
        if decision.action == "up":
            missing = decision.replicas - len(signals.active)
            draining = [r for r in signals.replicas if r.state == "draining"]
            for r in sorted(draining, key=lambda r: -r.load)[:missing]:  # cheaper than a cold start
                self.pool.undrain(r.replica_id)
                missing -= 1
            for _ in range(max(missing, 0)):
                self.pool.start(decision.option or self.policy_option())
        elif decision.action == "down":
            for replica_id in decision.drain:
                self.pool.drain(replica_id)

    def policy_option(self) -> str:
        options: Sequence[ReplicaOption] = getattr(self.policy, "options", ())
        return options[0].name if options else "default"

    def finish_drains(self, signals: FleetSignals) -> None:
        for r in signals.replicas:
            if r.state == "draining" and r.num_outstanding == 0 and r.num_running + r.num_waiting == 0:
                self.pool.stop(r.replica_id)
                self.num_stopped += 1
