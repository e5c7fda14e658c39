"""Tenancy in the server: authentication, admission, fair-share weights, scoped usage, /admin routes.

`Tenancy` is the one object app.py talks to:

    install(app, count_error)        auth middleware, the Refusal handler, /admin routes (with --auth)
    admit(request, request_id, n)    principal -> limits checked and reserved -> (tenant, priority)
    settle(request_id, finals, use)  actual use replaces the reservation (every ending calls it)
    usage_tenant(request, tenant)    whose usage the caller may read (None: everyone's)

/admin routes (an admin API key; JSON in and out; errors in OpenAI's shape):

    GET    /admin/tenants                 list
    POST   /admin/tenants                 {"name", "priority", "weight", "rpm", "tpm", "max_concurrency", "budget"}
    PATCH  /admin/tenants/{name}          any of those fields; null removes a limit or the budget
    DELETE /admin/tenants/{name}          the tenant and its keys (ledger rows stay)
    GET    /admin/keys[?tenant=NAME]      ids and states, never secrets
    POST   /admin/keys                    {"tenant", "admin", "expires"} -> {"key": ..., shown once}
    DELETE /admin/keys/{key_id}           revoke
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tokenfactory.gateway.admission import Actual, Admission, Ticket
from tokenfactory.gateway.auth import ANONYMOUS_PRINCIPAL, AuthMiddleware, KeyAuthenticator, Principal, Refusal
from tokenfactory.meter.ledger import utc_now
from tokenfactory.tenants.cli import key_dict, parse_expires, tenant_dict
from tokenfactory.tenants.store import Budget, Tenant, TenantStore
from tokenfactory.types import ParameterError, RequestOutput


class Tenancy:
    def __init__(self, store: TenantStore | None, admission: Admission | None = None,
                 policy: object | None = None) -> None:
        """`store` None: auth off (everyone is "anonymous", standard priority, no limits). `policy`: the
        engine's waiting-queue policy; tenant weights are handed to it if it takes them (set_weight)."""
        self.store = store
        self.authenticator = KeyAuthenticator(store) if store is not None else None
        self.admission = admission if admission is not None else Admission()
        self.set_weight: Callable[[str, float], None] | None = getattr(policy, "set_weight", None)
        self.request_id_to_ticket: dict[str, Ticket] = {}

    @property
    def auth_on(self) -> bool:
        return self.authenticator is not None

    def install(self, app: FastAPI, count_error: Callable[[int], None]) -> None:
        app.add_middleware(AuthMiddleware, authenticator=self.authenticator,  # type: ignore[arg-type]
                           on_refusal=count_error)

        @app.exception_handler(Refusal)
        async def refusal(_: Request, e: Refusal) -> JSONResponse:
            count_error(e.status)
            return JSONResponse(e.error(), status_code=e.status, headers=e.headers)

        if self.store is not None:
            app.include_router(admin_router(self.store))

    @staticmethod
    def principal(request: Request) -> Principal:
        return getattr(request.state, "principal", ANONYMOUS_PRINCIPAL)

    def admit(self, request: Request, request_id: str, worst_tokens: int) -> tuple[str, int]:
        """Check and reserve for the caller's tenant; returns (tenant name, priority band)."""
        tenant = self.principal(request).tenant
        if self.set_weight is not None:
            self.set_weight(tenant.name, tenant.weight)
        self.request_id_to_ticket[request_id] = self.admission.admit(tenant, worst_tokens)
        return tenant.name, tenant.band

    def settle(self, request_id: str, finals: Sequence[RequestOutput | None], use: dict[str, Any]) -> None:
        ticket = self.request_id_to_ticket.pop(request_id, None)
        if ticket is None:
            return
        done = [o for o in finals if o is not None]
        tokens = sum(len(o.prompt_token_ids) + sum(len(c.token_ids) for c in o.outputs) for o in done)
        self.admission.settle(ticket, Actual(tokens, use.get("energy_joules"), use.get("cost_usd")))

    def usage_tenant(self, request: Request, tenant: str | None) -> str | None:
        """The tenant whose usage the caller may read: its own; an admin (or auth off) may pick any or all."""
        principal = self.principal(request)
        if principal.is_admin or not self.auth_on:
            return tenant
        if tenant is not None and tenant != principal.tenant.name:
            raise Refusal(403, f"this API key belongs to tenant {principal.tenant.name} and may read only that "
                          f"tenant's usage, not {tenant!r}", "permission_error", "usage_of_another_tenant",
                          param="tenant")
        return principal.tenant.name


# -- /admin routes -----------------------------------------------------------------------------------------


class TenantBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    priority: str = "standard"
    weight: float = 1.0
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    budget: str | None = None


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    priority: str | None = None
    weight: float | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    budget: str | None = None


class KeyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str | None = None
    admin: bool = False
    expires: str | None = None


def admin_router(store: TenantStore) -> APIRouter:
    router = APIRouter(prefix="/admin")

    @router.get("/tenants")
    async def list_tenants() -> dict:
        tenants = await asyncio.to_thread(store.list_tenants)
        return {"object": "list", "data": [tenant_dict(t) for t in tenants]}

    @router.post("/tenants", status_code=201)
    async def add_tenant(body: TenantBody) -> dict:
        budget = Budget.parse(body.budget) if body.budget else None
        tenant = Tenant(body.name, body.priority, body.weight, body.rpm, body.tpm, body.max_concurrency, budget)
        return tenant_dict(await asyncio.to_thread(store.add_tenant, tenant))

    @router.patch("/tenants/{name}")
    async def update_tenant(name: str, body: TenantPatch) -> dict:
        changes = {k: getattr(body, k) for k in body.model_fields_set}
        if "budget" in changes:
            changes["budget"] = Budget.parse(changes["budget"]) if changes["budget"] else None
        for k in ("priority", "weight"):
            if k in changes and changes[k] is None:
                raise ParameterError(k, f"{k} cannot be null")
        return tenant_dict(await asyncio.to_thread(store.update_tenant, name, **changes))

    @router.delete("/tenants/{name}")
    async def remove_tenant(name: str) -> dict:
        num_keys = await asyncio.to_thread(store.remove_tenant, name)
        return {"name": name, "deleted": True, "num_keys_deleted": num_keys}

    @router.get("/keys")
    async def list_keys(tenant: str | None = None) -> dict:
        keys = await asyncio.to_thread(store.list_keys, tenant)
        now = utc_now()
        return {"object": "list", "data": [key_dict(k, now) for k in keys]}

    @router.post("/keys", status_code=201)
    async def create_key(body: KeyBody) -> dict:
        expires = parse_expires(body.expires) if body.expires else None
        key, info = await asyncio.to_thread(store.create_key, body.tenant, body.admin, expires)
        return {"key": key, **key_dict(info, utc_now())}

    @router.delete("/keys/{key_id}")
    async def revoke_key(key_id: str) -> dict:
        return key_dict(await asyncio.to_thread(store.revoke_key, key_id), utc_now())

    return router
