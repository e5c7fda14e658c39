"""The Responses API's routes (OpenAI's shapes, so the official client's `responses.*` work unchanged):

    POST   /v1/responses                        a Response object, or its events as SSE (`stream: true`)
    GET    /v1/responses/{id}                   DELETE /v1/responses/{id}       POST /v1/responses/{id}/cancel
    GET    /v1/responses/{id}/input_items[?after=&limit=&order=]

`install_responses_routes(app, service, settings)` adds them, with the `ResponsesAPI` (its store in the ledger's
database, kept `retention_s`) among the app's services. Without a ledger, responses are not stored: create
works (a stored or background one cannot), the other routes answer 404.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import SQLAlchemyError

from tokenfactory.batch.routes import principal_lookup
from tokenfactory.gateway.auth import principal_of
from tokenfactory.gateway.routes import call_of, until_disconnect
from tokenfactory.gateway.streaming import EventStream
from tokenfactory.responses.protocol import ResponsesRequest
from tokenfactory.responses.service import ResponseEvents, ResponsesAPI
from tokenfactory.responses.store import ResponseStore
from tokenfactory.service.service import RequestService

logger = logging.getLogger(__name__)

DEFAULT_RETENTION_S = 30 * 86_400  # OpenAI keeps stored responses 30 days


@dataclass(frozen=True)
class ResponsesSettings:
    retention_s: int = DEFAULT_RETENTION_S  # how long a stored response can be read or continued
    send_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.retention_s < 1:
            raise ValueError(f"the responses' retention must be at least a second, got {self.retention_s}")


def open_store(service: RequestService, retention_s: int) -> ResponseStore | None:
    if service.accounting is None:
        return None
    try:
        return ResponseStore(service.accounting.ledger.engine, retention_s)
    except SQLAlchemyError as e:  # the database refuses the table: responses are not stored, the server serves
        logger.warning("stored responses are off: the ledger's database refuses their table (%s)",
                       type(e).__name__ + ": " + str(e).splitlines()[0])
        return None


def install_responses_routes(app: FastAPI, service: RequestService,
                             settings: ResponsesSettings | None = None) -> ResponsesAPI:
    settings = settings or ResponsesSettings()
    api = ResponsesAPI(service, open_store(service, settings.retention_s), principal_lookup(service.tenancy))
    app.state.responses = api
    app.state.services.append(api)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        call = call_of(request)
        work = api.create(call, body)
        result = await work if body.background else await until_disconnect(request, call, work)
        if isinstance(result, dict):
            return JSONResponse(result)
        return event_stream(result, settings.send_timeout_s)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> dict[str, Any]:
        return await api.retrieve(principal_of(request), response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, request: Request) -> dict[str, Any]:
        return await api.delete(principal_of(request), response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str, request: Request) -> dict[str, Any]:
        return await api.cancel(principal_of(request), response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, after: str | None = None, limit: int = 20,
                          order: str = "desc") -> dict[str, Any]:
        return await api.input_items(principal_of(request), response_id, after, limit, order)

    return api


def event_stream(events: ResponseEvents, send_timeout_s: float) -> EventStream:
    """OpenAI's Responses SSE: `event: <type>` and `data: <event>` per event (no [DONE])."""
    async def body() -> AsyncIterator[str]:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    async def on_close(how: str) -> None:
        await events.aclose()

    return EventStream(body(), on_close, send_timeout_s)
