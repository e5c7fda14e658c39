"""The fleet as a user runs it, on the bundled model: `tokenfactory serve --replicas 2` (local processes) with
another server of ours as an external backend, one endpoint for the official client; a replica SIGKILLed under
streaming load (no hung client, no lost ledger row, the replica back); prefix affinity against least-work on
shared-prefix traffic; replicas as actors on the session's real local Ray."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_util import Server, read_metric, start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    # One thread, as each of the fleet's two local replicas gets on 2 cores: the same machine profile (kernel
    # choices are measured per thread count), so greedy answers agree whichever of the three serves.
    server = start_server(tmp_path_factory.mktemp("backend"), "--threads", "1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, backend):
    server = start_server(tmp_path_factory.mktemp("fleet"), "--replicas", "2", "--replica-timeout", "5",
                          "--backend", f"{backend.url}/v1,model={MODEL}", timeout=300)
    yield server
    server.stop()


def replicas(server: Server) -> dict[str, dict]:
    return {r["replica_id"]: r for r in httpx.get(server.url + "/fleet/replicas", timeout=10).json()["data"]}


def ledger(server: Server) -> list[sqlite3.Row]:
    with sqlite3.connect(server.data_dir / "ledger.db") as db:
        db.row_factory = sqlite3.Row
        return db.execute("select * from requests order by id").fetchall()


def test_one_endpoint_over_local_replicas_and_an_external_server(fleet, backend) -> None:
    assert set(replicas(fleet)) == {"p0", "p1", "b0"}
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]

    # One at a time, so every replica decodes its request alone: with the machine profile's crossovers a step of
    # 5+ sequences may take the dense path where a lone one takes the packed kernel, and greedy answers differ
    # by that rounding between batch sizes (as in any engine that is not batch-invariant). Idle replicas tie,
    # and least-work sends ties round: each of the three serves three, the first cold, the next two on a prefix
    # hit, which runs the prompt's last tokens through a smaller bfloat16 matmul (on CPUs whose GEMM blocks by
    # the row count, a near-tie can flip: tests/engine/test_engine.py). Alike in their cache, alike in answer.
    answers = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12,
        temperature=0).choices[0].message.content for _ in range(9)]
    assert answers[0]
    assert len(set(answers[:3])) == 1 and len(set(answers[3:])) == 1, answers  # whichever replica served it
    rows = ledger(fleet)
    assert {r["replica"] for r in rows} == {"p0", "p1", "b0"}
    backend_rows = [r for r in rows if r["replica"] == "b0"]
    assert all(r["energy_source"] == "modelled" and r["energy_joules"] > 0 and r["completion_tokens"] > 0
               for r in backend_rows)
    local_rows = [r for r in rows if r["replica"] != "b0"]
    assert all(r["energy_source"] == "modelled" and r["energy_joules"] is not None for r in local_rows)
    # The backend served b0's requests itself (its own ledger), counted with the same tokens.
    assert len(ledger(backend)) >= len(backend_rows)
    # Streaming through the external backend, with its usage.
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
                                       temperature=0, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    usage = httpx.get(fleet.url + "/v1/usage", params={"group_by": "replica"}).json()["data"]
    assert {u["key"] for u in usage} == {"p0", "p1", "b0"}
    assert sum(u["num_requests"] for u in usage) == len(ledger(fleet))
    assert read_metric(fleet.url, "tokenfactory:replica_up") == 3


def test_a_replica_sigkilled_under_load_loses_no_row_and_hangs_no_client(fleet) -> None:
    before = len(ledger(fleet))
    victim = replicas(fleet)["p0"]
    n = 12

    async def stream(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 48, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"http {resp.status_code}"
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data:") and '"error"' in line:
                    return "error: " + json.loads(line[5:])["error"]["message"]
        return "cut"

    async def load() -> list[str]:
        async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as http:
            tasks = [asyncio.ensure_future(stream(http, i)) for i in range(n)]
            await asyncio.sleep(1.5)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)
    results = asyncio.run(load())
    assert all(r == "done" or r.startswith("error: replica p0") or r == "http 503" for r in results), results
    assert "done" in results
    deadline = time.monotonic() + 30
    while len(ledger(fleet)) < before + n:  # every request has its row, once
        assert time.monotonic() < deadline, (results, len(ledger(fleet)) - before)
        time.sleep(0.2)
    rows = ledger(fleet)[before:]
    assert len(rows) == n and len({r["request_id"] for r in rows}) == n
    assert sum(r["status"] == "finished" for r in rows) == results.count("done")
    # It leaves the routing set within seconds and comes back restarted.
    deadline = time.monotonic() + 120
    while True:
        r = replicas(fleet)["p0"]
        if r["state"] == "ready" and r["alive"] and r["num_restarts"] == 1:
            break
        assert time.monotonic() < deadline, r
        time.sleep(0.5)
    assert r["pid"] != victim["pid"]
    ok = httpx.post(fleet.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200


def prefix_hit_rate(tmp: Path, router: str) -> float:
    tmp.mkdir()
    server = start_server(tmp, "--replicas", "2", "--router", router, timeout=300)
    try:
        prefixes = [f"System prompt {k}: " + " ".join(f"rule{k}-{j} says be brief." for j in range(40))
                    for k in range(4)]
        queries0 = read_metric(server.url, "tokenfactory:prefix_cache_queries_total")
        hits0 = read_metric(server.url, "tokenfactory:prefix_cache_hits_total")

        async def load() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                sem = asyncio.Semaphore(4)

                async def one(i: int) -> None:
                    async with sem:
                        body = {"prompt": prefixes[i % 4] + f" Question {i}?", "max_tokens": 2}
                        assert (await http.post("/v1/completions", json=body)).status_code == 200
                await asyncio.gather(*[one(i) for i in range(32)])
        asyncio.run(load())
        queries = read_metric(server.url, "tokenfactory:prefix_cache_queries_total") - queries0
        return (read_metric(server.url, "tokenfactory:prefix_cache_hits_total") - hits0) / queries
    finally:
        server.stop()


def test_prefix_affinity_raises_the_fleets_prefix_hit_rate(tmp_path) -> None:
    least = prefix_hit_rate(tmp_path / "least", "least-work")
    prefix = prefix_hit_rate(tmp_path / "prefix", "prefix")
    # Each of the 4 prefixes costs a miss once per replica it lands on: at most 4 misses with affinity, up to 8
    # without; the rest of each prompt (a few tokens) always misses.
    assert prefix > least + 0.05, (least, prefix)


def test_replicas_as_actors_on_a_real_ray(tmp_path, ray_address) -> None:
    server = start_server(tmp_path, "--replicas", "2", "--ray", ray_address, timeout=300)
    try:
        assert {r["kind"] for r in replicas(server).values()} == {"ray"}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        outs = [client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=6, temperature=0)
                for i in range(4)]  # one at a time: an idle fleet's ties go round the replicas
        assert all(o.usage.completion_tokens == 6 for o in outs)
        assert {r["replica"] for r in ledger(server)} == {"r0", "r1"}
    finally:
        server.stop()


def test_several_models_routed_by_model(tmp_path, backend) -> None:
    """The default model in one local replica, a second model (the same file under another name) in its own,
    and a third only on an external backend (with its tokenizer): each request goes where its `model` says."""
    from tokenfactory.models.loader import bundled_model_path

    path = str(bundled_model_path())
    server = start_server(tmp_path, "--replicas", "1", "--fleet-model", f"{path},name=smol-b",
                          "--backend", f"{backend.url}/v1,model={MODEL},served=smol-ext,tokenizer={path}", timeout=300)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == sorted([MODEL, "smol-b", "smol-ext"])
        for name in (MODEL, "smol-b", "smol-ext", MODEL):
            r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0)
            assert r.model == name and r.usage.completion_tokens > 0
        with pytest.raises(openai.NotFoundError, match="smol-b"):
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        rows = [(r["model"], r["replica"]) for r in ledger(server)]
        assert rows == [(MODEL, "p0"), ("smol-b", "m1-p0"), ("smol-ext", "b0"), (MODEL, "p0")]
        assert set(replicas(server)) == {"p0", "m1-p0", "b0"}
        usage = httpx.get(server.url + "/v1/usage", params={"group_by": "model"}).json()["data"]
        assert {u["key"]: u["num_requests"] for u in usage} == {MODEL: 2, "smol-b": 1, "smol-ext": 1}
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("llama-server") is None,
                    reason="llama-server (llama.cpp's server) is not on PATH; the external-backend path is tested on "
                           "our own server, and this test runs wherever llama-server is installed")
def test_llama_server_as_a_backend(tmp_path) -> None:
    from tests.server_util import free_port, stop_process
    from tokenfactory.models.loader import bundled_model_path

    port = free_port()
    log = open(tmp_path / "llama-server.log", "w")  # noqa: SIM115 - the child writes to it
    proc = subprocess.Popen(["llama-server", "-m", str(bundled_model_path()), "--port", str(port), "-t", "1",
                             "--host", "127.0.0.1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "llama-server.log").read_text()
            time.sleep(0.5)
        server = start_server(tmp_path, "--replicas", "0", "--backend", f"http://127.0.0.1:{port}/v1")
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=8, temperature=0)
            assert r.usage.completion_tokens > 0 and r.choices[0].message.content
            assert [row["replica"] for row in ledger(server)] == ["b0"]
        finally:
            server.stop()
    finally:
        stop_process(proc)
