"""The ledger on real SQLite files: durability settings, reopen, concurrent writers, totals."""

import datetime as dt
import random
import sqlite3
import subprocess
import sys
import threading

import pytest
import sqlalchemy as sa

from tokenfactory.meter.ledger import Ledger, LedgerRow, metadata, row_for
from tokenfactory.meter.paths import DATA_DIR_ENV, default_data_dir, ledger_path

DAY1 = dt.datetime(2025, 3, 1, 10, 0)
DAY2 = dt.datetime(2025, 3, 2, 23, 30)


def row(request_id, **kw):
    base = dict(model="smollm2", status="finished", prompt_tokens=10, completion_tokens=5)
    base.update(kw)
    return LedgerRow(request_id, **base)


def test_record_find_and_reopen(tmp_path):
    ledger = Ledger.open(tmp_path)
    ledger.record(row("a", energy_joules=12.5, energy_source="nvml", energy_scope="gpu", cost_device_usd=0.001,
                      cost_energy_usd=0.0002, cost_usd=0.0012, ttft_s=0.05, latency_s=0.4, cached_tokens=3))
    ledger.record(row("b", status="aborted"))
    ledger.close()
    reopened = Ledger.open(tmp_path, create=False)
    [a] = reopened.find("a")
    assert a.energy_joules == 12.5 and a.energy_source == "nvml" and a.ttft_s == 0.05 and a.cached_tokens == 3
    assert a.tenant == "anonymous"
    [b] = reopened.find("b")
    assert b.energy_joules is None and b.cost_usd is None and b.status == "aborted"  # missing stays missing
    assert reopened.count() == 2
    reopened.close()


def test_sqlite_is_wal_with_full_sync(tmp_path):
    ledger = Ledger.open(tmp_path)
    with ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    ledger.close()
    # another reader (plain sqlite3) sees the WAL file's mode too
    assert sqlite3.connect(ledger_path(tmp_path)).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_concurrent_writers_from_threads_lose_nothing(tmp_path):
    ledger = Ledger.open(tmp_path)
    errors = []

    def writer(t):
        try:
            for i in range(40):
                ledger.record(row(f"t{t}-{i}", tenant=f"tenant{t}"))
        except Exception as e:  # surfaced in the main thread below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert ledger.count() == 320
    by_tenant = {t.key: t.num_requests for t in ledger.totals(group_by="tenant")}
    assert by_tenant == {f"tenant{t}": 40 for t in range(8)}
    ledger.close()


WRITER = """
import sys
from tokenfactory.meter.ledger import Ledger, LedgerRow
ledger = Ledger.open(sys.argv[1])
for i in range(50):
    ledger.record(LedgerRow(f"p{sys.argv[2]}-{i}", "m", "finished", 1, 1))
"""


def test_concurrent_writers_from_processes(tmp_path):
    Ledger.open(tmp_path).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(p)]) for p in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    ledger = Ledger.open(tmp_path, create=False)
    assert ledger.count() == 100
    ledger.close()


def test_totals_since_and_group_by(tmp_path):
    ledger = Ledger.open(tmp_path)
    ledger.record_many([
        row("1", tenant="acme", model="m1", created_at=DAY1, energy_joules=10.0, energy_source="nvml",
            cost_device_usd=0.5, cost_energy_usd=0.1, cost_usd=0.6),
        row("2", tenant="acme", model="m2", created_at=DAY2, energy_joules=30.0, energy_source="modelled",
            cost_device_usd=0.25, cost_energy_usd=0.05, cost_usd=0.3),
        row("3", tenant="zeta", model="m1", created_at=DAY2, completion_tokens=7, cost_device_usd=1.0),
    ])
    [total] = ledger.totals()
    assert total.num_requests == 3 and total.completion_tokens == 17 and total.prompt_tokens == 30
    assert total.energy_joules == 40.0 and total.num_requests_with_energy == 2
    assert total.energy_sources == ("modelled", "nvml")  # mixed sources are shown, never hidden
    assert total.cost_device_usd == pytest.approx(1.75) and total.cost_usd == pytest.approx(0.9)
    by_day = ledger.totals(group_by="day")
    assert [(t.key, t.num_requests) for t in by_day] == [("2025-03-01", 1), ("2025-03-02", 2)]
    by_model = {t.key: t for t in ledger.totals(group_by="model")}
    assert by_model["m1"].energy_joules == 10.0 and by_model["m1"].num_requests == 2
    since = ledger.totals(since=dt.datetime(2025, 3, 2), group_by="tenant")
    assert [(t.key, t.num_requests, t.energy_joules) for t in since] == [("acme", 1, 30.0), ("zeta", 1, None)]
    # an aware `since` is converted to UTC: 2025-03-02 01:00 at +02:00 is 2025-03-01 23:00 UTC
    aware = dt.datetime(2025, 3, 2, 1, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    assert ledger.totals(since=aware)[0].num_requests == 2
    [empty] = ledger.totals(since=dt.datetime(2030, 1, 1))
    assert empty.num_requests == 0 and empty.energy_joules is None
    with pytest.raises(ValueError, match="group_by"):
        ledger.totals(group_by="week")
    ledger.close()


def test_row_validation_names_the_field():
    with pytest.raises(ValueError, match="status"):
        row("x", status="done")
    with pytest.raises(ValueError, match="prompt_tokens"):
        row("x", prompt_tokens=-1)
    with pytest.raises(ValueError, match="energy_source"):
        row("x", energy_joules=1.0)


def test_missing_ledger_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ledger at"):
        Ledger.open(tmp_path / "nothing", create=False)


def test_metadata_can_be_extended_by_later_tables(tmp_path):
    extra = sa.Table("test_tenants_extension", metadata, sa.Column("name", sa.String, primary_key=True))
    try:
        ledger = Ledger.open(tmp_path)
        with ledger.engine.begin() as conn:
            conn.execute(extra.insert(), [{"name": "acme"}])
        assert sa.inspect(ledger.engine).has_table("requests")
        ledger.close()
    finally:
        metadata.remove(extra)


def test_data_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert default_data_dir() == tmp_path / "xdg" / "tokenfactory"
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "env"))
    assert default_data_dir() == tmp_path / "env"
    assert ledger_path(tmp_path / "flag") == tmp_path / "flag" / "ledger.db"


def test_daily_sums_agree_with_the_rows_for_any_since(tmp_path):
    rng = random.Random(7)
    ledger = Ledger.open(tmp_path)
    start = dt.datetime(2025, 1, 1)
    rows = []
    for i in range(600):
        measured = rng.random() < 0.7
        joules = rng.uniform(0, 100) if measured else None
        rows.append(row(f"r{i}", tenant=rng.choice(["a", "b", "c"]), model=rng.choice(["m1", "m2"]),
                        prompt_tokens=rng.randint(0, 99), completion_tokens=rng.randint(0, 99),
                        energy_joules=joules, energy_source=rng.choice(["nvml", "rapl"]) if measured else None,
                        cost_device_usd=rng.uniform(0, 1), cost_energy_usd=joules and joules / 1e4,
                        cost_usd=joules and joules / 1e3,
                        created_at=start + dt.timedelta(hours=rng.uniform(0, 24 * 6))))
    ledger.record_many(rows[:300], batch_size=64)
    for r in rows[300:]:
        ledger.record(r)
    sinces = [None, dt.datetime(2025, 1, 3), dt.datetime(2025, 1, 3, 13, 17, 5), dt.datetime(2024, 12, 31, 23)]
    for since in sinces:
        for group_by in (None, "day", "tenant", "model"):
            fast, slow = ledger.totals(since, group_by), ledger.raw_totals(since, group_by)
            assert [t.key for t in fast] == [t.key for t in slow]
            for f, s in zip(fast, slow, strict=True):
                assert (f.num_requests, f.prompt_tokens, f.completion_tokens, f.num_requests_with_energy,
                        f.energy_sources) == (s.num_requests, s.prompt_tokens, s.completion_tokens,
                                              s.num_requests_with_energy, s.energy_sources)
                for name in ("energy_joules", "cost_device_usd", "cost_energy_usd", "cost_usd"):
                    assert getattr(f, name) == pytest.approx(getattr(s, name)), (since, group_by, name)
    before = ledger.totals(group_by="tenant")
    assert ledger.rebuild_rollup() == 600
    rebuilt = ledger.totals(group_by="tenant")
    assert [(t.key, t.num_requests, t.completion_tokens) for t in rebuilt] == \
        [(t.key, t.num_requests, t.completion_tokens) for t in before]
    ledger.close()


def test_row_for_a_metered_request(tmp_path):
    from tokenfactory.meter.attribution import Meter, MeterConfig
    from tokenfactory.meter.power import ConstantSource
    from tokenfactory.meter.prices import load_prices
    from tokenfactory.types import SequenceWork, StepStats

    class Shape:
        num_params, num_layers, num_heads, head_dim = 1000, 2, 2, 4

    clock = [0.0]
    meter = Meter(ConstantSource(100.0, "machine", lambda: clock[0]), Shape(), load_prices(),
                  MeterConfig(tick_interval_s=None), clock=lambda: clock[0])
    clock[0] = 0.5
    meter.on_step(StepStats(0, 0.0, 0.5, 4, 0, 1, 0, 0, 1, 0, (SequenceWork("q", 4, 0, True),)))
    energy = meter.finish_request("q", 1)
    ledger = Ledger.open(tmp_path)
    ledger.record(row_for(energy, model="m", status="finished", prompt_tokens=4, completion_tokens=1, ttft_s=0.5))
    [stored] = ledger.find("q")
    assert stored.energy_joules == pytest.approx(50.0) and stored.energy_source == "constant"
    assert stored.energy_scope == "machine" and stored.cost_usd == pytest.approx(energy.cost_usd)
    ledger.close()
