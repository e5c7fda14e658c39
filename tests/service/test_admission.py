"""Admission without a server: token buckets, concurrency, budgets reserved then settled (hammered from
threads), the ledger's spent-so-far, and the wording of each refusal. (Reservations, the fair queue gate
and per-model rates: tests/service/test_admission_reservations.py.)"""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from tokenfactory.meter.ledger import Ledger, LedgerRow
from tokenfactory.service.admission import Actual, Admission
from tokenfactory.service.errors import Refusal
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import ParameterError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


NOON = dt.datetime(2026, 11, 29, 12, 0)


def refused(admission: Admission, tenant: Tenant, tokens: int = 10) -> Refusal:
    with pytest.raises(Refusal) as e:
        admission.admit(tenant, tokens)
    return e.value


def test_requests_per_minute_bucket_with_retry_after() -> None:
    clock = Clock()
    a = Admission(clock=clock, wall=lambda: NOON)
    t = Tenant("chat", rpm=3)
    for _ in range(3):
        a.admit(t, 10).settle_actual(Actual(10, None, None))
    r = refused(a, t)
    assert r.status == 429 and r.code == "requests_per_minute_exceeded" and "requests/min" in r.message
    assert r.headers["Retry-After"] == "20"  # one request refills in 60/3 s
    clock.t += 20
    a.admit(t, 10)


def test_tokens_per_minute_reserves_worst_case_and_refunds_unused() -> None:
    clock = Clock()
    a = Admission(clock=clock, wall=lambda: NOON)
    t = Tenant("etl", tpm=100)
    first = a.admit(t, 80)  # prompt + max_tokens
    r = refused(a, t, 30)
    assert r.code == "tokens_per_minute_exceeded" and "tokens/min" in r.message and "model tokens" in r.message
    assert int(r.headers["Retry-After"]) == 6  # 10 tokens short at 100/60 per s
    first.settle_actual(Actual(20, None, None))  # used 20 of 80: 60 come back
    a.admit(t, 30)
    with pytest.raises(ParameterError) as e:
        a.admit(t, 101)  # could never fit: a 400 naming max_tokens, not a 429 to retry forever
    assert e.value.param == "max_tokens"


def test_concurrency_limit_and_release_on_settle() -> None:
    a = Admission(wall=lambda: NOON)
    t = Tenant("chat", max_concurrency=2)
    tickets = [a.admit(t, 1), a.admit(t, 1)]
    r = refused(a, t)
    assert r.code == "concurrency_limit_exceeded" and "concurrency" in r.message and "Retry-After" in r.headers
    tickets[0].settle_actual(Actual(1, None, None))
    a.admit(t, 1)
    assert a.admit(Tenant("other", max_concurrency=1), 1)  # per tenant


def test_a_refused_request_takes_nothing() -> None:
    a = Admission(clock=Clock(), wall=lambda: NOON)
    t = Tenant("chat", rpm=1, tpm=100, max_concurrency=5)
    with pytest.raises(ParameterError):
        a.admit(t, 500)  # fails at tokens/min ...
    a.admit(t, 50)  # ... so its requests/min slot was not taken


def hammer(a: Admission, tenant: Tenant, worst: int, actual: int, num_threads: int = 16,
           num_each: int = 20) -> tuple[int, int]:
    admitted = refused_count = 0
    lock = threading.Lock()
    start = threading.Barrier(num_threads)

    def worker() -> None:
        nonlocal admitted, refused_count
        start.wait()
        for _ in range(num_each):
            try:
                ticket = a.admit(tenant, worst)
            except Refusal:
                with lock:
                    refused_count += 1
                continue
            with lock:
                admitted += 1
            ticket.settle_actual(Actual(actual, actual * 2.0, actual * 1e-6))
    threads = [threading.Thread(target=worker) for _ in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return admitted, refused_count


def test_token_budget_hammered_from_threads_never_admits_a_worst_case_that_does_not_fit() -> None:
    a = Admission(wall=lambda: NOON)
    t = Tenant("cheap", budget=Budget.parse("1000tok/day"))
    admitted, refused_count = hammer(a, t, worst=64, actual=40)
    spent = a.budget_status(t).spent
    assert 1000 - 64 < spent <= 1000 and admitted == spent / 40 and refused_count > 0  # worst cases reserved
    r = refused(a, t, 64)  # 40 left: a worst case of 64 does not fit
    assert r.status == 402 and r.code == "budget_insufficient" and r.type == "insufficient_quota"
    assert "worst case is 64 model tokens" in r.message and "40 model tokens left of its 1 ktok/day" in r.message
    assert r.param == "max_tokens" and r.headers["Retry-After"] == str(12 * 3600)
    a.admit(t, 40).settle_actual(Actual(40, None, None))  # exactly what is left
    r = refused(a, t, 1)
    assert r.status == 402 and r.code == "budget_exhausted" and r.type == "insufficient_quota"
    assert "1 ktok/day budget" in r.message and "used 1000 model tokens" in r.message
    assert "resets at 2026-11-30 00:00 UTC (in 12 h 0 min)" in r.message
    assert r.headers["Retry-After"] == str(12 * 3600)


def test_joules_budget_reserves_everything_until_a_rate_is_known_then_by_the_rate() -> None:
    a = Admission(wall=lambda: NOON)
    t = Tenant("green", budget=Budget.parse("1kJ/day"))
    first = a.admit(t, 100)
    r = refused(a, t)  # all of the budget is reserved by the first request: wait, not exhausted
    assert r.status == 429 and r.code == "budget_reserved"
    first.settle_actual(Actual(100, 200.0, None))  # 2 J per model token
    admitted, _ = hammer(a, t, worst=50, actual=50)  # reserves 50 tokens x 2 J, uses the same
    spent = a.budget_status(t).spent
    assert 1000 <= spent <= 1000 + 100 and admitted == (spent - 200) / 100


def test_missing_measurement_charges_the_reservation() -> None:
    a = Admission(wall=lambda: NOON)
    t = Tenant("usd", budget=Budget.parse("1USD/day"))
    a.admit(t, 10).settle_actual(Actual(10, None, 0.01))  # rate: 0.001 USD per token
    ticket = a.admit(t, 100)
    assert ticket.reserved_budget == pytest.approx(0.1)
    ticket.settle_actual(Actual(100, None, None))
    assert a.budget_status(t).spent == pytest.approx(0.11)


def test_spent_so_far_comes_from_the_ledger_and_resets_with_the_period(tmp_path) -> None:
    ledger = Ledger.open(tmp_path)
    try:
        hour, day = dt.timedelta(hours=1), dt.timedelta(days=1)
        ledger.record(LedgerRow("r1", "m", "finished", 300, 200, tenant="acme", created_at=NOON - hour))
        ledger.record(LedgerRow("r0", "m", "finished", 999, 999, tenant="acme", created_at=NOON - day))
        ledger.record(LedgerRow("r2", "m", "finished", 999, 999, tenant="other", created_at=NOON))
        now = [NOON]
        a = Admission(ledger, wall=lambda: now[0])
        t = Tenant("acme", budget=Budget.parse("600tok/day"))
        assert a.budget_status(t).spent == 500  # today's rows of this tenant only
        assert refused(a, t, 150).code == "budget_insufficient"  # 100 left
        a.admit(t, 100).settle_actual(Actual(100, None, None))
        assert refused(a, t).code == "budget_exhausted"
        now[0] = NOON + dt.timedelta(days=1)  # a new UTC day: the budget resets
        assert a.budget_status(t).spent == 0
        a.admit(t, 10)
    finally:
        ledger.close()
