"""Authentication, admin routes, scoped usage, rate limits and budgets through a real `tokenfactory serve
--auth` on loopback (subprocess, the bundled model, real SQLite in a temporary --data-dir)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.bench.test_bench_serve import free_port, wait_healthy
from tests.server_util import stop_process
from tokenfactory.cli import main as cli_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """A server with --auth, and keys: admin, alice (rpm 3), bob (budget), expired, revoked."""
    data = tmp_path_factory.mktemp("tf-auth")
    d = ["--data-dir", str(data)]
    assert cli_main(["tenants", "add", "alice", "--priority", "interactive", "--rpm", "1000", *d]) == 0
    assert cli_main(["tenants", "add", "bob", "--priority", "batch", "--weight", "2", *d]) == 0
    assert cli_main(["tenants", "add", "limited", "--rpm", "2", "--max-concurrency", "1", "--tpm", "400", *d]) == 0
    assert cli_main(["tenants", "add", "thrifty", "--budget", "300tok/day", *d]) == 0
    from tokenfactory.tenants.cli import parse_expires
    from tokenfactory.tenants.store import TenantStore

    store, ledger = TenantStore.open(str(data))
    keys = {name: store.create_key(name)[0] for name in ("alice", "bob", "limited", "thrifty")}
    keys["admin"] = store.create_key(None, is_admin=True)[0]
    keys["expired"] = store.create_key("alice", expires_at=parse_expires("2020-01-01"))[0]
    revoked, info = store.create_key("alice")
    store.revoke_key(info.key_id)
    keys["revoked"] = revoked
    ledger.close()
    port = free_port()
    log = data / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tokenfactory.cli", "serve", "--auth", "--port", str(port),
                                    "--data-dir", str(data), "--scheduling-policy", "vtc-joules",
                                    "--max-model-len", "512", "--kv-cache-memory", "32MiB", "--max-num-seqs", "8",
                                    "--power-source", "constant",
                                    "--power-watts", "100", "--log-level", "warning"],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, log)
        yield url, data, keys
    finally:
        stop_process(process)
        banner = log.read_text()
        assert "auth    on: API keys required" in banner and "scheduling vtc-joules" in banner
        for secret in keys.values():  # never logged
            assert secret.split("_", 2)[2] not in banner


def complete(url: str, key: str | None, max_tokens: int = 4, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=120, trust_env=False,
                      json={"prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, **extra})


def error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_no_key_wrong_key_revoked_expired_are_401_with_words_about_api_keys(server) -> None:
    url, _, keys = server
    r = complete(url, None)
    assert r.status_code == 401 and error(r)["code"] == "missing_api_key"
    assert error(r)["message"].startswith("missing API key") and "not a model token" in error(r)["message"]
    assert r.headers["WWW-Authenticate"] == "Bearer"
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Basic dXNlcjpwdw=="}, trust_env=False)
    assert r.status_code == 401 and error(r)["code"] == "missing_api_key"
    r = complete(url, keys["alice"][:-2] + "zz")
    assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"
    assert error(r)["message"].startswith("invalid API key")
    assert keys["alice"][-8:] not in r.text  # the presented key is never echoed
    r = complete(url, "sk-some-openai-key")
    assert r.status_code == 401 and error(r)["code"] == "invalid_api_key"
    r = complete(url, keys["revoked"])
    assert r.status_code == 401 and error(r)["code"] == "invalid_api_key" and "revoked" in error(r)["message"]
    r = complete(url, keys["expired"])
    assert r.status_code == 401 and error(r)["code"] == "expired_api_key"
    assert error(r)["message"].startswith("expired API key") and "2020-01-01 00:00:00 UTC" in error(r)["message"]
    assert httpx.get(f"{url}/health", trust_env=False).status_code == 200  # probes need no key
    assert complete(url, keys["alice"]).status_code == 200


def test_admin_routes_refuse_user_keys_and_manage_tenants_for_admins(server) -> None:
    url, _, keys = server
    for method, path in (("GET", "/admin/tenants"), ("POST", "/admin/keys"), ("DELETE", "/admin/keys/x")):
        r = httpx.request(method, f"{url}{path}", headers={"Authorization": f"Bearer {keys['alice']}"},
                          json={}, trust_env=False)
        assert r.status_code == 403 and error(r)["code"] == "admin_only", (method, path)
    assert httpx.get(f"{url}/admin/tenants", trust_env=False).status_code == 401
    admin = {"Authorization": f"Bearer {keys['admin']}"}
    listed = httpx.get(f"{url}/admin/tenants", headers=admin, trust_env=False).json()["data"]
    assert {t["name"] for t in listed} >= {"alice", "bob", "limited", "thrifty"}
    r = httpx.post(f"{url}/admin/tenants", headers=admin, trust_env=False,
                   json={"name": "carol", "priority": "standard", "weight": 3, "budget": "1USD/month"})
    assert r.status_code == 201 and r.json()["budget"] == "1.00 USD/month"
    r = httpx.post(f"{url}/admin/tenants", headers=admin, trust_env=False, json={"name": "dave", "priority": "vip"})
    assert r.status_code == 400 and error(r)["param"] == "priority"
    r = httpx.patch(f"{url}/admin/tenants/carol", headers=admin, trust_env=False, json={"budget": None, "rpm": 10})
    assert r.status_code == 200 and (r.json()["budget"], r.json()["rpm"]) == (None, 10)
    r = httpx.post(f"{url}/admin/keys", headers=admin, trust_env=False, json={"tenant": "carol", "expires": "1d"})
    assert r.status_code == 201
    carol_key, carol_id = r.json()["key"], r.json()["key_id"]
    assert complete(url, carol_key).status_code == 200
    listed = httpx.get(f"{url}/admin/keys", headers=admin, params={"tenant": "carol"}, trust_env=False).json()
    assert [k["key_id"] for k in listed["data"]] == [carol_id] and carol_key not in str(listed)
    assert httpx.delete(f"{url}/admin/keys/{carol_id}", headers=admin, trust_env=False).json()["state"] == "revoked"
    assert complete(url, carol_key).status_code == 401  # revocation applies at once


def usage(url: str, key: str, **params) -> httpx.Response:
    return httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, params=params, trust_env=False)


def test_a_tenant_sees_only_its_own_usage_and_the_admin_sees_all(server) -> None:
    url, _, keys = server
    assert complete(url, keys["bob"], max_tokens=3).status_code == 200
    assert complete(url, keys["alice"], max_tokens=3).status_code == 200
    r = usage(url, keys["alice"], tenant="bob")
    assert r.status_code == 403 and error(r)["code"] == "usage_of_another_tenant" and "bob" in error(r)["message"]
    r = usage(url, keys["alice"], group_by="tenant")
    assert r.status_code == 200 and r.json()["tenant"] == "alice"
    assert [row["key"] for row in r.json()["data"]] == ["alice"]
    bob = usage(url, keys["bob"]).json()["data"][0]
    assert bob["num_requests"] >= 1 and bob["completion_tokens"] >= 3
    everyone = {row["key"]: row for row in usage(url, keys["admin"], group_by="tenant").json()["data"]}
    assert {"alice", "bob"} <= set(everyone) and everyone["bob"]["num_requests"] == bob["num_requests"]
    assert usage(url, keys["admin"], tenant="bob").json()["data"][0]["num_requests"] == bob["num_requests"]


def test_rate_limits_are_429_with_retry_after_naming_the_limit(server) -> None:
    url, _, keys = server
    r = complete(url, keys["limited"], max_tokens=500)  # 6 + 500 model tokens can never fit 400/min
    assert r.status_code == 400 and error(r)["param"] == "max_tokens" and "tokens per minute" in error(r)["message"]

    async def two_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
            body = {"prompt": "Count: one two", "max_tokens": 24, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {keys['limited']}"}
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body, headers=headers)
                                          for _ in range(2)))
    statuses = sorted(r.status_code for r in asyncio.run(two_at_once()))
    assert statuses == [200, 429]
    assert complete(url, keys["limited"]).status_code == 200  # the second request this minute (a refused one
    r = complete(url, keys["limited"])  # took no slot); the third is over the limit of 2/min
    assert r.status_code == 429 and error(r)["code"] == "requests_per_minute_exceeded"
    assert "requests/min" in error(r)["message"] and int(r.headers["Retry-After"]) >= 1


def test_budget_hammered_concurrently_is_never_exceeded_by_token_requests(server) -> None:
    url, _, keys = server
    body = {"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {keys['thrifty']}"}

    async def wave(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json=body, headers=headers)
                                          for _ in range(n)))
    responses = [r for _ in range(3) for r in asyncio.run(wave(10))]
    ok = [r for r in responses if r.status_code == 200]
    exhausted = [r for r in responses if r.status_code == 402]
    assert ok and exhausted and len(ok) + len(exhausted) + sum(r.status_code == 429 for r in responses) == 30
    one = ok[0].json()["usage"]["total_tokens"]  # every request here uses the same number of model tokens
    spent = usage(url, keys["thrifty"]).json()["data"][0]
    total = spent["prompt_tokens"] + spent["completion_tokens"]
    print(f"\nbudget 300 tok/day hammered with 3 waves of 10: {len(ok)} served ({one} tokens each), "
          f"{len(exhausted)} refused 402; ledger total {total} model tokens")
    assert 300 - one < total <= 300  # a worst case that does not fit what is left is refused: never over
    e = error(exhausted[-1])
    assert e["code"] == "budget_exhausted" and "300 tok/day" in e["message"] and "resets at" in e["message"]
