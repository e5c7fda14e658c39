"""Attribution math against a deterministic fake power source (piecewise-constant watts)."""

import random
import threading
import time

import pytest

from tokenfactory.config import ModelConfig
from tokenfactory.meter.attribution import Meter, MeterConfig, work_flops
from tokenfactory.meter.power import ConstantSource, EnergyReading, UnavailableSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.types import SequenceWork, StepStats

MODEL = ModelConfig(architecture="llama", vocab_size=1000, hidden_size=64, intermediate_size=128,
                    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeSource:
    """Energy = ∫ watts dt, with `watts` set by the test; the clock moves only when the test says."""

    name, scope, unavailable_reason = "fake", "gpu", None

    def __init__(self, clock: FakeClock, watts: float) -> None:
        self.clock, self.watts = clock, watts
        self.joules, self.last = 0.0, clock.now
        self.fail_next = 0

    def advance(self, seconds: float, watts: float | None = None) -> None:
        if watts is not None:
            self.watts = watts
        self.joules += self.watts * seconds
        self.clock.now += seconds

    def read(self) -> EnergyReading | None:
        if self.fail_next:
            self.fail_next -= 1
            return None
        return EnergyReading(self.joules, self.clock.now, self.name, self.scope, {"gpu0": self.joules})

    def describe(self) -> str:
        return "fake"

    def close(self) -> None:
        pass


def step(clock: FakeClock, source: FakeSource, duration: float, watts: float, work, index: int = 0) -> StepStats:
    start = clock.now
    source.advance(duration, watts)
    return StepStats(step_index=index, start_time=start, duration_s=duration, num_prefill_tokens=0,
                     num_decode_tokens=0, num_running=len(work), num_waiting=0, num_free_blocks=0,
                     num_total_blocks=1, num_preemptions=0, work=tuple(work))


def make_meter(watts: float = 50.0, **config):
    clock = FakeClock()
    source = FakeSource(clock, watts)
    config.setdefault("tick_interval_s", None)
    meter = Meter(source, MODEL, load_prices(device="h100"), MeterConfig(**config), clock=clock)
    return clock, source, meter


def test_work_flops_formula_by_hand():
    n, c = 3, 5
    attention = 4 * MODEL.num_layers * (MODEL.num_heads * MODEL.head_dim) * (n * c + n * (n + 1) / 2)
    assert work_flops(MODEL, n, c) == pytest.approx(2 * MODEL.num_params * n + attention)
    # one prefill of 3 tokens is exactly three decode steps over a growing context
    assert work_flops(MODEL, 3, 5) == pytest.approx(sum(work_flops(MODEL, 1, 5 + i) for i in range(3)))


def test_step_energy_split_by_flops_and_idle_kept_apart():
    clock, source, meter = make_meter(watts=50.0)
    for _ in range(4):  # 2 s idle at 50 W, read by the ticker every 0.5 s
        source.advance(0.5)
        meter.tick()
    work = [SequenceWork("a", 100, 0, True), SequenceWork("b", 1, 400, False)]
    meter.on_step(step(clock, source, 0.2, 300.0, work))  # 60 J in the step
    a, b = meter.finish_request("a", 1), meter.finish_request("b", 1)
    fa, fb = work_flops(MODEL, 100, 0), work_flops(MODEL, 1, 400)
    assert a.energy_joules + b.energy_joules == pytest.approx(60.0)
    assert a.energy_joules / b.energy_joules == pytest.approx(fa / fb)
    assert a.device_seconds == pytest.approx(0.2 * fa / (fa + fb))
    totals = meter.totals()
    assert totals.idle_joules == pytest.approx(100.0)
    assert totals.energy_joules_by_source == {"fake": pytest.approx(160.0)}
    assert a.energy_source == "fake" and a.energy_scope == "gpu"


def test_idle_gap_before_step_is_estimated_from_idle_power():
    clock, source, meter = make_meter(watts=40.0)
    source.advance(1.0)
    meter.tick()  # idle power measured: 40 W
    source.advance(0.7)  # more idle, no reading at the step's start
    meter.on_step(step(clock, source, 0.1, 500.0, [SequenceWork("r", 1, 10, False)]))
    r = meter.finish_request("r")
    assert r.energy_joules == pytest.approx(50.0)  # 500 W · 0.1 s, none of the 0.7 s idle gap
    assert meter.totals().idle_joules == pytest.approx(68.0)


def test_back_to_back_steps_charge_the_overhead_gap_to_the_step():
    clock, source, meter = make_meter(watts=100.0, idle_gap_s=0.05)
    meter.on_step(step(clock, source, 0.1, 200.0, [SequenceWork("r", 4, 0, True)]))
    source.advance(0.01)  # 10 ms of scheduler overhead at 200 W
    meter.on_step(step(clock, source, 0.1, 200.0, [SequenceWork("r", 1, 4, False)], 1))
    assert meter.finish_request("r").energy_joules == pytest.approx(42.0)
    assert meter.totals().idle_joules == pytest.approx(0.0)


def test_sum_of_requests_plus_idle_equals_source_total_random_schedule():
    rng = random.Random(1234)
    clock, source, meter = make_meter(watts=60.0)
    results, live = [], set()
    for i in range(400):
        if rng.random() < 0.3:
            source.advance(rng.uniform(0.01, 2.0), rng.uniform(30, 80))
            meter.tick()
        if rng.random() < 0.1:
            source.fail_next = 1  # a failed read: its energy must land in the next window
        work = []
        for rid in rng.sample(range(30), rng.randint(1, 6)):
            live.add(str(rid))
            prefill = rng.random() < 0.2
            work.append(SequenceWork(str(rid), rng.randint(2, 300) if prefill else 1, rng.randint(0, 2000), prefill))
        source.advance(rng.uniform(0.0, 0.06))  # overhead or idle before the step
        meter.on_step(step(clock, source, rng.uniform(0.005, 0.3), rng.uniform(150, 700), work, i))
        if live and rng.random() < 0.2:
            results.append(meter.finish_request(live.pop(), rng.randint(1, 50)))
    results += [meter.finish_request(rid) for rid in sorted(live)]
    totals = meter.totals()
    assert all(r.energy_joules is not None for r in results)
    total = totals.energy_joules_by_source["fake"]
    assert total == pytest.approx(source.joules)
    accounted = sum(r.energy_joules for r in results) + totals.idle_joules + totals.unattributed_joules
    assert accounted == pytest.approx(total, rel=1e-9)
    assert totals.attributed_joules == pytest.approx(sum(r.energy_joules for r in results), rel=1e-9)
    assert totals.unattributed_joules == pytest.approx(0.0, abs=1e-9)


def test_step_without_work_is_unattributed_not_idle():
    clock, source, meter = make_meter(watts=0.0)
    meter.on_step(step(clock, source, 0.5, 100.0, []))
    totals = meter.totals()
    assert totals.unattributed_joules == pytest.approx(50.0) and totals.idle_joules == 0.0


def test_failed_read_is_folded_into_the_next_window():
    clock, source, meter = make_meter(watts=0.0)
    source.fail_next = 1
    meter.on_step(step(clock, source, 0.1, 100.0, [SequenceWork("a", 1, 0, False)]))  # read fails
    meter.on_step(step(clock, source, 0.1, 300.0, [SequenceWork("b", 1, 0, False)], 1))
    a, b = meter.finish_request("a"), meter.finish_request("b")
    # 40 J over two equal-length steps: split by duration across the window (20 J each)
    assert a.energy_joules + b.energy_joules == pytest.approx(40.0)
    assert a.energy_joules == pytest.approx(20.0)


def test_unavailable_source_gives_none_energy_but_device_cost():
    clock = FakeClock()
    meter = Meter(UnavailableSource("nvml", "no GPU here", "gpu"), MODEL, load_prices(device="h100"),
                  MeterConfig(tick_interval_s=None), clock=clock)
    work = [SequenceWork("a", 8, 0, True)]
    meter.on_step(StepStats(0, clock.now, 0.5, 8, 0, 1, 0, 0, 1, 0, tuple(work)))
    r = meter.finish_request("a", 3)
    assert r.energy_joules is None and r.energy_source is None and r.facility_energy_joules is None
    assert r.cost_energy_usd is None and r.cost_usd is None
    assert r.device_seconds == pytest.approx(0.5)
    assert r.cost_device_usd == pytest.approx(0.5 / 3600 * meter.prices.device.usd_per_hour)
    totals = meter.totals()
    assert totals.energy_joules_by_source == {} and totals.idle_joules is None
    assert totals.current_watts is None and totals.joules_per_output_token is None


def test_cost_components_and_totals():
    clock, source, meter = make_meter(watts=0.0)
    meter.on_step(step(clock, source, 2.0, 360.0, [SequenceWork("a", 1, 0, False)]))  # 720 J
    r = meter.finish_request("a", num_output_tokens=4)
    prices = meter.prices
    assert r.cost_device_usd == pytest.approx(2.0 / 3600 * prices.device.usd_per_hour)
    assert r.cost_energy_usd == pytest.approx(720.0 * prices.energy_overhead_factor / 3.6e6 * prices.usd_per_kwh)
    assert r.cost_usd == pytest.approx(r.cost_device_usd + r.cost_energy_usd)
    assert r.joules_per_output_token == pytest.approx(180.0)
    totals = meter.totals()
    assert totals.joules_per_output_token == pytest.approx(180.0)
    assert totals.num_output_tokens == 4 and totals.cost_usd == pytest.approx(r.cost_usd)
    assert totals.current_watts == pytest.approx(360.0)


def test_unknown_request_has_zero_work():
    _, _, meter = make_meter()
    r = meter.finish_request("never-scheduled")
    assert r.energy_joules == 0.0 and r.device_seconds == 0.0 and r.num_steps == 0


def test_long_idle_settles_lazily_and_keeps_memory_bounded():
    clock, source, meter = make_meter(watts=20.0, settle_after_s=5.0)
    for _ in range(100):
        source.advance(1.0)
        meter.tick()
    totals = meter.totals()
    assert totals.idle_joules == pytest.approx(20.0 * 95, abs=20.0)
    assert totals.idle_joules + totals.unsettled_joules == pytest.approx(2000.0)
    assert len(meter._energy.idle_samples) <= 6


def test_config_errors_name_the_parameter():
    with pytest.raises(ValueError, match="num_devices"):
        MeterConfig(num_devices=0)
    with pytest.raises(ValueError, match="tick_interval_s"):
        MeterConfig(tick_interval_s=0)


def test_thread_safety_invariant_under_concurrent_readers():
    clock, source, meter = make_meter(watts=10.0)
    lock = threading.Lock()  # the fake clock itself is not thread-safe; the meter must be
    stop = threading.Event()
    finished = []

    def engine():
        for i in range(2000):
            with lock:
                stats = step(clock, source, 0.01, 200.0, [SequenceWork(f"r{i % 50}", 1, i, False)], i)
            meter.on_step(stats)
        stop.set()

    def server():
        while not stop.is_set():
            meter.totals()
            with lock:
                source.advance(0.001)
            meter.tick()

    threads = [threading.Thread(target=engine), threading.Thread(target=server)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finished += [meter.finish_request(f"r{i}") for i in range(50)]
    totals = meter.totals()
    accounted = sum(r.energy_joules for r in finished) + totals.idle_joules + totals.unattributed_joules
    accounted += totals.unsettled_joules
    assert accounted == pytest.approx(totals.energy_joules_by_source["fake"], rel=1e-9)
    assert sum(r.energy_joules for r in finished) > 0.9 * 2000 * 0.01 * 200.0 * 0.99


def test_sequences_of_one_request_add_up_within_a_step():
    clock, source, meter = make_meter(watts=0.0)
    work = [SequenceWork("n2", 1, 50, False), SequenceWork("n2", 1, 50, False), SequenceWork("solo", 1, 50, False)]
    meter.on_step(step(clock, source, 0.3, 100.0, work))
    both, solo = meter.finish_request("n2"), meter.finish_request("solo")
    assert both.energy_joules == pytest.approx(20.0) and solo.energy_joules == pytest.approx(10.0)
    assert both.num_steps == 1 and both.flops == pytest.approx(2 * work_flops(MODEL, 1, 50))


def test_background_ticker_measures_idle_with_a_real_clock():
    meter = Meter(ConstantSource(100.0, "machine"), MODEL, load_prices(),
                  MeterConfig(tick_interval_s=0.02, settle_after_s=0.05))
    with meter:
        time.sleep(0.3)
    totals = meter.totals()
    assert totals.idle_joules > 0 and totals.current_watts == pytest.approx(100.0)
    assert totals.idle_joules + totals.unsettled_joules == pytest.approx(totals.energy_joules_by_source["constant"])


def test_energy_listeners_hear_each_requests_measured_joules():
    """What the joule fair share is charged (through the engine client): per request, exactly the joules
    the meter attributed to it, step by step, and the same total as the requests' own accounts."""
    clock, source, meter = make_meter(watts=80.0)
    heard: list[dict[str, float]] = []
    meter.energy_listeners.append(heard.append)
    for i in range(3):
        work = [SequenceWork("a", 10, 5 * i, False), SequenceWork("b", 1, 40 + i, False)]
        meter.on_step(step(clock, source, 0.02, 80.0, work, index=i))
    assert heard, "no settlement reported"
    per_request = {r: sum(h.get(r, 0.0) for h in heard) for r in ("a", "b")}
    assert sum(per_request.values()) == pytest.approx(80.0 * 0.06, rel=1e-9)
    assert per_request["a"] > per_request["b"] > 0  # split by FLOPs: a computes 10 tokens a step, b one
    for r in ("a", "b"):
        assert meter.finish_request(r).energy_joules == pytest.approx(per_request[r], rel=1e-9)
