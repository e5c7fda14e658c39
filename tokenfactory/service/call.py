"""Who calls, and how: the `Call` every request-service method takes beside its validated body.

A `Call` is what the HTTP routes build from a request (the principal auth found, a fresh request id, the
tenant's priority band, a cancellation signal set when the client disconnects) and what the Batch API builds
for a line (the job's tenant, the line's durable request id, the batch band, the job's cancel signal). The
service reads nothing else of its caller: no headers, no request state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tokenfactory.tenants.store import ADMIN_TENANT, Tenant


@dataclass(frozen=True)
class Principal:
    """The caller: the tenant its requests run as, and what its key may do."""

    tenant: Tenant
    key_id: str | None  # None with auth off
    is_admin: bool


ANONYMOUS = Tenant("anonymous")
ADMIN = Tenant(ADMIN_TENANT)
ANONYMOUS_PRINCIPAL = Principal(ANONYMOUS, None, is_admin=False)


@dataclass(frozen=True)
class Call:
    """One call into the request service.

    `request_id` None: the service makes one (`chatcmpl-...`, `cmpl-...`); a caller that must be idempotent
    across restarts (a batch line) brings its own. `priority` None: the tenant's band. `cancelled` is set by
    the caller when the answer is no longer wanted (a disconnect, a cancelled job): the engine requests are
    aborted, and the request is settled as aborted, billed for what was made."""

    principal: Principal = ANONYMOUS_PRINCIPAL
    request_id: str | None = None
    priority: int | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def tenant(self) -> Tenant:
        return self.principal.tenant

    def derived(self, request_id: str) -> Call:
        """The same caller and signal under another request id (context compression's summary request)."""
        return Call(self.principal, request_id, self.priority, self.cancelled)
