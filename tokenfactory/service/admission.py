"""Admission: whether a tenant's request may start now, and one object that owns what it holds.

`Admission.admit` checks everything before it takes anything (a refused request holds nothing):

    concurrency   requests in flight < max_concurrency                           429 concurrency
    requests/min  a token bucket of capacity rpm refilled at rpm/60 per second    429 requests/min
    tokens/min    a bucket of capacity tpm refilled at tpm/60 per second; a
                  request takes its worst case, Σ prompt + n × max_tokens         429 tokens/min
    budget        worst case <= amount - spent (else 402), and <= amount - spent
                  - reserved by the tenant's requests in flight (else 429)        402 / 429 budget
    queue         prompts waiting: this tenant's <= its share, all <= max_waiting 503 overloaded

then returns a `Reservation` that holds all of it: one queue slot per prompt, one concurrency slot, the
tokens/min worst case, the budget worst case. The reservation is the only way to give them back, and
it gives everything back exactly once, whichever of its exits runs first or however often:
`leave_queue(i)` frees prompt i's queue slot (its engine request produced output or ended), `settle`
replaces the reservations by the metered use, `cancel` releases them and charges nothing (the request
never reached the engine). A reservation dropped without either (a bug in a caller) is released at the
next admission and charged its whole reservation, and counted in `snapshot().num_orphaned`.

Why the queue gate is here and fair: it used to count prompts before admission, so every refused
request leaked its slots and the server ended in permanent 503s; and one tenant's batch could fill
it for everyone. Here a tenant holds at most `max_waiting_per_tenant` prompts (default: half of
`max_waiting`; the whole of it for "anonymous", the only tenant when auth is off), so another tenant's
first request is admitted while one tenant is backlogged. A prompt counts from admission until it
leaves the queue, so requests arriving in the same instant cannot all pass.

Budgets reserve the worst case: tokens exactly; joules and USD as worst tokens × a per-token rate that
errs high: the largest of the last RATE_WINDOW settled requests of the same (tenant, model), else of
the model across tenants; while none is known a request reserves all that remains (so such requests
run one at a time). Overspend is then at most one request's worth: only the request admitted while
no rate was known, or one whose rate exceeds every recent one, can use more than it reserved.

Spent-so-far is read from the ledger once per tenant and period (requests of earlier runs count),
then kept in memory; `prime` does that read off the event loop (auth calls it in its thread).
Several servers sharing one ledger each enforce it alone. One lock guards all state: the event loop
and the odd thread (tests hammer it from many) may call in.
This file is past 400 lines because the reservation and the checks it undoes must change together.
"""

from __future__ import annotations

import datetime as dt
import itertools
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType

from tokenfactory.meter.attribution import RequestEnergy
from tokenfactory.meter.ledger import Ledger, utc_now
from tokenfactory.service.errors import Refusal, retry_after
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import ParameterError, RequestOutput

ANONYMOUS_TENANT = "anonymous"  # every request with auth off: the one tenant may use the whole queue
BUDGET_UNIT_NAMES = ("tokens", "joules", "usd")


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

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass
class BudgetState:
    budget: Budget
    start: dt.datetime
    end: dt.datetime
    spent: float
    reserved: float = 0.0
    num_reservations: int = 0  # at 0, `reserved` is set to exactly 0 (no float residue)


@dataclass(frozen=True)
class Actual:
    """What a request really used (settlement)."""

    tokens: int  # prompt + completion model tokens
    joules: float | None
    usd: float | None


@dataclass(frozen=True)
class Credit:
    """Use the ledger no longer counts: an older aborted attempt that a request's row superseded (meter/ledger.py),
    recorded at `created_at` (naive UTC). It leaves the spend of the budget period it was in."""

    tokens: int
    joules: float | None
    usd: float | None
    created_at: dt.datetime


@dataclass(frozen=True)
class AdmissionSnapshot:
    """Admission's state at one instant (for /metrics and tests: everything returns to zero when idle)."""

    num_queued: int  # prompts holding queue slots
    num_in_flight: int  # API requests admitted and not yet settled or cancelled
    unit_to_reserved: Mapping[str, float]  # budget reserved by requests in flight: tokens, joules, usd
    tenant_to_queued: Mapping[str, int]
    max_waiting: int
    num_orphaned: int  # reservations released because their owner dropped them (should stay 0)


@dataclass(eq=False)
class _Holds:
    """What one admitted request holds (mutated under Admission.lock only)."""

    tenant: Tenant
    model: str
    request_id: str
    queued: set[int]  # prompt indices still holding a queue slot
    tpm_tokens: int  # taken from tokens/min (0: no tpm limit)
    took_rpm: bool
    budget_unit: str | None
    budget_reserved: float
    released: bool = False


class Reservation:
    """All of one API request's holds; every exit releases everything exactly once (see the module doc).

    Usable as a context manager: leaving the block by an exception before it is settled cancels it.
    """

    def __init__(self, admission: Admission, holds: _Holds) -> None:
        self._admission, self._holds = admission, holds
        # A dropped, unreleased reservation: queue it for release (never take the lock from a finalizer,
        # which may run inside a locked section of this very thread).
        self._finalizer = weakref.finalize(self, admission.orphans.append, holds)
        self._finalizer.atexit = False

    @property
    def tenant(self) -> str:
        return self._holds.tenant.name

    @property
    def priority(self) -> int:
        return self._holds.tenant.band

    @property
    def request_id(self) -> str:
        return self._holds.request_id

    @property
    def released(self) -> bool:
        return self._holds.released

    @property
    def num_queued(self) -> int:
        return len(self._holds.queued)

    @property
    def budget_unit(self) -> str | None:
        return self._holds.budget_unit

    @property
    def reserved_budget(self) -> float:
        return self._holds.budget_reserved

    def leave_queue(self, index: int | None = None) -> None:
        """Prompt `index`'s engine request started producing output (or ended): free its queue slot.
        None: the lowest slot still held. Repeated or late calls do nothing."""
        self._admission.leave_queue(self._holds, index)

    def settle(self, finals: Sequence[RequestOutput | None], energy: RequestEnergy | None,
               credit: Credit | None = None) -> None:
        """Actual use (model tokens from `finals`, joules and USD from the metered `energy`, None without a
        meter) replaces the reservation; `credit`: an earlier attempt the ledger no longer counts. Only the
        first of settle/cancel counts."""
        self.settle_actual(actual_use(finals, energy), credit)

    def settle_actual(self, actual: Actual, credit: Credit | None = None) -> None:
        if self._admission.release(self._holds, actual, "settle", credit):
            self._finalizer.detach()

    def cancel(self) -> None:
        """The request never reached the engine: release everything and charge nothing."""
        self._release(None, "cancel")

    def _release(self, actual: Actual | None, how: str) -> None:
        if self._admission.release(self._holds, actual, how):
            self._finalizer.detach()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.cancel()  # does nothing if it was settled already


def actual_use(finals: Sequence[RequestOutput | None], energy: RequestEnergy | None) -> Actual:
    done = [o for o in finals if o is not None]
    tokens = sum(len(o.prompt_token_ids) + o.num_completion_tokens for o in done)
    if energy is None:
        return Actual(tokens, None, None)
    return Actual(tokens, energy.energy_joules, energy.cost_usd)


def limited(limit: str, code: str, message: str, wait_s: float) -> Refusal:
    return Refusal(429, f"rate limit reached ({limit}): {message}; retry after {max(1, math.ceil(wait_s))} s",
                   "rate_limit_error", code, retry_after(wait_s))


def overloaded(message: str, retry_after_s: int) -> Refusal:
    return Refusal(503, f"the server is overloaded: {message}; retry after {retry_after_s} s", "server_error",
                   "overloaded", {"Retry-After": str(retry_after_s)})


def _spent_from_ledger(ledger: Ledger | None, tenant: str, budget: Budget, start: dt.datetime) -> float:
    if ledger is None:
        return 0.0
    t = ledger.totals(since=start, tenant=tenant)[0]
    return {"tokens": float(t.prompt_tokens + t.completion_tokens), "joules": t.energy_joules or 0.0,
            "usd": t.cost_usd or 0.0}[budget.unit]


class Admission:
    RATE_WINDOW = 64  # settled requests whose per-token joules and USD bound a reservation

    def __init__(self, ledger: Ledger | None = None, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], dt.datetime] = utc_now, *, max_waiting: int = 256,
                 max_waiting_per_tenant: int | None = None, retry_after_s: int = 2) -> None:
        """`max_waiting`: prompts admitted and not yet producing output, over all tenants (503 past it);
        `max_waiting_per_tenant`: one tenant's share (None: max_waiting // 2, all of it for anonymous)."""
        if max_waiting < 1 or (max_waiting_per_tenant is not None and max_waiting_per_tenant < 1):
            raise ValueError(f"max_waiting and max_waiting_per_tenant must be >= 1, got {max_waiting} and "
                             f"{max_waiting_per_tenant}")
        self.ledger, self.clock, self.wall = ledger, clock, wall
        self.max_waiting, self.max_waiting_per_tenant = max_waiting, max_waiting_per_tenant
        self.retry_after_s = retry_after_s
        self.lock = threading.Lock()
        self.tenant_to_in_flight: dict[str, int] = {}
        self.tenant_to_rpm: dict[str, TokenBucket] = {}
        self.tenant_to_tpm: dict[str, TokenBucket] = {}
        self.tenant_to_budget: dict[str, BudgetState] = {}
        self.tenant_to_queued: dict[str, int] = {}
        self.num_queued = 0
        self.key_to_holds: dict[int, _Holds] = {}
        self.keys = itertools.count()
        self.orphans: deque[_Holds] = deque()  # appended by finalizers (atomic), drained under the lock
        self.num_orphaned = 0
        # Per-token joules and USD of recent settled requests: by (unit, tenant, model), and by (unit, model).
        self.tenant_model_to_rates: dict[tuple[str, str, str], deque[float]] = {}
        self.model_to_rates: dict[tuple[str, str], deque[float]] = {}

    def share(self, tenant: str) -> int:
        """How many prompts one tenant may have waiting."""
        if self.max_waiting_per_tenant is not None:
            return min(self.max_waiting_per_tenant, self.max_waiting)
        return self.max_waiting if tenant == ANONYMOUS_TENANT else max(1, self.max_waiting // 2)

    # -- admit and release -------------------------------------------------------------------------------

    def admit(self, tenant: Tenant, worst_tokens: int, *, num_prompts: int = 1, model: str = "",
              request_id: str = "") -> Reservation:
        """Check every limit, then take them all; raises Refusal (429/402/503) or ParameterError (a request
        that could never fit)."""
        now = self.clock()
        with self.lock:
            self._drain_orphans()
            self._check_concurrency(tenant)
            rpm = self._check_rpm(tenant, now)
            tpm = self._check_tpm(tenant, worst_tokens, now)
            state, reserve = self._check_budget(tenant, model, worst_tokens)
            self._check_queue(tenant.name, num_prompts)
            # Every check passed: take.
            holds = _Holds(tenant, model, request_id, set(range(num_prompts)), worst_tokens if tpm else 0,
                           rpm is not None, state.budget.unit if state else None, reserve)
            self._take(holds, rpm, tpm, state)
        return Reservation(self, holds)

    def leave_queue(self, holds: _Holds, index: int | None) -> None:
        with self.lock:
            if holds.released or not holds.queued:
                return
            if index is None:
                index = min(holds.queued)
            elif index not in holds.queued:
                return
            holds.queued.discard(index)
            self._unqueue(holds.tenant.name, 1)

    def release(self, holds: _Holds, actual: Actual | None, how: str, credit: Credit | None = None) -> bool:
        """Give back everything `holds` holds; `how`: settle (charge `actual`, less `credit`), cancel (charge
        nothing, give back the requests/min slot too) or orphan (charge the whole reservation). False if it
        was released already."""
        now = self.clock()
        with self.lock:
            if holds.released:
                return False
            self._release_locked(holds, actual, how, now)
            if credit is not None:
                self._credit(holds.tenant.name, credit)
        return True

    def snapshot(self) -> AdmissionSnapshot:
        with self.lock:
            self._drain_orphans()
            unit_to_reserved = dict.fromkeys(BUDGET_UNIT_NAMES, 0.0)
            for holds in self.key_to_holds.values():
                if holds.budget_unit is not None:
                    unit_to_reserved[holds.budget_unit] += holds.budget_reserved
            return AdmissionSnapshot(self.num_queued, sum(self.tenant_to_in_flight.values()),
                                     MappingProxyType(unit_to_reserved), MappingProxyType(dict(self.tenant_to_queued)),
                                     self.max_waiting, self.num_orphaned)

    def budget_status(self, tenant: Tenant) -> BudgetState | None:
        with self.lock:
            return self._budget_state(tenant)

    def prime(self, tenant: Tenant) -> None:
        """Read the tenant's spent-so-far from the ledger now if admission would need it (blocking: call it
        off the event loop, as auth does), so that `admit` on the event loop finds it in memory."""
        budget = tenant.budget
        if budget is None or self.ledger is None:
            return
        with self.lock:
            if self._budget_is_current(tenant):
                return
        start, end = budget.period_bounds(self.wall())
        spent = _spent_from_ledger(self.ledger, tenant.name, budget, start)
        with self.lock:
            if not self._budget_is_current(tenant):
                self._install_budget(tenant, start, end, spent)

    # -- the checks (lock held; each raises, none takes) --------------------------------------------------

    def _check_concurrency(self, tenant: Tenant) -> None:
        in_flight = self.tenant_to_in_flight.get(tenant.name, 0)
        if tenant.max_concurrency is not None and in_flight >= tenant.max_concurrency:
            raise limited("concurrency", "concurrency_limit_exceeded", f"tenant {tenant.name} already has "
                          f"{in_flight} requests in flight (limit {tenant.max_concurrency} at once)", 1.0)

    def _check_rpm(self, tenant: Tenant, now: float) -> TokenBucket | None:
        rpm = self._bucket(self.tenant_to_rpm, tenant.name, tenant.rpm, now)
        if rpm is not None and (wait := rpm.wait_s(1, now)) > 0:
            raise limited("requests/min", "requests_per_minute_exceeded",
                          f"tenant {tenant.name} may send {tenant.rpm} requests per minute", wait)
        return rpm

    def _check_tpm(self, tenant: Tenant, worst_tokens: int, now: float) -> TokenBucket | None:
        tpm = self._bucket(self.tenant_to_tpm, tenant.name, tenant.tpm, now)
        if tpm is None:
            return None
        if worst_tokens > tpm.capacity:
            raise ParameterError("max_tokens", f"this request may use {worst_tokens} model tokens (prompt + "
                                 f"max_tokens), more than tenant {tenant.name}'s limit of {tenant.tpm} model "
                                 "tokens per minute: lower max_tokens or shorten the prompt")
        if (wait := tpm.wait_s(worst_tokens, now)) > 0:
            raise limited("tokens/min", "tokens_per_minute_exceeded", f"tenant {tenant.name} may use "
                          f"{tenant.tpm} model tokens per minute and this request may use {worst_tokens}", wait)
        return tpm

    def _check_budget(self, tenant: Tenant, model: str, worst_tokens: int) -> tuple[BudgetState | None, float]:
        """The budget reservation this request needs: its worst case in the budget's unit."""
        state = self._budget_state(tenant)
        if state is None:
            return None, 0.0
        budget, name = state.budget, tenant.name
        left = budget.amount - state.spent
        if left <= 0:
            raise self._exhausted(name, state)
        rate = 1.0 if budget.unit == "tokens" else self._rate(budget.unit, name, model)
        if rate is None:  # nothing known yet: reserve all that remains, so these run one at a time
            if state.num_reservations:
                raise self._reserved(name, state, None)
            return state, left
        worst = worst_tokens * rate
        if worst > left:
            raise self._insufficient(name, state, worst_tokens, worst, left)
        if worst > left - state.reserved:
            raise self._reserved(name, state, worst)
        return state, worst

    def _check_queue(self, name: str, num_prompts: int) -> None:
        share = self.share(name)
        if num_prompts > share:
            raise ParameterError("prompt", f"this request has {num_prompts} prompts, more than the {share} one "
                                 f"tenant may have waiting on this server: send them in smaller requests")
        held = self.tenant_to_queued.get(name, 0)
        if held + num_prompts > share:
            raise overloaded(f"tenant {name} already has {held} prompts waiting and this request adds "
                             f"{num_prompts} (one tenant may have {share} of the server's {self.max_waiting})",
                             self.retry_after_s)
        if self.num_queued + num_prompts > self.max_waiting:
            raise overloaded(f"{self.num_queued} prompts are already waiting and this request adds {num_prompts} "
                             f"(limit {self.max_waiting})", self.retry_after_s)

    # -- refusals (worded with both numbers, in the budget's unit) ---------------------------------------

    def _exhausted(self, name: str, state: BudgetState) -> Refusal:
        left = state.end - self.wall()
        return Refusal(402, f"budget exhausted: tenant {name} has used {_amount(state.spent, state.budget.unit)} "
                       f"of its {state.budget.describe()} budget; it resets at {state.end:%Y-%m-%d %H:%M} UTC (in "
                       f"{_span(left)})", "insufficient_quota", "budget_exhausted", retry_after(left.total_seconds()))

    def _insufficient(self, name: str, state: BudgetState, worst_tokens: int, worst: float, left: float) -> Refusal:
        unit, until = state.budget.unit, state.end - self.wall()
        rate = "" if unit == "tokens" else f" ({worst_tokens} model tokens at the highest recent rate)"
        return Refusal(402, f"budget too small for this request: its worst case is {_amount(worst, unit)}{rate} "
                       f"and tenant {name} has {_amount(left, unit)} left of its {state.budget.describe()} budget "
                       f"until {state.end:%Y-%m-%d %H:%M} UTC: lower max_tokens (or n, or the number of prompts)",
                       "insufficient_quota", "budget_insufficient", retry_after(until.total_seconds()),
                       param="max_tokens")

    def _reserved(self, name: str, state: BudgetState, worst: float | None) -> Refusal:
        unit, left = state.budget.unit, state.budget.amount - state.spent
        need = f"this request needs {_amount(worst, unit)}; " if worst is not None else ""
        return limited("budget", "budget_reserved", f"{need}{_amount(state.reserved, unit)} of the "
                       f"{_amount(left, unit)} left of tenant {name}'s {state.budget.describe()} budget is "
                       "reserved by its requests in flight", 1.0)

    # -- state changes (lock held) ------------------------------------------------------------------------

    def _take(self, holds: _Holds, rpm: TokenBucket | None, tpm: TokenBucket | None,
              state: BudgetState | None) -> None:
        name = holds.tenant.name
        self.tenant_to_in_flight[name] = self.tenant_to_in_flight.get(name, 0) + 1
        if rpm is not None:
            rpm.level -= 1
        if tpm is not None:
            tpm.level -= holds.tpm_tokens
        if state is not None:
            state.reserved += holds.budget_reserved
            state.num_reservations += 1
        self.tenant_to_queued[name] = self.tenant_to_queued.get(name, 0) + len(holds.queued)
        self.num_queued += len(holds.queued)
        self.key_to_holds[id(holds)] = holds

    def _release_locked(self, holds: _Holds, actual: Actual | None, how: str, now: float) -> None:
        holds.released = True
        name = holds.tenant.name
        self.key_to_holds.pop(id(holds), None)
        self._unqueue(name, len(holds.queued))
        holds.queued.clear()
        in_flight = self.tenant_to_in_flight.get(name, 1) - 1
        if in_flight > 0:
            self.tenant_to_in_flight[name] = in_flight
        else:
            self.tenant_to_in_flight.pop(name, None)
        tpm, rpm = self.tenant_to_tpm.get(name), self.tenant_to_rpm.get(name)
        if tpm is not None and holds.tpm_tokens and how != "orphan":
            tpm.give_back(holds.tpm_tokens - (actual.tokens if actual is not None else 0), now)
        if rpm is not None and holds.took_rpm and how == "cancel":
            rpm.give_back(1, now)
        if actual is not None:
            self._record_rates(holds, actual)
        self._charge(holds, actual, how)

    def _charge(self, holds: _Holds, actual: Actual | None, how: str) -> None:
        state = self.tenant_to_budget.get(holds.tenant.name)
        if state is None or holds.budget_unit != state.budget.unit:
            return  # the budget was removed or changed unit meanwhile: nothing of ours is in it
        state.num_reservations = max(state.num_reservations - 1, 0)
        state.reserved = max(state.reserved - holds.budget_reserved, 0.0) if state.num_reservations else 0.0
        if how == "cancel":
            return
        used = None
        if actual is not None:
            used = {"tokens": float(actual.tokens), "joules": actual.joules, "usd": actual.usd}[state.budget.unit]
        state.spent += used if used is not None else holds.budget_reserved  # no measurement: the reservation

    def _credit(self, name: str, credit: Credit) -> None:
        """Take a superseded attempt out of the spend it was read into (only if it fell in the current period)."""
        state = self.tenant_to_budget.get(name)
        if state is None or not state.start <= credit.created_at < state.end:
            return
        used = {"tokens": float(credit.tokens), "joules": credit.joules, "usd": credit.usd}[state.budget.unit]
        if used is not None:
            state.spent = max(state.spent - used, 0.0)

    def _unqueue(self, name: str, count: int) -> None:
        if not count:
            return
        self.num_queued -= count
        left = self.tenant_to_queued.get(name, 0) - count
        if left > 0:
            self.tenant_to_queued[name] = left
        else:
            self.tenant_to_queued.pop(name, None)

    def _drain_orphans(self) -> None:
        while self.orphans:
            holds = self.orphans.popleft()
            if not holds.released:
                self.num_orphaned += 1
                self._release_locked(holds, None, "orphan", self.clock())

    def _record_rates(self, holds: _Holds, actual: Actual) -> None:
        if actual.tokens <= 0:
            return
        for unit, value in (("joules", actual.joules), ("usd", actual.usd)):
            if value is None:
                continue
            for rates, key in ((self.tenant_model_to_rates, (unit, holds.tenant.name, holds.model)),
                               (self.model_to_rates, (unit, holds.model))):
                rates.setdefault(key, deque(maxlen=self.RATE_WINDOW)).append(value / actual.tokens)

    def _rate(self, unit: str, tenant: str, model: str) -> float | None:
        """Per-token joules or USD that errs high: this tenant's on this model, else the model's."""
        rates = self.tenant_model_to_rates.get((unit, tenant, model)) or self.model_to_rates.get((unit, model))
        return max(rates) if rates else None

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

    def _budget_is_current(self, tenant: Tenant) -> bool:
        state, budget = self.tenant_to_budget.get(tenant.name), tenant.budget
        return (state is not None and budget is not None and state.budget.unit == budget.unit
                and state.budget.period == budget.period and state.start <= self.wall() < state.end)

    def _install_budget(self, tenant: Tenant, start: dt.datetime, end: dt.datetime, spent: float) -> BudgetState:
        assert tenant.budget is not None
        old = self.tenant_to_budget.get(tenant.name)
        state = BudgetState(tenant.budget, start, end, spent)
        if old is not None and old.budget.unit == tenant.budget.unit:
            # Requests in flight keep their reservations across a new period (they settle into it).
            state.reserved, state.num_reservations = old.reserved, old.num_reservations
        self.tenant_to_budget[tenant.name] = state
        return state

    def _budget_state(self, tenant: Tenant) -> BudgetState | None:
        budget = tenant.budget
        if budget is None:
            self.tenant_to_budget.pop(tenant.name, None)
            return None
        if self._budget_is_current(tenant):
            state = self.tenant_to_budget[tenant.name]
        else:  # not primed (no auth thread ran first): read the ledger here
            start, end = budget.period_bounds(self.wall())
            state = self._install_budget(tenant, start, end,
                                         _spent_from_ledger(self.ledger, tenant.name, budget, start))
        state.budget = budget  # a new amount applies at once
        return state


def _amount(value: float, unit: str) -> str:
    return f"{value:.4f} USD" if unit == "usd" else f"{value:.6g} {'J' if unit == 'joules' else 'model tokens'}"


def _span(delta: dt.timedelta) -> str:
    minutes = max(int(delta.total_seconds() // 60), 0)
    days, hours, mins = minutes // 1440, minutes % 1440 // 60, minutes % 60
    return f"{days} d {hours} h" if days else f"{hours} h {mins} min"

