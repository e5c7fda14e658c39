"""Tenancy in the server: authentication, admission, fair-share weights, scoped usage, /admin routes.

`Tenancy` is the one object app.py talks to:

    install(app, count_error)        auth middleware, the Refusal handler, /admin routes (with --auth)
    admit(request, request_id, worst_tokens, num_prompts=, model=) -> Reservation
                                     principal -> limits checked, all of them reserved by one object
                                     (gateway/admission.py: leave_queue, settle, cancel; see there)
    usage_tenant(request, tenant)    whose usage the caller may read (None: everyone's)
    shutdown()                       stop the tenant-store threads

Store work (key lookups, /admin routes) runs on the tenancy's own bounded `StoreExecutor`.

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

import functools
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from tokenfactory.gateway.admission import Admission, Reservation
from tokenfactory.gateway.auth import (
    ANONYMOUS_PRINCIPAL,
    AuthMiddleware,
    KeyAuthenticator,
    Principal,
    Refusal,
    StoreExecutor,
)
from tokenfactory.meter.ledger import utc_now
from tokenfactory.tenants.cli import key_dict, parse_expires, tenant_dict
from tokenfactory.tenants.store import Budget, Tenant, TenantStore
from tokenfactory.types import ParameterError


class Tenancy:
    def __init__(self, store: TenantStore | None, admission: Admission | None = None,
                 set_weight: Callable[[str, float], None] | None = None,
                 executor: StoreExecutor | None = None) -> None:
        """`store` None: auth off (everyone is "anonymous", standard priority, no limits). `set_weight`: how a
        tenant's fair-share weight reaches the engine (a SetTenantWeight message through its client); sent
        when a tenant's weight is first seen or changes."""
        self.store = store
        self.admission = admission if admission is not None else Admission()
        self.executor = executor if executor is not None else StoreExecutor()
        # The budget's spent-so-far is read in the auth thread, so that admit() never reads the ledger.
        self.authenticator = KeyAuthenticator(store, self.admission.prime) if store is not None else None
        self.set_weight = set_weight
        self.tenant_to_weight_sent: dict[str, float] = {}

    @property
    def auth_on(self) -> bool:
        return self.authenticator is not None

    def install(self, app: FastAPI, count_error: Callable[[int], None]) -> None:
        app.add_middleware(AuthMiddleware, authenticator=self.authenticator,  # type: ignore[arg-type]
                           on_refusal=count_error, executor=self.executor)

        @app.exception_handler(Refusal)
        async def refusal(_: Request, e: Refusal) -> JSONResponse:
            count_error(e.status)
            return JSONResponse(e.error(), status_code=e.status, headers=e.headers)

        if self.store is not None:
            app.include_router(admin_router(self.store, self.executor))

    @staticmethod
    def principal(request: Request) -> Principal:
        return getattr(request.state, "principal", ANONYMOUS_PRINCIPAL)

    def admit(self, request: Request, request_id: str, worst_tokens: int, *, num_prompts: int = 1,
              model: str = "") -> Reservation:
        """Check and reserve everything for the caller's tenant (raises Refusal or ParameterError, having
        taken nothing). `worst_tokens`: Σ prompt + n × max_tokens over the request's prompts."""
        tenant = self.principal(request).tenant
        if self.set_weight is not None and self.tenant_to_weight_sent.get(tenant.name) != tenant.weight:
            self.tenant_to_weight_sent[tenant.name] = tenant.weight
            self.set_weight(tenant.name, tenant.weight)
        return self.admission.admit(tenant, worst_tokens, num_prompts=num_prompts, model=model,
                                    request_id=request_id)

    def shutdown(self) -> None:
        self.executor.shutdown()

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


ADMIN_TIMEOUT_S = 30.0  # writes may wait for the database's own lock timeout; still never forever


def admin_router(store: TenantStore, executor: StoreExecutor) -> APIRouter:
    router = APIRouter(prefix="/admin")

    async def run(fn: Callable[..., Any], *args: Any) -> Any:  # noqa: ANN401 - whatever the store returns
        return await executor.run(fn, *args, timeout_s=ADMIN_TIMEOUT_S, what="the tenant store")

    @router.get("/tenants")
    async def list_tenants() -> dict:
        tenants = await run(store.list_tenants)
        return {"object": "list", "data": [tenant_dict(t) for t in tenants]}

    @router.post("/tenants", status_code=201)
    async def add_tenant(body: TenantBody) -> dict:
        budget = Budget.parse(body.budget) if body.budget else None
        tenant = Tenant(body.name, body.priority, body.weight, body.rpm, body.tpm, body.max_concurrency, budget)
        return tenant_dict(await run(store.add_tenant, tenant))

    @router.patch("/tenants/{name}")
    async def update_tenant(name: str, body: TenantPatch) -> dict:
        changes = {k: getattr(body, k) for k in body.model_fields_set}
        if "budget" in changes:
            changes["budget"] = Budget.parse(changes["budget"]) if changes["budget"] else None
        for k in ("priority", "weight"):
            if k in changes and changes[k] is None:
                raise ParameterError(k, f"{k} cannot be null")
        return tenant_dict(await run(functools.partial(store.update_tenant, name, **changes)))

    @router.delete("/tenants/{name}")
    async def remove_tenant(name: str) -> dict:
        num_keys = await run(store.remove_tenant, name)
        return {"name": name, "deleted": True, "num_keys_deleted": num_keys}

    @router.get("/keys")
    async def list_keys(tenant: str | None = None) -> dict:
        keys = await run(store.list_keys, tenant)
        now = utc_now()
        return {"object": "list", "data": [key_dict(k, now) for k in keys]}

    @router.post("/keys", status_code=201)
    async def create_key(body: KeyBody) -> dict:
        expires = parse_expires(body.expires) if body.expires else None
        key, info = await run(store.create_key, body.tenant, body.admin, expires)
        return {"key": key, **key_dict(info, utc_now())}

    @router.delete("/keys/{key_id}")
    async def revoke_key(key_id: str) -> dict:
        return key_dict(await run(store.revoke_key, key_id), utc_now())

    return router
