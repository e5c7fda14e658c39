"""/dashboard: the factory floor in a browser — utilisation, tokens, power and money, live, joined.

    GET /dashboard                   the page (static HTML; uPlot vendored under static/vendor, no CDN)
    GET /dashboard/static/{file}     its script, style and the chart library
    GET /dashboard/events            server-sent events: {"type": "history"} with the last hour's points,
                                     then {"type": "point"} every second (dashboard_feed.py), and for an
                                     admin {"type": "tenants"} every `tenants_interval_s`: per tenant this
                                     month's tokens, joules, dollars and budget left, and the last requests

Who may watch: with --auth, an admin API key (the page asks for one and sends it as a bearer token; a
tenant's key is refused, 403); without --auth, clients on loopback only (the operator at the machine),
and no tenant section. The events are an `EventStream` (streaming.py) with a send deadline, so a page that
stops reading is dropped instead of holding the server; the points come from the feed's history, so a
page costs one wake-up a second and computes nothing.

`install` is the one call build_app makes; it also starts the hourly utilisation rollup
(meter/utilisation.py) when the server has a ledger. `close()` stops both (the app's shutdown).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response

from tokenfactory.engine.client import EngineClient
from tokenfactory.gateway.auth import Auth
from tokenfactory.gateway.dashboard_feed import DashboardFeed
from tokenfactory.gateway.streaming import EventStream, sse
from tokenfactory.service.errors import Refusal

if TYPE_CHECKING:
    from tokenfactory.gateway.metrics import ServerMetrics
    from tokenfactory.meter.utilisation import UtilisationRecorder
    from tokenfactory.service.accounting import Accounting
    from tokenfactory.service.tenancy import Tenancy

STATIC_DIR = Path(__file__).with_name("static")
STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css",
                "vendor/uPlot.iife.min.js": "text/javascript", "vendor/uPlot.min.css": "text/css",
                "vendor/uPlot.LICENSE": "text/plain"}
NUM_RECENT_REQUESTS = 20


class Dashboard:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, accounting: Accounting | None,
                 tenancy: Tenancy, auth: Auth, *, interval_s: float = 1.0, tenants_interval_s: float = 5.0,
                 send_timeout_s: float = 10.0, rollup_interval_s: float | None = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.accounting, self.tenancy, self.auth = accounting, tenancy, auth
        self.tenants_interval_s, self.send_timeout_s = tenants_interval_s, send_timeout_s
        # One ledger read per interval however many admin pages are open: they share the latest view.
        self._tenants_lock = asyncio.Lock()
        self._tenants_view: tuple[float, dict[str, Any]] | None = None
        self._clock = clock
        self.feed = DashboardFeed(engine, metrics.ttft, metrics.itl, accounting.meter if accounting else None,
                                  interval_s=interval_s).start()
        self.recorder: UtilisationRecorder | None = None
        if accounting is not None and rollup_interval_s is not None:
            from tokenfactory.meter.utilisation import UtilisationRecorder

            self.recorder = UtilisationRecorder(accounting.meter, accounting.ledger.engine,
                                                rollup_interval_s).start()

    def close(self) -> None:
        self.feed.close()
        if self.recorder is not None:
            self.recorder.close()

    async def authorize(self, request: Request) -> bool:
        """Whether the caller sees the admin (tenant) view; raises Refusal for those who may not watch."""
        if self.auth.authenticator is not None:
            principal = await self.auth.principal(request.headers.get("authorization"))
            if not principal.is_admin:
                raise Refusal(403, "the dashboard needs an admin API key (`tokenfactory keys create --admin`); "
                              "this key belongs to a tenant", "permission_error", "admin_only")
            return True
        host = request.client.host if request.client is not None else ""
        if not is_loopback(host):
            raise Refusal(403, "without --auth the dashboard is served to loopback clients only: open it on the "
                          "server's machine (or an SSH tunnel), or start the server with --auth and use an "
                          "admin key", "permission_error", "loopback_only")
        return False

    async def events(self, admin: bool) -> AsyncIterator[str]:
        seq, history = self.feed.points_after(0)
        yield sse({"type": "history", "interval_s": self.feed.interval_s, "admin": admin, "points": history})
        next_tenants = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if admin and loop.time() >= next_tenants:
                next_tenants = loop.time() + self.tenants_interval_s
                yield sse({"type": "tenants", **await self.shared_tenant_view()})
            await asyncio.sleep(self.feed.interval_s / 2)
            seq, points = self.feed.points_after(seq)
            for point in points:
                yield sse({"type": "point", "point": point})

    async def shared_tenant_view(self) -> dict[str, Any]:
        """tenant_view, read on a worker thread at most once per `tenants_interval_s` for all pages."""
        async with self._tenants_lock:
            cached, now = self._tenants_view, self._clock()
            if cached is None or now - cached[0] >= self.tenants_interval_s * 0.9:
                cached = self._tenants_view = (now, await asyncio.to_thread(self.tenant_view))
            return cached[1]

    def tenant_view(self) -> dict[str, Any]:
        """This month's usage per tenant with its budget left, and the last requests (a thread's work: it
        reads the ledger and the tenant store)."""
        from tokenfactory.meter.invoice import recent_requests
        from tokenfactory.meter.ledger import utc_now

        if self.accounting is None:
            return {"tenants": [], "recent": []}
        now = utc_now()
        month_start = dt.datetime(now.year, now.month, 1)
        name_to_usage = {t.key: t for t in self.accounting.ledger.totals(since=month_start, group_by="tenant")}
        store, admission = self.tenancy.store, self.tenancy.admission
        tenants = store.list_tenants() if store is not None else []
        names = sorted(set(name_to_usage) | {t.name for t in tenants})
        name_to_tenant = {t.name: t for t in tenants}
        rows = []
        for name in names:
            u, tenant = name_to_usage.get(name), name_to_tenant.get(name)
            rows.append({"name": name, "requests": u.num_requests if u else 0,
                         "tokens": (u.prompt_tokens + u.completion_tokens) if u else 0,
                         "joules": u.energy_joules if u else None, "usd": u.cost_usd if u else None,
                         **budget_left(admission, tenant)})
        return {"month": month_start.strftime("%Y-%m"), "tenants": rows,
                "recent": recent_requests(self.accounting.ledger.engine, NUM_RECENT_REQUESTS)}


def budget_left(admission: Any, tenant: Any) -> dict[str, Any]:  # noqa: ANN401 - Admission, Tenant | None
    if tenant is None or tenant.budget is None:
        return {"budget": None, "budget_left": None, "budget_unit": None}
    admission.prime(tenant)  # the ledger read happens here, outside admission's lock
    state = admission.budget_status(tenant)
    left = state.budget.amount - state.spent - state.reserved if state is not None else None
    return {"budget": tenant.budget.describe(), "budget_left": left, "budget_unit": tenant.budget.unit}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def install(app: FastAPI, engine: EngineClient, metrics: ServerMetrics, accounting: Accounting | None,
            tenancy: Tenancy, auth: Auth, **options: Any) -> Dashboard:  # noqa: ANN401 - Dashboard's keyword options
    """The dashboard's routes on `app`; returns the Dashboard, whose close() the app's shutdown calls."""
    dashboard = Dashboard(engine, metrics, accounting, tenancy, auth, **options)

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{path:path}", include_in_schema=False)
    async def static(path: str) -> Response:
        if path not in STATIC_FILES:  # a fixed list: no path from the URL reaches the file system
            return Response("not found", status_code=404, media_type="text/plain")
        return FileResponse(STATIC_DIR / path, media_type=STATIC_FILES[path])

    @app.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        admin = await dashboard.authorize(request)

        async def on_close(how: str) -> None:
            return None

        return EventStream(dashboard.events(admin), on_close, dashboard.send_timeout_s)

    return dashboard
