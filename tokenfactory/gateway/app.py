"""The OpenAI-compatible HTTP API on top of an engine client: the routes, and what wires them.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /v1/usage, GET /health,
GET /metrics (and /admin/* with --auth, admin.py). The rest of the gateway is split by reason to change:
serving.py (requests to engine requests and back), streaming.py (SSE a client cannot hold hostage),
settlement.py (meter, ledger and reservations settled once), errors.py (OpenAI's error shape),
protocol.py (request bodies and their ranges), admission.py and auth.py (who may, how much).

A request can only fail itself: its values are checked where they enter (protocol.py), the engine fails a
request that breaks a step alone (engine/faults.py), its reservations live in one `Reservation` and its
meter, ledger and tenant accounting in one `Settlement`, each released exactly once on every way out, and
a streaming client that stops reading is dropped after `stream_send_timeout_s` (streaming.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenfactory.engine.client import EngineClient
from tokenfactory.fleet.fleet import Fleet
from tokenfactory.gateway import dashboard
from tokenfactory.gateway.accounting import Accounting
from tokenfactory.gateway.admin import Tenancy
from tokenfactory.gateway.admission import Admission
from tokenfactory.gateway.errors import APIError, BodySizeLimit, install_error_handlers
from tokenfactory.gateway.fleet_routes import fleet_down, install_fleet_routes
from tokenfactory.gateway.metrics import ServerMetrics
from tokenfactory.gateway.protocol import ChatCompletionRequest, CompletionRequest
from tokenfactory.gateway.serving import Handler, ServerSettings
from tokenfactory.gateway.settlement import Settlement
from tokenfactory.gateway.trust import LoopbackTrust, TrustSettings

__all__ = ["APIError", "AppService", "ServerSettings", "Settlement", "build_app"]


class AppService(Protocol):
    """Work that lives as long as the app: started when it starts, stopped (in reverse order) before it drains."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def build_app(engine: EngineClient, settings: ServerSettings, accounting: Accounting | None = None,
              on_shutdown: Callable[[], None] | None = None, tenancy: Tenancy | None = None,
              models: Mapping[str, EngineClient] | None = None, allowed_hosts: Sequence[str] = ()) -> FastAPI:
    """`engine` serves `settings.served_model_name`; `models` adds other models by name (a fleet per model);
    `allowed_hosts`: names a request's Host may carry without --auth besides IP literals and localhost
    (gateway/trust.py)."""
    if tenancy is None:  # auth off, no limits but the queue bound
        tenancy = Tenancy(None, Admission(max_waiting=settings.max_waiting, retry_after_s=settings.retry_after_s))
    metrics = ServerMetrics(engine, settings.served_model_name,
                            accounting.meter if accounting else None, accounting.ledger if accounting else None,
                            admission=tenancy.admission, models=models, baseline=settings.baseline)
    handler = Handler(engine, settings, metrics, accounting, tenancy, models)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for service in app.state.services:  # the Batch API's runner resumes unfinished jobs here
            await service.start()
        yield
        for service in reversed(app.state.services):
            await service.stop()
        await handler.drain()  # SIGTERM: every pending ledger row (aborted requests' too) is written first
        app.state.dashboard.close()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tokenfactory", lifespan=lifespan)
    # Started with the app, stopped before the pending ledger rows are drained: what the composition root adds
    # (serve/cli.py installs the Batch API, whose runner is one).
    app.state.services: list[AppService] = []
    app.state.handler = handler
    app.state.metrics = metrics
    install_error_handlers(app, lambda status: metrics.errors.labels(settings.served_model_name, str(status)).inc())
    tenancy.install(app, lambda status: metrics.errors.labels(settings.served_model_name, str(status)).inc())
    fleets = [s.engine for s in handler.models.values() if isinstance(s.engine, Fleet)]
    if fleets:  # /fleet/replicas and per-replica /metrics (fleet_routes.py)
        install_fleet_routes(app, fleets, metrics.registry, tenancy)
    app.state.dashboard = dashboard.install(app, engine, metrics, accounting, tenancy)  # /dashboard (dashboard.py)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_alive:
            return JSONResponse({"status": "unavailable", "reason": engine.dead_reason or "the engine is not running"},
                                status_code=503)
        ledger = accounting.ledger.status() if accounting is not None else None
        if ledger is not None and ledger.degraded:  # serving goes on; rows wait in the journal
            return JSONResponse({"status": "degraded", "model": settings.served_model_name, "reason": ledger.reason,
                                 "ledger_rows_pending": ledger.num_pending})
        down = {**{n: s.engine.dead_reason or "stopped" for n, s in handler.models.items() if not s.engine.is_alive},
                **{rid: why for fleet in fleets for rid, why in fleet_down(fleet).items()}}
        if down:  # serving goes on with the others
            return JSONResponse({"status": "degraded", "model": settings.served_model_name,
                                 "reason": f"{len(down)} models or replicas are not taking requests",
                                 "replicas_down": down})
        return JSONResponse({"status": "ok", "model": settings.served_model_name})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [{
            "id": served.name, "object": "model", "created": int(handler.started), "owned_by": "tokenfactory",
            "root": served.name, "max_model_len": served.engine.info.max_model_len,
            "machine_profile": served.engine.info.machine_profile}  # engine/tuning.py: what this engine measured
            for served in handler.models.values()]}

    @app.get("/v1/usage")
    async def usage(request: Request, since: str | None = None, group_by: str | None = None,
                    tenant: str | None = None) -> dict:
        if accounting is None:
            raise APIError(404, "usage is not recorded by this server (it runs without a ledger)", "not_found_error")
        return await handler.usage(since, group_by, tenancy.usage_tenant(request, tenant))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await handler.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await handler.chat(body, request)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)  # type: ignore[arg-type]
    if not tenancy.auth_on:  # outermost: a browser's cross-site request is refused before anything runs
        app.add_middleware(LoopbackTrust, settings=TrustSettings(tuple(allowed_hosts)),  # type: ignore[arg-type]
                           on_refusal=lambda status: metrics.errors.labels(settings.served_model_name,
                                                                           str(status)).inc())
    return app
