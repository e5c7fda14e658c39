"""FairSlots and TenantBackoff (batch/slots.py) on a real event loop and a manual clock: the cap per tenant, a
freed slot handed to tenants in turn, a cancelled waiter giving its place (or its slot) back, and a backoff that
doubles while refused and resets when a line passes."""

from __future__ import annotations

import asyncio

import pytest

from tokenfactory.batch.slots import FairSlots, TenantBackoff


def test_slots_go_round_the_waiting_tenants_within_their_caps() -> None:
    async def scenario() -> list[str]:
        slots, order = FairSlots(2, lambda tenant: 2 if tenant == "big" else 1), []

        async def line(tenant: str) -> None:
            await slots.acquire(tenant)
            order.append(tenant)

        await slots.acquire("big")
        await slots.acquire("big")  # the server is full with one tenant's lines
        waiters = [asyncio.ensure_future(line(t)) for t in ("big", "big", "big", "small", "other")]
        await asyncio.sleep(0)
        assert slots.num_waiting == 5
        for _ in range(4):
            slots.release(order[-1] if order else "big")
            await asyncio.sleep(0)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert slots.num_waiting == 0
        return order

    order = asyncio.run(scenario())
    assert order[:3] == ["big", "small", "other"]  # in turn: the newcomers are not queued behind big's backlog


def test_a_cancelled_waiter_gives_its_place_or_its_slot_back() -> None:
    async def scenario() -> tuple[int, int]:
        slots = FairSlots(1, lambda tenant: 1)
        await slots.acquire("a")
        waiter = asyncio.ensure_future(slots.acquire("b"))
        await asyncio.sleep(0)
        slots.release("a")  # hands the slot to b ...
        waiter.cancel()  # ... which is cancelled before it runs: the slot goes back
        await asyncio.gather(waiter, return_exceptions=True)
        return slots.num_in_flight, slots.num_waiting

    assert asyncio.run(scenario()) == (0, 0)
    with pytest.raises(ValueError):
        FairSlots(0, lambda tenant: 1)


def test_backoff_doubles_while_refused_and_resets_when_a_line_passes() -> None:
    now = [100.0]
    backoff = TenantBackoff(0.5, 4.0, clock=lambda: now[0])
    assert [backoff.refused("t") for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.wait_s("t") == 4.0 and backoff.wait_s("other") == 0.0
    now[0] += 4.0
    assert backoff.wait_s("t") == 0.0
    backoff.passed("t")
    assert backoff.refused("t") == 0.5
