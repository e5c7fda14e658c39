"""Tenants and API keys: the store on real SQLite (beside a real ledger) and the `tenants` / `keys` commands."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import sqlalchemy as sa

from tokenfactory.cli import main as cli_main
from tokenfactory.meter.ledger import utc_now
from tokenfactory.tenants.cli import parse_expires
from tokenfactory.tenants.store import Budget, Tenant, TenantStore, api_keys_table
from tokenfactory.types import ParameterError


@pytest.fixture
def store(tmp_path):
    store, ledger = TenantStore.open(str(tmp_path))
    yield store
    ledger.close()


@pytest.mark.parametrize(("text", "amount", "unit", "period", "shown"), [
    ("50USD/month", 50.0, "usd", "month", "50.00 USD/month"),
    ("2MJ/month", 2e6, "joules", "month", "2 MJ/month"),
    ("10Mtok/day", 1e7, "tokens", "day", "10 Mtok/day"),
    ("500 kJ / day", 5e5, "joules", "day", "500 kJ/day"),
    ("1.5$/day", 1.5, "usd", "day", "1.50 USD/day"),
])
def test_budget_parses_and_describes(text, amount, unit, period, shown) -> None:
    b = Budget.parse(text)
    assert (b.amount, b.unit, b.period) == (pytest.approx(amount), unit, period)
    assert b.describe() == shown


@pytest.mark.parametrize("text", ["50", "50USD", "10Xtok/day", "5USD/week", "-3J/day", "0tok/day"])
def test_bad_budget_names_the_parameter(text) -> None:
    with pytest.raises(ParameterError, match="budget") as e:
        Budget.parse(text)
    assert e.value.param == "budget"


def test_budget_periods_are_utc_calendar_days_and_months() -> None:
    now = dt.datetime(2026, 12, 31, 23, 59)
    assert Budget(1, "tokens", "day").period_bounds(now) == (dt.datetime(2026, 12, 31), dt.datetime(2027, 1, 1))
    assert Budget(1, "tokens", "month").period_bounds(now) == (dt.datetime(2026, 12, 1), dt.datetime(2027, 1, 1))


def test_tenant_validation_names_the_parameter() -> None:
    for kwargs, param in (({"name": "bad name"}, "name"), ({"name": "a", "priority": "urgent"}, "priority"),
                          ({"name": "a", "weight": 0}, "weight"), ({"name": "a", "rpm": 0}, "rpm")):
        with pytest.raises(ParameterError) as e:
            Tenant(**kwargs)
        assert e.value.param == param


def test_tenants_crud_and_reserved_names(store) -> None:
    store.add_tenant(Tenant("chat", "interactive", 2.0, rpm=60, budget=Budget.parse("5USD/day")))
    store.add_tenant(Tenant("etl", "batch"))
    assert [t.name for t in store.list_tenants()] == ["chat", "etl"]
    with pytest.raises(ParameterError, match="already exists"):
        store.add_tenant(Tenant("chat"))
    with pytest.raises(ParameterError, match="reserved"):
        store.add_tenant(Tenant("anonymous"))
    updated = store.update_tenant("chat", rpm=None, weight=3.0, budget=None)
    assert (updated.rpm, updated.weight, updated.budget, updated.priority) == (None, 3.0, None, "interactive")
    assert store.get_tenant("chat") == updated
    with pytest.raises(ParameterError, match="no tenant"):
        store.update_tenant("nobody", weight=2.0)
    store.create_key("etl")
    assert store.remove_tenant("etl") == 1
    assert store.get_tenant("etl") is None and store.list_keys("etl") == []


def test_keys_are_stored_hashed_and_checked(store) -> None:
    store.add_tenant(Tenant("chat"))
    key, info = store.create_key("chat")
    assert key.startswith(f"tf_{info.key_id}_")
    with store.engine.connect() as conn:
        row = conn.execute(sa.select(api_keys_table)).one()
    secret = key.split("_", 2)[2]
    assert secret not in " ".join(str(v) for v in row) and len(row.salt) == 32 and len(row.digest) == 64
    ok = store.check_key(key)
    assert ok.state == "active" and ok.tenant.name == "chat" and ok.info.key_id == info.key_id
    assert store.check_key(key[:-1] + ("A" if key[-1] != "A" else "B")).state == "invalid"
    assert store.check_key("sk-not-ours").state == "invalid"
    assert store.check_key(f"tf_{'0' * 12}_{secret}").state == "invalid"
    other_key, _ = store.create_key("chat")
    assert store.check_key(other_key).info.key_id != info.key_id  # salts differ: same tenant, new key


def test_expired_revoked_admin_and_orphaned_keys(store) -> None:
    store.add_tenant(Tenant("chat"))
    expired, _ = store.create_key("chat", expires_at=utc_now() - dt.timedelta(seconds=1))
    assert store.check_key(expired).state == "expired"
    later, _ = store.create_key("chat", expires_at=utc_now() + dt.timedelta(hours=1))
    assert store.check_key(later).state == "active"
    assert store.check_key(later, now=utc_now() + dt.timedelta(hours=2)).state == "expired"
    revoked, info = store.create_key("chat")
    assert store.revoke_key(info.key_id).revoked_at is not None
    assert store.check_key(revoked).state == "revoked"
    with pytest.raises(ParameterError, match="no API key"):
        store.revoke_key("ffffffffffff")
    admin, admin_info = store.create_key(None, is_admin=True)
    assert store.check_key(admin).info.is_admin and store.check_key(admin).tenant is None
    with pytest.raises(ParameterError, match="needs a tenant"):
        store.create_key(None)
    with pytest.raises(ParameterError, match="no tenant"):
        store.create_key("ghost")


def test_parse_expires() -> None:
    now = dt.datetime(2026, 1, 1)
    assert parse_expires("30d", now) == dt.datetime(2026, 1, 31)
    assert parse_expires("2026-03-01T00:00+01:00", now) == dt.datetime(2026, 2, 28, 23)
    with pytest.raises(ParameterError, match="--expires"):
        parse_expires("soon", now)


def test_commands_through_the_real_command_line(tmp_path, capsys) -> None:
    d = ["--data-dir", str(tmp_path)]
    assert cli_main(["tenants", "add", "chat", "--priority", "interactive", "--weight", "2", "--rpm", "60",
                     "--budget", "10Mtok/day", *d]) == 0
    assert cli_main(["tenants", "add", "etl", "--priority", "batch", *d]) == 0
    assert cli_main(["tenants", "add", "etl", *d]) == 2  # already exists: a clear error, no traceback
    assert "already exists" in capsys.readouterr().err
    assert cli_main(["tenants", "update", "chat", "--no-rpm", "--tpm", "1000", "--format", "json", *d]) == 0
    shown = json.loads(capsys.readouterr().out)[0]
    assert (shown["rpm"], shown["tpm"], shown["budget"]) == (None, 1000, "10 Mtok/day")
    assert cli_main(["keys", "create", "--tenant", "chat", "--expires", "7d", *d]) == 0
    key = capsys.readouterr().out.splitlines()[0]
    assert key.startswith("tf_")
    assert cli_main(["keys", "list", "--format", "json", *d]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert len(listed) == 1 and listed[0]["state"] == "active" and key not in json.dumps(listed)
    assert cli_main(["keys", "revoke", listed[0]["key_id"], *d]) == 0
    assert cli_main(["keys", "list", "--format", "json", *d]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])[0]["state"] == "revoked"
    assert cli_main(["tenants", "remove", "etl", *d]) == 0
    assert cli_main(["tenants", "list", "--format", "json", *d]) == 0
    assert [t["name"] for t in json.loads(capsys.readouterr().out.split("\n", 1)[1])] == ["chat"]
    assert cli_main(["tenants", "update", "chat", *d]) == 2
    assert "nothing to change" in capsys.readouterr().err


def test_every_presented_key_costs_one_identical_query_one_hmac_and_one_compare(store, monkeypatch) -> None:
    """Timing must not say whether a key_id exists: count the work of each path instead of timing it (no
    flakiness): a valid key, a wrong secret, an unknown key_id, a malformed key, a revoked key and a key
    whose tenant was removed each make the same one SQL statement, one HMAC and one compare_digest."""
    import hmac

    from tokenfactory.tenants import store as store_module

    store.add_tenant(Tenant("chat"))
    store.add_tenant(Tenant("gone"))
    valid, info = store.create_key("chat")
    revoked, revoked_info = store.create_key("chat")
    store.revoke_key(revoked_info.key_id)
    orphan, _ = store.create_key("gone")
    with store.engine.begin() as conn:  # its tenant vanished (rows removed behind the store's back)
        conn.execute(sa.text("DELETE FROM tenants WHERE name = 'gone'"))
    secret = valid.split("_", 2)[2]
    presented = {"valid": valid, "wrong secret": valid[:-1] + ("A" if valid[-1] != "A" else "B"),
                 "unknown key_id": f"tf_{'0' * 12}_{secret}", "malformed": "sk-not-ours", "revoked": revoked,
                 "orphan": orphan}
    statements: list[str] = []
    counts = {"digest": 0, "compare": 0}
    real_digest, real_compare = store_module._digest, hmac.compare_digest

    def digest(salt: str, text: str) -> str:
        counts["digest"] += 1
        return real_digest(salt, text)

    def compare(a: str, b: str) -> bool:
        counts["compare"] += 1
        return real_compare(a, b)
    monkeypatch.setattr(store_module, "_digest", digest)
    monkeypatch.setattr(hmac, "compare_digest", compare)
    sa.event.listen(store.engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    states, sql = {}, set()
    for name, key in presented.items():
        statements.clear()
        counts.update(digest=0, compare=0)
        states[name] = store.check_key(key).state
        assert len(statements) == 1 and counts == {"digest": 1, "compare": 1}, name
        sql.add(statements[0])
    assert len(sql) == 1  # the same statement (one indexed lookup by key_id) for all of them
    assert states["valid"] == "active" and states["revoked"] == "revoked" and info.key_id in valid
    assert {states[k] for k in ("wrong secret", "unknown key_id", "malformed", "orphan")} == {"invalid"}
