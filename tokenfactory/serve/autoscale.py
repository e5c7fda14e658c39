"""`serve --autoscaler slo|energy`: the fleet's replica count follows demand (docs/autoscaling.md).

The policy and controller are fleet/autoscaler.py's; here they are wired to serve: flags, a factory that starts
local process replicas (`a0`, `a1`, ...: each with its share of the machine's cores at --max-replicas), the
controller's thread, `GET /fleet/autoscaler` (the policy, its bounds, the last decision, the recent changes with
their reasons, cold starts), and /metrics series: decisions by action, the target and provisioned replica
counts, replicas starting, the last cold start in seconds.

The SLO signal: each decode step is a TPOT sample (fleet/scaling_pool.py), and before each tick the requests
that got their first token since the last one are read from the server's own TTFT histogram (its bucket counts'
increase, each request taken at its bucket's upper bound: conservative by at most one bucket), so the policy
sees the TTFT clients saw, queueing at the gateway included.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokenfactory.config import EngineConfig
    from tokenfactory.fleet.autoscaler import Controller, LatencyWindow
    from tokenfactory.fleet.fleet import Fleet, Replica
    from tokenfactory.fleet.launch import DevicePower, RayOptions
    from tokenfactory.fleet.node_energy import NodeEnergy
    from tokenfactory.fleet.scaling_pool import ControllerThread, FleetPool

P = "tokenfactory:"


def add_autoscaler_args(g: argparse._ArgumentGroup) -> None:
    from tokenfactory.fleet.autoscaler import AUTOSCALERS, AutoscalerConfig

    d = AutoscalerConfig()  # the one definition of these defaults, which `simulate` reads too (#30)

    g.add_argument("--autoscaler", choices=[*sorted(AUTOSCALERS), "auto"], nargs="?", const="auto",
                   help="follow demand between --min-replicas and --max-replicas (local process replicas): slo "
                        "keeps headroom within the SLO, energy packs replicas and stops the rest; alone (auto): "
                        "the --profile's goal, else slo")
    g.add_argument("--min-replicas", type=int, default=d.min_replicas,
                   help="autoscaler floor; 0 scales to zero when idle: a request that finds no replica is held "
                        "(up to --scale-from-zero-wait) while one starts, its TTFT carrying the cold start")
    g.add_argument("--scale-from-zero-wait", type=float, default=120.0,
                   help="with --min-replicas 0: seconds a request may wait for a replica to start")
    g.add_argument("--max-replicas", type=int, default=d.max_replicas, help="autoscaler ceiling")
    g.add_argument("--scale-up-delay", type=float, default=d.up_delay_s,
                   help="seconds a scale-up must be wanted (no flapping on bursts)")
    g.add_argument("--scale-down-delay", type=float, default=d.down_delay_s,
                   help="seconds a scale-down must be wanted, and since the last change (longer: fewer cold starts)")
    g.add_argument("--autoscale-interval", type=float, default=d.interval_s,
                   help="seconds between the autoscaler's ticks")
    g.add_argument("--autoscale-target-seqs", type=int,
                   help="sequences a replica serves within the SLO (default: its max_num_seqs)")
    g.add_argument("--ttft-slo", type=float, default=d.slo.ttft_s, help="TTFT target at p99, seconds")
    g.add_argument("--tpot-slo", type=float, default=d.slo.tpot_s, help="TPOT target at p99, seconds")


@dataclasses.dataclass
class Autoscaling:
    controller: Controller
    pool: FleetPool
    thread: ControllerThread

    def stop(self) -> None:
        self.thread.stop()
        self.pool.wait(30.0)


def hold_s(args: argparse.Namespace) -> float:
    """How long a request that finds no replica waits for one: --scale-from-zero-wait with --min-replicas 0
    (the autoscaler starts one), else 0 (it fails at once). Given to the fleet when it is made."""
    if getattr(args, "autoscaler", None) and getattr(args, "min_replicas", 1) == 0:
        return float(args.scale_from_zero_wait)
    return 0.0


def start_autoscaler(args: argparse.Namespace, fleet: Fleet, config: EngineConfig, power: DevicePower,
                     ray: RayOptions | None = None, energy: NodeEnergy | None = None) -> Autoscaling | None:
    """The controller over `fleet`, ticking on its thread; None without --autoscaler."""
    if not getattr(args, "autoscaler", None):
        return None
    from tokenfactory.fleet.autoscaler import SLO, AutoscalerConfig, Controller, ReplicaOption, make_autoscaler
    from tokenfactory.fleet.scaling_pool import ControllerThread, FleetPool, observe_steps

    policy = "slo" if args.autoscaler == "auto" else args.autoscaler  # "auto" that no --profile chose
    scaling = AutoscalerConfig(args.min_replicas, args.max_replicas, SLO(args.ttft_slo, args.tpot_slo),
                               up_delay_s=args.scale_up_delay, down_delay_s=args.scale_down_delay,
                               interval_s=args.autoscale_interval)
    threads = getattr(args, "threads", None) or max(1, (os.cpu_count() or 1) // scaling.max_replicas)
    target = args.autoscale_target_seqs or config.max_num_seqs
    option = ReplicaOption("local", config.device, power.idle_watts, power.busy_watts, target, 0.0)

    pool = FleetPool(fleet, replica_factory(args, config, threads, power, ray, energy), option.name,
                     allow_zero=scaling.min_replicas == 0)
    controller = Controller(make_autoscaler(policy, scaling, [option]), pool, held=lambda: fleet.num_held)
    observe_steps(fleet, controller.latency)
    thread = ControllerThread(controller, scaling.interval_s)
    thread.start()
    return Autoscaling(controller, pool, thread)


def replica_factory(args: argparse.Namespace, config: EngineConfig, threads: int, power: DevicePower,
                    ray: RayOptions | None = None, energy: NodeEnergy | None = None) -> Callable[[str, str], Replica]:
    """How the controller starts a replica: the way the fleet's own are started (fleet/launch.py: a Ray actor
    with `ray`, reporting its node's energy to `energy`, else a local process), restarted the same way."""
    from tokenfactory.fleet.launch import local_replica, replica_starter

    kind, start = replica_starter(config, threads, ray, args.replica_timeout, energy)

    def factory(replica_id: str, _option: str) -> Replica:
        return local_replica(replica_id, kind, start, start(replica_id), config, power)
    return factory


def ttft_feed(histogram: Histogram, model: str, latency: LatencyWindow, max_per_tick: int = 500
              ) -> Callable[[float], None]:
    """A callable for before each tick: the histogram's new observations into the latency window."""
    last: dict[float, float] = {}

    def feed(now: float) -> None:
        cumulative = {}
        for family in histogram.collect():
            for sample in family.samples:
                if sample.name.endswith("_bucket") and sample.labels.get("model_name") == model:
                    cumulative[float(sample.labels["le"])] = sample.value
        bounds = sorted(cumulative)
        finite = [b for b in bounds if math.isfinite(b)]
        below = 0.0
        for le in bounds:
            new = cumulative[le] - last.get(le, 0.0)
            count, below = int(new - below), new
            value = le if math.isfinite(le) else 2 * (finite[-1] if finite else 1.0)
            for _ in range(min(count, max_per_tick)):
                latency.observe(now, value, None)
        last.update(cumulative)
    return feed


def describe(auto: Autoscaling) -> str:
    c = auto.controller.policy.config
    return (f"{auto.controller.policy.name}, {c.min_replicas}..{c.max_replicas} replicas, SLO TTFT "
            f"{c.slo.ttft_s:g} s / TPOT {c.slo.tpot_s * 1000:.0f} ms at p{c.slo.percentile:g}, delays up "
            f"{c.up_delay_s:g} s / down {c.down_delay_s:g} s")


class AutoscalerCollector(Collector):
    def __init__(self, auto: Autoscaling, model: str) -> None:
        self.auto, self.model = auto, model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        ctl, pool = self.auto.controller, self.auto.pool
        decisions = CounterMetricFamily(P + "autoscaler_decisions", "Autoscaler decisions by action (up, down, "
                                        "hold).", labels=["model_name", "policy", "action"])
        for action in ("up", "down", "hold"):
            decisions.add_metric([self.model, ctl.policy.name, action], ctl.num_by_action[action])
        yield decisions

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric([self.model], value)
            return g
        yield gauge("autoscaler_target_replicas", "Replicas the last decision asked for.",
                    ctl.last.replicas if ctl.last else len(pool.fleet.replicas))
        yield gauge("autoscaler_replicas_starting", "Replicas being started.", len(pool.starting))
        yield gauge("autoscaler_replicas_stopped", "Replicas drained and stopped so far.", ctl.num_stopped)
        if pool.cold_starts:
            yield gauge("autoscaler_last_cold_start_seconds", "Seconds the last replica start took.",
                        pool.cold_starts[-1].seconds)


def install_autoscaler_routes(app: FastAPI, auto: Autoscaling, registry: CollectorRegistry, ttft: Histogram,
                              model: str) -> None:
    """`GET /fleet/autoscaler` (read-only, like /metrics), the collector, and the TTFT feed."""
    registry.register(AutoscalerCollector(auto, model))
    auto.thread.before_tick = ttft_feed(ttft, model, auto.controller.latency)

    @app.get("/fleet/autoscaler")
    async def autoscaler_status() -> dict:
        ctl = auto.controller
        return {"policy": ctl.policy.name, "config": dataclasses.asdict(ctl.policy.config),
                "last": dataclasses.asdict(ctl.last) if ctl.last else None,
                "recent": [dataclasses.asdict(d) for d in list(ctl.decisions)[-20:]],
                "num_by_action": dict(ctl.num_by_action), "num_stopped": ctl.num_stopped,
                "starting": sorted(auto.pool.starting),
                "cold_starts": [dataclasses.asdict(c) for c in auto.pool.cold_starts[-20:]]}
