"""Admission end to end, through a real `tokenfactory serve --auth --max-waiting 4` on loopback (issue #13).

The issue's reproduction: a tenant with --rpm 1 sends 7 requests and got 200, 429 x4, then 503 x2 (its
refused requests leaked queue slots), after which every tenant got 503. Now: 200, then 429s, never
503, and another tenant is served. Then the fair gate (one tenant's backlog fills only its share of
the queue), a joule budget hammered concurrently (overspend at most one request's worth), and after
all of it the admission gauges in /metrics are back to zero.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_util import Server, start_server
from tokenfactory.cli import main as cli_main
from tokenfactory.tenants.store import TenantStore

pytestmark = pytest.mark.slow

TENANTS = {"limited": ["--rpm", "1"], "other": [], "batch": [], "green": ["--budget", "300J/day"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, str]]]:
    tmp = tmp_path_factory.mktemp("admission")
    data = ["--data-dir", str(tmp / "data")]
    for name, options in TENANTS.items():
        assert cli_main(["tenants", "add", name, *options, *data]) == 0
    store, ledger = TenantStore.open(str(tmp / "data"))
    keys = {name: store.create_key(name)[0] for name in TENANTS}
    ledger.close()
    s = start_server(tmp, "--auth", "--max-waiting", "4", "--max-num-seqs", "1", "--power-source", "constant",
                     "--power-watts", "100")
    yield s, keys
    s.stop()
    assert "Traceback" not in s.log(), s.log()


def post(url: str, key: str, max_tokens: int = 4, **extra: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=300,
                      trust_env=False, json={"prompt": "The capital of France is", "max_tokens": max_tokens,
                                             "temperature": 0, "ignore_eos": True, **extra})


def idle(s: Server) -> bool:
    return all(s.metric(f"tokenfactory:{m}") == 0 for m in ("admission_queued", "admission_in_flight",
                                                            "admission_reserved_budget"))


def test_the_issue_rpm_1_tenant_sends_7_requests_200_then_429s_never_503_and_others_are_served(server) -> None:
    s, keys = server
    statuses = [post(s.url, keys["limited"]).status_code for _ in range(7)]
    assert statuses == [200] + [429] * 6
    r = post(s.url, keys["other"])  # it used to be refused: "4 requests are already waiting" while none was
    assert r.status_code == 200, r.text
    assert idle(s)


async def generating(client: httpx.AsyncClient, url: str, key: str) -> tuple[httpx.Response, AsyncIterator[str]]:
    """Open a long stream and return once it generates (its prompt left the queue). Keep the line iterator:
    dropping it would close the stream."""
    request = client.build_request("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                   json={"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
                                         "stream": True})
    response = await client.send(request, stream=True)
    assert response.status_code == 200
    lines = response.aiter_lines()
    while '"text": ""' in (line := await lines.__anext__()) or not line.strip():
        pass  # the role chunk, blank separators: not yet a generated token
    return response, lines


def test_one_tenants_backlog_fills_only_its_share_of_the_queue(server) -> None:
    s, keys = server

    async def scenario() -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            running, _lines = await generating(client, s.url, keys["batch"])  # the one sequence slot is taken
            headers = {"Authorization": f"Bearer {keys['batch']}"}
            body = {"prompt": "Hello", "max_tokens": 2, "ignore_eos": True}
            waiting = [asyncio.ensure_future(client.post(f"{s.url}/v1/completions", json=body, headers=headers))
                       for _ in range(2)]
            for _ in range(200):
                if s.metric("tokenfactory:admission_queued") == 2:
                    break
                await asyncio.sleep(0.05)
            assert s.metric("tokenfactory:admission_queued") == 2  # batch holds its share: 2 of 4
            r = await client.post(f"{s.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded" and "Retry-After" in r.headers
            assert "tenant batch already has 2 prompts waiting" in r.json()["error"]["message"]
            r = await client.post(f"{s.url}/v1/completions", headers=headers,
                                  json={**body, "prompt": ["a", "b", "c"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # 3 prompts never fit a share of 2
            other = asyncio.ensure_future(client.post(f"{s.url}/v1/completions", json=body,
                                                      headers={"Authorization": f"Bearer {keys['other']}"}))
            for _ in range(200):  # the other tenant's first request is admitted (it waits its turn)
                if s.metric("tokenfactory:admission_queued") == 3:
                    break
                await asyncio.sleep(0.05)
            assert s.metric("tokenfactory:admission_queued") == 3
            await running.aclose()  # the client leaves: the running stream is aborted, the rest run
            assert [r.status_code for r in await asyncio.gather(*waiting, other)] == [200, 200, 200]
    asyncio.run(scenario())
    assert idle(s)


def test_a_joule_budget_hammered_concurrently_overspends_at_most_one_request(server) -> None:
    s, keys = server

    async def wave(n: int) -> list[httpx.Response]:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            body = {"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {keys['green']}"}
            return await asyncio.gather(*(client.post(f"{s.url}/v1/completions", json=body, headers=headers)
                                          for _ in range(n)))
    responses = []
    for _ in range(16):  # waves of 2: a tenant's share of the queue (4 // 2), so none is refused 503
        responses += asyncio.run(wave(2))
        if any(r.status_code == 402 for r in responses):
            break
    ok = [r for r in responses if r.status_code == 200]
    assert ok and {r.status_code for r in responses} <= {200, 402, 429}, [r.text for r in responses]
    joules = [r.json()["usage"]["energy_joules"] for r in ok]
    usage = httpx.get(f"{s.url}/v1/usage", headers={"Authorization": f"Bearer {keys['green']}"},
                      trust_env=False).json()["data"][0]
    print(f"\n300 J/day hammered in waves of 2: {len(ok)} served, largest {max(joules):.2f} J, "
          f"ledger total {usage['energy_joules']:.2f} J")
    assert usage["energy_joules"] == pytest.approx(sum(joules))
    assert usage["energy_joules"] <= 300 + max(joules)
    assert idle(s)


def test_admission_gauges_are_in_metrics_and_documented(server) -> None:
    s, _ = server
    text = httpx.get(f"{s.url}/metrics", trust_env=False).text
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name in ("admission_queued", "admission_in_flight", "admission_reserved_budget", "admission_max_waiting"):
        assert f"tokenfactory:{name}" in text and f"tokenfactory:{name}" in doc
    assert s.metric("tokenfactory:admission_max_waiting") == 4
