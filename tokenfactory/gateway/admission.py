"""Admission: whether a tenant's request may start now, checked before any work and settled after.

Checks, in order, all before anything is taken (a refused request consumes nothing):

    concurrency   requests in flight < max_concurrency                          429 concurrency
    requests/min  a token bucket of capacity rpm refilled at rpm/60 per second   429 requests/min
    tokens/min    a bucket of capacity tpm refilled at tpm/60 per second; a
                  request takes its worst case, prompt + max_tokens (× n)        429 tokens/min
    budget        spent + reserved < amount for the UTC day or month            402 budget_exhausted
                  (reserved by requests in flight: 429 budget_reserved)

Every 429 carries Retry-After (seconds, rounded up) and names the limit in its message and code.
An exhausted budget is 402 Payment Required rather than 429: waiting a few seconds will not help,
OpenAI's clients do not retry it, and the message says which budget and when it resets.

Reserve, then settle (so concurrent requests cannot overspend): admission reserves the worst case
(tokens: prompt + max_tokens; joules and USD: those tokens × the highest per-token rate observed in
the last 64 requests), and settlement replaces the reservation by the metered actual use and gives
unused tokens/min back. A request is admitted only while spent + reserved < amount, so the budget is
exceeded by at most one request's worth (the last one admitted); while no joules or USD rate has been
observed yet, a request reserves all that remains, so such requests run one at a time.

Spent-so-far is read from the ledger once per tenant and period (requests of earlier server runs
count), then kept in memory; several servers sharing one ledger each enforce it alone.
State is touched from the event loop only; the lock guards against the odd thread all the same.
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenfactory.gateway.auth import Refusal
from tokenfactory.meter.ledger import Ledger, utc_now
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import ParameterError


@dataclass
class TokenBucket:
    """Capacity c, refilled at c/60 per second (a per-minute limit that allows a minute's burst)."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.capacity / 60.0)
        self.updated = now

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now)."""
        self.refill(now)
        return max(0.0, (amount - self.level) * 60.0 / self.capacity)


@dataclass
class BudgetState:
    budget: Budget
    start: dt.datetime
    end: dt.datetime
    spent: float
    reserved: float = 0.0


@dataclass
class Ticket:
    """An admitted request's reservations, released by `settle`."""

    tenant: str
    reserved_tokens: int  # against tokens/min
    budget_unit: str | None
    reserved_budget: float


@dataclass(frozen=True)
class Actual:
    """What a request really used (settlement)."""

    tokens: int  # prompt + completion model tokens
    joules: float | None
    usd: float | None


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def limited(limit: str, code: str, message: str, wait_s: float) -> Refusal:
    return Refusal(429, f"rate limit reached ({limit}): {message}; retry after {max(1, math.ceil(wait_s))} s",
                   "rate_limit_error", code, retry_after(wait_s))


def _spent_from_ledger(ledger: Ledger | None, tenant: str, budget: Budget, start: dt.datetime) -> float:
    if ledger is None:
        return 0.0
    t = ledger.totals(since=start, tenant=tenant)[0]
    return {"tokens": float(t.prompt_tokens + t.completion_tokens), "joules": t.energy_joules or 0.0,
            "usd": t.cost_usd or 0.0}[budget.unit]


class Admission:
    RATE_WINDOW = 64  # settled requests whose per-token joules and USD bound a reservation

    def __init__(self, ledger: Ledger | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], dt.datetime] = utc_now) -> None:
        self.ledger, self.clock, self.wall = ledger, clock, wall
        self.lock = threading.Lock()
        self.tenant_to_in_flight: dict[str, int] = {}
        self.tenant_to_rpm: dict[str, TokenBucket] = {}
        self.tenant_to_tpm: dict[str, TokenBucket] = {}
        self.tenant_to_budget: dict[str, BudgetState] = {}
        self.unit_to_rates: dict[str, deque[float]] = {"joules": deque(maxlen=self.RATE_WINDOW),
                                                       "usd": deque(maxlen=self.RATE_WINDOW)}

    def admit(self, tenant: Tenant, worst_tokens: int) -> Ticket:
        """Check every limit, then reserve; raises Refusal (429/402) or ParameterError (a request that
        could never fit its tokens/min limit)."""
        now = self.clock()
        with self.lock:
            name = tenant.name
            in_flight = self.tenant_to_in_flight.get(name, 0)
            if tenant.max_concurrency is not None and in_flight >= tenant.max_concurrency:
                raise limited("concurrency", "concurrency_limit_exceeded", f"tenant {name} already has {in_flight} "
                              f"requests in flight (limit {tenant.max_concurrency} at once)", 1.0)
            rpm = self._bucket(self.tenant_to_rpm, name, tenant.rpm, now)
            if rpm is not None and (wait := rpm.wait_s(1, now)) > 0:
                raise limited("requests/min", "requests_per_minute_exceeded",
                              f"tenant {name} may send {tenant.rpm} requests per minute", wait)
            tpm = self._bucket(self.tenant_to_tpm, name, tenant.tpm, now)
            if tpm is not None:
                if worst_tokens > tpm.capacity:
                    raise ParameterError("max_tokens", f"this request may use {worst_tokens} model tokens (prompt + "
                                         f"max_tokens), more than tenant {name}'s limit of {tenant.tpm} model "
                                         "tokens per minute: lower max_tokens or shorten the prompt")
                if (wait := tpm.wait_s(worst_tokens, now)) > 0:
                    raise limited("tokens/min", "tokens_per_minute_exceeded", f"tenant {name} may use {tenant.tpm} "
                                  f"model tokens per minute and this request may use {worst_tokens}", wait)
            state = self._budget_state(tenant)
            reserve = self._check_budget(name, state, worst_tokens) if state is not None else 0.0
            # Every check passed: take.
            self.tenant_to_in_flight[name] = in_flight + 1
            if rpm is not None:
                rpm.level -= 1
            if tpm is not None:
                tpm.level -= worst_tokens
            if state is not None:
                state.reserved += reserve
            return Ticket(name, worst_tokens if tpm is not None else 0, state.budget.unit if state else None, reserve)

    def settle(self, ticket: Ticket, actual: Actual) -> None:
        """Release the reservations; charge the actual use (the reservation if a measurement is missing)."""
        now = self.clock()
        with self.lock:
            name = ticket.tenant
            self.tenant_to_in_flight[name] = max(self.tenant_to_in_flight.get(name, 1) - 1, 0)
            tpm = self.tenant_to_tpm.get(name)
            if tpm is not None and ticket.reserved_tokens:
                tpm.refill(now)
                tpm.level = min(tpm.capacity, tpm.level + max(ticket.reserved_tokens - actual.tokens, 0))
            for unit, value in (("joules", actual.joules), ("usd", actual.usd)):
                if value is not None and actual.tokens > 0:
                    self.unit_to_rates[unit].append(value / actual.tokens)
            state = self.tenant_to_budget.get(name)
            if state is None or ticket.budget_unit is None:
                return
            state.reserved = max(state.reserved - ticket.reserved_budget, 0.0)
            used = {"tokens": float(actual.tokens), "joules": actual.joules, "usd": actual.usd}[ticket.budget_unit]
            state.spent += used if used is not None else ticket.reserved_budget

    def budget_status(self, tenant: Tenant) -> BudgetState | None:
        with self.lock:
            return self._budget_state(tenant)

    # -- helpers (called with the lock held) -------------------------------------------------------------

    def _bucket(self, buckets: dict[str, TokenBucket], name: str, limit: int | None, now: float) -> TokenBucket | None:
        if limit is None:
            buckets.pop(name, None)
            return None
        bucket = buckets.get(name)
        if bucket is None:
            bucket = buckets[name] = TokenBucket(float(limit), float(limit), now)
        elif bucket.capacity != limit:  # the limit was updated: keep the level, within the new capacity
            bucket.capacity, bucket.level = float(limit), min(bucket.level, float(limit))
        return bucket

    def _budget_state(self, tenant: Tenant) -> BudgetState | None:
        budget = tenant.budget
        if budget is None:
            self.tenant_to_budget.pop(tenant.name, None)
            return None
        now = self.wall()
        state = self.tenant_to_budget.get(tenant.name)
        if state is None or state.budget.unit != budget.unit or state.budget.period != budget.period \
                or not state.start <= now < state.end:
            start, end = budget.period_bounds(now)
            reserved = state.reserved if state is not None and state.budget.unit == budget.unit else 0.0
            state = BudgetState(budget, start, end, _spent_from_ledger(self.ledger, tenant.name, budget, start),
                                reserved)
            self.tenant_to_budget[tenant.name] = state
        state.budget = budget  # a new amount applies at once
        return state

    def _check_budget(self, name: str, state: BudgetState, worst_tokens: int) -> float:
        budget, remaining = state.budget, state.budget.amount - state.spent - state.reserved
        if state.spent >= budget.amount:
            left = state.end - self.wall()
            raise Refusal(402, f"budget exhausted: tenant {name} has used {_amount(state.spent, budget.unit)} of its "
                          f"{budget.describe()} budget; it resets at {state.end:%Y-%m-%d %H:%M} UTC (in "
                          f"{_span(left)})", "insufficient_quota", "budget_exhausted",
                          retry_after(left.total_seconds()))
        if remaining <= 0:
            raise limited("budget", "budget_reserved", f"the rest of tenant {name}'s {budget.describe()} budget is "
                          "reserved by its requests in flight", 1.0)
        if budget.unit == "tokens":
            return float(worst_tokens)
        rates = self.unit_to_rates[budget.unit]
        return worst_tokens * max(rates) if rates else remaining


def _amount(value: float, unit: str) -> str:
    return f"{value:.4f} USD" if unit == "usd" else f"{value:.6g} {'J' if unit == 'joules' else 'model tokens'}"


def _span(delta: dt.timedelta) -> str:
    minutes = max(int(delta.total_seconds() // 60), 0)
    days, hours, mins = minutes // 1440, minutes % 1440 // 60, minutes % 60
    return f"{days} d {hours} h" if days else f"{hours} h {mins} min"
