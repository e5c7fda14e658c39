"""The admin API's tenants, over the real gateway (HTTP, auth, the tenant store on SQLite) and a fake engine:
the same settings, names and rules as `tokenfactory tenants` (one schema, tenants/store.py TENANT_SETTINGS)."""

from __future__ import annotations

import argparse

import httpx
import pytest

from tests.fake_engine import FakeEngineClient
from tests.server_util import start_gateway
from tokenfactory.gateway.admin import TenantBody, TenantPatch
from tokenfactory.tenants.cli import register
from tokenfactory.tenants.store import TENANT_SETTINGS, Tenant


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    g = start_gateway(FakeEngineClient(step_s=0.001), tmp_path_factory.mktemp("admin"), auth=True)
    yield g
    g.stop()


def test_the_admin_api_and_the_cli_take_the_same_settings() -> None:
    editable = {f for f in Tenant.__dataclass_fields__} - {"name", "created_at"}
    assert set(TENANT_SETTINGS) == editable
    assert set(TenantPatch.model_fields) == editable and set(TenantBody.model_fields) == editable | {"name"}
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["tenants", "update", "acme", "--priority", "batch", "--weight", "2", "--rpm", "1",
                              "--tpm", "9", "--max-concurrency", "3", "--budget", "1USD/day",
                              "--context-compression", "off"])
    assert all(getattr(args, name) is not None for name in editable)  # a flag for every setting


def test_context_compression_set_changed_and_removed_through_the_admin_api(gw) -> None:
    admin = {"Authorization": f"Bearer {gw.store.create_key(None, is_admin=True)[0]}"}
    made = httpx.post(gw.url + "/admin/tenants", headers=admin, timeout=10, json={
        "name": "acme", "budget": "10Mtok/day", "context_compression": "summarize"})
    assert made.status_code == 201, made.text
    assert made.json()["context_compression"] == '{"mode": "summarize"}' and made.json()["budget"] == "10 Mtok/day"
    assert gw.store.get_tenant("acme").context_compression == '{"mode": "summarize"}'
    patched = httpx.patch(gw.url + "/admin/tenants/acme", headers=admin, timeout=10,
                          json={"context_compression": {"summary_tokens": 64}, "rpm": 5})
    assert patched.status_code == 200 and gw.store.get_tenant("acme").context_compression == '{"summary_tokens": 64}'
    cleared = httpx.patch(gw.url + "/admin/tenants/acme", headers=admin, timeout=10,
                          json={"context_compression": None, "budget": None, "rpm": None})
    t = gw.store.get_tenant("acme")
    assert cleared.status_code == 200 and (t.context_compression, t.budget, t.rpm) == (None, None, None)
    # The same rules as the CLI's, errors naming the setting.
    for body, param in (({"context_compression": '{"mode": "shrink"}'}, "context_compression"),
                        ({"weight": None}, "weight"), ({"budget": "lots"}, "budget"), ({"colour": "red"}, "colour")):
        r = httpx.patch(gw.url + "/admin/tenants/acme", headers=admin, timeout=10, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
