"""The request service's structured-output rules (service/structured.py): fields to one grammar naming its
field, closed schemas, tool plans and how they combine, and the rendering of tool calls (fast, no model)."""

from __future__ import annotations

import json

import pytest

from tokenfactory.gateway.render import result_body, stream_chunks
from tokenfactory.models.tools import ToolCall
from tokenfactory.service.protocol import ChatCompletionRequest, CompletionRequest
from tokenfactory.service.results import Choice, ChoiceDelta, CompletionResult, CompletionStream, Usage
from tokenfactory.service.structured import closed_schema, plan_tools, request_grammar
from tokenfactory.types import FinishReason, GrammarKind, ParameterError

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}}}}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def test_closed_schema_closes_only_what_is_left_unsaid() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                               "b": {"type": "object", "additionalProperties": True},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}}}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["c"] and schema == {**schema}  # input untouched


def test_each_field_becomes_one_grammar_naming_it() -> None:
    cases = [
        (chat(response_format={"type": "json_object"}), GrammarKind.JSON_OBJECT, "response_format"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}),
         GrammarKind.JSON_SCHEMA, "response_format.json_schema.schema"),
        (chat(guided_json='{"type": "integer"}'), GrammarKind.JSON_SCHEMA, "guided_json"),
        (chat(guided_regex="a+"), GrammarKind.REGEX, "guided_regex"),
        (chat(guided_choice=["a", "b"]), GrammarKind.CHOICE, "guided_choice"),
        (chat(guided_grammar='start: "a"'), GrammarKind.GRAMMAR, "guided_grammar"),
        (CompletionRequest(prompt="x", structured_outputs={"json": {"type": "object"}}), GrammarKind.JSON_SCHEMA,
         "structured_outputs.json"),
        (CompletionRequest(prompt="x", structured_outputs={"json_object": True}), GrammarKind.JSON_OBJECT,
         "structured_outputs.json_object"),
    ]
    for body, kind, param in cases:
        spec = request_grammar(body.output_constraints(), None)
        assert spec is not None and spec.kind is kind and spec.param == param
    assert request_grammar(chat(response_format={"type": "text"}).output_constraints(), None) is None
    body = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}})
    spec = request_grammar(body.output_constraints(), None)
    assert json.loads(spec.source)["additionalProperties"] is False


def test_bad_fields_and_combinations_name_the_field(bundled) -> None:
    with pytest.raises(ParameterError) as e:
        chat(response_format={"type": "json_schema", "json_schema": {"name": "n"}}).output_constraints()
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(ParameterError) as e:
        chat(response_format={"type": "yaml"}).output_constraints()
    assert e.value.param == "response_format.type"
    with pytest.raises(ParameterError) as e:
        chat(guided_json="{nope").output_constraints()
    assert e.value.param == "guided_json"
    with pytest.raises(ParameterError) as e:
        request_grammar(chat(guided_regex="a", guided_choice=["a"]).output_constraints(), None)
    assert e.value.param == "guided_choice"
    tok = bundled.tokenizer
    forced = plan_tools([TOOL], "required", None, tok)
    with pytest.raises(ParameterError) as e:
        request_grammar(chat(response_format={"type": "json_object"}).output_constraints(), forced)
    assert e.value.param == "response_format"
    with pytest.raises(ParameterError) as e:
        plan_tools(None, "required", None, tok)
    assert e.value.param == "tool_choice"


def test_tool_plans(bundled) -> None:
    tok = bundled.tokenizer
    auto = plan_tools([TOOL], None, None, tok)
    assert auto.parse and not auto.forced and auto.grammar is not None and auto.grammar.param == "tool_choice"
    # Under auto a response format wins over the tools.
    assert request_grammar(chat(response_format={"type": "json_object"}).output_constraints(), auto).kind \
        is GrammarKind.JSON_OBJECT
    none = plan_tools([TOOL], "none", None, tok)
    assert not none.parse and none.grammar is None
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "f"}}, False, tok)
    assert named.forced and '"additionalProperties": false' in named.grammar.source  # the arguments are closed
    parsed = named.parse_output('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"x": 1})]


def test_tool_calls_render_in_openai_shapes() -> None:
    call = ToolCall("f", '{"x": 1}', id="call_abc")
    result = CompletionResult("chat", "chatcmpl-1", "m", 0, (Choice(0, None, FinishReason.TOOL_CALLS, None, (call,)),),
                              Usage(3, 9, 0, num_forced_tokens=5))
    body = result_body(result)
    assert body["choices"][0] == {"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}}
    assert body["usage"]["forced_tokens"] == 5
    assert "forced_tokens" not in result_body(CompletionResult("chat", "c", "m", 0, (), Usage(1, 1, 0)))["usage"]
    stream = CompletionStream("chat", "chatcmpl-1", "m", 0, None, None)  # type: ignore[arg-type]
    [chunk] = stream_chunks(stream, ChoiceDelta(0, "", None, None, ((0, call),)))
    assert chunk["choices"][0]["delta"] == {"tool_calls": [
        {"index": 0, "id": "call_abc", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
