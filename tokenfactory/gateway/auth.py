"""Who is calling: `Authorization: Bearer <API key>` checked against the tenant store.

`serve --auth` turns it on; without it every request runs as the tenant "anonymous" (the local,
single-user case) and the /admin routes are closed. An ASGI middleware checks /v1/* and /admin/*
before the body is read and puts the caller's `Principal` in the request state; /health and
/metrics stay open (probes and scrapers carry no key).

Refusals a person can act on, in OpenAI's error shape, worded so that an *API key* (authentication)
can never be mistaken for a *model token* (a unit of text):

    401 missing_api_key   no Authorization header, or not "Bearer <key>"
    401 invalid_api_key   not a key of this server, a revoked key, or a key of a removed tenant
    401 expired_api_key   the key's expiry time has passed
    403 admin_only        an /admin route with a tenant's (non-admin) key, or with auth off

The key itself is never logged, echoed or stored (the store keeps a salted HMAC).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from tokenfactory.tenants.store import ADMIN_TENANT, Tenant, TenantStore

ANONYMOUS = Tenant("anonymous")
ADMIN = Tenant(ADMIN_TENANT)
PROTECTED_PREFIXES = ("/v1/", "/admin")
INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}  # RFC 6750 §3


@dataclass(frozen=True)
class Principal:
    """The caller: the tenant its requests run as, and what its key may do."""

    tenant: Tenant
    key_id: str | None  # None with auth off
    is_admin: bool


ANONYMOUS_PRINCIPAL = Principal(ANONYMOUS, None, is_admin=False)


class Refusal(Exception):
    """A request refused before any work, in OpenAI's error shape (raised by auth and admission)."""

    def __init__(self, status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers or {}

    def error(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return json.dumps(self.error()).encode()


HOW_TO = ("send the header 'Authorization: Bearer <API key>' with a key made by `tokenfactory keys create "
          "--tenant NAME` (an API key authenticates you; it is not a model token)")


def missing_key() -> Refusal:
    return Refusal(401, f"missing API key: this server requires authentication; {HOW_TO}",
                   "authentication_error", "missing_api_key", {"WWW-Authenticate": "Bearer"})


def invalid_key(detail: str) -> Refusal:
    return Refusal(401, f"invalid API key: {detail}; {HOW_TO}", "authentication_error", "invalid_api_key",
                   INVALID_TOKEN)


class KeyAuthenticator:
    """Checks bearer keys against the store. `authenticate` is blocking (one indexed SQL read)."""

    def __init__(self, store: TenantStore) -> None:
        self.store = store

    def authenticate(self, authorization: str | None) -> Principal:
        if not authorization or not authorization.strip():
            raise missing_key()
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise missing_key()
        check = self.store.check_key(key.strip())
        info = check.info
        if check.state == "invalid" or info is None:
            raise invalid_key("the API key in the Authorization header is not one this server issued")
        if check.state == "revoked":
            raise invalid_key(f"API key {info.key_id} was revoked at {info.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
        if check.state == "expired":
            raise Refusal(401, f"expired API key: API key {info.key_id} expired at {info.expires_at:%Y-%m-%d %H:%M:%S} "
                          f"UTC; ask for a new API key (`tokenfactory keys create --tenant {info.tenant}`)",
                          "authentication_error", "expired_api_key", INVALID_TOKEN)
        tenant = check.tenant if check.tenant is not None else ADMIN
        return Principal(tenant, info.key_id, info.is_admin)


def admin_only(auth_on: bool) -> Refusal:
    if not auth_on:
        return Refusal(403, "the /admin routes are closed: this server runs without authentication "
                       "(start it with `tokenfactory serve --auth` and use an admin API key)", "permission_error",
                       "admin_only")
    return Refusal(403, "this API key may not use /admin routes: they need an admin API key "
                   "(`tokenfactory keys create --admin`)", "permission_error", "admin_only")


class AuthMiddleware:
    """Pure ASGI: authenticate protected paths, put `principal` in scope["state"], or answer the refusal."""

    def __init__(self, app: Callable, authenticator: KeyAuthenticator | None,
                 on_refusal: Callable[[int], None] = lambda status: None) -> None:
        self.app, self.authenticator, self.on_refusal = app, authenticator, on_refusal

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(PROTECTED_PREFIXES):
            return await self.app(scope, receive, send)
        try:
            principal = await self.principal(scope)
            if path.startswith("/admin") and not principal.is_admin:
                raise admin_only(self.authenticator is not None)
        except Refusal as refusal:
            self.on_refusal(refusal.status)
            return await send_refusal(refusal, send)
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)

    async def principal(self, scope: dict) -> Principal:
        if self.authenticator is None:
            return ANONYMOUS_PRINCIPAL
        headers = dict(scope.get("headers", []))
        raw = headers.get(b"authorization")
        value = raw.decode("latin-1") if raw is not None else None
        return await asyncio.to_thread(self.authenticator.authenticate, value)


async def send_refusal(refusal: Refusal, send: Callable) -> None:
    body = refusal.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

