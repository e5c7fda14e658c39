"""Settling one API request: its meter figures, its ledger row and its tenant reservations, exactly once.

A request can end in many ways (its body finishing, a failure, a disconnect, a client that stops reading,
a disconnect while its ledger row is being written, a stream whose body never started): every one of
them calls `Settlement.start` or `settle`, and only the first call does the work, in one task that no
caller's cancellation can cancel. Pending settlements are tracked so that SIGTERM waits for their rows.
"""

from __future__ import annotations

import asyncio
import logging

from tokenfactory.engine.client import AddRequest
from tokenfactory.meter.attribution import RequestEnergy
from tokenfactory.meter.ledger import LedgerRow
from tokenfactory.service.accounting import Accounting
from tokenfactory.service.admission import Credit, Reservation
from tokenfactory.types import RequestOutput

logger = logging.getLogger(__name__)


def credit_of(row: LedgerRow | None) -> Credit | None:
    if row is None:
        return None
    return Credit(row.prompt_tokens + row.completion_tokens, row.energy_joules, row.cost_usd, row.created_at)


class Settlement:
    """Meter, ledger and tenant reservations of one API request, settled exactly once whatever ends it
    (the body finishing, a disconnect while the row is written, a failure): the first call starts the one
    settling task, every later call awaits that same task, and cancelling a caller never cancels it."""

    def __init__(self, accounting: Accounting | None, pending: set[asyncio.Task], request_id: str,
                 adds: list[AddRequest], reservation: Reservation, model: str | None = None) -> None:
        """`pending`: the server's set of unfinished settlements (what shutdown waits for); `model`: the
        served model's name for its ledger row (None: the accounting's own)."""
        self.accounting, self.pending, self.model = accounting, pending, model
        self.request_id, self.adds, self.reservation = request_id, adds, reservation
        self.task: asyncio.Task[RequestEnergy | None] | None = None

    async def settle(self, finals: list[RequestOutput | None], status: str) -> RequestEnergy | None:
        """The request's energy and cost (None without a meter, or if settling failed)."""
        return await asyncio.shield(self.start(finals, status))

    def start(self, finals: list[RequestOutput | None], status: str) -> asyncio.Task[RequestEnergy | None]:
        if self.task is None:
            self.task = asyncio.ensure_future(self._settle(finals, status))
            self.pending.add(self.task)
            self.task.add_done_callback(self.pending.discard)
        return self.task

    async def _settle(self, finals: list[RequestOutput | None], status: str) -> RequestEnergy | None:
        energy = superseded = None
        try:
            if self.accounting is not None:
                settled = await self.accounting.settle_request(self.request_id, [a.request_id for a in self.adds],
                                                               finals, status, tenant=self.reservation.tenant,
                                                               model=self.model)
                energy, superseded = settled.energy, settled.superseded
        except Exception:  # noqa: BLE001 - the answer still goes out; the log says what went wrong
            logger.exception("settling request %s failed", self.request_id)
        finally:
            # Actual use replaces the reservation; an earlier attempt this row superseded leaves the budget's spend.
            self.reservation.settle(finals, energy, credit=credit_of(superseded))
        return energy
