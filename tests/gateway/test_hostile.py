"""A property-based battery of OpenAI requests — valid, boundary and hostile — against a real `tokenfactory
serve --auth` on the bundled model. After every request: the answer is 2xx or an OpenAI-shaped 4xx naming
the parameter, /health is ok, and once the server is idle the KV blocks in use and every admission counter
are back where they started. TOKENFACTORY_HOSTILE_EXAMPLES sets the number of examples (default 200)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_util import Server, start_server
from tokenfactory.cli import main as cli_main

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
EXAMPLES = int(os.environ.get("TOKENFACTORY_HOSTILE_EXAMPLES", "200"))
IDLE_GAUGES = ("tokenfactory:num_requests_running", "tokenfactory:kv_cache_usage_perc",
               "tokenfactory:admission_queued", "tokenfactory:admission_in_flight")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    tmp = tmp_path_factory.mktemp("hostile")
    d = ["--data-dir", str(tmp / "data")]
    assert cli_main(["tenants", "add", "mallory", "--rpm", "100000", "--tpm", "10000000", *d]) == 0
    from tokenfactory.tenants.store import TenantStore

    store, ledger = TenantStore.open(str(tmp / "data"))
    key = store.create_key("mallory")[0]
    ledger.close()
    server = start_server(tmp, "--auth", "--max-num-seqs", "16", "--stream-send-timeout", "20")
    try:
        yield server, key
    finally:
        server.stop()


# -- what a hostile client sends -------------------------------------------------------------------------

HUGE = st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, -1, 0, 2**31, 2**31 - 1, -(2**31)])
FLOATS = st.one_of(st.sampled_from([math.inf, -math.inf, math.nan, 1e309, -1e309, 1e-320, -0.0, 2.0000001]),
                   st.floats(allow_nan=True, allow_infinity=True))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e" * 50, "é" * 200]))
WRONG = st.one_of(st.none(), st.booleans(), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
                  st.lists(st.integers(), max_size=3), TEXT)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly valid values (so requests reach the engine), sometimes boundary or hostile ones."""
    return st.one_of(valid, valid, HUGE, FLOATS, WRONG)


SAMPLING = {
    "max_tokens": field(st.integers(1, 6)),
    "n": field(st.integers(1, 3)),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0.01, 1)),
    "top_k": field(st.integers(-1, 60000)),
    "min_p": field(st.floats(0, 1)),
    "seed": field(st.integers(-(2**63), 2**63 - 1)),
    "presence_penalty": field(st.floats(-2, 2)),
    "frequency_penalty": field(st.floats(-2, 2)),
    "repetition_penalty": field(st.floats(0.5, 2)),
    "min_tokens": field(st.integers(0, 4)),
    "stop": field(st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), max_size=20))),
    "stop_token_ids": field(st.lists(st.one_of(st.integers(0, 49151), HUGE), max_size=300)),
    "ignore_eos": field(st.booleans()),
    "stream": st.booleans(),
    "logprobs": field(st.integers(0, 5)),
    "echo": field(st.booleans()),
    "user": field(TEXT),
    "no_such_field": WRONG,
}
PROMPT = st.one_of(TEXT, st.lists(TEXT, max_size=4), st.lists(st.integers(0, 49151), max_size=20),
                   st.lists(st.integers(-5, 10**12), min_size=1, max_size=3),
                   st.lists(TEXT, min_size=257, max_size=300),
                   st.lists(st.lists(st.integers(0, 49151), max_size=5), max_size=3), WRONG)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                    "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                                        {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2))}),
             max_size=4),
    WRONG)
AUTH = st.one_of(st.just("valid"), st.just("valid"), st.just("valid"),
                 st.sampled_from([None, "", "Bearer", "Bearer ", "Basic abc", "Bearer tf_nokey_x" + "y" * 40,
                                  "Bearer \u00ff\u00fe", "bearer  " + "z" * 5000]))


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict, str | None]:
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    body: dict = {"model": draw(st.one_of(st.just(MODEL), st.just(MODEL), WRONG)), "max_tokens": 4}
    if path.endswith("chat/completions"):
        body["messages"] = draw(MESSAGES)
    else:
        body["prompt"] = draw(PROMPT)
    for name in draw(st.lists(st.sampled_from(sorted(SAMPLING)), max_size=5, unique=True)):
        if path.endswith("chat/completions") and name in ("echo", "logprobs"):
            name = "top_logprobs" if name == "logprobs" else "logprobs"
            body[name] = draw(field(st.integers(0, 5)) if name == "top_logprobs" else field(st.booleans()))
            continue
        body[name] = draw(SAMPLING[name])
    if body.get("stream") is True and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(field(st.booleans()))}
    return path, body, draw(AUTH)


# -- the oracle -------------------------------------------------------------------------------------------


def check_answer(r: httpx.Response, stream: bool) -> None:
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert "param" in err and "code" in err
        if r.status_code == 400 and err.get("code") != "invalid_json":
            assert err["param"], f"a 400 must name the parameter: {err}"
        return
    if stream:
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text[-500:]
        for e in events[:-1]:
            assert "error" not in json.loads(e), e
    else:
        assert r.json()["choices"]


def wait_idle(server: Server, start: dict[str, float]) -> None:
    deadline = time.monotonic() + 30
    while True:
        now = {name: server.metric(name) for name in IDLE_GAUGES}
        if now == start:
            return
        assert time.monotonic() < deadline, f"not back to idle: {now} (start {start})"
        time.sleep(0.05)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(req=requests())
def test_hostile_requests_fail_only_themselves(hostile, req) -> None:
    server, key = hostile
    path, body, auth = req
    headers = {"Content-Type": "application/json"}
    if auth == "valid":
        headers["Authorization"] = f"Bearer {key}"
    elif auth is not None:
        headers["Authorization"] = auth
    start = {name: 0.0 for name in IDLE_GAUGES}
    content = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    try:
        r = httpx.post(server.url + path, content=content, headers=headers, timeout=120)
    except (UnicodeEncodeError, httpx.LocalProtocolError):  # httpx refuses such a header: nothing was sent
        return
    check_answer(r, stream=body.get("stream") is True and r.status_code == 200)
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    wait_idle(server, start)


def test_the_issues_reproductions_are_400s_naming_the_parameter(hostile) -> None:
    server, key = hostile
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    cases = [({"prompt": "hi", "max_tokens": 1, "seed": 18446744073709551616}, "seed"),
             ({"prompt": "hi", "max_tokens": 1, "temperature": 1, "top_k": 9223372036854775808}, "top_k"),
             ({"prompt": "hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [10000000]}, "stop_token_ids"),
             ({"prompt": "hi", "max_tokens": 1, "temperature": 1e309}, "temperature"),
             ({"prompt": "hi", "max_tokens": 1, "repetition_penalty": 1e309}, "repetition_penalty"),
             ({"prompt": "hi \ud800", "max_tokens": 1}, "prompt")]
    for body, param in cases:
        raw = json.dumps({"model": MODEL, **body}).replace("1e+309", "1e309").encode()
        r = httpx.post(server.url + "/v1/completions", content=raw, headers=h, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.get(server.url + "/v1/usage", params={"since": "999999999999d"}, headers=h, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models", headers=h).json()["data"][0]
    assert not Path(models["root"]).is_absolute() and "/" not in models["root"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
                   headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
