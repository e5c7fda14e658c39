"""The ledger on a real PostgreSQL server (a private cluster started in a temporary directory), through the
same SQLAlchemy code as SQLite: record, find, totals with grouping, concurrent writers."""

from __future__ import annotations

import threading

import pytest

from tests.postgres_util import PostgresCluster
from tokenfactory.meter.ledger import Ledger, LedgerRow

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres_url() -> str:
    cluster = PostgresCluster()
    cluster.start()
    yield cluster.url
    cluster.remove()


def row(i: int, tenant: str = "a", model: str = "m") -> LedgerRow:
    return LedgerRow(request_id=f"r{i}", model=model, status="finished", prompt_tokens=10, completion_tokens=i,
                     tenant=tenant, energy_joules=0.5, energy_source="modelled", energy_scope="cpu-package",
                     cost_usd=0.001, cost_energy_usd=0.0001, cost_device_usd=0.0009)


def test_ledger_on_postgresql(postgres_url) -> None:
    ledger = Ledger(postgres_url)
    try:
        ledger.record(row(1))
        [found] = ledger.find("r1")
        assert found.completion_tokens == 1 and found.energy_source == "modelled"

        def writer(k: int) -> None:
            for j in range(10):
                ledger.record(row(100 + 10 * k + j, tenant=f"t{k % 2}"))

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert ledger.count() == 41
        [total] = ledger.totals()
        assert total.num_requests == 41 and total.energy_joules == pytest.approx(41 * 0.5)
        by_tenant = {t.key: t.num_requests for t in ledger.totals(group_by="tenant")}
        assert by_tenant == {"a": 1, "t0": 20, "t1": 20}
    finally:
        ledger.close()
    reopened = Ledger(postgres_url)
    try:
        assert reopened.count() == 41
    finally:
        reopened.close()


def test_a_rerun_supersedes_its_aborted_attempt_on_postgresql(postgres_url) -> None:
    """Issue #25, on PostgreSQL: the same rule and the same one truth (rows, daily sums, audit table) as SQLite."""
    import dataclasses
    import datetime as dt

    import sqlalchemy as sa

    from tokenfactory.meter.schema import superseded_table

    ledger = Ledger(postgres_url)
    try:
        t0 = dt.datetime(2026, 1, 5, 12, 0)
        aborted = LedgerRow("batch_pg-l1", "m", "aborted", 10, 400, tenant="pg", created_at=t0)
        answer = LedgerRow("batch_pg-l1", "m", "finished", 10, 1500, tenant="pg", created_at=t0 + dt.timedelta(1))
        assert ledger.record(aborted) is None
        assert ledger.record(answer).completion_tokens == 400
        assert ledger.record(aborted) is None  # a late copy of the cut-off attempt changes nothing
        [kept] = ledger.find("batch_pg-l1")
        assert (kept.status, kept.completion_tokens) == ("finished", 1500)
        [total] = ledger.totals(tenant="pg")
        [raw] = [t for t in ledger.raw_totals(group_by="tenant") if t.key == "pg"]
        assert (total.num_requests, total.completion_tokens) == (raw.num_requests, raw.completion_tokens) == (1, 1500)
        by_day = {t.key: t.completion_tokens for t in ledger.totals(group_by="day", tenant="pg")}
        assert by_day == {"2026-01-06": 1500}  # the old day's sums gave the cut-off attempt back
        same_day = [LedgerRow(f"batch_pg-l{i}", "m", status, 10, n, tenant="pg", created_at=t0 + dt.timedelta(1, i))
                    for i, (status, n) in enumerate((("aborted", 7), ("finished", 9)), start=2)]
        ledger.record(same_day[0])
        ledger.record_many([dataclasses.replace(same_day[1], request_id="batch_pg-l2"), same_day[1]])
        by_day = {t.key: t.completion_tokens for t in ledger.totals(group_by="day", tenant="pg")}
        assert by_day == {"2026-01-06": 1500 + 9 + 9}  # one statement touched the day's sums twice: merged
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(superseded_table)).scalar_one() == 2
    finally:
        ledger.close()
