"""Utilisation joined to tokens and power: busy and idle device-seconds, their energy, the tokens made, in
the meter's totals, in /metrics' collectors and in the ledger's hourly rollup (meter/utilisation.py)."""

import datetime as dt

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.meter.test_meter_attribution import MODEL, FakeClock
from tokenfactory.gateway.metrics import MeterCollector
from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.ledger import Ledger
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.meter.utilisation import UtilisationRecorder, device_usage, from_totals
from tokenfactory.types import SequenceWork, StepStats


def run_step(clock: FakeClock, meter: Meter, duration: float, prefill: int, decode: int) -> None:
    start = clock.now
    clock.now += duration
    work = (SequenceWork("r1", prefill + decode, 0, prefill > 0),)
    meter.on_step(StepStats(step_index=0, start_time=start, duration_s=duration, num_prefill_tokens=prefill,
                            num_decode_tokens=decode, num_running=1, num_waiting=0, num_free_blocks=0,
                            num_total_blocks=1, num_preemptions=0, work=work))


@pytest.fixture
def metered():
    clock = FakeClock()
    prices = load_prices(device="h100")
    meter = Meter(ConstantSource(100.0, "gpu", clock=clock), MODEL, prices,
                  MeterConfig(tick_interval_s=None, device="cuda:0"), clock=clock)
    return clock, meter, prices


def test_busy_idle_seconds_joules_and_tokens_are_counted(metered):
    clock, meter, prices = metered
    clock.now += 10.0  # idle: 10 s at 100 W
    run_step(clock, meter, 2.0, prefill=50, decode=0)  # busy: 2 s at 100 W
    run_step(clock, meter, 1.0, prefill=0, decode=10)
    u = from_totals(meter.totals())
    assert u.device == "cuda:0" and u.energy_source == "constant"
    assert u.busy_device_seconds == pytest.approx(3.0) and u.idle_device_seconds == pytest.approx(10.0)
    assert u.busy_joules == pytest.approx(300.0) and u.idle_joules == pytest.approx(1000.0)
    assert (u.num_prefill_tokens, u.num_decode_tokens) == (50, 10)
    assert u.utilisation == pytest.approx(3 / 13) and u.joules_per_token == pytest.approx(300 / 60)
    assert u.idle_cost_usd == pytest.approx(prices.device_cost_usd(10.0) + prices.energy_cost_usd(1000.0))
    assert u.energy_kwh == pytest.approx(1300 / 3.6e6)

    registry = CollectorRegistry()
    registry.register(MeterCollector(meter))
    text = generate_latest(registry).decode()
    assert 'tokenfactory:device_busy_seconds_total{device="cuda:0"} 3.0' in text
    assert 'tokenfactory:device_idle_seconds_total{device="cuda:0"} 10.0' in text
    assert 'tokenfactory:device_energy_joules_total{device="cuda:0",source="constant",state="busy"} 300.0' in text
    assert 'tokenfactory:device_tokens_total{device="cuda:0",kind="decode"} 10.0' in text
    assert 'tokenfactory:device_utilisation{device="cuda:0"} 0.230769' in text


def test_the_hourly_rollup_answers_the_one_query(metered, tmp_path):
    clock, meter, prices = metered
    ledger = Ledger.open(tmp_path)
    hours = iter([dt.datetime(2026, 11, 3, 9, 59), dt.datetime(2026, 11, 3, 10, 1), dt.datetime(2026, 11, 4, 0, 0)])
    recorder = UtilisationRecorder(meter, ledger.engine, interval_s=None, wall=lambda: next(hours))
    try:
        clock.now += 4.0
        run_step(clock, meter, 1.0, prefill=100, decode=0)
        first = recorder.flush()  # 09:00
        clock.now += 5.0
        run_step(clock, meter, 1.0, prefill=0, decode=20)
        second = recorder.flush()  # 10:00
        run_step(clock, meter, 0.5, prefill=0, decode=5)
        recorder.flush()  # the next day
        assert first.busy_device_seconds == pytest.approx(1.0) and first.idle_device_seconds == pytest.approx(4.0)
        assert second.num_decode_tokens == 20 and second.busy_joules == pytest.approx(100.0)
        [nov3] = device_usage(ledger.engine, dt.datetime(2026, 11, 3), dt.datetime(2026, 11, 4))
        assert nov3.busy_device_seconds == pytest.approx(2.0) and nov3.idle_device_seconds == pytest.approx(9.0)
        assert nov3.num_tokens == 120 and nov3.busy_joules == pytest.approx(200.0)
        assert nov3.idle_joules == pytest.approx(900.0) and nov3.utilisation == pytest.approx(2 / 11)
        [everything] = device_usage(ledger.engine)
        live = from_totals(meter.totals())
        for name in ("busy_device_seconds", "idle_device_seconds", "busy_joules", "idle_joules", "idle_cost_usd"):
            assert getattr(everything, name) == pytest.approx(getattr(live, name)), name
        assert everything.num_tokens == live.num_tokens == 125
        assert "18% busy" in nov3.describe() and "120 tokens" in nov3.describe()
        assert device_usage(ledger.engine, device="cpu") == []
    finally:
        ledger.close()


def test_unmeasured_energy_stays_null_in_the_rollup(tmp_path):
    from tokenfactory.meter.power import UnavailableSource

    clock = FakeClock()
    meter = Meter(UnavailableSource("none", "no source"), MODEL, load_prices(),
                  MeterConfig(tick_interval_s=None), clock=clock)
    ledger = Ledger.open(tmp_path)
    recorder = UtilisationRecorder(meter, ledger.engine, interval_s=None)
    try:
        run_step(clock, meter, 1.0, prefill=10, decode=0)
        recorder.flush()
        [u] = device_usage(ledger.engine)
        assert u.busy_joules is None and u.idle_joules is None and u.energy_source is None
        assert u.busy_device_seconds == pytest.approx(1.0) and u.joules_per_token is None
        assert "energy not measured" in u.describe()
    finally:
        ledger.close()


def test_a_database_that_refuses_does_not_stop_the_server_starting(metered, tmp_path, caplog):
    """The rollup is bookkeeping: if its table cannot be made (database gone), the recorder starts anyway,
    says so, and each flush tries again; the counters wait for it."""
    import sqlalchemy as sa

    clock, meter, _ = metered
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'missing-dir' / 'ledger.db'}")
    recorder = UtilisationRecorder(meter, engine, interval_s=None)
    assert "not created yet" in caplog.text
    run_step(clock, meter, 1.0, prefill=5, decode=0)
    with pytest.raises(sa.exc.OperationalError):
        recorder.flush()
    recorder.close()  # logged, not raised
    (tmp_path / "missing-dir").mkdir()
    assert recorder.flush().busy_device_seconds == pytest.approx(1.0)  # nothing lost while it refused
    [u] = device_usage(engine)
    assert u.num_prefill_tokens == 5
