"""usage_daily: running sums per (UTC day, tenant, model, energy source), kept with the request rows.

Every insert into `requests` adds its row's values to the matching usage_daily row in the same
transaction (an upsert), so the two never disagree and usage queries over any number of requests
read one row per day × tenant × model × source. A `since` inside a day reads that day's part from
`requests` (a range scan on created_at) and whole days from here.

Upserts are dialect-specific: SQLite and PostgreSQL have them (INSERT ... ON CONFLICT DO UPDATE).
On another database the ledger skips this table and queries `requests` directly.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from tokenfactory.meter.schema import requests_table, usage_daily_table

UPSERT_INSERTS: dict[str, Callable[[sa.Table], Any]] = {"sqlite": sqlite.insert, "postgresql": postgresql.insert}
KEY_COLUMNS = ("day", "tenant", "model", "energy_source")
SUM_COLUMNS = ("num_requests", "prompt_tokens", "cached_tokens", "completion_tokens", "energy_joules",
               "num_with_energy", "cost_device_usd", "cost_energy_usd", "num_with_cost_energy", "cost_usd",
               "num_with_cost")
NO_SOURCE = ""  # usage_daily's key for rows without energy (a NULL key would never collide)


class Part(NamedTuple):
    """Sums for one (group key, energy source): what both query paths return, merged by ledger.py."""

    key: str | None
    energy_source: str | None
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    energy_joules: float | None  # None when no row had energy
    num_with_energy: int
    cost_device_usd: float
    cost_energy_usd: float | None
    cost_usd: float | None


def supported(dialect_name: str) -> bool:
    return dialect_name in UPSERT_INSERTS


def deltas(rows: Iterable[dict[str, Any]], sign: int = 1) -> list[dict[str, Any]]:
    """Request rows (column dicts) summed per usage_daily key; `sign` -1: what taking them out subtracts (a
    superseded attempt, ledger.py)."""
    key_to_sums: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["created_at"].date().isoformat(), row["tenant"], row["model"], row["energy_source"] or NO_SOURCE)
        sums = key_to_sums.get(key)
        if sums is None:
            sums = key_to_sums[key] = dict(zip(KEY_COLUMNS, key, strict=True)) | dict.fromkeys(SUM_COLUMNS, 0)
        sums["num_requests"] += 1
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_device_usd"):
            sums[name] += row[name]
        for value_name, count_name in (("energy_joules", "num_with_energy"),
                                       ("cost_energy_usd", "num_with_cost_energy"), ("cost_usd", "num_with_cost")):
            if row[value_name] is not None:
                sums[value_name] += row[value_name]
                sums[count_name] += 1
    if sign != 1:
        for sums in key_to_sums.values():
            for name in SUM_COLUMNS:
                sums[name] *= sign
    return list(key_to_sums.values())


def upsert(conn: sa.Connection, sums: list[dict[str, Any]]) -> None:
    insert = UPSERT_INSERTS[conn.dialect.name](usage_daily_table)
    stmt = insert.on_conflict_do_update(
        index_elements=list(KEY_COLUMNS),
        set_={name: usage_daily_table.c[name] + insert.excluded[name] for name in SUM_COLUMNS},
    )
    conn.execute(stmt, sums)


def merge(sums: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sums with the same key added into one (an upsert may touch each key once per statement)."""
    key_to_sums: dict[tuple[Any, ...], dict[str, Any]] = {}
    for part in sums:
        key = tuple(part[name] for name in KEY_COLUMNS)
        if key not in key_to_sums:
            key_to_sums[key] = dict(part)
        else:
            for name in SUM_COLUMNS:
                key_to_sums[key][name] += part[name]
    return list(key_to_sums.values())


def prune(conn: sa.Connection, sums: list[dict[str, Any]]) -> None:
    """Drop the keys of `sums` that no row counts any more (a day whose only row was superseded), so a day
    with no request does not show as a group of zeros."""
    t = usage_daily_table.c
    for key in {tuple(s[name] for name in KEY_COLUMNS) for s in sums}:
        conn.execute(usage_daily_table.delete().where(t.num_requests <= 0).where(
            sa.and_(*(t[name] == value for name, value in zip(KEY_COLUMNS, key, strict=True)))))


def rebuild(conn: sa.Connection) -> int:
    """Recompute usage_daily from `requests` (repair after writes that bypassed the Ledger)."""
    conn.execute(usage_daily_table.delete())
    columns = [c for c in requests_table.c if c.name != "id"]
    batch, written = [], 0
    for row in conn.execute(sa.select(*columns)).mappings():
        batch.append(row)
        if len(batch) >= 50_000:
            written += _flush(conn, batch)
            batch = []
    return written + (_flush(conn, batch) if batch else 0)


def _flush(conn: sa.Connection, batch: list[Any]) -> int:
    upsert(conn, deltas(batch))
    return len(batch)


def query(conn: sa.Connection, group_by: str | None, first_day: dt.date | None,
          tenant: str | None = None) -> list[Part]:
    """Sums from usage_daily, from `first_day` on (all days when None), of one tenant when given, grouped
    like Ledger.totals."""
    t = usage_daily_table.c
    key_columns = {"day": t.day, "tenant": t.tenant, "model": t.model}
    key = key_columns[group_by].label("key") if group_by else sa.literal(None).label("key")
    stmt = sa.select(key, t.energy_source, *(sa.func.sum(t[name]) for name in SUM_COLUMNS))
    if first_day is not None:
        stmt = stmt.where(t.day >= first_day.isoformat())
    if tenant is not None:
        stmt = stmt.where(t.tenant == tenant)
    stmt = stmt.group_by(key, t.energy_source) if group_by else stmt.group_by(t.energy_source)
    parts = []
    for row in conn.execute(stmt):
        s = dict(zip(SUM_COLUMNS, row[2:], strict=True))
        parts.append(Part(
            key=row[0], energy_source=row[1] or None, num_requests=int(s["num_requests"]),
            prompt_tokens=int(s["prompt_tokens"]), cached_tokens=int(s["cached_tokens"]),
            completion_tokens=int(s["completion_tokens"]),
            energy_joules=float(s["energy_joules"]) if s["num_with_energy"] else None,
            num_with_energy=int(s["num_with_energy"]), cost_device_usd=float(s["cost_device_usd"]),
            cost_energy_usd=float(s["cost_energy_usd"]) if s["num_with_cost_energy"] else None,
            cost_usd=float(s["cost_usd"]) if s["num_with_cost"] else None,
        ))
    return parts
