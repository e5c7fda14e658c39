"""The Responses API on a real `tokenfactory serve --auth` (the bundled SmolLM2-135M) through the official `openai`
client and the OpenAI Agents SDK with its default (Responses) model: create, retrieve, continue with
previous_response_id, input_items, delete; refused across tenants; the streamed event sequence (text and
function calls); tools and text.format json_schema; background responses and cancel; usage with joules and
cost and the ledger row under the response's id; a stream dropped early aborted and freed. Slow: the real
model, a real server process."""

from __future__ import annotations

import json
import signal
import time

import httpx
import jsonschema
import openai
import pytest

from tests.agents_util import run_clock_agent
from tests.server_util import Server, start_server
from tokenfactory.cli import main as cli_main

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> tuple[Server, dict[str, str]]:
    tmp = tmp_path_factory.mktemp("responses")
    d = ["--data-dir", str(tmp / "data")]
    from tokenfactory.tenants.store import TenantStore

    keys = {}
    for name in ("alice", "bob"):
        assert cli_main(["tenants", "add", name, *d]) == 0
    store, ledger = TenantStore.open(str(tmp / "data"))
    keys = {name: store.create_key(name)[0] for name in ("alice", "bob")}
    ledger.close()
    s = start_server(tmp, "--auth", "--power-source", "modelled", "--machine-profile", "off", timeout=600)
    yield s, keys
    s.stop()


def client_of(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=key, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def alice(server) -> openai.OpenAI:
    return client_of(server, server[1]["alice"])


@pytest.fixture(scope="module")
def bob(server) -> openai.OpenAI:
    return client_of(server, server[1]["bob"])


def test_create_retrieve_continue_and_refused_across_tenants(server, alice, bob) -> None:
    r = alice.responses.create(model=MODEL, input="What is the capital of France? One word.",
                               instructions="You answer briefly.", max_output_tokens=16, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text.strip() and r.id.startswith("resp_")
    usage = r.usage.model_extra
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert usage["energy_joules"] > 0 and usage["energy_source"] == "modelled" and usage["cost_usd"] > 0
    [row] = server[0].ledger_rows(r.id)  # chat's ledger row, under the response's id, as alice
    assert (row["tenant"], row["prompt_tokens"], row["completion_tokens"]) == (
        "alice", r.usage.input_tokens, r.usage.output_tokens)
    assert alice.responses.retrieve(r.id).output_text == r.output_text
    more = alice.responses.create(model=MODEL, input="And of Germany?", previous_response_id=r.id,
                                  max_output_tokens=8, temperature=0)
    assert more.previous_response_id == r.id
    assert more.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens - 10  # the history replayed
    items = alice.responses.input_items.list(more.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "And of Germany?"
    # Another tenant sees none of it: not its object, not as a conversation to continue, not to delete.
    for attempt in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                    lambda: bob.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.NotFoundError) as refused:
        bob.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id"
    alice.responses.delete(r.id)  # the client reads no body back
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(r.id)
    unstored = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)
    for kw, param in (({"input": [{"type": "image", "url": "x"}]}, "input[0].type"),
                      ({"input": "Hi", "temperature": -1}, "temperature"),
                      ({"input": "Hi", "max_output_tokens": 5000}, "max_output_tokens"),  # past the context
                      ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0]")):
        with pytest.raises(openai.BadRequestError) as bad:
            alice.responses.create(model=MODEL, **kw)
        assert bad.value.body["param"] == param, bad.value.body


def test_streamed_event_sequence_for_text_and_a_function_call(alice) -> None:
    events = list(alice.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12, temperature=0,
                                         stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          kinds[-1]] and kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text and text == next(e.text for e in events if e.type == "response.output_text.done") == done.output_text
    assert done.usage.output_tokens > 0 and done.usage.model_extra["energy_joules"] > 0
    calls = list(alice.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                        tool_choice="required", max_output_tokens=60, stream=True))
    kinds = [e.type for e in calls]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    args = next(e for e in calls if e.type == "response.function_call_arguments.done")
    assert args.name == "get_weather" and isinstance(json.loads(args.arguments)["city"], str)
    [item] = [e.item for e in calls if e.type == "response.output_item.done"]
    assert item.type == "function_call" and item.call_id and calls[-1].response.output[0].call_id == item.call_id


def test_a_stream_dropped_early_is_aborted_and_frees_everything(server) -> None:
    url, key = server[0].url, server[1]["alice"]
    body = {"model": MODEL, "input": "Count from 1 to 1000, separated by commas.", "max_output_tokens": 1500,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=600) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert created["type"] == "response.created"
        for line in lines:  # until the first text delta, then hang up
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                break
    rid = created["response"]["id"]
    deadline = time.monotonic() + 60
    while not (rows := server[0].ledger_rows(rid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    [row] = rows
    assert row["status"] == "aborted" and row["completion_tokens"] < 1500
    while server[0].metric("tokenfactory:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server[0].metric("tokenfactory:num_requests_running") == 0
    with pytest.raises(openai.NotFoundError):  # never finished: not stored
        client_of(server, key).responses.retrieve(rid)


def test_function_tool_round_trip_and_json_schema(alice) -> None:
    r = alice.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                               tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and "city" in json.loads(call.arguments)
    after = alice.responses.create(model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=30,
                                   input=[{"type": "function_call_output", "call_id": call.call_id,
                                           "output": "Sunny, 21 C."}], temperature=0)
    assert after.output[0].type in ("message", "function_call") and after.status in ("completed", "incomplete")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"]}
    j = alice.responses.create(model=MODEL, input="Describe Paris as JSON.", max_output_tokens=80,
                               text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                "strict": True}})
    jsonschema.validate(json.loads(j.output_text), schema)


def test_background_runs_and_cancels(server, alice, bob) -> None:
    r = alice.responses.create(model=MODEL, input="Say hi.", max_output_tokens=8, background=True)
    assert r.status == "queued" and r.background
    deadline = time.monotonic() + 300
    while (r := alice.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0
    long = alice.responses.create(model=MODEL, input="Count from 1 to 1000, separated by commas.",
                                  max_output_tokens=1500, temperature=0, background=True)
    with pytest.raises(openai.NotFoundError):
        bob.responses.cancel(long.id)
    cancelled = alice.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 60  # a cancelled call's row is written as it is settled, just after
    while not (rows := server[0].ledger_rows(long.id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    [row] = rows  # billed for what was made, once
    assert row["status"] == "aborted" and row["completion_tokens"] < 1500
    with pytest.raises(openai.BadRequestError):
        alice.responses.cancel(alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id)


def test_agents_sdk_default_responses_model_runs_a_function_tool(server) -> None:
    from agents import set_default_openai_api, set_default_openai_client

    set_default_openai_api("responses")  # the SDK's default: said, so a changed default fails here
    set_default_openai_client(openai.AsyncOpenAI(base_url=server[0].url + "/v1", api_key=server[1]["alice"],
                                                 max_retries=0, timeout=600), use_for_tracing=False)
    run_clock_agent(MODEL)


def test_a_background_response_cut_off_by_a_restart_runs_again_billed_once(server, alice) -> None:
    """Last in the module: it restarts the server on the same data directory."""
    s, keys = server
    r = alice.responses.create(model=MODEL, input="Count from 1 to 100, separated by commas.",
                               max_output_tokens=120, temperature=0, background=True)
    deadline = time.monotonic() + 120
    while not s.metric("tokenfactory:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.stop() in (0, -signal.SIGTERM)  # SIGTERM while it runs (uvicorn re-raises it after a clean stop)
    [cut] = s.ledger_rows(r.id)
    assert cut["status"] == "aborted"
    again = start_server(s.data_dir.parent, "--auth", "--power-source", "modelled", "--machine-profile", "off",
                         timeout=600)
    try:
        client = client_of((again, keys), keys["alice"])
        deadline = time.monotonic() + 300
        while (r := client.responses.retrieve(r.id)).status in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert r.status in ("completed", "incomplete") and r.usage.output_tokens > 0
        [row] = again.ledger_rows(r.id)  # the rerun's row superseded the cut-off one: billed once
        assert (row["status"], row["completion_tokens"]) == ("finished", r.usage.output_tokens)
    finally:
        again.stop()
