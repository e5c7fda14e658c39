"""Accounting.settle against a database that stalls: the client still gets its usage, promptly, on the
ledger's own threads; a second settle for the same API request writes nothing; close() leaves what it
could not write in the journal for the next start; /metrics shows the journal's counts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tests.meter.test_ledger_faults import lock_held, wait_until
from tokenfactory.gateway.metrics import LedgerCollector
from tokenfactory.meter.attribution import Meter, MeterConfig
from tokenfactory.meter.journal import JournalFile
from tokenfactory.meter.ledger import Ledger, LedgerConfig, LedgerRow
from tokenfactory.meter.paths import journal_path, ledger_path
from tokenfactory.meter.power import ConstantSource
from tokenfactory.meter.prices import load_prices
from tokenfactory.service.accounting import Accounting, AccountingConfig
from tokenfactory.types import CompletionOutput, RequestMetrics, RequestOutput, SequenceWork, StepStats


class Shape:
    num_params, num_layers, num_heads, head_dim = 1000, 2, 2, 4


def metered(engine_ids: list[str]) -> Meter:
    """A meter on a manual clock that has seen one 0.5 s step at 100 W for these engine requests."""
    clock = [0.0]
    meter = Meter(ConstantSource(100.0, "machine", lambda: clock[0]), Shape(), load_prices(),
                  MeterConfig(tick_interval_s=None), clock=lambda: clock[0])
    clock[0] = 0.5
    work = tuple(SequenceWork(rid, 4, 0, True) for rid in engine_ids)
    meter.on_step(StepStats(0, 0.0, 0.5, 4 * len(work), 0, len(work), 0, 0, 1, 0, work))
    return meter


def final(engine_id: str) -> RequestOutput:
    return RequestOutput(engine_id, None, [1, 2, 3, 4], [CompletionOutput(0, "hi", [5, 6], finish_reason="stop")],
                         metrics=RequestMetrics(arrival_time=0.0, first_token_time=0.1, finished_time=0.5))


def test_settle_twice_for_one_id_writes_one_row(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path)
    accounting = Accounting(metered(["e1", "e2", "e3"]), ledger, "m")

    async def main() -> list[dict]:
        first = await accounting.settle("api-1", ["e1"], [final("e1")], "finished")
        again = await accounting.settle("api-1", ["e1"], [final("e1")], "aborted")  # a fallback path
        both = await asyncio.gather(*(accounting.settle("api-2", ["e2"], [final("e2")], "finished")
                                      for _ in range(2)))
        # A client that leaves while its row is being written: the write goes on, once.
        leaving = asyncio.ensure_future(accounting.settle("api-3", ["e3"], [final("e3")], "finished"))
        await asyncio.sleep(0)
        leaving.cancel()
        later = await accounting.settle("api-3", ["e3"], [final("e3")], "aborted")
        return [first, again, *both, later]

    first, again, both_a, both_b, later = asyncio.run(main())
    assert first == again and both_a == both_b and later.energy_joules is not None
    for api_id in ("api-1", "api-2", "api-3"):
        [stored] = ledger.find(api_id)
        assert stored.status == "finished" and stored.completion_tokens == 2 and stored.prompt_tokens == 4
    assert ledger.find("api-1")[0].energy_joules == pytest.approx(first.energy_joules)
    assert ledger.status().num_journalled_total == 0
    accounting.close()


def test_a_held_lock_does_not_hold_the_client(tmp_path: Path) -> None:
    # The write waits up to 5 s for the lock; the client waits 0.2 s, then the row is journalled. When
    # the lock goes the write commits late and the replay finds the row there: one row.
    ledger = Ledger.open(tmp_path, config=LedgerConfig(busy_timeout_s=5.0, retry_initial_s=0.05, retry_max_s=0.2))
    accounting = Accounting(metered(["e1", "e2"]), ledger, "m", AccountingConfig(write_timeout_s=0.2))
    expected = Accounting(metered(["e1", "e2"]), Ledger.open(tmp_path / "other"), "m")

    async def settle_both() -> tuple[dict, dict, float]:
        started = time.monotonic()
        one, two = await asyncio.gather(accounting.settle("api-1", ["e1"], [final("e1")], "finished"),
                                        accounting.settle("api-2", ["e2"], [final("e2")], "finished"))
        await asyncio.to_thread(lambda: None)  # asyncio's own pool (auth lookups) is free meanwhile
        return one, two, time.monotonic() - started

    with lock_held(ledger_path(tmp_path)) as release:
        one, two, elapsed = asyncio.run(settle_both())
        assert elapsed < 2.0
        s = ledger.status()
        assert s.degraded and s.reason == "a ledger write took longer than 0.2 s" and s.num_journalled_total == 2
        release()
    right = asyncio.run(expected.settle("api-1", ["e1"], [final("e1")], "finished"))
    assert one == right and one.energy_joules == pytest.approx(two.energy_joules)  # usage is correct
    wait_until(lambda: not ledger.status().degraded)
    accounting.close()
    assert len(ledger.find("api-1")) == 1 and len(ledger.find("api-2")) == 1
    assert ledger.count() == 2
    expected.close()


def test_close_leaves_unwritten_rows_for_the_next_start(tmp_path: Path) -> None:
    ledger = Ledger.open(tmp_path, config=LedgerConfig(busy_timeout_s=0.5, retry_initial_s=5.0, retry_max_s=5.0))
    accounting = Accounting(metered(["e1"]), ledger, "m", AccountingConfig(write_timeout_s=5.0))

    async def settle_and_close() -> dict:
        settling = asyncio.ensure_future(accounting.settle("api-1", ["e1"], [final("e1")], "finished"))
        await asyncio.sleep(0.1)  # its write is waiting for the lock
        await asyncio.to_thread(accounting.close, 0.05)  # SIGTERM: a bounded wait, then journal
        return await settling

    with lock_held(ledger_path(tmp_path)):
        usage = asyncio.run(settle_and_close())
    assert usage.energy_joules is not None
    assert JournalFile(journal_path(tmp_path)).count() >= 1  # the last replay could not take it
    reopened = Ledger.open(tmp_path)  # the next start
    [stored] = reopened.find("api-1")
    assert stored.completion_tokens == 2 and reopened.count() == 1
    assert JournalFile(journal_path(tmp_path)).is_empty()
    reopened.close()


def test_ledger_metrics(tmp_path: Path) -> None:
    Ledger.open(tmp_path).close()
    read_only = Ledger(f"sqlite:///file:{ledger_path(tmp_path)}?mode=ro&uri=true",
                       journal_path=journal_path(tmp_path), config=LedgerConfig(retry_initial_s=60, retry_max_s=60))
    for i in range(3):
        read_only.record(LedgerRow(f"r{i}", "m", "finished", 1, 1))
    registry = CollectorRegistry()
    registry.register(LedgerCollector(read_only))
    text = generate_latest(registry).decode()
    for line in ("tokenfactory:ledger_rows_journalled_total 3.0", "tokenfactory:ledger_rows_replayed_total 0.0",
                 "tokenfactory:ledger_rows_pending 3.0", "tokenfactory:ledger_degraded 1.0"):
        assert line in text.splitlines(), line
    read_only.close()
    ledger = Ledger.open(tmp_path)
    registry = CollectorRegistry()
    registry.register(LedgerCollector(ledger))
    assert "tokenfactory:ledger_rows_pending 0.0" in generate_latest(registry).decode().splitlines()
    ledger.close()
