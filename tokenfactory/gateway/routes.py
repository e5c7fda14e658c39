"""The OpenAI routes as thin adapters over the request service: build the `Call` from the request (the
principal auth found; the cancel signal set when the client disconnects), call the service, render its typed
result (gateway/render.py) as a JSON body or a server-sent-event stream (streaming.py).

    GET  /v1/models            POST /v1/completions            POST /v1/chat/completions
    POST /v1/embeddings        POST /tokenize, /detokenize (vLLM's shapes)
    GET  /v1/usage[?since=&group_by=&tenant=]
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenfactory.gateway.auth import principal_of
from tokenfactory.gateway.direct import DirectWriter
from tokenfactory.gateway.render import embedding_body, result_body, stream_chunks
from tokenfactory.gateway.streaming import EventStream, sse
from tokenfactory.service.call import Call
from tokenfactory.service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from tokenfactory.service.results import CompletionResult, CompletionStream, StreamEnd, StreamFailed
from tokenfactory.service.service import RequestService

T = TypeVar("T")
DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks that its client is still there


def call_of(request: Request) -> Call:
    return Call(principal_of(request))


async def until_disconnect(request: Request, call: Call, work: Awaitable[T]) -> T:
    """Await the service's work; if the client disconnects first, set the call's cancel signal (the service
    aborts the engine requests and settles the request as aborted) and let the work end."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                call.cancelled.set()
                return await task  # raises Cancelled once everything is released
    finally:
        if not task.done():  # this route itself was cancelled
            call.cancelled.set()
            task.cancel()


def answer(result: CompletionResult | CompletionStream, include_usage: bool, send_timeout_s: float,
           direct_writes: bool = True) -> Response:
    if isinstance(result, CompletionResult):
        return JSONResponse(result_body(result))
    return sse_response(result, include_usage, send_timeout_s, direct_writes)


def sse_response(stream: CompletionStream, include_usage: bool, send_timeout_s: float,
                 direct_writes: bool = True) -> EventStream:
    """The stream's events as OpenAI's chunks; the usage chunk only with stream_options.include_usage, then
    `data: [DONE]` (an error event ends the stream without it). Closing the response closes the stream.
    `direct_writes`: a plain delta's chunk may be written from the engine's thread (direct.py), the same bytes."""
    async def body() -> AsyncIterator[str]:
        async for event in stream:
            if isinstance(event, StreamFailed):
                yield sse(stream_chunks(stream, event)[0])
                return
            if isinstance(event, StreamEnd) and not include_usage:
                continue
            for chunk in stream_chunks(stream, event):
                yield sse(chunk, include_usage)
        yield "data: [DONE]\n\n"

    async def on_close(how: str) -> None:
        await stream.aclose()

    def direct(writer: DirectWriter) -> bool:  # a plain delta's chunk, the same bytes as body() would send
        return stream.send_directly(lambda delta: writer.write(sse(stream_chunks(stream, delta)[0],
                                                                   include_usage).encode()))

    return EventStream(body(), on_close, send_timeout_s, direct if direct_writes else None)


def include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def install_openai_routes(app: FastAPI, service: RequestService, send_timeout_s: float,
                          direct_writes: bool = True) -> None:
    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": int(service.started), "owned_by": "tokenfactory",
            "root": served.name, "max_model_len": served.engine.info.max_model_len,
            "machine_profile": served.engine.info.machine_profile}  # engine/tuning.py: what this engine measured
            for served in service.models.values()]}

    @app.get("/v1/usage")
    async def usage(request: Request, since: str | None = None, group_by: str | None = None,
                    tenant: str | None = None) -> dict[str, Any]:
        report = await service.usage(call_of(request), since, group_by, tenant)
        return {"object": "usage", "group_by": report.group_by, "since": report.since, "tenant": report.tenant,
                "data": [dataclasses.asdict(r) for r in report.rows]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        call = call_of(request)
        result = await until_disconnect(request, call, service.completions(call, body))
        return answer(result, include_usage(body), send_timeout_s, direct_writes)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        call = call_of(request)
        result = await until_disconnect(request, call, service.chat(call, body))
        return answer(result, include_usage(body), send_timeout_s, direct_writes)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        call = call_of(request)
        result = await until_disconnect(request, call, service.embeddings(call, body))
        return JSONResponse(embedding_body(result, body.encoding_format))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        result = await service.tokenize(body)
        return {"count": len(result.token_ids), "max_model_len": result.max_model_len, "tokens": result.token_ids,
                "token_strs": result.token_strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return {"prompt": await service.detokenize(body)}
