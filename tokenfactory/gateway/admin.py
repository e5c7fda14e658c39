"""Tenancy over HTTP: the auth middleware and the /admin routes (admission itself is the request service's,
service/tenancy.py). `install_tenancy(app, tenancy, executor, count_error)` is the one call build_app makes.

Store work (key lookups, /admin routes) runs on the gateway's own bounded `StoreExecutor`.

/admin routes (an admin API key; JSON in and out; errors in OpenAI's shape):

    GET    /admin/tenants                 list
    POST   /admin/tenants                 {"name", "priority", "weight", "rpm", "tpm", "max_concurrency", "budget",
                                           "context_compression"}: the settings `tokenfactory tenants add` takes
    PATCH  /admin/tenants/{name}          any of those fields; null removes a limit, the budget or the default
    DELETE /admin/tenants/{name}          the tenant and its keys (ledger rows stay)
    GET    /admin/keys[?tenant=NAME]      ids and states, never secrets
    POST   /admin/keys                    {"tenant", "admin", "expires"} -> {"key": ..., shown once}
    DELETE /admin/keys/{key_id}           revoke
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, FastAPI
from pydantic import BaseModel, ConfigDict, create_model

from tokenfactory.gateway.auth import Auth, AuthMiddleware, KeyAuthenticator, StoreExecutor
from tokenfactory.meter.ledger import utc_now
from tokenfactory.service.tenancy import Tenancy
from tokenfactory.tenants.cli import key_dict, parse_expires, tenant_dict
from tokenfactory.tenants.store import TENANT_SETTINGS, Tenant, TenantStore, tenant_settings


def install_tenancy(app: FastAPI, tenancy: Tenancy, executor: StoreExecutor,
                    count_error: Callable[[int], None]) -> Auth:
    """The auth middleware (keys checked on `executor`, a budget's spent-so-far primed there too, so that
    admission never reads the ledger on the event loop) and, with a tenant store, the /admin routes. A
    `Refusal` is an APIError: errors.py renders it."""
    store = tenancy.store
    authenticator = KeyAuthenticator(store, tenancy.admission.prime) if store is not None else None
    app.add_middleware(AuthMiddleware, authenticator=authenticator,  # type: ignore[arg-type]
                       on_refusal=count_error, executor=executor)

    if store is not None:
        app.include_router(admin_router(store, executor))
    return Auth(authenticator, executor)


# -- /admin routes -----------------------------------------------------------------------------------------


# The tenant settings' one schema (tenants/store.py TENANT_SETTINGS), the CLI's too: every setting may be
# given; absent from a PATCH: unchanged; null in a PATCH: a limit, the budget or the default removed.
_SETTINGS = {name: (kind | None, None) for name, kind in TENANT_SETTINGS.items()}
TenantBody = create_model("TenantBody", __config__=ConfigDict(extra="forbid"), name=(str, ...), **_SETTINGS)
TenantPatch = create_model("TenantPatch", __config__=ConfigDict(extra="forbid"), **_SETTINGS)


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
    async def add_tenant(body: TenantBody) -> dict:  # type: ignore[valid-type]
        given = {k: getattr(body, k) for k in TENANT_SETTINGS if getattr(body, k) is not None}
        tenant = Tenant(body.name, **tenant_settings(given))  # type: ignore[attr-defined]
        return tenant_dict(await run(store.add_tenant, tenant))

    @router.patch("/tenants/{name}")
    async def update_tenant(name: str, body: TenantPatch) -> dict:  # type: ignore[valid-type]
        changes = tenant_settings({k: getattr(body, k) for k in body.model_fields_set})  # type: ignore[attr-defined]
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
