"""The Responses API's request body, and what it becomes: the chat messages and the chat request the request
service runs (its tools, structured outputs, admission, metering and ledger row are chat's).

    input              a string (one user message) or a list of items: messages (`{"role", "content"}` with
                       text or input_text/output_text parts; `"type": "message"` optional), `function_call`
                       (an earlier call of the model) and `function_call_output` (its result); `reasoning`
                       items are skipped (no reasoning is produced here)
    instructions       a system message first (not carried into a continuation, as OpenAI does)
    tools              `{"type": "function", "name", "description", "parameters", "strict"}` (flat, not chat's
                       nested `function`); tool_choice `auto`/`none`/`required`/`{"type": "function", "name"}`
    text.format        `text`, `json_object`, or `{"type": "json_schema", "name", "schema", "strict"}`
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from tokenfactory.service.protocol import MAX_MESSAGES, MAX_TOKENS, ChatCompletionRequest
from tokenfactory.types import ParameterError

ROLES = ("user", "assistant", "system", "developer")
IGNORED_ITEM_TYPES = ("reasoning",)  # a client replays what another model produced; nothing here reads it


class ResponsesRequest(BaseModel):
    """POST /v1/responses. Fields OpenAI's SDKs send that change nothing here are accepted and ignored (include,
    truncation, reasoning, prompt caching, service_tier, safety_identifier); anything else is a 400 naming it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]  # a list: at most MAX_MESSAGES items (input_items); a string: any length
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # not OpenAI's here, vLLM's: reproducible sampling
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default: kept (for `retention` seconds here), retrievable and continuable
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Accepted, changing nothing: what the official SDKs send by default or on request.
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check_supported(self) -> None:
        if self.background and not self.store:
            raise ParameterError("background", "background responses must be stored: set store to true (or "
                                 "leave it out)")
        if self.background and self.stream:
            raise ParameterError("stream", "a background response does not stream here: leave stream out and "
                                 "poll GET /v1/responses/{id}")

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request that answers this response, over `messages` (the conversation so far and this input)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                                "top_p": self.top_p, "seed": self.seed, "user": self.user,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.tools:
            body["tools"] = [chat_tool(t, i) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = chat_tool_choice(self.tool_choice)
        if self.text is not None:
            body["response_format"] = response_format(self.text)
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except pydantic.ValidationError as e:  # a range chat checks (temperature, top_p): named as sent here
            error = e.errors()[0]
            param = responses_param(".".join(str(part) for part in error["loc"]) or "input")
            raise ParameterError(param, f"invalid value for {param}: {error['msg']}") from e


CHAT_TO_RESPONSES_FIELD = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                           "max_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_param(param: str) -> str:
    """A chat request's field, as the Responses request calls it (`messages[2]` -> `input`)."""
    return CHAT_TO_RESPONSES_FIELD.get(param.split(".")[0].split("[")[0], param)


def chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise ParameterError(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': "
                             f"...}}: this server runs function tools only, got type {tool.get('type')!r}")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice  # auto, none, required: chat checks them
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" or "mode" in choice:
        raise ParameterError("tool_choice", "tool_choice allowed_tools is not supported by this server")
    raise ParameterError("tool_choice", "tool_choice must be auto, none, required or {'type': 'function', 'name'}")


def response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise ParameterError("text.format", "text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                             "{'type': 'json_schema', 'name', 'schema', 'strict'}")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not value:
        raise ParameterError("input", "input must not be empty")
    if len(value) > MAX_MESSAGES:
        raise ParameterError("input", f"input holds at most {MAX_MESSAGES} items, got {len(value)}")
    return value


def item_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant turn before it (or starts one), its
    output is a `tool` message."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind in IGNORED_ITEM_TYPES:
            continue
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": text})
        else:
            raise ParameterError(f"input[{i}].type", f"input[{i}] has type {kind!r}: this server takes message, "
                                 "function_call and function_call_output items")
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise ParameterError(f"input[{i}].role", f"input[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"input[{i}].content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(parts: object, param: str) -> str:
    if not isinstance(parts, list):
        raise ParameterError(param, f"{param} must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ParameterError(f"{param}[{j}]", f"{param}[{j}] is {kind!r}: this server reads text parts only "
                                 "(input_text, output_text)")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ParameterError(f"input[{i}].{key}", f"input[{i}].{key} must be a string")
    return value
