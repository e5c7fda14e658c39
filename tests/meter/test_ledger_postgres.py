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
