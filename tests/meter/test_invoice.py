"""`tokenfactory usage --invoice`: a tenant's month from the ledger, equal to its rows and to the meter's
totals to the joule and the cent; device time priced at the profile the server ran with."""

import csv
import dataclasses
import datetime as dt
import io

import openai
import pytest

from tests.fake_engine import FakeEngineClient
from tests.meter.test_invoice_utilisation import run_step
from tests.meter.test_meter_attribution import MODEL, FakeClock
from tests.server_util import start_gateway
from tokenfactory.cli import main
from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.invoice import make_invoice, month_range
from tokenfactory.meter.ledger import Ledger, LedgerRow, row_for, utc_now
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Requests through the real gateway (fake engine, 100 W constant source, SQLite ledger), then stopped
    after reading the meter's totals from /metrics; plus rows of another tenant and of last month."""
    data_dir = tmp_path_factory.mktemp("invoice")
    gw = start_gateway(FakeEngineClient(step_s=0.002), data_dir)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        for i in range(6):
            client.completions.create(model="fake-tiny", prompt=f"bill me {i}", max_tokens=8 + i)
        stream = client.chat.completions.create(model="fake-tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=12, stream=True)
        assert sum(1 for _ in stream) > 1
        meter = {name: gw.metric("tokenfactory:" + name) for name in (
            "attributed_energy_joules_total", "device_busy_seconds_total")}
        meter["cost_device"] = _sample(gw.url, 'tokenfactory:cost_usd_total{component="device"}')
        meter["cost_energy"] = _sample(gw.url, 'tokenfactory:cost_usd_total{component="energy"}')
    finally:
        gw.stop()
    ledger = Ledger.open(data_dir)
    now = utc_now()
    last_month = month_range(now.strftime("%Y-%m"))[0] - dt.timedelta(days=1)
    ledger.record_many([
        LedgerRow("other-1", "fake-tiny", "finished", 10, 5, tenant="zeta", energy_joules=3.0,
                  energy_source="constant", energy_scope="machine", device_seconds=1.0, cost_device_usd=1.0,
                  cost_energy_usd=0.5, cost_usd=1.5),
        LedgerRow("old-1", "fake-tiny", "finished", 10, 5, energy_joules=3.0, energy_source="constant",
                  energy_scope="machine", device_seconds=1.0, cost_device_usd=1.0, cost_energy_usd=0.5,
                  cost_usd=1.5, created_at=last_month)])
    yield data_dir, ledger, meter, now.strftime("%Y-%m")
    ledger.close()


def _sample(url: str, line_prefix: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(line_prefix + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_prefix} not in /metrics")


def _rows(ledger: Ledger, tenant: str, month: str) -> list[dict]:
    import sqlalchemy as sa

    from tokenfactory.meter.schema import requests_table as t

    start, end = month_range(month)
    with ledger.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(sa.select(t).where(
            (t.c.tenant == tenant) & (t.c.created_at >= start) & (t.c.created_at < end)))]


def test_invoice_equals_the_ledger_rows_and_the_meter(served):
    data_dir, ledger, meter, month = served
    rows = _rows(ledger, "anonymous", month)
    assert len(rows) == 7 and all(r["energy_source"] == "constant" for r in rows)
    inv = make_invoice(ledger.engine, "anonymous", month)
    assert inv.num_requests == 7 and inv.status_to_requests == {"finished": 7}
    assert inv.prompt_tokens == sum(r["prompt_tokens"] for r in rows) > 0
    assert inv.completion_tokens == sum(r["completion_tokens"] for r in rows) > 0
    [energy] = inv.energy
    joules = sum(r["energy_joules"] for r in rows)
    assert energy.source == "constant" and energy.joules == pytest.approx(joules, abs=1e-9) and joules > 0
    assert energy.facility_joules == pytest.approx(joules * load_prices().energy_overhead_factor)  # at the wall
    # the meter's own totals, read from /metrics before the server stopped: to the joule and the cent
    assert abs(energy.joules - meter["attributed_energy_joules_total"]) < 1e-6
    assert abs(inv.device_seconds - meter["device_busy_seconds_total"]) < 1e-9
    assert round(inv.cost_device_usd, 2) == round(meter["cost_device"], 2)
    assert abs(inv.cost_device_usd - meter["cost_device"]) < 1e-12
    assert abs(inv.cost_energy_usd - meter["cost_energy"]) < 1e-12
    assert inv.cost_device_usd == pytest.approx(sum(r["cost_device_usd"] for r in rows), abs=1e-15)
    assert inv.total_usd == pytest.approx(sum(r["cost_usd"] for r in rows), abs=1e-15)  # no markup by default
    cpu = load_prices().device.usd_per_hour  # start_gateway runs on the CPU profile
    assert inv.cost_device_usd == pytest.approx(inv.device_hours * cpu)


def test_the_cli_writes_csv_and_html_with_a_markup(served, tmp_path, capsys):
    data_dir, ledger, _, month = served
    prices = tmp_path / "prices.toml"
    prices.write_text('[billing]\nmarkup_fraction = 0.25\nas_of = 2026-11-01\nsource = "our rate card v3"\n')
    out = tmp_path / "out"
    assert main(["usage", "--data-dir", str(data_dir), "--invoice", "--tenant", "anonymous", "--month", month,
                 "--out", str(out), "--prices", str(prices)]) == 0
    assert "7 requests" in capsys.readouterr().out
    inv = make_invoice(ledger.engine, "anonymous", month, prices)
    lines = list(csv.reader(io.StringIO((out / f"invoice-anonymous-{month}.csv").read_text())))
    item_to_quantity = {(r[2], r[3]): r[4] for r in lines[1:]}
    assert item_to_quantity[("requests", "finished")] == "7"
    assert float(item_to_quantity[("usd", "markup (25.00%)")]) == pytest.approx(inv.subtotal_usd * 0.25, abs=1e-6)
    assert item_to_quantity[("usd", "total")] == f"{inv.subtotal_usd * 1.25:.2f}"
    assert "our rate card v3" in item_to_quantity[("sources", "prices")]
    html = (out / f"invoice-anonymous-{month}.html").read_text()
    assert "Statement for anonymous" in html and f"{inv.total_usd:.2f}" in html and "our rate card v3" in html
    # another tenant and another month are not on this statement
    zeta = make_invoice(ledger.engine, "zeta", month)
    assert zeta.num_requests == 1 and zeta.cost_device_usd == 1.0 and zeta.total_usd == 1.5


def test_a_device_profile_change_prices_device_time(tmp_path):
    """The same work metered at the H100 profile and at the CPU's: the statement's device dollars are the
    device-hours at each profile's rate."""
    ledger = Ledger.open(tmp_path)
    try:
        for tenant, profile in (("on-h100", "h100"), ("on-cpu", "cpu")):
            clock = FakeClock()
            prices = load_prices(device=profile)
            meter = Meter(ConstantSource(300.0, "gpu", clock=clock), MODEL, prices,
                          MeterConfig(tick_interval_s=None), clock=clock)
            run_step(clock, meter, 1800.0, prefill=10, decode=0)  # half an hour of device time
            energy = meter.finish_request("r1", 1)
            row = row_for(energy, model="m", status="finished", prompt_tokens=10, completion_tokens=1, tenant=tenant)
            ledger.record(dataclasses.replace(row, request_id=tenant))
        month = utc_now().strftime("%Y-%m")
        h100, cpu = make_invoice(ledger.engine, "on-h100", month), make_invoice(ledger.engine, "on-cpu", month)
        assert h100.device_hours == cpu.device_hours == pytest.approx(0.5)
        assert h100.cost_device_usd == pytest.approx(0.5 * load_prices(device="h100").device.usd_per_hour)
        assert cpu.cost_device_usd == pytest.approx(0.5 * load_prices().device.usd_per_hour)
        assert h100.energy[0].joules == pytest.approx(300.0 * 1800.0)  # 150 Wh either way
        wall = load_prices()  # 0.15 kWh drawn, at the wall through the power supply (and the PUE)
        assert h100.cost_energy_usd == pytest.approx(cpu.cost_energy_usd) == pytest.approx(
            0.15 * wall.energy_overhead_factor * wall.usd_per_kwh)
    finally:
        ledger.close()


def test_invoice_flags_are_checked(tmp_path, capsys):
    Ledger.open(tmp_path).close()
    assert main(["usage", "--data-dir", str(tmp_path), "--invoice", "--month", "2026-11"]) == 2
    assert "--tenant" in capsys.readouterr().err
    assert main(["usage", "--data-dir", str(tmp_path), "--invoice", "--tenant", "a", "--month", "Nov"]) == 2
    assert "--month" in capsys.readouterr().err


def test_tenants_with_dotted_names_get_their_own_private_files_named_by_month(tmp_path):
    """Issue #25: `acme.eu` and `acme.us` both wrote invoice-...acme.csv (the name cut at its dot, no month)
    with mode 0644 beside a 0600 ledger."""
    ledger = Ledger.open(tmp_path / "data")
    month = utc_now().strftime("%Y-%m")
    ledger.record_many([LedgerRow(f"r-{t}", "m", "finished", 10, 5 * (i + 1), tenant=t)
                        for i, t in enumerate(("acme.eu", "acme.us"))])
    out = tmp_path / "out"
    for tenant in ("acme.eu", "acme.us"):
        assert main(["usage", "--data-dir", str(tmp_path / "data"), "--invoice", "--tenant", tenant,
                     "--month", month, "--out", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"invoice-acme.{r}-{month}.{ext}" for r in ("eu", "us") for ext in ("csv", "html")]
    assert {oct(p.stat().st_mode)[-3:] for p in out.iterdir()} == {"600"}
    eu = list(csv.reader(io.StringIO((out / f"invoice-acme.eu-{month}.csv").read_text())))
    assert ["acme.eu", month, "tokens", "completion (out)", "5", "tokens"] in eu
    from tokenfactory.meter.invoice import invoice_stem

    assert "/" not in invoice_stem("../../etc/x", month)
    ledger.close()
