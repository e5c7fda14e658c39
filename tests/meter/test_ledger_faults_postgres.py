"""PostgreSQL restarted mid-load (a clean stop, then a crash): writers in threads never see an error, and
afterwards every acknowledged row is in the ledger once and the daily sums equal the rows."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.meter.test_ledger_faults import assert_each_once, wait_until
from tests.postgres_util import PostgresCluster
from tokenfactory.meter.ledger import Ledger, LedgerConfig, LedgerRow

pytestmark = pytest.mark.slow


def test_postgres_restarted_mid_load_loses_and_doubles_nothing(tmp_path: Path) -> None:
    cluster = PostgresCluster()
    cluster.start()
    ledger = Ledger.open(tmp_path, url=cluster.url,
                         config=LedgerConfig(connect_timeout_s=1, retry_initial_s=0.05, retry_max_s=0.3))
    acknowledged: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(k: int) -> None:
        i = 0
        while not stop.is_set():
            rid = f"w{k}-{i}"
            try:
                ledger.record(LedgerRow(rid, "m", "finished", 10, i % 50, tenant=f"t{k}", energy_joules=0.25,
                                        energy_source="modelled", cost_usd=0.001))
            except BaseException as e:  # noqa: BLE001 - must never happen: counted below
                errors.append(e)
            acknowledged.append(rid)
            i += 1
            time.sleep(0.002)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for fast in (True, False):  # SIGINT (fast shutdown), then SIGQUIT (a crash, recovery at start)
            time.sleep(0.4)
            before = ledger.status().num_journalled_total
            cluster.stop(fast=fast)
            time.sleep(0.6)
            assert ledger.status().degraded and ledger.status().num_journalled_total > before
            cluster.start()
            wait_until(lambda: not ledger.status().degraded, timeout_s=30)  # drains under load
        num_recovered = len(acknowledged)
        time.sleep(0.2)
        assert len(acknowledged) > num_recovered and not ledger.status().degraded  # straight to the database
        stop.set()
        for t in threads:
            t.join()
        wait_until(lambda: not ledger.status().degraded, timeout_s=30)
        assert not errors
        s = ledger.status()
        assert s.num_pending == 0 and s.num_replayed_total > 0
        assert_each_once(ledger, acknowledged)
        by_tenant = {t.key: t.num_requests for t in ledger.totals(group_by="tenant")}
        assert by_tenant == {f"t{k}": sum(r.startswith(f"w{k}-") for r in acknowledged) for k in range(4)}
    finally:
        stop.set()
        ledger.close()
        cluster.remove()
