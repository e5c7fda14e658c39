"""Energy, money and the ledger for each API request, between the meter and the request service.

One API request may be several engine requests (a completions call with a list of prompts); its energy
and cost are their sums, and it gets one ledger row. The row is committed before the response's last
byte is sent: `settle()` is awaited before the final body or the final stream chunks are written.

The database never fails a request (issue #13). Ledger writes run on their own small thread pool (not
asyncio's default one, which auth lookups use: a held lock must not stall authentication), and a write
that takes longer than `write_timeout_s` is journalled instead; if it commits late, the unique
request_id makes the replay add nothing. `settle` is idempotent per API request id: a second call (a
client that disconnected while its row was being written, a fallback path) gets the first call's usage
and writes nothing. `close()` at shutdown waits, bounded, for the writes in flight.

A row can supersede an older aborted attempt at the same request id (meter/ledger.py: a batch line cut off
by a restart and run again). `settle_request` returns that attempt's row with the usage, so the caller
(`Settlement`) takes it out of the tenant's budget spend as the ledger took it out of the sums.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tokenfactory.meter.attribution import Meter, RequestEnergy
from tokenfactory.meter.ledger import Ledger, LedgerRow, row_for
from tokenfactory.types import ParameterError, RequestOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AccountingConfig:
    write_timeout_s: float = 2.0  # a ledger write slower than this is journalled (the client does not wait)
    num_ledger_threads: int = 4  # ledger writes in flight at once
    num_settled_remembered: int = 10_000  # API request ids whose usage a repeated settle() returns

    def __post_init__(self) -> None:
        if not self.write_timeout_s > 0:
            raise ParameterError("write_timeout_s", f"write_timeout_s must be > 0, got {self.write_timeout_s}")
        for name in ("num_ledger_threads", "num_settled_remembered"):
            if getattr(self, name) < 1:
                raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")


DEFAULT_CONFIG = AccountingConfig()


def merge_energy(api_request_id: str, parts: Sequence[RequestEnergy]) -> RequestEnergy:
    """Sum of the parts; energy (and cost) is None if any part's is (missing is never 0)."""
    first = parts[0]

    def total(name: str) -> float | None:
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else sum(values)

    outputs = [p.num_output_tokens for p in parts]
    return dataclasses.replace(
        first, request_id=api_request_id, energy_joules=total("energy_joules"),
        facility_energy_joules=total("facility_energy_joules"), device_seconds=sum(p.device_seconds for p in parts),
        flops=sum(p.flops for p in parts), num_steps=sum(p.num_steps for p in parts),
        num_output_tokens=None if any(o is None for o in outputs) else sum(outputs),  # type: ignore[arg-type]
        cost_device_usd=sum(p.cost_device_usd for p in parts), cost_energy_usd=total("cost_energy_usd"),
        cost_usd=total("cost_usd"))


@dataclass(frozen=True)
class Settled:
    """One API request settled: its energy and cost, and the older aborted attempt its row superseded (None:
    none, or not known because the row went to the journal)."""

    energy: RequestEnergy
    superseded: LedgerRow | None = None


class Accounting:
    def __init__(self, meter: Meter, ledger: Ledger, model_name: str,
                 config: AccountingConfig = DEFAULT_CONFIG) -> None:
        self.meter, self.ledger, self.model_name, self.config = meter, ledger, model_name, config
        self._writes = concurrent.futures.ThreadPoolExecutor(config.num_ledger_threads, "ledger-write")
        self._journal_writes = concurrent.futures.ThreadPoolExecutor(1, "ledger-journal")
        self._id_to_settlement: OrderedDict[str, asyncio.Future[Settled]] = OrderedDict()
        self._in_flight_lock = threading.Lock()  # done-callbacks run on the pool's threads
        self._in_flight: dict[concurrent.futures.Future[LedgerRow | None], LedgerRow] = {}

    async def settle(self, api_request_id: str, engine_ids: Sequence[str], finals: Sequence[RequestOutput | None],
                     status: str, tenant: str = "anonymous", model: str | None = None) -> RequestEnergy:
        """Finish the request with the meter, commit its ledger row, and return its energy and cost.
        `finals[i]` is engine request i's last output (None if it never produced one). Only the first call
        for an `api_request_id` does the work; later ones return its usage. The work goes on if the caller
        is cancelled, so a client that leaves mid-write still gets its row, once."""
        return (await self.settle_request(api_request_id, engine_ids, finals, status, tenant, model)).energy

    async def settle_request(self, api_request_id: str, engine_ids: Sequence[str],
                             finals: Sequence[RequestOutput | None], status: str, tenant: str = "anonymous",
                             model: str | None = None) -> Settled:
        """`settle`, with the attempt the row superseded (a later call: the first call's `Settled`)."""
        settlement = self._id_to_settlement.get(api_request_id)
        if settlement is None:
            settlement = asyncio.ensure_future(self._settle(api_request_id, engine_ids, finals, status, tenant,
                                                            model or self.model_name))
            self._remember(api_request_id, settlement)
        return await asyncio.shield(settlement)

    def _remember(self, api_request_id: str, settlement: asyncio.Future[Settled]) -> None:
        self._id_to_settlement[api_request_id] = settlement
        while len(self._id_to_settlement) > self.config.num_settled_remembered:
            oldest_id, oldest = next(iter(self._id_to_settlement.items()))
            if not oldest.done():
                break  # still being written: kept until it is
            del self._id_to_settlement[oldest_id]

    async def _settle(self, api_request_id: str, engine_ids: Sequence[str], finals: Sequence[RequestOutput | None],
                      status: str, tenant: str, model: str) -> Settled:
        parts = []
        for rid, out in zip(engine_ids, finals, strict=True):
            num_out = out.num_completion_tokens if out is not None else 0
            parts.append(self.meter.finish_request(rid, num_out))
        energy = merge_energy(api_request_id, parts)
        superseded = await self._commit(self._row(energy, finals, status, tenant, model))
        return Settled(energy, superseded)

    def _row(self, energy: RequestEnergy, finals: Sequence[RequestOutput | None], status: str,
             tenant: str, model: str) -> LedgerRow:
        done = [o for o in finals if o is not None]
        metrics = [o.metrics for o in done if o.metrics is not None]
        first_tokens = [m.first_token_time for m in metrics if m.first_token_time is not None]
        arrivals = [m.arrival_time for m in metrics]
        ends = [m.finished_time or m.last_token_time for m in metrics]
        return row_for(
            energy, model=model, status=status, tenant=tenant,
            prompt_tokens=sum(len(o.prompt_token_ids) for o in done),
            completion_tokens=sum(o.num_completion_tokens for o in done),
            cached_tokens=sum(o.num_cached_tokens for o in done),
            ttft_s=min(first_tokens) - min(arrivals) if first_tokens and arrivals else None,
            latency_s=max(e for e in ends if e is not None) - min(arrivals)
            if arrivals and any(e is not None for e in ends) else None,
            replica="+".join(sorted({o.replica for o in done if o.replica is not None})) or None)

    async def _commit(self, row: LedgerRow) -> LedgerRow | None:
        """The row in the database (returning the older aborted attempt it superseded, if any), or in the
        journal if the write is slow; never raises for the database."""
        write = self._submit(self._writes, self.ledger.record, row)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(write), self.config.write_timeout_s)
        except TimeoutError:  # cancelled if it had not started; else it may still commit (harmlessly)
            reason = f"a ledger write took longer than {self.config.write_timeout_s:g} s"
        except Exception as e:  # noqa: BLE001 - record() keeps database errors; anything else must not fail a request
            logger.exception("ledger: recording %s failed", row.request_id)
            reason = f"a ledger write failed ({type(e).__name__})"
        journal = self._submit(self._journal_writes, self.ledger.journal, row, reason)
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(journal)), self.config.write_timeout_s)
        except TimeoutError:  # the disk is slow too: the journal thread still writes it, close() waits
            logger.warning("ledger: journalling %s takes longer than %g s", row.request_id,
                           self.config.write_timeout_s)
        return None

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., LedgerRow | None],
                row: LedgerRow, *args: str) -> concurrent.futures.Future[LedgerRow | None]:
        future = pool.submit(fn, row, *args)
        with self._in_flight_lock:
            self._in_flight[future] = row
        future.add_done_callback(self._done)
        return future

    def _done(self, future: concurrent.futures.Future[LedgerRow | None]) -> None:
        with self._in_flight_lock:
            self._in_flight.pop(future, None)

    def close(self, timeout_s: float = 10.0) -> None:
        """At shutdown, after the engine has drained: wait (at most `timeout_s`) for the ledger writes in
        flight, journal the rows of any still unfinished, then close the ledger (one last replay; what the
        database does not take stays in the journal for the next start). Blocking: call it from a thread
        or after the event loop has stopped."""
        with self._in_flight_lock:
            pending = list(self._in_flight.items())
        done, not_done = concurrent.futures.wait([f for f, _ in pending], timeout=timeout_s)
        self._writes.shutdown(wait=False, cancel_futures=True)
        self._journal_writes.shutdown(wait=False, cancel_futures=True)
        rows = {row.request_id: row for future, row in pending if future in not_done}
        for row in rows.values():  # a late commit of the same row is harmless: the replay skips it
            self.ledger.journal(row, "the server stopped before a ledger write finished")
        if rows:
            logger.warning("ledger: %d write(s) unfinished at shutdown were journalled", len(rows))
        self.ledger.close()
