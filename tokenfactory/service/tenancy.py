"""Tenancy in the request service: admission of a principal's request, fair-share weights, scoped usage.

    admit(principal, request_id, worst_tokens, num_prompts=, model=) -> Reservation
                                     the tenant's limits checked, all of them reserved by one object
                                     (service/admission.py: leave_queue, settle, cancel; see there)
    usage_tenant(principal, tenant)  whose usage the caller may read (None: everyone's)

With no tenant store (auth off) everyone is "anonymous": standard priority, no limits but the queue bound.
Authentication itself (bearer keys, the /admin routes) is the gateway's (gateway/auth.py, gateway/admin.py).
"""

from __future__ import annotations

from collections.abc import Callable

from tokenfactory.service.admission import Admission, Reservation
from tokenfactory.service.call import Principal
from tokenfactory.service.errors import Refusal
from tokenfactory.tenants.store import TenantStore


class Tenancy:
    def __init__(self, store: TenantStore | None, admission: Admission | None = None,
                 set_weight: Callable[[str, float], None] | None = None) -> None:
        """`store` None: auth off. `set_weight`: how a tenant's fair-share weight reaches the engine (a
        SetTenantWeight message through its client); sent when a tenant's weight is first seen or changes."""
        self.store = store
        self.admission = admission if admission is not None else Admission()
        self.set_weight = set_weight
        self.tenant_to_weight_sent: dict[str, float] = {}

    @property
    def auth_on(self) -> bool:
        return self.store is not None

    def admit(self, principal: Principal, request_id: str, worst_tokens: int, *, num_prompts: int = 1,
              model: str = "") -> Reservation:
        """Check and reserve everything for the caller's tenant (raises Refusal or ParameterError, having
        taken nothing). `worst_tokens`: Σ prompt + n × max_tokens over the request's prompts."""
        tenant = principal.tenant
        if self.set_weight is not None and self.tenant_to_weight_sent.get(tenant.name) != tenant.weight:
            self.tenant_to_weight_sent[tenant.name] = tenant.weight
            self.set_weight(tenant.name, tenant.weight)
        return self.admission.admit(tenant, worst_tokens, num_prompts=num_prompts, model=model,
                                    request_id=request_id)

    def usage_tenant(self, principal: Principal, tenant: str | None) -> str | None:
        """The tenant whose usage the caller may read: its own; an admin (or auth off) may pick any or all."""
        if principal.is_admin or not self.auth_on:
            return tenant
        if tenant is not None and tenant != principal.tenant.name:
            raise Refusal(403, f"this API key belongs to tenant {principal.tenant.name} and may read only that "
                          f"tenant's usage, not {tenant!r}", "permission_error", "usage_of_another_tenant",
                          param="tenant")
        return principal.tenant.name
