"""Reservations that cannot leak, on Admission alone with a manual clock: every refusal takes nothing,
every exit releases everything exactly once, the 503 gate is fair between tenants, budgets refuse a
worst case that does not fit, joules and USD are reserved at per-(tenant, model) rates, and budgets
hammered from threads overspend at most one request's worth."""

from __future__ import annotations

import datetime as dt
import gc
import random
import threading

import pytest

from tokenfactory.meter.attribution import RequestEnergy
from tokenfactory.service.admission import Actual, Admission, AdmissionSnapshot, Reservation
from tokenfactory.service.errors import Refusal
from tokenfactory.tenants.store import Budget, Tenant
from tokenfactory.types import CompletionOutput, ParameterError, RequestOutput

NOON = dt.datetime(2026, 11, 29, 12, 0)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def admission(**kwargs: object) -> Admission:
    return Admission(clock=Clock(), wall=lambda: NOON, **kwargs)  # type: ignore[arg-type]


def idle(a: Admission) -> bool:
    s = a.snapshot()
    return (s.num_queued, s.num_in_flight, dict(s.tenant_to_queued), s.num_orphaned) == (0, 0, {}, 0) \
        and set(s.unit_to_reserved.values()) == {0.0}


def refusal(a: Admission, tenant: Tenant, tokens: int = 10, num_prompts: int = 1, model: str = "") -> Refusal:
    with pytest.raises(Refusal) as e:
        a.admit(tenant, tokens, num_prompts=num_prompts, model=model)
    return e.value


def test_the_issue_a_rate_limited_tenant_gets_429s_never_503_and_others_are_admitted() -> None:
    """serve --auth --max-waiting 4; a tenant with --rpm 1 sends 7 requests: 200, then 429s (they used to
    leak queue slots until everyone got 503), and another tenant's first request is admitted."""
    a = admission(max_waiting=4)
    limited, other = Tenant("limited", rpm=1), Tenant("other")
    first = a.admit(limited, 10)
    codes = [refusal(a, limited).code for _ in range(6)]
    assert codes == ["requests_per_minute_exceeded"] * 6
    assert a.snapshot().num_queued == 1 and a.snapshot().num_in_flight == 1  # only the admitted one
    second = a.admit(other, 10)
    first.leave_queue(0)
    first.settle_actual(Actual(12, None, None))
    second.settle_actual(Actual(12, None, None))
    assert idle(a)


REFUSALS = {  # case: (tenant, what is held first, the refused request's (worst tokens, prompts), error code)
    "concurrency": (Tenant("t", max_concurrency=1), [(10, 1)], (10, 1), "concurrency_limit_exceeded"),
    "rpm": (Tenant("t", rpm=1), [(10, 1, "settled")], (10, 1), "requests_per_minute_exceeded"),
    "tpm": (Tenant("t", tpm=100), [(60, 1)], (50, 1), "tokens_per_minute_exceeded"),
    "tpm never fits": (Tenant("t", tpm=100), [], (101, 1), "max_tokens"),
    "budget too small": (Tenant("t", budget=Budget.parse("50tok/day")), [], (60, 1), "budget_insufficient"),
    "budget spent": (Tenant("t", budget=Budget.parse("50tok/day")), [(50, 1, "settled")], (1, 1),
                     "budget_exhausted"),
    "budget reserved": (Tenant("t", budget=Budget.parse("50tok/day")), [(40, 1)], (20, 1), "budget_reserved"),
    "tenant's queue share": (Tenant("t"), [(10, 2)], (10, 1), "overloaded"),
    "queue never fits": (Tenant("t"), [], (10, 3), "prompt"),
}


def levels(a: Admission) -> dict[tuple[str, str], float | str]:
    """Each token bucket's level ("full" for a full one: a refused first request may create it full)."""
    return {(kind, name): "full" if b.level == b.capacity else b.level
            for kind, buckets in (("rpm", a.tenant_to_rpm), ("tpm", a.tenant_to_tpm)) for name, b in buckets.items()}


@pytest.mark.parametrize("case", [*REFUSALS, "the whole queue"])
def test_every_refusal_takes_nothing(case: str) -> None:
    a = admission(max_waiting=4)
    tenant, held, (worst, num_prompts), code = REFUSALS.get(case, (Tenant("t"), [], (10, 1), "overloaded"))
    reservations = [a.admit(Tenant(f"o{i}"), 10, num_prompts=2) for i in range(2)] if case == "the whole queue" else []
    for worst_held, prompts, *settled in held:
        r = a.admit(tenant, worst_held, num_prompts=prompts)
        if settled:
            r.settle_actual(Actual(worst_held, None, None))
        reservations.append(r)
    before, buckets = a.snapshot(), levels(a)
    with pytest.raises((Refusal, ParameterError)) as e:
        a.admit(tenant, worst, num_prompts=num_prompts)
    assert getattr(e.value, "code", None) == code or getattr(e.value, "param", None) == code
    assert a.snapshot() == before
    assert levels(a) == {**buckets, **{k: v for k, v in levels(a).items() if k not in buckets and v == "full"}}
    for r in reservations:
        r.cancel()
    assert idle(a)


def test_a_reservation_releases_everything_once_whatever_the_order_of_exits() -> None:
    a = admission()
    t = Tenant("t", max_concurrency=1, tpm=100, budget=Budget.parse("100tok/day"))
    r = a.admit(t, 60, num_prompts=2)
    assert (r.tenant, r.priority, r.num_queued, r.released) == ("t", 1, 2, False)
    r.leave_queue(1)
    r.leave_queue(1)  # the same prompt again: nothing more
    assert a.snapshot().num_queued == 1
    r.settle_actual(Actual(30, None, None))
    r.settle_actual(Actual(30, None, None))  # idempotent: charged once
    r.cancel()  # after settling: nothing
    r.leave_queue()
    assert r.released and idle(a) and a.budget_status(t).spent == 30
    again = a.admit(t, 60)  # the concurrency slot came back; tokens/min got the unused 30 back
    again.cancel()
    again.settle_actual(Actual(60, None, None))  # after cancelling: nothing
    assert idle(a) and a.budget_status(t).spent == 30


def test_cancel_charges_nothing_and_gives_the_requests_per_minute_slot_back() -> None:
    a = admission()
    t = Tenant("t", rpm=1, tpm=50, budget=Budget.parse("50tok/day"))
    a.admit(t, 50).cancel()  # e.g. the engine was found dead after admission
    r = a.admit(t, 50)  # rpm, tpm and budget all whole again
    r.settle_actual(Actual(50, None, None))
    assert refusal(a, t, 1).code == "requests_per_minute_exceeded" and a.budget_status(t).spent == 50


def test_leave_queue_without_an_index_frees_the_lowest_slot_still_held() -> None:
    a = admission(max_waiting=8, max_waiting_per_tenant=8)
    r = a.admit(Tenant("t"), 1, num_prompts=3)
    r.leave_queue(0)
    r.leave_queue()
    assert a.snapshot().num_queued == 1
    r.leave_queue(1)  # freed already, by the call without an index
    assert a.snapshot().num_queued == 1
    r.leave_queue()
    r.leave_queue()  # more calls than prompts: nothing
    assert a.snapshot().num_queued == 0 and a.snapshot().num_in_flight == 1
    r.cancel()
    assert idle(a)


def test_the_context_manager_cancels_on_an_exception_and_keeps_a_settled_request_settled() -> None:
    a = admission()
    t = Tenant("t", budget=Budget.parse("100tok/day"))
    with pytest.raises(RuntimeError), a.admit(t, 10):
        raise RuntimeError("tokenizing failed after admission")
    assert idle(a) and a.budget_status(t).spent == 0
    with pytest.raises(RuntimeError), a.admit(t, 10) as r:
        r.settle_actual(Actual(7, None, None))
        raise RuntimeError("the client left after settlement")
    assert idle(a) and a.budget_status(t).spent == 7
    with a.admit(t, 10) as r:  # a normal exit hands the reservation on: still held
        pass
    assert not r.released and a.snapshot().num_in_flight == 1
    r.settle_actual(Actual(5, None, None))
    assert idle(a)


def test_settle_counts_prompt_and_completion_tokens_of_every_final_and_the_metered_use() -> None:
    a = admission()
    t = Tenant("t", budget=Budget.parse("1USD/day"))
    a.admit(t, 10).settle_actual(Actual(10, 20.0, 0.01))  # a rate: 0.001 USD per model token
    r = a.admit(t, 100, num_prompts=2)
    out = RequestOutput("r-0", "hi", [1, 2, 3], [CompletionOutput(0, "abc", [4, 5], finish_reason="length")])
    energy = RequestEnergy("r", 9.0, "constant", "system", 1.0, 9.0, 0.1, 1e9, 2, 2, 0.01, 0.01, 0.02)
    r.settle([out, None], energy)  # the second prompt never produced output
    assert a.budget_status(t).spent == pytest.approx(0.03) and idle(a)


def test_a_dropped_reservation_is_released_at_the_next_admission_and_charged_in_full() -> None:
    a = admission()
    t = Tenant("t", budget=Budget.parse("100tok/day"))
    a.admit(t, 40)  # dropped on the floor: a caller's bug
    gc.collect()
    s = a.snapshot()
    assert s.num_orphaned == 1 and s.num_queued == 0 and s.num_in_flight == 0
    assert a.budget_status(t).spent == 40  # charged its worst case: a bug never lets a budget overspend


# -- the fair 503 gate -----------------------------------------------------------------------------------


def test_one_tenant_may_hold_half_the_queue_so_another_tenant_is_still_admitted() -> None:
    a = admission(max_waiting=4)
    batch, chat, third = Tenant("batch"), Tenant("chat"), Tenant("third")
    assert a.share("batch") == 2 and a.share("anonymous") == 4
    held = a.admit(batch, 10, num_prompts=2)
    r = refusal(a, batch)
    assert (r.status, r.code, r.type, r.headers["Retry-After"]) == (503, "overloaded", "server_error", "2")
    assert "tenant batch already has 2 prompts waiting" in r.message and "2 of the server's 4" in r.message
    other = a.admit(chat, 10)  # the backlog of batch does not refuse chat's first request
    a.admit(chat, 10).cancel()
    assert a.snapshot().tenant_to_queued == {"batch": 2, "chat": 1}
    other2 = a.admit(chat, 10)
    r = refusal(a, third)
    assert r.code == "overloaded" and "4 prompts are already waiting" in r.message and "(limit 4)" in r.message
    held.leave_queue(0)  # one of batch's prompts started producing output
    a.admit(third, 10).cancel()
    for res in (held, other, other2):
        res.cancel()
    assert idle(a)


def test_with_auth_off_the_one_tenant_may_fill_the_queue_and_the_share_can_be_set() -> None:
    a = admission(max_waiting=4)
    anyone = Tenant("anonymous")
    held = a.admit(anyone, 10, num_prompts=4)
    assert refusal(a, anyone).code == "overloaded"
    held.cancel()
    b = admission(max_waiting=4, max_waiting_per_tenant=1)
    held = b.admit(Tenant("t"), 10)
    assert refusal(b, Tenant("t")).code == "overloaded"
    held.cancel()
    with pytest.raises(ParameterError) as e:
        b.admit(Tenant("u"), 10, num_prompts=2)  # could never fit: a 400, not a 503 to retry forever
    assert e.value.param == "prompt" and "2 prompts" in str(e.value)
    with pytest.raises(ValueError):
        Admission(max_waiting=0)


# -- budgets: the worst case must fit; rates per tenant and model ----------------------------------------


def test_a_worst_case_that_does_not_fit_the_budget_is_402_naming_both_numbers() -> None:
    a = admission()
    t = Tenant("t", budget=Budget.parse("1000tok/day"))
    r = refusal(a, t, 4096)  # the whole context, or 256 prompts x n=16: never admitted "because > 0 is left"
    assert r.status == 402 and r.code == "budget_insufficient" and r.param == "max_tokens"
    assert "worst case is 4096 model tokens" in r.message and "1000 model tokens left" in r.message
    g = Tenant("g", budget=Budget.parse("1kJ/day"))
    a.admit(g, 100, model="m").settle_actual(Actual(100, 200.0, None))  # 2 J per model token
    r = refusal(a, g, 500, model="m")  # 1000 J worst case; 800 J left
    assert r.code == "budget_insufficient" and "worst case is 1000 J (500 model tokens" in r.message
    assert "800 J left of its 1 kJ/day budget" in r.message
    assert idle(a)


def test_a_budget_reserved_by_requests_in_flight_is_429_with_the_numbers() -> None:
    a = admission()
    t = Tenant("t", budget=Budget.parse("100tok/day"))
    held = a.admit(t, 70)
    r = refusal(a, t, 40)
    assert r.status == 429 and r.code == "budget_reserved"
    assert "this request needs 40 model tokens; 70 model tokens of the 100 model tokens left" in r.message
    held.settle_actual(Actual(50, None, None))
    a.admit(t, 40).cancel()  # 50 left now


def test_joule_and_usd_rates_are_per_tenant_and_model_with_the_models_max_as_fallback() -> None:
    a = admission()
    budget = Budget.parse("10kJ/day")
    alice, bob = Tenant("alice", budget=budget), Tenant("bob", budget=budget)
    first = a.admit(alice, 10, model="small")
    assert first.reserved_budget == 10_000 and refusal(a, alice, model="small").code == "budget_reserved"
    first.settle_actual(Actual(100, 300.0, None))  # alice on small: 3 J per model token
    r = a.admit(bob, 10, model="small")
    assert r.reserved_budget == pytest.approx(30.0)  # bob knows nothing yet: the model's max across tenants
    r.settle_actual(Actual(100, 100.0, None))  # bob on small: 1 J per model token
    r = a.admit(bob, 10, model="small")
    assert r.reserved_budget == pytest.approx(10.0)  # bob's own rate now
    r.cancel()
    r = a.admit(alice, 10, model="small")
    assert r.reserved_budget == pytest.approx(30.0)  # the max of alice's recent rates, not the latest
    r.settle_actual(Actual(100, 50.0, None))
    r = a.admit(alice, 10, model="small")
    assert r.reserved_budget == pytest.approx(30.0)
    big = a.admit(bob, 10, model="big")  # another model: nothing known, all of bob's remainder
    assert big.reserved_budget == pytest.approx(10_000 - 100)  # bob used 100 J
    usd = Tenant("payer", budget=Budget.parse("5USD/day"))
    first = a.admit(usd, 10, model="small")
    first.settle_actual(Actual(100, None, 0.5))  # 0.005 USD per model token; the joule rates teach nothing
    last = a.admit(usd, 10, model="small")
    assert last.reserved_budget == pytest.approx(0.05)
    for res in (r, big, last):
        res.cancel()
    assert idle(a)


# -- hammered from threads: overspend at most one request's worth ----------------------------------------


def hammer(a: Admission, tenant: Tenant, use: callable, num_threads: int = 12, num_each: int = 25) -> list[float]:
    """In each round every thread tries to admit one request, all of them are in flight together, then
    the admitted ones settle; returns each admitted request's charge in the budget's unit.
    `use(rng)` -> (worst tokens, Actual)."""
    charges: list[float] = []
    lock, admitting, settling = threading.Lock(), threading.Barrier(num_threads), threading.Barrier(num_threads)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(num_each):
            worst, actual = use(rng)
            admitting.wait()
            try:
                r: Reservation | None = a.admit(tenant, worst, model="m")
            except Refusal:
                r = None
            settling.wait()  # everyone admitted in this round is in flight at once
            if r is None:
                continue
            r.leave_queue()
            r.settle_actual(actual)
            with lock:
                charges.append({"tokens": actual.tokens, "joules": actual.joules, "usd": actual.usd}[r.budget_unit])
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return charges


@pytest.mark.parametrize("unit", ["tokens", "joules", "usd"])
def test_budgets_hammered_from_threads_overspend_at_most_one_request(unit: str) -> None:
    """Per-token rates vary from request to request (up to the first request's, which sets the highest);
    actual tokens are at most the worst case. The budget may be exceeded only by the first request,
    admitted before any rate was known: by at most one request's worth."""
    a = admission(max_waiting=64, max_waiting_per_tenant=64)
    amount = {"tokens": 2000.0, "joules": 4000.0, "usd": 0.4}[unit]
    tenant = Tenant("t", budget=Budget(amount, unit, "day"))
    top = {"tokens": 1.0, "joules": 2.0, "usd": 2e-4}[unit]
    first = a.admit(tenant, 64, model="m")  # no rate known: reserves all of the budget
    first_charge = 64 * top
    first.settle_actual(Actual(64, 64 * top, 64 * top))

    def use(rng: random.Random) -> tuple[int, Actual]:
        tokens, rate = rng.randint(48, 64), rng.uniform(top * 0.75, top)
        return 64, Actual(tokens, tokens * rate, tokens * rate)
    charges = [first_charge, *hammer(a, tenant, use)]
    spent = a.budget_status(tenant).spent
    assert spent == pytest.approx(sum(charges))
    assert spent <= amount + max(charges)  # at most one request's worth over
    assert spent >= amount - 64 * top * 2  # and it went on admitting while a worst case fitted
    assert idle(a) and isinstance(a.snapshot(), AdmissionSnapshot)


def test_a_request_admitted_before_any_rate_is_known_is_the_only_one_that_can_overspend() -> None:
    a = admission()
    t = Tenant("t", budget=Budget.parse("100J/day"))
    r: Reservation = a.admit(t, 10, model="m")
    assert refusal(a, t, model="m").code == "budget_reserved"  # one at a time while no rate is known
    r.settle_actual(Actual(10, 130.0, None))  # it used more than was left
    assert a.budget_status(t).spent == 130 and refusal(a, t, model="m").code == "budget_exhausted"
