"""Who is calling: `Authorization: Bearer <API key>` checked against the tenant store.

`serve --auth` turns it on; without it every request runs as the tenant "anonymous" (the local,
single-user case) and the /admin routes are closed. An ASGI middleware checks /v1/*, /admin/* and
/fleet/* before the body is read and puts the caller's `Principal` in the request state; /admin and
/fleet (replica management, the autoscaler's state) need an admin key; /health and /metrics stay open
(probes and scrapers carry no key).

Refusals a person can act on, in OpenAI's error shape, worded so that an *API key* (authentication)
can never be mistaken for a *model token* (a unit of text):

    401 missing_api_key   no Authorization header, or not "Bearer <key>"
    401 invalid_api_key   not a key of this server, a revoked key, or a key of a removed tenant
    401 expired_api_key   the key's expiry time has passed
    403 admin_only        an /admin or /fleet route with a tenant's (non-admin) key, or /admin with auth off
    503 auth_unavailable  the tenant store did not answer within AUTH_TIMEOUT_S (a held database lock,
                          a database restart) or too many lookups are already pending

Lookups run on their own small bounded thread pool (`StoreExecutor`), not asyncio's default one that
other blocking work (ledger writes) may fill: a held lock makes authentication answer 503 at once or
within its short timeout, never hang, and never takes threads from anything else.
The key itself is never logged, echoed or stored (the store keeps a salted HMAC).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import sqlalchemy as sa
from starlette.requests import Request

from tokenfactory.service.call import ADMIN, ANONYMOUS_PRINCIPAL, Principal
from tokenfactory.service.errors import Refusal
from tokenfactory.tenants.store import Tenant, TenantStore

T = TypeVar("T")
AUTH_TIMEOUT_S = 2.0  # an indexed read answers in milliseconds; past this the database is stuck

PROTECTED_PREFIXES = ("/v1/", "/admin", "/fleet", "/tokenize", "/detokenize")
INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}  # RFC 6750 §3


@dataclass(frozen=True)
class Auth:
    """How the gateway checks callers: the key authenticator (None with auth off) and the store's threads."""

    authenticator: KeyAuthenticator | None
    executor: StoreExecutor

    async def principal(self, authorization: str | None) -> Principal:
        if self.authenticator is None:
            return ANONYMOUS_PRINCIPAL
        return await self.executor.run(self.authenticator.authenticate, authorization)


def principal_of(request: Request) -> Principal:
    """The caller the middleware found (anonymous with auth off)."""
    return getattr(request.state, "principal", ANONYMOUS_PRINCIPAL)


HOW_TO = ("send the header 'Authorization: Bearer <API key>' with a key made by `tokenfactory keys create "
          "--tenant NAME` (an API key authenticates you; it is not a model token)")


def missing_key() -> Refusal:
    return Refusal(401, f"missing API key: this server requires authentication; {HOW_TO}",
                   "authentication_error", "missing_api_key", {"WWW-Authenticate": "Bearer"})


def invalid_key(detail: str) -> Refusal:
    return Refusal(401, f"invalid API key: {detail}; {HOW_TO}", "authentication_error", "invalid_api_key",
                   INVALID_TOKEN)


class StoreExecutor:
    """A small thread pool of its own for blocking tenant-store work, bounded twice: at most
    `max_pending` calls submitted and not finished (a call past that is refused at once), and each
    awaited for at most `timeout_s` (a stuck call keeps its thread until the database answers, but
    nobody waits for it). Both refusals are 503 with Retry-After, worded for `what`."""

    def __init__(self, max_workers: int = 4, max_pending: int = 16, timeout_s: float = AUTH_TIMEOUT_S) -> None:
        self.pool = ThreadPoolExecutor(max_workers, thread_name_prefix="tf-store")
        self.pending = threading.BoundedSemaphore(max_pending)
        self.timeout_s = timeout_s

    async def run(self, fn: Callable[..., T], *args: object, timeout_s: float | None = None,
                  what: str = "authentication") -> T:
        if not self.pending.acquire(blocking=False):
            raise unavailable(what, "too many lookups are already waiting for the tenant database")
        try:
            future = self.pool.submit(fn, *args)
        except RuntimeError:  # shut down
            self.pending.release()
            raise unavailable(what, "the server is shutting down") from None
        future.add_done_callback(lambda _: self.pending.release())  # when the thread is done, not the waiter
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s or self.timeout_s)
        except TimeoutError:
            raise unavailable(what, f"the tenant database did not answer within {timeout_s or self.timeout_s:g} s "
                              "(it may be locked by another process)") from None
        except (sa.exc.SQLAlchemyError, OSError) as e:  # never the SQL text or its parameters
            raise unavailable(what, f"the tenant database failed ({type(e).__name__})") from None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def unavailable(what: str, reason: str) -> Refusal:
    return Refusal(503, f"{what} is temporarily unavailable: {reason}; retry in a few seconds", "server_error",
                   f"{'auth' if what == 'authentication' else 'store'}_unavailable", {"Retry-After": "2"})


class KeyAuthenticator:
    """Checks bearer keys against the store. `authenticate` is blocking (one indexed SQL read), and so is
    `on_principal` (admission reads a budget's spent-so-far there, off the event loop)."""

    def __init__(self, store: TenantStore, on_principal: Callable[[Tenant], None] | None = None) -> None:
        self.store, self.on_principal = store, on_principal

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
        if self.on_principal is not None:
            self.on_principal(tenant)
        return Principal(tenant, info.key_id, info.is_admin)


def admin_only(auth_on: bool, path: str = "/admin") -> Refusal:
    route = "/fleet" if path.startswith("/fleet") else "/admin"
    if not auth_on:
        return Refusal(403, "the /admin routes are closed: this server runs without authentication "
                       "(start it with `tokenfactory serve --auth` and use an admin API key)", "permission_error",
                       "admin_only")
    return Refusal(403, f"this API key may not use {route} routes: they need an admin API key "
                   "(`tokenfactory keys create --admin`)", "permission_error", "admin_only")


class AuthMiddleware:
    """Pure ASGI: authenticate protected paths, put `principal` in scope["state"], or answer the refusal."""

    def __init__(self, app: Callable, authenticator: KeyAuthenticator | None,
                 on_refusal: Callable[[int], None] = lambda status: None,
                 executor: StoreExecutor | None = None) -> None:
        self.app, self.authenticator, self.on_refusal = app, authenticator, on_refusal
        self.executor = executor if executor is not None else StoreExecutor()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not path.startswith(PROTECTED_PREFIXES):
            return await self.app(scope, receive, send)
        try:
            principal = await self.principal(scope)
            if path.startswith("/admin") and not principal.is_admin:
                raise admin_only(self.authenticator is not None)
            if path.startswith("/fleet") and self.authenticator is not None and not principal.is_admin:
                raise admin_only(True, path)
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
        return await self.executor.run(self.authenticator.authenticate, value)


async def send_refusal(refusal: Refusal, send: Callable) -> None:
    body = refusal.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in refusal.headers.items()]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

