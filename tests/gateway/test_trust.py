"""Control routes a web page cannot borrow (issue #25): without --auth, a browser's cross-site request (Origin,
Sec-Fetch-Site) and a DNS-rebound Host are refused before any route runs, and a program's requests pass; with
--auth, /fleet/* needs the same admin key as /admin (and `tokenfactory fleet status --api-key` works). Real
gateway over a fleet of fake replicas, real HTTP."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import Gateway, start_gateway
from tokenfactory.fleet.fleet import Fleet, Replica
from tokenfactory.gateway.trust import TrustSettings, host_of

CROSS_SITE = {"Origin": "http://attacker.example", "Sec-Fetch-Site": "cross-site"}


def fleet_gateway(tmp_path: Path, auth: bool = False) -> Gateway:
    fleet = Fleet("fake-tiny", [Replica("p0", FakeEngineClient(step_s=0.002), "local"),
                                Replica("p1", FakeEngineClient(step_s=0.002), "local")], check_interval_s=0.05)
    return start_gateway(fleet, tmp_path / "data", auth=auth)


@pytest.fixture()
def gw(tmp_path: Path) -> Gateway:
    g = fleet_gateway(tmp_path)
    yield g
    g.stop()


def state_of(gw: Gateway, replica: str) -> str:
    return next(r["state"] for r in httpx.get(gw.url + "/fleet/replicas").json()["data"] if r["replica_id"] == replica)


def test_a_cross_site_page_cannot_drain_a_replica_or_upload_and_a_program_can(gw: Gateway) -> None:
    r = httpx.post(gw.url + "/fleet/replicas/p0/drain", headers=CROSS_SITE)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request"
    assert state_of(gw, "p0") == "ready"  # nothing ran
    r = httpx.post(gw.url + "/fleet/replicas/p0/drain", headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403  # Sec-Fetch-Site alone (a browser that sends no Origin on this request)
    r = httpx.post(gw.url + "/fleet/replicas/p0/drain", headers={"Origin": "null"})
    assert r.status_code == 403  # a sandboxed frame or a file:// page
    files = {"file": ("x.jsonl", io.BytesIO(b'{"custom_id": "a"}\n'), "application/jsonl")}
    r = httpx.post(gw.url + "/v1/files", headers=CROSS_SITE, data={"purpose": "batch"}, files=files)
    assert r.status_code == 403
    assert httpx.get(gw.url + "/v1/files").json()["data"] == []  # no file was kept
    r = httpx.post(gw.url + "/v1/completions", headers={"Origin": "https://evil.test"},
                   json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 403 and "Origin: https://evil.test" in r.json()["error"]["message"]
    # A program sends neither header; the dashboard's own page sends its own origin (same origin).
    assert httpx.post(gw.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    r = httpx.post(gw.url + "/fleet/replicas/p0/drain", headers={"Origin": gw.url, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200 and state_of(gw, "p0") == "draining"
    assert httpx.post(gw.url + "/fleet/replicas/p0/undrain").status_code == 200


def test_a_rebound_host_is_refused_everywhere_but_health_and_metrics(gw: Gateway) -> None:
    rebound = {"Host": "attacker.example"}  # a name the page made point at 127.0.0.1
    r = httpx.get(gw.url + "/dashboard/events", headers=rebound)
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert httpx.get(gw.url + "/v1/usage", headers=rebound).status_code == 403
    assert httpx.post(gw.url + "/fleet/replicas/p0/drain", headers=rebound).status_code == 403
    assert state_of(gw, "p0") == "ready"
    assert httpx.get(gw.url + "/health", headers=rebound).status_code == 200  # probes may use a service name
    assert httpx.get(gw.url + "/metrics", headers=rebound).status_code == 200
    for host in (f"127.0.0.1:{gw.port}", f"localhost:{gw.port}", "[::1]:8000", "10.1.2.3"):
        assert httpx.get(gw.url + "/v1/models", headers={"Host": host}).status_code == 200, host


def test_the_host_and_origin_rules() -> None:
    assert [host_of(h) for h in ("Example.org:80", "[::1]:8000", "::1", "127.0.0.1")] == [
        "example.org", "::1", "::1", "127.0.0.1"]
    default, named = TrustSettings(), TrustSettings(("tokenfactory.svc",))
    assert default.host_allowed("localhost") and default.host_allowed("app.localhost")
    assert default.host_allowed("192.168.1.9") and not default.host_allowed("attacker.example")
    assert named.host_allowed("tokenfactory.svc") and TrustSettings(("*",)).host_allowed("anything")
    assert default.origin_allowed("http://localhost:3000", "127.0.0.1")
    assert default.origin_allowed("http://gpu-box:8000", "gpu-box")  # same origin as the request's Host
    assert not default.origin_allowed("http://192.168.1.9", "127.0.0.1") and not default.origin_allowed("null", "")


def test_with_auth_fleet_routes_need_the_admin_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tokenfactory.cli import main

    gw = fleet_gateway(tmp_path, auth=True)
    try:
        admin, _ = gw.store.create_key(None, is_admin=True)
        from tokenfactory.tenants.store import Tenant

        gw.store.add_tenant(Tenant("acme"))
        tenant_key, _ = gw.store.create_key("acme")
        assert httpx.get(gw.url + "/fleet/replicas").status_code == 401
        r = httpx.post(gw.url + "/fleet/replicas/p0/drain", headers={"Authorization": f"Bearer {tenant_key}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
        ok = httpx.get(gw.url + "/fleet/replicas", headers={"Authorization": f"Bearer {admin}"})
        assert ok.status_code == 200 and [r["replica_id"] for r in ok.json()["data"]] == ["p0", "p1"]
        # With --auth there is no loopback trust to borrow: a browser never attaches the bearer key itself.
        assert httpx.get(gw.url + "/v1/models", headers={"Authorization": f"Bearer {admin}", **CROSS_SITE,
                                                         "Host": "attacker.example"}).status_code == 200
        assert main(["fleet", "status", "--url", gw.url, "--api-key", admin]) == 0
        assert "p0" in capsys.readouterr().out
    finally:
        gw.stop()
