"""Structured outputs and tool calling on a real `tokenfactory serve` (the bundled SmolLM2-135M) through clients
no one on the project wrote: the official `openai` client (response_format json_object and json_schema, strict
true and false, streamed; vLLM's guided_* and structured_outputs fields on chat and completions; tools with
tool_choice required / named / auto, streamed tool-call deltas, a tool result in the history; the errors that
name their field), LangChain's ChatOpenAI (with_structured_output by json_schema and by function calling,
bind_tools) and the OpenAI Agents SDK over chat completions (an agent whose function tool is called and whose
result it reads), and a Batch API job of such lines. Slow: the real model, a real server process."""

from __future__ import annotations

import io
import json
import re
import time

import jsonschema
import openai
import pytest

from tests.agents_util import run_clock_agent
from tests.server_util import Server, start_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "languages": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["en", "fr", "de"]}}},
    "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    # The machine profile is not what this tests: off, so a busy machine starts the server sooner.
    s = start_server(tmp_path_factory.mktemp("structured"), "--power-source", "modelled", "--machine-profile", "off",
                     timeout=600)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)  # a busy machine


def test_response_format_json_schema_strict_and_not_and_json_object(client) -> None:
    for strict in (True, False):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=120,
            temperature=1.0, seed=strict, n=2,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": strict}})
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            data = json.loads(choice.message.content)
            jsonschema.validate(data, PERSON)
            assert set(data) <= set(PERSON["properties"])  # objects are closed, strict or not
        assert r.usage.model_extra["forced_tokens"] > 0
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON object."}],
                                       max_tokens=80, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a long object: what there is of it is still JSON's beginning
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_streamed_json_schema_and_a_grammar_cut_by_max_tokens(client) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}], max_tokens=120, stream=True,
        stream_options={"include_usage": True},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert usage is not None and usage.model_extra["forced_tokens"] > 0
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person."}],
                                         max_tokens=4, response_format={"type": "json_schema", "json_schema": {
                                             "name": "person", "schema": PERSON}})
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith('{"name": "')


def test_vllm_fields_on_chat_and_completions(client) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
                                          max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no")
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick a colour."}],
                                          max_tokens=10, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert chat.choices[0].message.content in ("red", "blue")
    text = client.completions.create(model=MODEL, prompt="Call me at ", max_tokens=20,
                                     extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text.choices[0].text) and text.choices[0].finish_reason == "stop"
    text = client.completions.create(model=MODEL, prompt="A person: ", max_tokens=120,
                                     extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(text.choices[0].text), PERSON)
    text = client.completions.create(model=MODEL, prompt="Answer: ", max_tokens=20,
                                     extra_body={"guided_grammar": 'start: "It is " ("true" | "false") "."'})
    assert text.choices[0].text in ("It is true.", "It is false.")


def test_errors_name_their_field(client) -> None:
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format.json_schema.schema"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(extra_body={"guided_regex": "a+", "guided_choice": ["a"]}), "guided_choice"),
        (dict(extra_body={"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)


def _check_calls(message, names: set[str]) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_tool_choice_required_named_and_auto(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=150, temperature=1.0, n=2, seed=3)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"get_weather", "get_time"})
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message, {"get_time"})
    assert r.usage.model_extra["forced_tokens"] >= 10  # the envelope up to the arguments is all forced
    # auto: the model may answer in words or call; whatever it writes parses as one or the other.
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=60)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, {"get_weather"})
    else:
        assert isinstance(choice.message.content, str) and "<tool_call>" not in choice.message.content
    # "none": no call is made, whatever the model writes.
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none", max_tokens=20)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas_and_a_tool_result_in_the_history(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], max_tokens=150,
                                            tool_choice="required", parallel_tool_calls=False, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0]["id"], "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


def test_langchain_structured_output_and_bind_tools(server: Server) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=40)
        age: int = Field(ge=0, le=130)

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="none", model=MODEL, max_tokens=120, temperature=0.7,
                     max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a famous scientist.")
        assert isinstance(person, Person) and 0 <= person.age <= 130, method

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "18 degrees"

    message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert isinstance(message.tool_calls[0]["args"]["city"], str)
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_agents_sdk_calls_its_function_tool_and_reads_the_result(server: Server) -> None:
    from agents import OpenAIChatCompletionsModel

    run_clock_agent(OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0)))


def test_batch_lines_with_schemas_and_tools(client) -> None:
    lines = [
        {"custom_id": "json", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": MODEL, "messages": [{"role": "user", "content": "A person."}], "max_tokens": 120,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}},
        {"custom_id": "tool", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": MODEL, "messages": USER, "max_tokens": 150, "tools": [WEATHER], "tool_choice": "required"}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {
            "model": MODEL, "messages": USER, "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}}},
    ]
    f = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(json.dumps(x) for x in lines).encode())),
                            purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(1)
    out = {x["custom_id"]: x for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    errors = {x["custom_id"]: x for x in map(json.loads, client.files.content(batch.error_file_id).text.splitlines())}
    jsonschema.validate(json.loads(out["json"]["response"]["body"]["choices"][0]["message"]["content"]), PERSON)
    tool_choice = out["tool"]["response"]["body"]["choices"][0]
    assert tool_choice["finish_reason"] == "tool_calls" and tool_choice["message"]["tool_calls"]
    bad = errors["bad"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "response_format.json_schema.schema"
