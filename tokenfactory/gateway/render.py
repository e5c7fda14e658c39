"""The request service's typed results rendered in OpenAI's shapes: response bodies, stream chunks, usage.

Used by the HTTP routes and by the Batch API, whose output file holds the same bodies.
"""

from __future__ import annotations

import array
import base64
import sys
from typing import Any

from tokenfactory.meter.attribution import RequestEnergy
from tokenfactory.models.tools import ToolCall
from tokenfactory.service.results import (
    Choice,
    ChoiceDelta,
    CompletionResult,
    CompletionStream,
    EmbeddingResult,
    PromptLogprobs,
    PromptRendering,
    StreamEnd,
    StreamEvent,
    StreamFailed,
    StreamStart,
    Usage,
)
from tokenfactory.types import FinishReason, Logprob


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def energy_fields(energy: RequestEnergy) -> dict[str, Any]:
    return {"energy_joules": energy.energy_joules, "energy_source": energy.energy_source,
            "energy_scope": energy.energy_scope, "energy_overhead_factor": energy.energy_overhead_factor,
            "facility_energy_joules": energy.facility_energy_joules,
            "joules_per_output_token": energy.joules_per_output_token,
            "cost_usd": energy.cost_usd, "cost_device_usd": energy.cost_device_usd,
            "cost_energy_usd": energy.cost_energy_usd}


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage object, with the energy and cost fields when the server meters (absent without a meter)."""
    body: dict[str, Any] = {"prompt_tokens": usage.num_prompt_tokens, "completion_tokens": usage.num_completion_tokens,
                            "total_tokens": usage.num_total_tokens,
                            "prompt_tokens_details": {"cached_tokens": usage.num_cached_tokens}}
    if usage.tokens_source is not None:  # an external backend served it: whose counts these are
        body["tokens_source"] = usage.tokens_source
    if usage.energy is not None:
        body.update(energy_fields(usage.energy))
    if usage.num_forced_tokens is not None:  # a grammar's forced tokens: output made without a decode step each
        body["forced_tokens"] = usage.num_forced_tokens
    if (c := usage.compression) is not None:
        body.update({"compressed_prompt_tokens": c.compressed_prompt_tokens,
                     "compression_summary_tokens": c.summary_tokens,
                     "compression_summary_request_id": c.summary_request_id})
    return body


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: list[list[Logprob]] | None) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    content = []
    for entry in logprobs:
        chosen, top = entry[0], entry[1:]
        content.append({"token": chosen.token, "logprob": chosen.logprob, "bytes": _token_bytes(chosen.token),
                        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token)}
                                         for t in top]})
    return {"content": content}


def completion_logprobs(logprobs: list[list[Logprob]] | None, text_offset: int = 0,
                        echoed: PromptLogprobs | None = None, num_echoed: int = 0) -> dict[str, Any] | None:
    """The legacy completions logprobs. `echoed`: the prompt's logprobs first (echo with logprobs), each with its
    top `num_echoed`; the first prompt token has none (`null`), as OpenAI and vLLM return it."""
    if logprobs is None and echoed is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset
    if echoed is not None:
        tokens.append(echoed.first_token)
        token_logprobs.append(None)
        top.append(None)
        offsets.append(offset)
        offset += len(echoed.first_token)
    entries = [(e, num_echoed) for e in (echoed.entries if echoed is not None else [])]
    for entry, k in entries + [(e, len(e) - 1) for e in logprobs or []]:
        chosen = entry[0]
        tokens.append(chosen.token)
        token_logprobs.append(chosen.logprob)
        top.append({t.token: t.logprob for t in entry[1:1 + k]} if k else None)
        offsets.append(offset)
        offset += len(chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def tool_call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {} if index is None else {"index": index}
    return {**body, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def vllm_prompt_logprobs(prompt: PromptLogprobs | None, k: int | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first token, then per token {token id: {logprob, rank,
    decoded_token}} for the token itself and the top `k`."""
    if prompt is None or k is None:
        return None
    out: list[dict[str, Any] | None] = [None]
    for entry in prompt.entries:
        out.append({str(t.token_id): {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.token}
                    for t in entry[:1 + k]})
    return out


def _chat_choice(c: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message["tool_calls"] = [tool_call_body(call) for call in c.tool_calls]
    return {"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs),
            "finish_reason": finish_reason(c.finish_reason)}


def _text_choice(c: Choice, prompt: PromptRendering) -> dict[str, Any]:
    echoed = c.prompt_logprobs if prompt.echo_logprobs is not None else None
    body = {"index": c.index, "text": c.text or "",
            "logprobs": completion_logprobs(c.logprobs, 0, echoed, prompt.echo_logprobs or 0),
            "finish_reason": finish_reason(c.finish_reason)}
    if prompt.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs, prompt.prompt_logprobs)
    return body


def result_body(result: CompletionResult) -> dict[str, Any]:
    """A `chat.completion` or `text_completion` body."""
    chat = result.kind == "chat"
    body = {"id": result.request_id, "object": "chat.completion" if chat else "text_completion",
            "created": result.created, "model": result.model,
            "choices": [_chat_choice(c) if chat else _text_choice(c, result.prompt) for c in result.choices],
            "usage": usage_body(result.usage)}
    if chat and result.prompt.prompt_logprobs is not None and result.choices:  # vLLM's: beside the choices
        body["prompt_logprobs"] = vllm_prompt_logprobs(result.choices[0].prompt_logprobs, result.prompt.prompt_logprobs)
    return body


def stream_chunks(stream: CompletionStream, event: StreamEvent) -> list[dict[str, Any]]:
    """The chunks one stream event becomes (an error event is `{"error": ...}`, as vLLM and OpenAI send it)."""
    chat = stream.kind == "chat"
    head = {"id": stream.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": stream.created, "model": stream.model}
    if isinstance(event, StreamStart):
        if chat:
            return [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
                    for i, _ in event.choice_to_prefix]
        return [{**head, "choices": [{"index": i, "text": prefix, "logprobs": None, "finish_reason": None}]}
                for i, prefix in event.choice_to_prefix if event.echo]
    if isinstance(event, ChoiceDelta):
        rendering = stream.prompt
        if chat:
            delta: dict[str, Any] = {"content": event.text} if event.text or (
                event.finish_reason is None and not event.tool_calls) else {}
            if event.tool_calls:  # each call whole, in OpenAI's delta shape (id, name and all its arguments)
                delta["tool_calls"] = [tool_call_body(call, i) for i, call in event.tool_calls]
            choice = {"index": event.index, "delta": delta, "logprobs": chat_logprobs(event.logprobs),
                      "finish_reason": finish_reason(event.finish_reason)}
            chunk = {**head, "choices": [choice]}
            if rendering.prompt_logprobs is not None and event.prompt_logprobs is not None:
                chunk["prompt_logprobs"] = vllm_prompt_logprobs(event.prompt_logprobs, rendering.prompt_logprobs)
            return [chunk]
        echoed = event.prompt_logprobs if rendering.echo_logprobs is not None else None
        choice = {"index": event.index, "text": event.text,
                  "logprobs": completion_logprobs(event.logprobs, 0, echoed, rendering.echo_logprobs or 0),
                  "finish_reason": finish_reason(event.finish_reason)}
        if rendering.prompt_logprobs is not None and event.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(event.prompt_logprobs, rendering.prompt_logprobs)
        return [{**head, "choices": [choice]}]
    if isinstance(event, StreamEnd):
        return [{**head, "choices": [], "usage": usage_body(event.usage)}]
    assert isinstance(event, StreamFailed)
    kind = "server_error" if event.param is None else "invalid_request_error"
    return [{"error": {"message": event.message, "type": kind, "param": event.param, "code": event.code}}]


def embedding_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """`base64`: the float32 values' little-endian bytes, base64-encoded (what OpenAI's client decodes)."""
    if encoding_format != "base64":
        return values
    packed = array.array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def embedding_body(result: EmbeddingResult, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings list; its usage carries the prompt tokens and the energy and cost fields."""
    usage = usage_body(result.usage)
    for name in ("completion_tokens", "prompt_tokens_details"):
        usage.pop(name, None)
    return {"object": "list", "model": result.model, "id": result.request_id,
            "data": [{"object": "embedding", "index": i, "embedding": embedding_vector(v, encoding_format)}
                     for i, v in enumerate(result.embeddings)],
            "usage": usage}
