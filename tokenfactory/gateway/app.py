"""The OpenAI-compatible HTTP API over the request service: the app, and what wires it.

Routes: the OpenAI ones (routes.py: models, completions, chat, usage), GET /health, GET /metrics, /admin/*
with --auth (admin.py), /dashboard (dashboard.py), /fleet/* over a fleet (fleet_routes.py); the composition
root adds the Batch API's (batch/routes.py). The HTTP side is split by reason to change: routes.py (a
request to a `Call` and the service's typed result to OpenAI's shapes, render.py), streaming.py (SSE a client
cannot hold hostage), errors.py (OpenAI's error shape), auth.py and admin.py (who is calling), limits.py
(connections), metrics.py. What a request does — validation, admission, the engine, settlement — is the
request service's (tokenfactory/service/).

A request can only fail itself: its values are checked where they enter (service/protocol.py), the engine
fails a request that breaks a step alone (engine/faults.py), its reservations live in one `Reservation` and
its meter, ledger and tenant accounting in one `Settlement`, each released exactly once on every way out,
and a streaming client that stops reading is dropped after `stream_send_timeout_s` (streaming.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenfactory.engine.client import EngineClient
from tokenfactory.gateway import dashboard
from tokenfactory.gateway.admin import install_tenancy
from tokenfactory.gateway.auth import StoreExecutor
from tokenfactory.gateway.errors import APIError, BodySizeLimit, install_error_handlers
from tokenfactory.gateway.fleet_routes import install_fleet_routes, replicas_down
from tokenfactory.gateway.metrics import LatencyObserver, ServerMetrics
from tokenfactory.gateway.routes import install_openai_routes
from tokenfactory.gateway.trust import LoopbackTrust, TrustSettings
from tokenfactory.service.accounting import Accounting
from tokenfactory.service.admission import Admission
from tokenfactory.service.service import RequestService
from tokenfactory.service.tenancy import Tenancy

__all__ = ["APIError", "AppService", "ServerSettings", "build_app"]


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    max_waiting: int = 256  # requests queued beyond this are refused with 503 (service/admission.py enforces it)
    max_body_bytes: int = 4 << 20
    retry_after_s: int = 2
    stream_send_timeout_s: float = 30.0  # a streaming client that takes no data this long is dropped
    direct_stream_writes: bool = True  # plain streams' chunks from the engine's thread (direct.py)
    baseline: tuple[str, float] | None = None  # (bench run, its J/output token): /metrics for the regression alert


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
    service = RequestService({settings.served_model_name: engine, **(models or {})}, accounting, tenancy,
                             LatencyObserver(metrics))
    executor = StoreExecutor()  # the tenant store's own threads: key lookups and /admin routes

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for started in app.state.services:  # the Batch API's runner resumes unfinished jobs here
            await started.start()
        yield
        for started in reversed(app.state.services):
            await started.stop()
        await service.drain()  # SIGTERM: every pending ledger row (aborted requests' too) is written first
        app.state.dashboard.close()
        executor.shutdown()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="tokenfactory", lifespan=lifespan)
    # Started with the app, stopped before the pending ledger rows are drained: what the composition root adds
    # (serve/cli.py installs the Batch API, whose runner is one).
    app.state.services: list[AppService] = []
    app.state.service = service
    app.state.metrics = metrics

    def count_error(status: int) -> None:
        metrics.errors.labels(settings.served_model_name, str(status)).inc()

    install_error_handlers(app, count_error)
    auth = install_tenancy(app, tenancy, executor, count_error)

    def served_clients() -> dict[str, EngineClient]:
        return {name: s.engine for name, s in service.models.items()}

    # /fleet/replicas and per-replica /metrics (fleet_routes.py), over each client's replica states
    install_fleet_routes(app, served_clients, metrics.registry, tenancy)
    app.state.dashboard = dashboard.install(app, engine, metrics, accounting, tenancy, auth)  # /dashboard
    install_openai_routes(app, service, settings.stream_send_timeout_s, settings.direct_stream_writes)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_alive:
            return JSONResponse({"status": "unavailable", "reason": engine.dead_reason or "the engine is not running"},
                                status_code=503)
        ledger = accounting.ledger.status() if accounting is not None else None
        if ledger is not None and ledger.degraded:  # serving goes on; rows wait in the journal
            return JSONResponse({"status": "degraded", "model": settings.served_model_name, "reason": ledger.reason,
                                 "ledger_rows_pending": ledger.num_pending})
        down = {**{n: s.engine.dead_reason or "stopped" for n, s in service.models.items() if not s.engine.is_alive},
                **replicas_down(served_clients())}
        if down:  # serving goes on with the others
            return JSONResponse({"status": "degraded", "model": settings.served_model_name,
                                 "reason": f"{len(down)} models or replicas are not taking requests",
                                 "replicas_down": down})
        return JSONResponse({"status": "ok", "model": settings.served_model_name})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)  # type: ignore[arg-type]
    if not tenancy.auth_on:  # outermost: a browser's cross-site request is refused before anything runs
        app.add_middleware(LoopbackTrust, settings=TrustSettings(tuple(allowed_hosts)),  # type: ignore[arg-type]
                           on_refusal=count_error)
    return app
