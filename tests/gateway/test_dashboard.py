"""/dashboard without a browser: the points' arithmetic from snapshots, the event stream over the real
gateway (fake engine), who may watch, and the static files shipped in the package."""

import json
import math

import httpx
import openai
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import start_gateway
from tokenfactory.engine.client import EngineFacts, EngineStats
from tokenfactory.gateway.dashboard import STATIC_DIR, STATIC_FILES, is_loopback
from tokenfactory.gateway.dashboard_feed import Replica, Sample, make_point, quantile
from tokenfactory.meter.attribution import MeterTotals
from tokenfactory.meter.prices import load_prices
from tokenfactory.tenants.store import Budget, Tenant


def stats(**kw) -> EngineStats:
    base = dict(time=0.0, num_steps=0, num_running=0, num_waiting=0, num_kv_blocks=100, num_free_kv_blocks=100,
                num_prompt_tokens_total=0, num_generation_tokens_total=0, num_prefix_queries=0, num_prefix_hits=0,
                num_preemptions=0, num_failed_requests=0, last_step_s=None, last_step_tokens=0, max_num_seqs=8,
                max_num_batched_tokens=256)
    return EngineStats(**(base | kw))


def totals(joules: float, busy_s: float, idle_s: float, watts: float | None = None) -> MeterTotals:
    return MeterTotals(source="constant", scope="machine", energy_joules_by_source={"constant": joules},
                       energy_joules_by_component={}, attributed_joules=0.0, idle_joules=0.0,
                       unattributed_joules=0.0, unsettled_joules=0.0, current_watts=watts,
                       busy_device_seconds=busy_s, idle_device_seconds=idle_s, num_requests_finished=0,
                       num_output_tokens=0, joules_per_output_token=None, cost_device_usd=0.0, cost_energy_usd=0.0,
                       cost_usd=0.0, idle_cost_usd=0.0, energy_overhead_factor=1.0)


def test_a_point_is_rates_over_the_interval_by_hand():
    prices = load_prices(device="h100")
    facts = EngineFacts("m", "cpu", weight_bytes=270_000_000, kv_bytes=1_000_000_000)
    a = Sample(1000.0, 10.0, (Replica("local", stats(), facts),), totals(500.0, 1.0, 1.0),
               ((0.1, 0.0), (1.0, 0.0), (math.inf, 0.0)), ())
    b = Sample(1002.0, 12.0, (Replica("local", stats(
        num_prompt_tokens_total=300, num_generation_tokens_total=100, num_free_kv_blocks=75, num_waiting=3,
        num_prefix_queries=200, num_prefix_hits=50, num_preemptions=2), facts),),
        totals(900.0, 2.5, 1.5, watts=200.0), ((0.1, 4.0), (1.0, 10.0), (math.inf, 10.0)), ())
    p = make_point(a, b, prices)
    assert p["t"] == 1002.0 and p["tokens_in_s"] == 150.0 and p["tokens_out_s"] == 50.0
    assert p["watts"] == 200.0 and p["joules_per_token"] == 4.0 and p["energy_source"] == "constant"
    usd_per_s = prices.device.usd_per_hour / 3600 + prices.energy_cost_usd(200.0)  # one second of H100 at 200 W
    assert p["usd_per_mtok"] == pytest.approx(usd_per_s / 50.0 * 1e6)
    assert p["busy"] == pytest.approx(0.75) and p["idle"] == pytest.approx(0.25)
    assert p["kv_usage"] == 0.25 and p["kv_used_bytes"] == 0.25e9 and p["weight_bytes"] == 270e6
    assert p["waiting"] == 3 and p["preemptions"] == 2 and p["prefix_hit_rate"] == 0.25
    assert p["spec_acceptance"] is None and p["tpot_p50"] is None  # no drafts, no observations: null, not 0
    assert p["ttft_p50"] == pytest.approx(0.1 + 0.9 * (5 - 4) / 6)  # linear inside the (0.1, 1] bucket
    assert p["replicas"][0]["name"] == "local" and p["replicas"][0]["tokens_out_s"] == 50.0


def test_replicas_are_a_list_of_the_same_snapshot():
    two = (Replica("r0", stats(num_generation_tokens_total=10), None),
           Replica("r1", stats(num_free_kv_blocks=0), None))
    before = (Replica("r0", stats(), None), Replica("r1", stats(), None))
    p = make_point(Sample(0, 0, before, None, (), ()), Sample(1, 1, two, None, (), ()), None)
    assert [r["name"] for r in p["replicas"]] == ["r0", "r1"]
    assert p["tokens_out_s"] == 10.0 and p["kv_usage"] == 0.5 and "watts" not in p  # no meter, no power


def test_quantile_matches_prometheus_histogram_quantile():
    after = ((0.5, 50.0), (1.0, 90.0), (2.0, 100.0), (math.inf, 100.0))
    assert quantile(0.5, (), after) == 0.5
    assert quantile(0.99, (), after) == pytest.approx(1.0 + (99 - 90) / 10)
    assert quantile(0.5, after, after) is None
    assert quantile(0.99, (), ((1.0, 1.0), (math.inf, 10.0))) == 1.0  # in +Inf: the largest finite bound


def read_events(url: str, n: int, headers: dict | None = None, timeout: float = 15) -> list[dict]:
    events = []
    with httpx.stream("GET", url + "/dashboard/events", headers=headers or {}, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) >= n:
                    break
    return events


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = start_gateway(FakeEngineClient(step_s=0.002), tmp_path_factory.mktemp("dashboard"))
    yield g
    g.stop()


def test_the_stream_carries_live_points_from_requests(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with httpx.stream("GET", gw.url + "/dashboard/events", timeout=20) as r:
        lines = r.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert first["type"] == "history" and first["admin"] is False and first["interval_s"] == 1.0
        for i in range(4):
            client.completions.create(model="fake-tiny", prompt=f"count {i}", max_tokens=16)
        seen = []
        for line in lines:
            if line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == "point"  # no tenant section without --auth
                seen.append(event["point"])
                if sum(p["tokens_out_s"] for p in seen) > 0 and len(seen) >= 2:
                    break
    made = sum(p["tokens_out_s"] for p in seen)  # token/s over ~1 s intervals
    assert made > 0
    history_end = first["points"][-1]["t"] if first["points"] else 0.0
    assert all(p["t"] > history_end for p in seen)  # live points follow the history, none repeated
    assert any(p.get("watts") and p["energy_source"] == "constant" for p in seen)
    assert all(p["t"] < q["t"] for p, q in zip(seen, seen[1:], strict=False))
    assert gw.metric("tokenfactory:device_busy_seconds_total") > 0


def test_the_page_and_its_vendored_files_are_served_and_nothing_else(gw):
    page = httpx.get(gw.url + "/dashboard")
    assert page.status_code == 200 and "/dashboard/static/vendor/uPlot.iife.min.js" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # no CDN: everything from this server
    for name, media in STATIC_FILES.items():
        r = httpx.get(f"{gw.url}/dashboard/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media), name
        assert (STATIC_DIR / name).read_bytes() == r.content
    assert "uPlot" in httpx.get(gw.url + "/dashboard/static/vendor/uPlot.iife.min.js").text
    assert "MIT" in httpx.get(gw.url + "/dashboard/static/vendor/uPlot.LICENSE").text
    for bad in ("../app.py", "vendor/../../app.py", "dashboard.html", "%2e%2e/app.py"):
        assert httpx.get(f"{gw.url}/dashboard/static/{bad}").status_code == 404, bad


def test_without_auth_only_loopback_may_watch():
    """The app (no --auth) called as if from another machine: the page itself is static, its data refused."""
    import asyncio

    from tokenfactory.gateway.app import ServerSettings, build_app

    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("10.0.0.7")
    assert not is_loopback("example.org") and not is_loopback("testclient")
    app = build_app(FakeEngineClient(), ServerSettings(served_model_name="fake-tiny"))

    async def get(path: str, client: tuple[str, int]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://192.0.2.1:8000") as c:  # the server's IP
            return await c.get(path)

    try:
        remote = asyncio.run(get("/dashboard/events", ("10.0.0.7", 5555)))
        assert remote.status_code == 403 and remote.json()["error"]["code"] == "loopback_only"
        assert "--auth" in remote.json()["error"]["message"]
        assert asyncio.run(get("/dashboard", ("10.0.0.7", 5555))).status_code == 200
    finally:
        app.state.dashboard.close()


@pytest.fixture(scope="module")
def authed(tmp_path_factory):
    g = start_gateway(FakeEngineClient(step_s=0.002), tmp_path_factory.mktemp("dashboard-auth"), auth=True)
    g.store.add_tenant(Tenant("acme", budget=Budget.parse("1USD/month")))
    keys = {"acme": g.store.create_key("acme")[0], "admin": g.store.create_key(None, is_admin=True)[0]}
    yield g, keys
    g.stop()


def test_an_admin_sees_tenants_and_a_tenant_key_is_refused(authed):
    gw, keys = authed
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=keys["acme"], max_retries=0, timeout=30)
    client.completions.create(model="fake-tiny", prompt="for the bill", max_tokens=8)
    no_key = httpx.get(gw.url + "/dashboard/events")
    assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    tenant = httpx.get(gw.url + "/dashboard/events", headers={"Authorization": f"Bearer {keys['acme']}"})
    assert tenant.status_code == 403 and "admin API key" in tenant.json()["error"]["message"]
    events = read_events(gw.url, 2, {"Authorization": f"Bearer {keys['admin']}"})
    history, tenants = events
    assert history["type"] == "history" and history["admin"] is True
    assert tenants["type"] == "tenants"
    [acme] = [t for t in tenants["tenants"] if t["name"] == "acme"]
    assert acme["requests"] == 1 and acme["tokens"] > 0 and acme["usd"] > 0 and acme["joules"] > 0
    assert acme["budget_unit"] == "usd" and acme["budget_left"] == pytest.approx(1.0 - acme["usd"])
    [last] = tenants["recent"][:1]
    assert last["tenant"] == "acme" and last["status"] == "finished" and last["completion_tokens"] > 0


def test_a_fleet_is_viewed_per_replica_from_its_replica_states():
    """Every client offers replica_states() (engine/client.py): a fleet one per replica with each one's facts,
    a single engine one ("local"); the dashboard reads those, one view per replica, never the fleet's sum."""
    from tokenfactory.fleet.fleet import Fleet
    from tokenfactory.fleet.fleet import Replica as FleetReplica
    from tokenfactory.gateway.dashboard_feed import replicas_of

    fleet = Fleet("fake-tiny", [FleetReplica("r0", FakeEngineClient(num_kv_blocks=64), "local"),
                                FleetReplica("r1", FakeEngineClient(num_kv_blocks=32), "local")])
    r0, r1 = replicas_of(fleet)
    assert (r0.name, r0.facts.kv_blocks, r1.name, r1.facts.kv_blocks) == ("r0", 64, "r1", 32)
    assert fleet.facts.kv_blocks == 96 and fleet.facts.router == "least-work"
    [local] = replicas_of(FakeEngineClient(num_kv_blocks=16))
    assert local.name == "local" and local.facts.kv_tokens == 16 * 16


def test_busy_share_is_taken_over_the_window_and_capped():
    """A 4 s step that ends inside a 1 s interval counts all its time there: the share over a 10 s
    window is 0.4, and over that one second it is capped at 1."""
    local = (Replica("local", stats(), None),)
    start = Sample(0.0, 0.0, local, totals(0.0, 0.0, 0.0), (), ())
    prev = Sample(9.0, 9.0, local, totals(0.0, 0.0, 9.0), (), ())
    cur = Sample(10.0, 10.0, local, totals(0.0, 4.0, 6.0), (), ())
    p = make_point(start, cur, load_prices())
    assert p["busy"] == pytest.approx(0.4) and p["idle"] == pytest.approx(0.6)
    assert make_point(prev, cur, load_prices())["busy"] == 1.0


@pytest.mark.slow
def test_the_real_server_dashboard_utilisation_and_statement(tmp_path):
    """`tokenfactory serve` on the bundled model: live points with the engine's memory facts, the device
    series in /metrics, and after a clean stop the hourly rollup and the statement from the same ledger."""
    import datetime as dt
    import signal
    import subprocess
    import sys

    from tests.server_util import start_server

    server = start_server(tmp_path, "--power-source", "constant", "--power-watts", "40")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with httpx.stream("GET", server.url + "/dashboard/events", timeout=60) as r:
            lines = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: "))
            assert next(lines)["type"] == "history"
            for _ in range(2):
                client.completions.create(model=client.models.list().data[0].id, prompt="Tokens are made by",
                                          max_tokens=16)
            point = next(e["point"] for e in lines if e["point"]["tokens_out_s"] > 0)
        assert point["weight_bytes"] > 50e6 and point["kv_free_bytes"] > 0  # AsyncEngine's EngineFacts
        assert point["watts"] == pytest.approx(40.0) and point["energy_source"] == "constant"
        assert server.metric("tokenfactory:device_tokens_total") > 0
        assert server.metric("tokenfactory:device_busy_seconds_total") > 0
    finally:
        assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it finished on
    usage = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "usage", "--utilisation", "--data-dir",
                            str(server.data_dir)], capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and usage.stdout.startswith("cpu: ") and "(constant)" in usage.stdout, usage
    month = dt.datetime.now(dt.UTC).strftime("%Y-%m")
    invoice = subprocess.run([sys.executable, "-m", "tokenfactory.cli", "usage", "--invoice", "--tenant", "anonymous",
                              "--month", month, "--out", str(tmp_path), "--format", "json", "--data-dir",
                              str(server.data_dir)], capture_output=True, text=True, timeout=120)
    summary = json.loads(invoice.stdout)
    assert summary["requests"] == 2 and summary["completion_tokens"] == 32 and summary["energy_joules"] > 0


def test_the_fleet_gateway_shows_one_view_per_replica(tmp_path):
    """The gateway over the fleet's client (fleet/fleet.py) with two replicas: each point lists both, with
    their own counts, and the totals are their sums."""
    from tokenfactory.fleet.fleet import Fleet
    from tokenfactory.fleet.fleet import Replica as FleetReplica

    fleet = Fleet("fake-tiny", [FleetReplica("r0", FakeEngineClient(step_s=0.002), "local"),
                                FleetReplica("r1", FakeEngineClient(step_s=0.002), "local")])
    gw = start_gateway(fleet, tmp_path)
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        for i in range(6):
            client.completions.create(model="fake-tiny", prompt=f"spread {i}", max_tokens=12)
        points = []
        with httpx.stream("GET", gw.url + "/dashboard/events", timeout=20) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    points += event["points"] if event["type"] == "history" else [event["point"]]
                    if any(p["tokens_out_s"] > 0 for p in points) and len(points) >= 3:
                        break
    finally:
        gw.stop()
    busy = next(p for p in points if p["tokens_out_s"] > 0)
    assert [r["name"] for r in busy["replicas"]] == ["r0", "r1"]
    assert busy["tokens_out_s"] == pytest.approx(sum(r["tokens_out_s"] for r in busy["replicas"]))
    assert sum(r["tokens_out_s"] > 0 for r in busy["replicas"]) >= 1


def test_the_page_and_the_chart_library_ship_in_the_wheel():
    """pyproject's package-data names every file the dashboard serves (users have no CDN and no build step)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["tokenfactory"]
    for name in ("dashboard.html", *STATIC_FILES):
        relative = f"gateway/static/{name}"
        assert (STATIC_DIR / name).is_file() and any(fnmatch.fnmatch(relative, p) for p in patterns), relative


def test_admin_pages_share_one_ledger_read_per_interval():
    import asyncio
    from types import SimpleNamespace

    from tokenfactory.gateway.dashboard import Dashboard
    from tokenfactory.gateway.metrics import ServerMetrics

    now = [100.0]
    engine = FakeEngineClient()
    dashboard = Dashboard(engine, ServerMetrics(engine, "m"), None, SimpleNamespace(), SimpleNamespace(),
                          tenants_interval_s=5.0,
                          rollup_interval_s=None, clock=lambda: now[0])
    calls = []
    dashboard.tenant_view = lambda: calls.append(now[0]) or {"tenants": [], "recent": [], "n": len(calls)}

    async def three_pages() -> list[dict]:
        return list(await asyncio.gather(*(dashboard.shared_tenant_view() for _ in range(3))))

    try:
        assert [v["n"] for v in asyncio.run(three_pages())] == [1, 1, 1]
        now[0] += 2.0
        assert asyncio.run(dashboard.shared_tenant_view())["n"] == 1  # still fresh
        now[0] += 3.0
        assert asyncio.run(dashboard.shared_tenant_view())["n"] == 2 and calls == [100.0, 105.0]
    finally:
        dashboard.close()
