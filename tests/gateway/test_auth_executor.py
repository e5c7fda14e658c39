"""Authentication on its own bounded executor: a tenant database that does not answer (a lock held by
another process, on a real SQLite file) makes auth answer 503 within its timeout instead of hanging,
too many pending lookups are refused at once, and the budget's spent-so-far is read in the auth thread
so that admission on the event loop never touches the ledger."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenfactory.gateway.auth import KeyAuthenticator, StoreExecutor
from tokenfactory.meter.ledger import Ledger, LedgerRow, utc_now
from tokenfactory.service.admission import Admission
from tokenfactory.service.errors import Refusal
from tokenfactory.tenants.store import Budget, Tenant, TenantStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[TenantStore, Ledger]]:
    store, ledger = TenantStore.open(str(tmp_path))
    yield store, ledger
    ledger.close()


def unavailable(coro: object) -> Refusal:
    with pytest.raises(Refusal) as e:
        asyncio.run(coro)  # type: ignore[arg-type]
    return e.value


def test_a_lookup_that_does_not_answer_is_503_within_the_timeout_and_never_blocks_the_next_one() -> None:
    gate = threading.Event()
    executor = StoreExecutor(max_workers=2, max_pending=2, timeout_s=0.05)

    async def scenario() -> None:
        for _ in range(2):  # two lookups stuck in the database: each answered 503 by its timeout
            with pytest.raises(Refusal) as e:
                await executor.run(gate.wait)
            r = e.value
            assert (r.status, r.code, r.type) == (503, "auth_unavailable", "server_error")
            assert r.headers["Retry-After"] == "2"
            assert r.message.startswith("authentication is temporarily unavailable") and "0.05 s" in r.message
        # Both threads are still stuck: a third lookup is refused at once, not queued behind them.
        with pytest.raises(Refusal) as e:
            await asyncio.wait_for(executor.run(lambda: "never runs"), timeout=5)
        assert "too many lookups are already waiting" in e.value.message
        gate.set()  # the database answers again
        for _ in range(100):
            try:
                assert await executor.run(lambda: "ok") == "ok"
                return
            except Refusal:  # the stuck threads are finishing
                await asyncio.sleep(0.01)
        raise AssertionError("the executor did not recover")
    asyncio.run(scenario())
    executor.shutdown()


def test_a_database_error_is_503_without_the_sql() -> None:
    import sqlalchemy as sa

    def broken() -> None:
        raise sa.exc.OperationalError("SELECT secret FROM api_keys WHERE key_id = ?", ("abc",), Exception("disk"))
    r = unavailable(StoreExecutor().run(broken))
    assert r.status == 503 and "OperationalError" in r.message and "SELECT" not in r.message and "abc" not in r.message


def hold_exclusive_lock(db: Path) -> sqlite3.Connection:
    """What another process's long write does: with locking_mode=EXCLUSIVE even WAL readers must wait."""
    conn = sqlite3.connect(db, isolation_level=None, timeout=1)
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    conn.execute("BEGIN EXCLUSIVE")
    conn.execute("UPDATE tenants SET weight = weight")
    return conn


def test_a_real_sqlite_lock_held_by_another_connection_makes_auth_503_then_recover(store) -> None:
    store, ledger = store
    db = Path(ledger.url.removeprefix("sqlite:///"))
    store.add_tenant(Tenant("chat"))
    key, _ = store.create_key("chat")
    authenticator, executor = KeyAuthenticator(store), StoreExecutor(timeout_s=0.3)
    store.engine.dispose()  # our own idle pooled connections would keep the other one from locking
    holder = hold_exclusive_lock(db)
    try:
        r = unavailable(executor.run(authenticator.authenticate, f"Bearer {key}"))
        assert r.status == 503 and r.code == "auth_unavailable" and "did not answer within 0.3 s" in r.message
    finally:
        holder.execute("ROLLBACK")
        holder.close()

    async def after() -> str:
        return (await executor.run(authenticator.authenticate, f"Bearer {key}")).tenant.name
    assert asyncio.run(after()) == "chat"
    executor.shutdown()


def test_the_auth_thread_reads_the_budget_so_that_admission_never_reads_the_ledger(store, monkeypatch) -> None:
    store, ledger = store
    ledger.record(LedgerRow("r1", "m", "finished", 30, 20, tenant="thrifty", created_at=utc_now()))
    store.add_tenant(Tenant("thrifty", budget=Budget.parse("100tok/day")))
    key, _ = store.create_key("thrifty")
    admission = Admission(ledger)
    principal = KeyAuthenticator(store, admission.prime).authenticate(f"Bearer {key}")  # in the auth thread

    def no_reads(*_: object, **__: object) -> None:
        raise AssertionError("admission read the ledger on the event loop")
    monkeypatch.setattr(ledger, "totals", no_reads)
    r = admission.admit(principal.tenant, 40)
    assert admission.budget_status(principal.tenant).spent == 50 and r.reserved_budget == 40
    r.cancel()
