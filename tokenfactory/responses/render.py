"""The Responses API's shapes: the Response object, its output items, usage (tokens, joules, cost), and the
streamed events in OpenAI's order, each with its `sequence_number`:

    response.created, response.in_progress
    per message:  response.output_item.added, response.content_part.added, response.output_text.delta...,
                  response.output_text.done, response.content_part.done, response.output_item.done
    per call:     response.output_item.added, response.function_call_arguments.delta (the whole arguments:
                  calls are parsed whole), response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete at max_output_tokens, response.failed)
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from tokenfactory.gateway.render import usage_body
from tokenfactory.models.tools import ToolCall
from tokenfactory.responses.protocol import ResponsesRequest
from tokenfactory.service.results import Usage


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if status == "completed" else "", "status": status}


def response_usage(usage: Usage) -> dict[str, Any]:
    """OpenAI's response usage (input/output tokens) with the meter's joules and cost beside them."""
    body = usage_body(usage)
    out = {"input_tokens": body.pop("prompt_tokens"), "output_tokens": body.pop("completion_tokens"),
           "total_tokens": body.pop("total_tokens"),
           "input_tokens_details": body.pop("prompt_tokens_details"),
           "output_tokens_details": {"reasoning_tokens": 0}}
    return out | body


@dataclass
class ResponseState:
    """One response while it is made: its request, id, and the output so far (the stored object is `body()`)."""

    request: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = 0
    status: str = "in_progress"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    incomplete_reason: str | None = None

    def body(self) -> dict[str, Any]:
        r = self.request
        text = r.text if r.text is not None else {"format": {"type": "text"}}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": self.model, "output": list(self.output), "usage": self.usage, "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p, "tools": r.tools or [],
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False, "text": text,
            "previous_response_id": r.previous_response_id, "store": r.store, "background": r.background,
            "metadata": r.metadata or {}, "user": r.user, "truncation": r.truncation or "disabled",
            "reasoning": None, "service_tier": "default",
        }

    def response_event(self, kind: str) -> dict[str, Any]:
        return {"type": kind, "response": self.body()}


class EventWriter:
    """The events a streamed response sends, as the chat stream's deltas arrive: a message item opened by the
    first text, closed before a call or at the end; each call an item of its own."""

    def __init__(self, state: ResponseState) -> None:
        self.state = state
        self.num_events = 0
        self.message_id: str | None = None
        self.text = ""

    def _out(self, event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = self.num_events
        self.num_events += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._out(self.state.response_event("response.created")),
                self._out(self.state.response_event("response.in_progress"))]

    def text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        index = len(self.state.output)
        if self.message_id is None:
            self.message_id = new_id("msg")
            events += [self._out({"type": "response.output_item.added", "output_index": index,
                                  "item": message_item(self.message_id, "", "in_progress")}),
                       self._out({"type": "response.content_part.added", "item_id": self.message_id,
                                  "output_index": index, "content_index": 0, "part": text_part("")})]
        self.text += text
        events.append(self._out({"type": "response.output_text.delta", "item_id": self.message_id,
                                 "output_index": index, "content_index": 0, "delta": text, "logprobs": []}))
        return events

    def close_message(self) -> list[dict[str, Any]]:
        if self.message_id is None:
            return []
        index, item_id, text = len(self.state.output), self.message_id, self.text
        item = message_item(item_id, text)
        self.state.output.append(item)
        self.message_id, self.text = None, ""
        return [self._out({"type": "response.output_text.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "text": text, "logprobs": []}),
                self._out({"type": "response.content_part.done", "item_id": item_id, "output_index": index,
                           "content_index": 0, "part": text_part(text)}),
                self._out({"type": "response.output_item.done", "output_index": index, "item": item})]

    def call(self, call: ToolCall) -> list[dict[str, Any]]:
        events = self.close_message()
        index, item_id = len(self.state.output), new_id("fc")
        item = call_item(item_id, call)
        self.state.output.append(item)
        return events + [
            self._out({"type": "response.output_item.added", "output_index": index,
                       "item": call_item(item_id, call, "in_progress")}),
            self._out({"type": "response.function_call_arguments.delta", "item_id": item_id, "output_index": index,
                       "delta": call.arguments}),
            self._out({"type": "response.function_call_arguments.done", "item_id": item_id, "output_index": index,
                       "arguments": call.arguments, "name": call.name}),
            self._out({"type": "response.output_item.done", "output_index": index, "item": item})]

    def end(self) -> list[dict[str, Any]]:
        """After the state's status is set: the closing events."""
        events = self.close_message()
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(self.state.status,
                                                                                           "response.failed")
        return events + [self._out(self.state.response_event(kind))]
