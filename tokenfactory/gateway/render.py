"""Engine outputs rendered as OpenAI response bodies and stream chunks (chat and legacy completions)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tokenfactory.types import FinishReason, Logprob, RequestOutput


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: list[list[Logprob]] | None


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else str(reason)


def usage_dict(finals: list[RequestOutput], extra: dict[str, Any] | None = None) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(o.num_completion_tokens for o in finals)
    cached = sum(o.num_cached_tokens for o in finals)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    sources = {o.tokens_source for o in finals if o.tokens_source is not None}
    if sources:  # an external backend served it: whose counts these are
        usage["tokens_source"] = "+".join(sorted(sources))
    usage.update(extra or {})
    return usage


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


def completion_logprobs(logprobs: list[list[Logprob]] | None, text_offset: int = 0) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for entry in logprobs:
        chosen = entry[0]
        tokens.append(chosen.token)
        token_logprobs.append(chosen.logprob)
        top.append({t.token: t.logprob for t in entry[1:]} if len(entry) > 1 else None)
        offsets.append(offset)
        offset += len(chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class render_chat:  # noqa: N801 - a namespace of renderers, used like a function table
    @staticmethod
    def full(request_id: str, model: str, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                             "logprobs": chat_logprobs(c.logprobs), "finish_reason": finish_reason(c.finish_reason)}
                            for c in choices],
                "usage": usage}

    @staticmethod
    def _chunk(request_id: str, model: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices}

    @staticmethod
    def first_chunks(request_id: str, model: str, created: int, adds: list, echo: bool) -> list[dict[str, Any]]:
        n = adds[0].params.n
        return [render_chat._chunk(request_id, model, created, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for i in range(n)]

    @staticmethod
    def delta_chunks(request_id: str, model: str, created: int, prompt_index: int, out: RequestOutput,
                     finished_before: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """Chunks for what is new in `out`; `finished_before`: choices whose finish was already sent (an
        output carries every choice of its request, finished ones too)."""
        chunks = []
        for c in out.outputs:
            if c.index in finished_before or (not c.token_ids_delta and not c.text_delta and not c.finished):
                continue
            delta = {"content": c.text_delta} if c.text_delta or not c.finished else {}
            chunks.append(render_chat._chunk(request_id, model, created, [{
                "index": c.index, "delta": delta,
                "logprobs": chat_logprobs(c.logprobs_delta) if c.logprobs_delta else None,
                "finish_reason": finish_reason(c.finish_reason)}]))
        return chunks

    @staticmethod
    def usage_chunk(request_id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
        return {**render_chat._chunk(request_id, model, created, []), "usage": usage}


class render_completion:  # noqa: N801
    @staticmethod
    def full(request_id: str, model: str, choices: list[Choice], usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": [{"index": c.index, "text": c.text, "logprobs": completion_logprobs(c.logprobs),
                             "finish_reason": finish_reason(c.finish_reason)} for c in choices],
                "usage": usage}

    @staticmethod
    def _chunk(request_id: str, model: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices}

    @staticmethod
    def first_chunks(request_id: str, model: str, created: int, adds: list, echo: bool) -> list[dict[str, Any]]:
        if not echo:
            return []
        return [render_completion._chunk(request_id, model, created, [
            {"index": i * add.params.n + k, "text": add.prompt or "", "logprobs": None, "finish_reason": None}])
            for i, add in enumerate(adds) for k in range(add.params.n)]

    @staticmethod
    def delta_chunks(request_id: str, model: str, created: int, prompt_index: int, out: RequestOutput,
                     finished_before: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
        """Chunks for what is new in `out`; `finished_before`: choices whose finish was already sent (an
        output carries every choice of its request, finished ones too)."""
        chunks = []
        n = len(out.outputs)
        for c in out.outputs:
            if c.index in finished_before or (not c.token_ids_delta and not c.text_delta and not c.finished):
                continue
            chunks.append(render_completion._chunk(request_id, model, created, [{
                "index": prompt_index * n + c.index, "text": c.text_delta,
                "logprobs": completion_logprobs(c.logprobs_delta) if c.logprobs_delta else None,
                "finish_reason": finish_reason(c.finish_reason)}]))
        return chunks

    @staticmethod
    def usage_chunk(request_id: str, model: str, created: int, usage: dict[str, Any]) -> dict[str, Any]:
        return {**render_completion._chunk(request_id, model, created, []), "usage": usage}
