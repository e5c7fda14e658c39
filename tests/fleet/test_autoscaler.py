"""The autoscaler on a fake clock: policies' decisions for a ramp, a spike, a drop and flapping input, applied by
the real `Controller` to a scripted pool (demand spread over its ready replicas, cold starts on the fake
clock); and `FleetPool` over a real `Fleet` of fake engines (start, drain, stop)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest

from tests.fake_engine import FakeEngineClient
from tokenfactory.fleet.autoscaler import (
    AutoscalerConfig,
    Controller,
    FleetSignals,
    LatencyWindow,
    ReplicaLoad,
    ReplicaOption,
    ScaleDecision,
    make_autoscaler,
)
from tokenfactory.fleet.fleet import Fleet, Replica
from tokenfactory.fleet.scaling_pool import FleetPool

LOCAL = ReplicaOption("local", "cpu", idle_watts=10.0, busy_watts=60.0, target_seqs=8, tokens_per_s=100.0)


class ScriptedPool:
    """Replicas whose load is the demand the test sets, spread evenly over the ready ones."""

    model = "m"

    def __init__(self, num_ready: int, cold_start_s: float, clock: Callable[[], float]) -> None:
        self.clock, self.cold_start_s = clock, cold_start_s
        self.id_to_state = {f"r{i}": "ready" for i in range(num_ready)}
        self.id_to_ready_at: dict[str, float] = {}
        self.demand = 0
        self.num_started = num_ready
        self.stopped: list[str] = []
        self.joules_per_token: dict[str, float] = {}

    def loads(self, now: float) -> list[ReplicaLoad]:
        for rid, at in list(self.id_to_ready_at.items()):
            if now >= at:
                self.id_to_state[rid] = "ready"
                del self.id_to_ready_at[rid]
        ready = sorted(r for r, s in self.id_to_state.items() if s == "ready")
        share = {r: self.demand // len(ready) + (i < self.demand % len(ready)) for i, r in enumerate(ready)}
        return [ReplicaLoad(rid, state, "local", share.get(rid, 0), 0, 64, 0.1, share.get(rid, 0), 0.0,
                            self.joules_per_token.get(rid)) for rid, state in sorted(self.id_to_state.items())]

    def start(self, option: str) -> str:
        rid = f"r{self.num_started}"
        self.num_started += 1
        self.id_to_state[rid] = "starting"
        self.id_to_ready_at[rid] = self.clock() + self.cold_start_s
        return rid

    def drain(self, replica_id: str) -> None:
        self.id_to_state[replica_id] = "draining"

    def undrain(self, replica_id: str) -> None:
        self.id_to_state[replica_id] = "ready"

    def stop(self, replica_id: str) -> None:
        del self.id_to_state[replica_id]
        self.stopped.append(replica_id)

    @property
    def active(self) -> int:
        return sum(s in ("ready", "starting") for s in self.id_to_state.values())


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def setup(policy: str = "slo", ready: int = 1, cold_start_s: float = 5.0, **overrides: float
          ) -> tuple[Clock, ScriptedPool, Controller]:
    clock = Clock()
    pool = ScriptedPool(ready, cold_start_s, clock)
    config = AutoscalerConfig(**{"min_replicas": 1, "max_replicas": 8, "up_delay_s": 10.0, "down_delay_s": 60.0,
                                 **overrides})
    return clock, pool, Controller(make_autoscaler(policy, config, [LOCAL]), pool)


def run(clock: Clock, pool: ScriptedPool, ctl: Controller, demand: Callable[[float], int], seconds: float
        ) -> list[tuple[float, int, ScaleDecision]]:
    """Tick once a second; (time, active replicas after the tick, decision)."""
    trace = []
    end = clock.now + seconds
    while clock.now < end:
        pool.demand = demand(clock.now)
        decision = ctl.tick(clock.now)
        trace.append((clock.now, pool.active, decision))
        clock.now += 1.0
    return trace


def changes(trace: list[tuple[float, int, ScaleDecision]]) -> list[ScaleDecision]:
    return [d for _, _, d in trace if d.action != "hold"]


def test_ramp_adds_replicas_one_delay_after_the_load_passes_each_threshold() -> None:
    clock, pool, ctl = setup()
    trace = run(clock, pool, ctl, lambda t: int(t * 0.4), 120)  # 0 -> 48 sequences
    counts = [n for _, n, _ in trace]
    assert counts == sorted(counts), "a ramp never scales down"
    ups = changes(trace)
    assert [d.action for d in ups] == ["up"] * 6 and counts[-1] == 7
    for d in ups:  # each to what the load then needed: ceil(load / (80% of 8))
        assert d.option == "local" and "SLO concurrency" in d.reason
        assert d.replicas == math.ceil(int(d.time * 0.4) / 6.4)
    # The first threshold is passed at t = 18 s (7 seqs > 6.4); wanted for the 10 s up-delay, then applied;
    # each later step also waits its delay from the previous change.
    assert ups[0].time == 18 + 10
    assert all(b.time - a.time >= 10 for a, b in zip(ups, ups[1:], strict=False))


def test_spike_jumps_to_the_needed_count_in_one_decision() -> None:
    clock, pool, ctl = setup(ready=2)
    trace = run(clock, pool, ctl, lambda t: 4 if t < 20 else 40, 60)
    ups = changes(trace)
    assert len(ups) == 1 and ups[0].time == 30.0 and ups[0].replicas == 7  # ceil(40 / 6.4)
    assert [n for t, n, _ in trace if t >= 30][0] == 7
    # While they start, the pool counts them: nothing is started twice.
    assert pool.num_started == 2 + 5


def test_slo_breach_adds_one_even_when_the_load_looks_within_the_band() -> None:
    clock, pool, ctl = setup(ready=2)
    for t in range(0, 30):
        ctl.latency.observe(float(t), 3.5, 0.05)  # TTFT p99 3.5 s against the SLO's 2 s
    trace = run(clock, pool, ctl, lambda t: 10, 15)  # 10 seqs: under 80% of 2 x 8, over 40%
    ups = changes(trace)
    assert len(ups) == 1 and ups[0].replicas == 3 and "TTFT p99 3.50 s > SLO 2 s" in ups[0].reason


def test_a_slow_tail_at_low_load_adds_nothing() -> None:
    clock, pool, ctl = setup(ready=2)
    for t in range(0, 30):
        ctl.latency.observe(float(t), 30.0, 0.05)  # e.g. requests that waited out a cold start
    assert changes(run(clock, pool, ctl, lambda t: 2, 15)) == []


def test_drop_drains_the_least_loaded_and_stops_it_only_when_empty() -> None:
    clock, pool, ctl = setup(ready=4, cold_start_s=0.0)
    run(clock, pool, ctl, lambda t: 20, 5)  # within the band for 4 replicas
    assert pool.active == 4
    trace = run(clock, pool, ctl, lambda t: 2, 100)
    downs = changes(trace)
    assert len(downs) == 1 and downs[0].action == "down" and downs[0].replicas == 1  # ceil(2 / 3.2)
    assert downs[0].time == pytest.approx(5 + 60)  # the down delay after the last change-free minute
    assert downs[0].drain == ("r2", "r3", "r0")  # the idle two, then the lighter (by id) of the busy two
    # The ready replica left has the whole demand; the drained ones had none once drained and were stopped.
    assert sorted(pool.stopped) == sorted(downs[0].drain) and pool.active == 1


def test_flapping_input_changes_nothing() -> None:
    clock, pool, ctl = setup(ready=2, cold_start_s=0.0)
    trace = run(clock, pool, ctl, lambda t: 40 if int(t) // 5 % 2 else 2, 300)  # flips every 5 s
    assert changes(trace) == [] and pool.active == 2
    assert all("delay" in d.reason for _, _, d in trace if "band" not in d.reason)
    assert ctl.num_by_action["hold"] == 300


def test_a_slow_oscillation_follows_demand_without_extra_changes() -> None:
    clock, pool, ctl = setup(ready=1, cold_start_s=0.0)
    trace = run(clock, pool, ctl, lambda t: 40 if int(t) // 200 % 2 else 2, 900)
    actions = [d.action for d in changes(trace)]
    assert actions == ["up", "down", "up", "down"]  # one change per demand edge, no ping-pong


def test_energy_packs_tighter_and_drains_the_least_efficient_first() -> None:
    demand = 20
    slo_clock, slo_pool, slo = setup("slo", ready=1, cold_start_s=0.0)
    en_clock, en_pool, en = setup("energy", ready=1, cold_start_s=0.0)
    run(slo_clock, slo_pool, slo, lambda t: demand, 40)
    run(en_clock, en_pool, en, lambda t: demand, 40)
    assert slo_pool.active == math.ceil(demand / (0.8 * 8)) == 4
    assert en_pool.active == math.ceil(demand / (0.95 * 8)) == 3
    # Consolidation: r1 is the least efficient replica, so it is drained first.
    en_pool.joules_per_token.update({"r0": 0.5, "r1": 2.0, "r2": 0.7})
    trace = run(en_clock, en_pool, en, lambda t: 4, 100)
    (down,) = changes(trace)
    assert down.drain[0] == "r1" and down.replicas == 1  # 4 seqs fit one replica at 70% of 8
    run(slo_clock, slo_pool, slo, lambda t: 4, 100)
    assert slo_pool.active == 2  # the slo policy keeps headroom: ceil(4 / (40% of 8))


def test_energy_adds_the_cheapest_option_per_token() -> None:
    cheap = ReplicaOption("h100", "H100-SXM", 70, 700, target_seqs=64, tokens_per_s=3000, usd_per_hour=2.69)
    dear = ReplicaOption("a100", "A100-80GB", 50, 400, target_seqs=32, tokens_per_s=900, usd_per_hour=1.39)
    assert cheap.usd_per_mtok < dear.usd_per_mtok
    policy = make_autoscaler("energy", AutoscalerConfig(max_replicas=4, up_delay_s=0), [dear, cheap])
    loads = (ReplicaLoad("r0", "ready", "a100", 32, 20, 32, 0.5, 52, 900.0, 0.4),)
    d = policy.decide(FleetSignals("m", 0.0, loads))
    assert d.action == "up" and d.option == "h100"


def test_scale_to_zero_and_back_from_zero_without_delay() -> None:
    clock, pool, ctl = setup(min_replicas=0, cold_start_s=3.0)
    trace = run(clock, pool, ctl, lambda t: 0, 70)
    assert [d.action for d in changes(trace)] == ["down"] and changes(trace)[0].replicas == 0
    assert pool.active == 0 and pool.stopped == ["r0"]
    held = 3
    ctl.held = lambda: held
    d = ctl.tick(clock.now)
    assert d.action == "up" and d.replicas == 1 and "held with no replica" in d.reason


def test_bounds_hold_and_say_so() -> None:
    clock, pool, ctl = setup(ready=2, max_replicas=2)
    trace = run(clock, pool, ctl, lambda t: 100, 30)
    assert changes(trace) == [] and "held at --max-replicas 2" in trace[-1][2].reason
    with pytest.raises(ValueError, match="max-replicas"):
        AutoscalerConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="unknown autoscaler"):
        make_autoscaler("nope", AutoscalerConfig(), [LOCAL])


def test_latency_window_percentiles_forget_old_samples() -> None:
    w = LatencyWindow(window_s=10.0)
    for i in range(100):
        w.observe(float(i) * 0.1, ttft_s=float(i), tpot_s=None)
    assert w.percentile("ttft", 9.9, 50) == 49.0 and w.percentile("ttft", 9.9, 99) == 98.0
    assert w.percentile("tpot", 9.9, 99) is None
    assert w.percentile("ttft", 100.0, 99) is None


def test_fleet_pool_starts_drains_and_stops_real_fleet_replicas() -> None:
    fleet = Fleet("m", [Replica("p0", FakeEngineClient(), "local")])
    fleet.start()
    pool = FleetPool(fleet, lambda rid, option: Replica(rid, FakeEngineClient(), "local"))
    config = AutoscalerConfig(min_replicas=1, max_replicas=2, up_delay_s=0.0, down_delay_s=0.0)
    policy = make_autoscaler("slo", config, [ReplicaOption("local", "cpu", 10, 60, target_seqs=1,
                                                           tokens_per_s=10)])
    ctl = Controller(policy, pool, held=lambda: 0)
    try:
        pool.loads(0.0)
        fleet.replicas["p0"].request_id_to_tokens.update({"x": 10, "y": 10})  # two routed, outstanding
        assert ctl.tick(1.0).action == "up"
        pool.wait()
        assert set(fleet.replicas) == {"p0", "a0"} and pool.cold_starts[0].ok
        fleet.replicas["p0"].request_id_to_tokens.clear()
        d = ctl.tick(2.0)
        assert d.action == "down" and d.drain == ("a0",) and fleet.replicas["a0"].state == "draining"
        ctl.tick(3.0)
        pool.wait()
        assert set(fleet.replicas) == {"p0"} and ctl.num_stopped == 1
        pool.stop("p0")  # the last replica is never stopped
        pool.wait()
        assert set(fleet.replicas) == {"p0"}
    finally:
        fleet.shutdown()
        time.sleep(0)


def test_fleet_pool_scales_a_real_fleet_to_zero_and_back_for_a_held_request() -> None:
    """--min-replicas 0: the idle fleet's last replica is drained and stopped; a request then is held, the
    controller sees it held and starts a replica at once, and the request is served by it."""
    template = FakeEngineClient()
    fleet = Fleet("m", [Replica("p0", FakeEngineClient(), "local")], info=template.info,
                  tokenizer=template.tokenizer, hold_s=10.0)
    fleet.start()
    pool = FleetPool(fleet, lambda rid, option: Replica(rid, FakeEngineClient(), "local"), allow_zero=True)
    config = AutoscalerConfig(min_replicas=0, max_replicas=1, up_delay_s=5.0, down_delay_s=0.0)
    policy = make_autoscaler("slo", config, [ReplicaOption("local", "cpu", 10, 60, target_seqs=4, tokens_per_s=10)])
    ctl = Controller(policy, pool, held=lambda: fleet.num_held)
    try:
        pool.loads(0.0)
        assert ctl.tick(1.0).action == "down"
        ctl.tick(2.0)
        pool.wait()
        assert fleet.replicas == {} and fleet.is_alive

        async def request() -> list:
            task = asyncio.ensure_future(collect(fleet))
            while fleet.num_held == 0:
                await asyncio.sleep(0.01)
            d = await asyncio.to_thread(ctl.tick, 2.5)  # held with no replica: up at once, no up-delay
            assert d.action == "up" and "held" in d.reason
            return await task
        outs = asyncio.run(request())
        pool.wait()
        assert outs[-1].finished and outs[-1].replica == "a0" and pool.cold_starts[-1].ok
    finally:
        fleet.shutdown()


async def collect(fleet: Fleet) -> list:
    from tokenfactory.engine.client import AddRequest
    from tokenfactory.types import SamplingParams

    request = AddRequest("held", [3, 4, 5], "abc", SamplingParams(max_tokens=4, ignore_eos=True), time.monotonic(),
                         "t", 1)
    return [o async for o in fleet.generate(request)]


def test_fleet_status_reads_a_servers_replicas(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.server_util import start_gateway
    from tokenfactory.cli import main

    fleet = Fleet("fake-tiny", [Replica("p0", FakeEngineClient(), "local"), Replica("p1", FakeEngineClient(), "local")])
    gateway = start_gateway(fleet, tmp_path)
    try:
        assert main(["fleet", "status", "--url", gateway.url]) == 0
        out = capsys.readouterr().out
        assert "fake-tiny: 2 replicas, router least-work" in out and "p1" in out and "autoscaler: off" in out
    finally:
        gateway.stop()
    assert main(["fleet", "status", "--url", "http://127.0.0.1:9"]) == 2
