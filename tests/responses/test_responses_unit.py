"""The Responses API's pure parts: input items as chat messages, the chat request a body becomes, the streamed
event order, and the store (per tenant, retention on a manual clock, a stopped server's running responses found again)
on a real SQLite file. tests/responses/test_responses_server.py runs it all on the bundled model."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tokenfactory.models.tools import ToolCall
from tokenfactory.responses.protocol import ResponsesRequest, input_items, item_messages, responses_param
from tokenfactory.responses.render import EventWriter, ResponseState
from tokenfactory.responses.store import ResponseStore
from tokenfactory.types import ParameterError


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                         {"type": "input_text", "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "w", "arguments": "{}"},
    ]
    assert item_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
    ]
    assert input_items("Hi") == [{"type": "message", "role": "user", "content": "Hi"}]
    assert input_items(ResponsesRequest(input="x" * 5000).input)[0]["content"] == "x" * 5000  # a long text is one item
    with pytest.raises(ParameterError) as e:
        input_items([{"role": "user", "content": "x"}] * 4097)
    assert e.value.param == "input"
    for bad, param in (([{"type": "input_image"}], "input[0].type"), ([{"role": "robot", "content": "x"}],
                       "input[0].role"), ([{"role": "user", "content": [{"type": "input_file"}]}],
                                          "input[0].content[0]"),
                       ([{"type": "function_call_output", "output": "x"}], "input[0].call_id")):
        with pytest.raises(ParameterError) as e:
            item_messages(bad)
        assert e.value.param == param


def test_the_chat_request_a_body_becomes() -> None:
    body = ResponsesRequest(input="x", max_output_tokens=9, temperature=0.5, tool_choice={"type": "function",
                            "name": "w"}, tools=[{"type": "function", "name": "w", "parameters": {"type": "object"}}],
                            text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"},
                                             "strict": True}}, stream=True, include=[], truncation="disabled")
    chat = body.chat_request([{"role": "user", "content": "x"}])
    assert chat.max_completion_tokens == 9 and chat.temperature == 0.5 and chat.stream
    assert chat.stream_options.include_usage
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                           "strict": True}}
    with pytest.raises(ParameterError) as e:
        ResponsesRequest(input="x", tools=[{"type": "web_search"}]).chat_request([])
    assert e.value.param == "tools[0]"
    with pytest.raises(ParameterError) as e:
        ResponsesRequest(input="x", background=True, store=False).check_supported()
    assert e.value.param == "background"
    for field, value in (("temperature", -1.0), ("top_p", 2.0)):  # chat's ranges, named as sent here
        with pytest.raises(ParameterError) as e:
            ResponsesRequest(input="x", **{field: value}).chat_request([{"role": "user", "content": "x"}])
        assert e.value.param == field
    assert responses_param("messages[3].tool_calls") == "input" and responses_param("max_tokens") == "max_output_tokens"


def test_streamed_events_in_openais_order() -> None:
    state = ResponseState(ResponsesRequest(input="x"), "m", created_at=1)
    writer = EventWriter(state)
    events = writer.start() + writer.text_delta("Hel") + writer.text_delta("lo") + writer.call(
        ToolCall("w", '{"a": 1}', "call_1"))
    state.status = "completed"
    events += writer.end()
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["output"][1]["call_id"] == "call_1"
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert {e["output_index"] for e in events[9:13]} == {1}


def test_store_per_tenant_with_retention(tmp_path) -> None:
    now = [1000.0]
    store = ResponseStore(sa.create_engine(f"sqlite:///{tmp_path / 'ledger.db'}"), retention_s=60,
                          clock=lambda: now[0])

    def body(rid: str, status: str = "completed") -> dict:
        return {"id": rid, "created_at": 1000, "status": status, "previous_response_id": None}

    store.put("alice", body("r1"), [{"id": "m1"}], [{"role": "user", "content": "hi"}])
    store.put("alice", body("r2", "in_progress"), [], [{"role": "user", "content": "go"}], '{"input": "go"}')
    assert store.get("r1", "alice").messages == [{"role": "user", "content": "hi"}]
    assert store.get("r1", "bob") is None and store.get("r1", None) is not None  # None: an admin's read
    assert not store.delete("r1", "bob") and store.get("r1", "alice") is not None
    store.put("alice", body("r1") | {"status": "incomplete"}, [], [])  # replaced, not added
    assert store.get("r1", "alice").status == "incomplete"
    [run] = store.running()  # a background response a stopped server left running, with what runs it again
    assert (run.response_id, run.tenant, run.request_json, run.messages) == (
        "r2", "alice", '{"input": "go"}', [{"role": "user", "content": "go"}])
    now[0] = 1060.0  # created_at + retention: gone from reads at once, then swept
    assert store.get("r1", "alice") is None
    assert store.sweep() == 2
    now[0] = 0.0
    assert store.get("r1", "alice") is None
