"""Who of the Batch API's tenants runs a line next: slots handed out fairly, and a tenant's wait after a refusal.

`FairSlots` bounds the lines in the engine twice: at most `total` at once, and at most `cap(tenant)` of one
tenant. A free slot goes to the waiting tenants in turn (round robin over tenants, first come first served
within one), so a tenant with a 50,000-line job and a tenant with one line both run: the second waits for one
slot to free, never behind the first one's queue. `TenantBackoff` is the wait of a tenant whose line was refused
for a limit (429) or a full queue (503): its lines wait *without* a slot (the slot goes to someone else), the
delay doubling from `initial_s` to `max_s` while refusals go on and reset by a line that passes.

Both live on one event loop (no locks); a waiter cancelled while it waits gives up its place, and one cancelled
just after it was handed a slot gives the slot back.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class FairSlots:
    def __init__(self, total: int, cap: Callable[[str], int]) -> None:
        """`cap(tenant)`: the most lines of that tenant in flight at once (at least 1)."""
        if total < 1:
            raise ValueError(f"total must be >= 1, got {total}")
        self.total, self.cap = total, cap
        self.num_in_flight = 0
        self.tenant_to_in_flight: dict[str, int] = {}
        self.tenant_to_waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self.turns: deque[str] = deque()  # tenants with waiters, in the order they get the next free slot

    def _fits(self, tenant: str) -> bool:
        return self.num_in_flight < self.total and self.tenant_to_in_flight.get(tenant, 0) < max(1, self.cap(tenant))

    def _take(self, tenant: str) -> None:
        self.num_in_flight += 1
        self.tenant_to_in_flight[tenant] = self.tenant_to_in_flight.get(tenant, 0) + 1

    async def acquire(self, tenant: str) -> None:
        if not self.tenant_to_waiters.get(tenant) and self._fits(tenant):
            self._take(tenant)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self.tenant_to_waiters.setdefault(tenant, deque())
        waiters.append(future)
        if tenant not in self.turns:
            self.turns.append(tenant)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(tenant)  # handed a slot as it was cancelled: give it on
            else:
                self._forget(tenant, future)
            raise

    def release(self, tenant: str) -> None:
        self.num_in_flight -= 1
        left = self.tenant_to_in_flight.get(tenant, 1) - 1
        if left > 0:
            self.tenant_to_in_flight[tenant] = left
        else:
            self.tenant_to_in_flight.pop(tenant, None)
        self._hand_out()

    def _hand_out(self) -> None:
        """Free slots to waiting tenants in turn: each tenant that fits gets one, then goes to the back."""
        skipped = 0
        while self.turns and self.num_in_flight < self.total and skipped < len(self.turns):
            tenant = self.turns.popleft()
            waiters = self.tenant_to_waiters.get(tenant)
            if not waiters:
                self.tenant_to_waiters.pop(tenant, None)
                continue
            if not self._fits(tenant):  # at its own cap: it waits for one of its own lines to end
                self.turns.append(tenant)
                skipped += 1
                continue
            skipped = 0
            self._take(tenant)
            waiters.popleft().set_result(None)
            if waiters:
                self.turns.append(tenant)
            else:
                self.tenant_to_waiters.pop(tenant, None)

    def _forget(self, tenant: str, future: asyncio.Future[None]) -> None:
        waiters = self.tenant_to_waiters.get(tenant)
        if waiters is not None and future in waiters:
            waiters.remove(future)
            if not waiters:
                self.tenant_to_waiters.pop(tenant, None)
                if tenant in self.turns:
                    self.turns.remove(tenant)

    @property
    def num_waiting(self) -> int:
        return sum(len(w) for w in self.tenant_to_waiters.values())


class TenantBackoff:
    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.initial_s, self.max_s, self.clock = initial_s, max_s, clock
        self.tenant_to_delay: dict[str, float] = {}
        self.tenant_to_until: dict[str, float] = {}

    def refused(self, tenant: str) -> float:
        """A line of `tenant` was refused for a limit: its lines wait; returns the delay."""
        delay = min(self.max_s, self.tenant_to_delay.get(tenant, self.initial_s / 2) * 2)
        self.tenant_to_delay[tenant] = delay
        self.tenant_to_until[tenant] = max(self.tenant_to_until.get(tenant, 0.0), self.clock() + delay)
        return delay

    def passed(self, tenant: str) -> None:
        self.tenant_to_delay.pop(tenant, None)
        self.tenant_to_until.pop(tenant, None)

    def wait_s(self, tenant: str) -> float:
        return max(0.0, self.tenant_to_until.get(tenant, 0.0) - self.clock())

    async def wait(self, tenant: str) -> None:
        while (left := self.wait_s(tenant)) > 0:
            await asyncio.sleep(left)
