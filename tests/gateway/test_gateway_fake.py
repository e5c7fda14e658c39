"""The real gateway (HTTP, auth, admission, metering, the ledger) over a fake engine client: no model.

Uvicorn serves `build_app` on loopback in a thread of this process, wired as `tokenfactory serve` wires
it (tests/server_util.start_gateway): a Meter on a constant 100 W source hears the fake's steps, rows go
to a real SQLite ledger, and with auth the tenants and keys live beside it. The fake
(tests/fake_engine.py) writes known text, so every answer is exact. After each refusal the admission
gauges in /metrics and the engine's own counts must be back at zero: nothing leaked.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.fake_engine import BYTE_OFFSET, EOS, SCRIPTS, FakeEngineClient
from tests.server_util import Gateway, start_gateway
from tokenfactory.engine.client import AddRequest, RequestError
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import FinishReason, RequestOutput, SamplingParams

MODEL = "fake-tiny"
FOX, PACK = SCRIPTS[0], SCRIPTS[1]
ADMISSION_GAUGES = ("tokenfactory:admission_queued", "tokenfactory:admission_in_flight")


def until(cond: Callable[[], bool], timeout_s: float = 5.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_idle(gw: Gateway) -> None:
    """Admission holds nothing and the engine runs, queues and holds nothing."""
    until(lambda: all(gw.metric(g) == 0 for g in ADMISSION_GAUGES), what="admission gauges at 0")
    s = gw.engine.wait_idle()
    assert s.alive and s.num_running == 0 and s.num_waiting == 0
    assert gw.metric("tokenfactory:num_requests_running") == 0
    assert gw.metric("tokenfactory:kv_cache_usage_perc") == 0


def statuses(gw: Gateway) -> dict[str, int]:
    rows = gw.ledger_rows()
    return {s: sum(r["status"] == s for r in rows) for s in ("finished", "failed", "aborted")}


@pytest.fixture(scope="module")
def gw(tmp_path_factory) -> Gateway:
    g = start_gateway(FakeEngineClient(step_s=0.001), tmp_path_factory.mktemp("gateway"))
    yield g
    g.stop()


@pytest.fixture(scope="module")
def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


# -- completions and chat -------------------------------------------------------------------------------------


def test_models_health_and_a_torch_free_gateway(gw, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(gw.url + "/health").json() == {"status": "ok", "model": MODEL}
    code = ("import sys; import tests.fake_engine, tests.server_util, tokenfactory.gateway.app, "
            "tokenfactory.gateway.limits; assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_completion_text_usage_energy_and_its_ledger_row(gw, client) -> None:
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=5)
    assert r.choices[0].text == "The q" and r.choices[0].finish_reason == "length"
    u, extra = r.usage, r.usage.model_extra
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (3, 5, 8)  # <s> h i
    assert u.prompt_tokens_details.cached_tokens == 0
    assert extra["energy_source"] == "constant" and extra["energy_scope"] == "machine"
    assert extra["energy_joules"] > 0 and extra["cost_usd"] > 0
    assert extra["cost_usd"] == pytest.approx(extra["cost_device_usd"] + extra["cost_energy_usd"])
    assert extra["joules_per_output_token"] == pytest.approx(extra["energy_joules"] / 5)
    [row] = gw.ledger_rows(r.id)
    assert row["status"] == "finished" and row["tenant"] == "anonymous" and row["model"] == MODEL
    assert (row["prompt_tokens"], row["completion_tokens"]) == (3, 5)
    assert row["energy_joules"] == pytest.approx(extra["energy_joules"]) and row["energy_source"] == "constant"
    assert row["cost_usd"] == pytest.approx(extra["cost_usd"]) and row["ttft_s"] <= row["latency_s"]
    assert_idle(gw)


def test_finish_reasons_length_eos_stop_token_and_ignore_eos(client) -> None:
    def one(**kw: object) -> openai.types.Completion:
        return client.completions.create(model=MODEL, prompt="hi", **kw)

    r = one(max_tokens=len(FOX))
    assert (r.choices[0].text, r.choices[0].finish_reason) == (FOX, "length")
    r = one(max_tokens=100)  # the script ends with EOS: its token is counted, its text skipped
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (FOX, "stop", len(FOX) + 1)
    r = one(max_tokens=len(FOX) + 6, extra_body={"ignore_eos": True})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (FOX + "The q", "length")
    r = one(max_tokens=20, extra_body={"stop_token_ids": [BYTE_OFFSET + ord("q")]})  # the stop token is kept
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("The q", "stop", 5)
    r = one(max_tokens=20, extra_body={"stop_token_ids": [EOS, BYTE_OFFSET + ord("q")], "min_tokens": 6})
    assert r.choices[0].text == "The quick brown fox " and r.choices[0].finish_reason == "length"
    r = one(max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["T", "h", "e"] and len(lp.token_logprobs) == 3 and len(lp.top_logprobs[0]) == 2


def test_chat_n_and_stop_strings(gw, client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=60, stop=[" brown"])
    by_index = {c.index: c for c in r.choices}
    assert by_index[0].message.content == "The quick" and by_index[0].finish_reason == "stop"
    assert by_index[1].message.content == PACK and by_index[1].finish_reason == "stop"  # EOS
    assert by_index[0].message.role == "assistant"
    prompt = "<|user|>\nhi\n<|assistant|>\n"  # the fake's template, encoded without special tokens
    assert r.usage.prompt_tokens == len(prompt.encode())
    assert r.usage.completion_tokens == len("The quick brown") + len(PACK) + 1  # the stop string's tokens stay
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=30,
                                       stop=["fox"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == "The quick brown fox"
    [row] = gw.ledger_rows(r.id)
    assert row["status"] == "finished" and row["completion_tokens"] == r.usage.completion_tokens


def stream_choices(client: openai.OpenAI, **kw: object) -> tuple[dict, dict, object, int]:
    """Each choice's joined text and its finish reasons, the usage chunk's usage, and the number of chunks
    that came for a choice after its finish."""
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    usage, num_after_finish = None, 0
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
            assert not chunk.choices
            continue
        for c in chunk.choices:
            num_after_finish += c.index in reasons
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    return texts, reasons, usage, num_after_finish


STREAM_N = {"model": MODEL, "prompt": ["hi", "hello"], "max_tokens": 50, "n": 2, "stop": [" box"]}


def test_streamed_completions_deltas_join_to_the_whole_answer(gw, client) -> None:
    full = client.completions.create(**STREAM_N)
    texts, reasons, usage, _ = stream_choices(client, **STREAM_N)
    reasons = {i: r[0] for i, r in reasons.items()}
    assert texts == {c.index: c.text for c in full.choices} == {0: FOX, 1: "Pack my", 2: FOX, 3: "Pack my"}
    assert reasons == {c.index: c.finish_reason for c in full.choices} == {i: "stop" for i in range(4)}
    assert usage.completion_tokens == full.usage.completion_tokens and usage.model_extra["energy_joules"] > 0
    assert_idle(gw)


def test_a_streamed_choice_finishes_once(client) -> None:
    _, reasons, _, num_after_finish = stream_choices(client, **STREAM_N)
    assert reasons == {i: ["stop"] for i in range(4)} and num_after_finish == 0


def test_streamed_chat_with_usage_and_ledger_row(gw, client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=9, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "The quick"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.completion_tokens == 9 and usage.model_extra["energy_source"] == "constant"
    [row] = gw.ledger_rows(chunks[0].id)
    assert row["status"] == "finished" and row["completion_tokens"] == 9
    assert row["energy_joules"] == pytest.approx(usage.model_extra["energy_joules"])


# -- errors ------------------------------------------------------------------------------------------------------


BAD = [  # (path, raw JSON body, status, param, code)
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi", "temperature": 1e309}', 400, "temperature", None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi", "seed": 18446744073709551616}', 400, "seed", None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi", "top_k": 9223372036854775808}', 400, "top_k", None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi", "stop_token_ids": [300]}', 400, "stop_token_ids",
     None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi \\ud800"}', 400, "prompt", None),
    ("/v1/chat/completions", '{"model": "fake-tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', 400,
     "messages[0].content", None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi", "bogus": 1}', 400, "bogus", None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": [300]}', 400, "prompt", None),
    ("/v1/completions", '{"model": "fake-tiny", "prompt": "hi", "max_tokens": 254}', 400, "max_tokens", None),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 300}), 400, "prompt", None),
    ("/v1/chat/completions", '{"model": "fake-tiny", "messages": []}', 400, "messages", None),
    ("/v1/completions", '{"model": "gpt-17", "prompt": "hi"}', 404, "model", "model_not_found"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 250_000}), 413, None, "request_too_large"),
    ("/v1/completions", "{not json", 400, None, "invalid_json"),
]


@pytest.mark.parametrize(("path", "raw", "status", "param", "code"), BAD)
def test_bad_requests_are_refused_naming_the_parameter_before_the_engine(gw, path, raw, status, param, code) -> None:
    num_added = gw.engine.num_added
    r = httpx.post(gw.url + path, content=raw.encode(), headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert (err["param"], err["code"]) == (param, code), err
    if param == "bogus":
        assert err["message"] == "unrecognized request argument: bogus"
    if status == 400 and raw.startswith('{"model": "fake-tiny", "prompt": "xxx'):
        assert "256" in err["message"] and "model tokens" in err["message"]
    assert gw.engine.num_added == num_added  # nothing reached the engine
    assert_idle(gw)


# -- the engine failing one request, or dying -------------------------------------------------------------------


def test_a_request_the_engine_fails_alone_is_a_500_and_the_others_are_served(gw) -> None:
    gw.engine.fail_prompts_containing("FAIL-ME")
    before = statuses(gw)

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8} for p in ("ok 1", "FAIL-ME", "ok 2")]
            return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))

    ok1, failed, ok2 = asyncio.run(scenario())
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "request_failed", failed.text
    assert "told to fail it" in failed.json()["error"]["message"]
    assert ok1.status_code == ok2.status_code == 200 and ok1.json()["choices"][0]["text"] == "The quic"
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "FAIL-ME too", "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "request_failed"
    until(lambda: statuses(gw)["failed"] == before["failed"] + 2, what="two failed rows")
    assert statuses(gw)["finished"] == before["finished"] + 2
    assert gw.metric("tokenfactory:requests_failed_alone_total") >= 2
    assert httpx.get(gw.url + "/health").json()["status"] == "ok"
    assert_idle(gw)


def test_a_dead_engine_is_503_on_requests_and_health(tmp_path) -> None:
    engine = FakeEngineClient(step_s=0.001)
    g = start_gateway(engine, tmp_path)
    try:
        engine.pause()
        result: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            g.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}, timeout=30)))
        t.start()
        until(lambda: engine.stats().num_waiting == 1, what="the request in the engine")
        engine.kill("the device fell off the bus")
        t.join(10)
        r = result["r"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        r = httpx.post(g.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        health = httpx.get(g.url + "/health")
        assert health.status_code == 503 and "fell off the bus" in health.json()["reason"]
        until(lambda: all(g.metric(name) == 0 for name in ADMISSION_GAUGES), what="admission gauges at 0")
        until(lambda: [row["status"] for row in g.ledger_rows()] == ["failed"], what="a failed row")
    finally:
        g.stop()


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_gets_an_aborted_row(gw) -> None:
    engine = gw.engine
    num_aborted = engine.num_aborted
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        engine.pause()  # it is surely still running when the client leaves
        request_id = json.loads(first[6:])["id"]
        # (The fake's snapshot is taken after each step, so the first output can arrive before it says so.)
        until(lambda: engine.stats().num_running == 1 and gw.metric("tokenfactory:kv_cache_usage_perc") > 0,
              what="the request running in the snapshot")
        lines.close()
    until(lambda: engine.num_aborted == num_aborted + 1, what="the abort")
    assert engine.aborted_request_ids[-1].startswith(request_id)
    until(lambda: bool(gw.ledger_rows(request_id)), what="the aborted row")
    [row] = gw.ledger_rows(request_id)
    assert row["status"] == "aborted" and 0 < row["completion_tokens"] < 200 and row["energy_joules"] > 0
    engine.resume()
    assert_idle(gw)


# -- auth and admission -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def agw(tmp_path_factory) -> tuple[Gateway, dict[str, str]]:
    g = start_gateway(FakeEngineClient(step_s=0.001), tmp_path_factory.mktemp("auth"), auth=True, max_waiting=4)
    store = g.store
    for tenant in (Tenant("alice"), Tenant("rpm1", rpm=1), Tenant("conc1", max_concurrency=1),
                   Tenant("tight", budget=Budget.parse("20tok/day")), Tenant("batch", priority="batch"),
                   Tenant("other")):
        store.add_tenant(tenant)
    keys = {t.name: store.create_key(t.name)[0] for t in store.list_tenants()}
    keys["admin"] = store.create_key(None, is_admin=True)[0]
    yield g, keys
    g.stop()


def post(gw: Gateway, key: str | None, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + path, json={"model": MODEL, **body}, headers=headers, timeout=30)


def test_missing_or_invalid_keys_are_401_and_admin_routes_403_for_tenant_keys(agw) -> None:
    g, keys = agw
    r = post(g, None, {"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key" and "WWW-Authenticate" in r.headers
    assert "API key" in r.json()["error"]["message"]
    r = post(g, "tf_nope_nope", {"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=g.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(g.url + "/admin/tenants", headers={"Authorization": f"Bearer {keys['alice']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    r = httpx.get(g.url + "/admin/tenants", headers={"Authorization": f"Bearer {keys['admin']}"})
    assert r.status_code == 200 and "alice" in {t["name"] for t in r.json()["data"]}
    assert httpx.get(g.url + "/health").status_code == 200 and httpx.get(g.url + "/metrics").status_code == 200
    assert g.engine.num_added == 0
    assert_idle(g)


def test_a_tenant_key_is_served_as_its_tenant_with_its_weight_sent_to_the_engine(agw) -> None:
    g, keys = agw
    c = openai.OpenAI(base_url=g.url + "/v1", api_key=keys["alice"], max_retries=0, timeout=30)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content == "The"
    [row] = g.ledger_rows(r.id)
    assert row["tenant"] == "alice" and row["status"] == "finished"
    until(lambda: g.engine.tenant_to_weight.get("alice") == 1.0, what="alice's weight in the engine")
    assert_idle(g)


def test_rate_limit_is_429_with_retry_after(agw) -> None:
    g, keys = agw
    assert post(g, keys["rpm1"], {"prompt": "hi", "max_tokens": 2}).status_code == 200
    r = post(g, keys["rpm1"], {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "requests_per_minute_exceeded"
    assert int(r.headers["Retry-After"]) >= 1
    assert_idle(g)


def test_concurrency_limit_is_429_while_the_first_request_runs(agw) -> None:
    g, keys = agw
    g.engine.pause()
    try:
        result: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: result.setdefault("r", post(g, keys["conc1"], {"prompt": "hi",
                                                                                            "max_tokens": 2})))
        t.start()
        until(lambda: g.metric("tokenfactory:admission_in_flight") == 1, what="the first request admitted")
        r = post(g, keys["conc1"], {"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert "Retry-After" in r.headers
    finally:
        g.engine.resume()
    t.join(10)
    assert result["r"].status_code == 200
    assert_idle(g)


def test_budget_is_402_once_spent_or_too_small(agw) -> None:
    g, keys = agw
    r = post(g, keys["tight"], {"prompt": "hi", "max_tokens": 18})  # worst case 3 + 18 > 20 model tokens
    assert r.status_code == 402 and r.json()["error"]["code"] == "budget_insufficient"
    assert r.json()["error"]["param"] == "max_tokens"
    r = post(g, keys["tight"], {"prompt": "hi", "max_tokens": 17})  # exactly the budget
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 20
    r = post(g, keys["tight"], {"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 402 and r.json()["error"]["code"] == "budget_exhausted" and "Retry-After" in r.headers
    assert_idle(g)


def test_one_tenants_backlog_gets_503_past_its_share_and_another_tenant_is_still_admitted(agw) -> None:
    g, keys = agw  # max_waiting 4: a tenant may hold 2 queue slots
    body = {"prompt": "hi", "max_tokens": 2}

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
            def send(tenant: str, payload: dict = body) -> asyncio.Future:
                return asyncio.ensure_future(c.post("/v1/completions", json={"model": MODEL, **payload},
                                                    headers={"Authorization": f"Bearer {keys[tenant]}"}))

            waiting = [send("batch"), send("batch")]
            while g.metric("tokenfactory:admission_queued") < 2:
                await asyncio.sleep(0.01)
            r = await send("batch")
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            assert "tenant batch already has 2 prompts waiting" in r.json()["error"]["message"]
            assert "Retry-After" in r.headers
            r = await send("batch", {**body, "prompt": ["a", "b", "c"]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # never fits a share of 2
            other = send("other")
            while g.metric("tokenfactory:admission_queued") < 3:
                await asyncio.sleep(0.01)
            assert g.engine.stats().num_waiting == 3 and g.engine.stats().num_running == 0
            g.engine.resume()
            return await asyncio.gather(*waiting, other)

    g.engine.pause()
    try:
        responses = asyncio.run(scenario())
    finally:
        g.engine.resume()
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert_idle(g)


# -- the fake keeps the real engine's contract ----------------------------------------------------------------


def check_stream(outs: list[RequestOutput], n: int) -> RequestOutput:
    """What the gateway relies on in a request's outputs; returns the last one."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    state: dict[int, tuple[str, list[int], FinishReason | None]] = {i: ("", [], None) for i in range(n)}
    for out in outs:
        assert [c.index for c in out.outputs] == list(range(n)) and out.error is None
        for c in out.outputs:
            text, ids, reason = state[c.index]
            assert c.token_ids == ids + c.token_ids_delta and c.text.startswith(text + c.text_delta)
            if reason is not None:  # a finished choice stays finished and gets nothing new
                assert c.finish_reason == reason and not c.token_ids_delta and not c.text_delta
            state[c.index] = (text + c.text_delta, c.token_ids, c.finish_reason)
    last = outs[-1]
    for c in last.outputs:
        assert state[c.index][0] == c.text and c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    m = last.metrics
    assert m is not None and m.arrival_time <= m.first_token_time <= m.finished_time
    return last


async def run_contract(client) -> None:
    ids = client.tokenizer.encode("Hello there")

    def add(rid: str, **params: object) -> AddRequest:
        return AddRequest(rid, ids, "Hello there", SamplingParams(temperature=0, **params), time.monotonic(),
                          "anonymous", 1)

    async def outputs(request: AddRequest) -> list[RequestOutput]:
        return [o async for o in client.generate(request)]

    last = check_stream(await outputs(add("c-n2", n=2, max_tokens=12, ignore_eos=True)), 2)
    assert last.prompt_token_ids == ids and last.prompt == "Hello there"
    assert all(c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 12 for c in last.outputs)
    text = last.outputs[0].text
    stop = next(text[k:k + 2] for k in range(1, len(text) - 1) if text[k:k + 2].strip() and text.find(
        text[k:k + 2]) == k)
    last = check_stream(await outputs(add("c-stop", max_tokens=12, ignore_eos=True, stop=(stop,))), 1)
    c = last.outputs[0]
    assert c.finish_reason == FinishReason.STOP and c.text == text[:text.find(stop)]
    with pytest.raises(RequestError, match="stop_token_ids"):
        await outputs(add("c-bad", max_tokens=2, stop_token_ids=(client.info.vocab_size,)))
    # Leaving early aborts it. It asks for the whole context window and must stop far short of it, seen in a
    # snapshot taken after it left: one taken before could show an idle engine (the snapshot trails the steps),
    # and a request that ran to its end would pass a wait for free blocks alone.
    num_generated = client.stats().num_generation_tokens_total
    room = client.info.max_model_len - len(ids)
    gen = client.generate(add("c-abort", max_tokens=room, ignore_eos=True))
    assert not (await anext(gen)).finished
    await gen.aclose()
    left = time.monotonic()
    deadline = left + 10
    while ((s := client.stats()).time <= left or s.num_running or s.num_waiting
           or s.num_free_kv_blocks != s.num_kv_blocks):
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.01)
    assert s.num_steps > 0 and s.num_generation_tokens_total > 2 * 12
    assert s.num_generation_tokens_total - num_generated < room // 4, "the aborted request ran on"


def test_the_fake_keeps_the_engine_client_contract() -> None:
    engine = FakeEngineClient(step_s=0.001)
    engine.start()
    try:
        asyncio.run(run_contract(engine))
        # The snapshot the contract waited on is taken after each step, so it can predate the abort: wait for it.
        deadline = time.monotonic() + 10
        while engine.num_aborted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_aborted == 1 and engine.aborted_request_ids == ["c-abort"]
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_the_real_engine_keeps_the_same_contract(tmp_path) -> None:
    """The same checks on AsyncEngine over a tiny random-weight model: the fake's semantics are the real ones."""
    from tests.reference import tiny_random_model_dir
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.async_engine import AsyncEngine
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.models.loader import load_model

    loaded = load_model(tiny_random_model_dir(tmp_path, "llama"))
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", block_size=8, kv_cache_memory=4 << 20,
                                                max_model_len=256, enable_prefix_caching=False), loaded))
    engine.start()
    try:
        asyncio.run(run_contract(engine))
    finally:
        engine.shutdown()
