"""The ledger: one row per finished, aborted or failed request, committed before the response ends.

SQLAlchemy Core over any database URL; by default SQLite at <data_dir>/ledger.db in WAL mode with
synchronous=FULL, so a committed row survives SIGKILL and power loss, and readers never block the
writer. PostgreSQL works through its URL (postgresql+psycopg://..., with psycopg installed).

`metadata` is the schema's one MetaData: later tables (tenants, API keys) are declared on it in
their own modules, and Ledger creates whatever is declared when it opens (create_all adds missing
tables; it does not alter existing ones). Times are stored as naive UTC.

Queries: `totals(since, group_by)` sums requests, tokens, joules and cost, grouped by day, tenant or
model. They read usage_daily (rollup.py: sums per day × tenant × model × source, upserted in the
same transaction as each row) for whole days, and `requests` through its created_at index for a
partial first day, so they cost the same at a thousand rows and at a million; bench_ledger.py says
how fast. Write through Ledger only (or call rebuild_rollup() after writing around it).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from tokenfactory.meter import rollup
from tokenfactory.meter.paths import ledger_path
from tokenfactory.meter.rollup import Part
from tokenfactory.meter.schema import metadata, requests_table
from tokenfactory.types import ParameterError

if TYPE_CHECKING:
    from tokenfactory.meter.attribution import RequestEnergy

STATUSES = ("finished", "aborted", "failed")
ANONYMOUS = "anonymous"


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


def to_utc_naive(when: dt.datetime) -> dt.datetime:
    """Aware datetimes are converted to UTC; naive ones are taken to be UTC already."""
    return when.astimezone(dt.UTC).replace(tzinfo=None) if when.tzinfo is not None else when


@dataclass(frozen=True)
class LedgerRow:
    request_id: str
    model: str
    status: str  # finished | aborted | failed
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    tenant: str = ANONYMOUS
    energy_joules: float | None = None
    energy_source: str | None = None
    energy_scope: str | None = None
    energy_overhead_factor: float = 1.0
    device_seconds: float = 0.0
    cost_device_usd: float = 0.0
    cost_energy_usd: float | None = None
    cost_usd: float | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    created_at: dt.datetime = field(default_factory=utc_now)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ParameterError("status", f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            if getattr(self, name) < 0:
                raise ParameterError(name, f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.request_id:
            raise ParameterError("request_id", "request_id must not be empty")
        if (self.energy_joules is None) != (self.energy_source is None):
            raise ParameterError("energy_source", "energy_source must be given exactly when energy_joules is")
        object.__setattr__(self, "created_at", to_utc_naive(self.created_at))


def row_for(energy: RequestEnergy, *, model: str, status: str, prompt_tokens: int, completion_tokens: int,
            cached_tokens: int = 0, tenant: str = ANONYMOUS, ttft_s: float | None = None,
            latency_s: float | None = None) -> LedgerRow:
    """The ledger row for a request the meter has finished (Meter.finish_request's result)."""
    return LedgerRow(
        request_id=energy.request_id, model=model, status=status, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=cached_tokens, tenant=tenant,
        energy_joules=energy.energy_joules, energy_source=energy.energy_source, energy_scope=energy.energy_scope,
        energy_overhead_factor=energy.energy_overhead_factor, device_seconds=energy.device_seconds,
        cost_device_usd=energy.cost_device_usd, cost_energy_usd=energy.cost_energy_usd, cost_usd=energy.cost_usd,
        ttft_s=ttft_s, latency_s=latency_s,
    )


_ROW_FIELDS = tuple(f.name for f in fields(LedgerRow))


def row_values(row: LedgerRow) -> dict[str, Any]:
    """Column values of a row (dataclasses.asdict deep-copies, which bulk inserts cannot afford)."""
    return {name: getattr(row, name) for name in _ROW_FIELDS}


@dataclass(frozen=True)
class UsageTotals:
    key: str | None  # the day (YYYY-MM-DD), tenant or model; None when not grouped
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    energy_joules: float | None  # sum over rows with energy; None when no row had any
    num_requests_with_energy: int
    energy_sources: tuple[str, ...]  # the sources whose joules were summed (mixing scopes shows here)
    cost_device_usd: float
    cost_energy_usd: float | None
    cost_usd: float | None  # sum over rows whose cost is known

    @property
    def joules_per_completion_token(self) -> float | None:
        if self.energy_joules is None or not self.completion_tokens:
            return None
        return self.energy_joules / self.completion_tokens


GROUP_BY_COLUMNS: dict[str, sa.ColumnElement[Any]] = {
    "day": sa.func.date(requests_table.c.created_at),  # SQLite date(), PostgreSQL date()
    "tenant": requests_table.c.tenant,
    "model": requests_table.c.model,
}


class Ledger:
    """Thread-safe (one SQLAlchemy engine, a pool of connections); many processes may share a file."""

    def __init__(self, url: str, create: bool = True) -> None:
        self._url = url
        self._engine = sa.create_engine(url)
        if self._engine.dialect.name == "sqlite":
            sa.event.listen(self._engine, "connect", _sqlite_pragmas)
        self._rollup = rollup.supported(self._engine.dialect.name)
        if create:
            metadata.create_all(self._engine)

    @classmethod
    def open(cls, data_dir: str | Path | None = None, url: str | None = None, create: bool = True) -> Ledger:
        """`url` if given, else SQLite at <data_dir>/ledger.db (created when `create`)."""
        if url is not None:
            return cls(url, create)
        path = ledger_path(data_dir)
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        elif not path.exists():
            raise FileNotFoundError(f"no ledger at {path}: nothing has been recorded there yet "
                                    "(the server writes it; --data-dir chooses another directory)")
        return cls(f"sqlite:///{path}", create)

    @property
    def url(self) -> str:
        return self._url

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    def record(self, row: LedgerRow) -> None:
        """Insert and commit one row (and its day's sums); returns once the row is durable."""
        self._insert([row_values(row)])

    def record_many(self, rows: Iterable[LedgerRow], batch_size: int = 10_000) -> int:
        """Bulk insert (one transaction per batch). Returns the number of rows written."""
        written, batch = 0, []
        for row in rows:
            batch.append(row_values(row))
            if len(batch) >= batch_size:
                written += self._insert(batch)
                batch = []
        return written + (self._insert(batch) if batch else 0)

    def _insert(self, batch: list[dict[str, Any]]) -> int:
        with self._engine.begin() as conn:
            conn.execute(requests_table.insert(), batch)
            if self._rollup:
                rollup.upsert(conn, rollup.deltas(batch))
        return len(batch)

    def rebuild_rollup(self) -> int:
        """Recompute the daily sums from the request rows; returns the rows read."""
        if not self._rollup:
            return 0
        with self._engine.begin() as conn:
            return rollup.rebuild(conn)

    def find(self, request_id: str) -> list[LedgerRow]:
        """Every row recorded for `request_id` (normally one)."""
        columns = [c for c in requests_table.c if c.name != "id"]
        stmt = sa.select(*columns).where(requests_table.c.request_id == request_id)
        with self._engine.connect() as conn:
            return [LedgerRow(**row._asdict()) for row in conn.execute(stmt)]

    def count(self) -> int:
        with self._engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).select_from(requests_table)).scalar_one()

    def totals(self, since: dt.datetime | None = None, group_by: str | None = None,
               tenant: str | None = None) -> list[UsageTotals]:
        """Sums since `since` (UTC if naive), of one tenant's requests when `tenant` is given: one
        UsageTotals per group ordered by key, or exactly one when not grouped."""
        if group_by is not None and group_by not in GROUP_BY_COLUMNS:
            raise ParameterError("group_by", f"group_by must be one of {', '.join(GROUP_BY_COLUMNS)}, "
                                             f"got {group_by!r}")
        since = to_utc_naive(since) if since is not None else None
        with self._engine.connect() as conn:
            if not self._rollup:
                parts = _raw_parts(conn, group_by, since, None, tenant)
            elif since is None:
                parts = rollup.query(conn, group_by, None, tenant)
            elif since == dt.datetime.combine(since.date(), dt.time()):
                parts = rollup.query(conn, group_by, since.date(), tenant)
            else:  # the rest of since's day from the rows, whole days after it from the sums
                next_day = since.date() + dt.timedelta(days=1)
                parts = (_raw_parts(conn, group_by, since, dt.datetime.combine(next_day, dt.time()), tenant)
                         + rollup.query(conn, group_by, next_day, tenant))
        totals = _combine(parts)
        if group_by is None and not totals:
            return [UsageTotals(None, 0, 0, 0, 0, None, 0, (), 0.0, None, None)]
        return totals

    def raw_totals(self, since: dt.datetime | None = None, group_by: str | None = None) -> list[UsageTotals]:
        """totals() computed from the request rows alone (slow on big ledgers; for checks)."""
        with self._engine.connect() as conn:
            return _combine(_raw_parts(conn, group_by, to_utc_naive(since) if since else None, None))

    def close(self) -> None:
        self._engine.dispose()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    cursor.execute("PRAGMA synchronous=FULL")  # fsync the WAL at every commit: no lost row
    cursor.execute("PRAGMA busy_timeout=30000")  # concurrent writers wait their turn (ms)
    cursor.close()


def _raw_parts(conn: sa.Connection, group_by: str | None, since: dt.datetime | None,
               until: dt.datetime | None, tenant: str | None = None) -> list[Part]:
    t = requests_table.c
    key = GROUP_BY_COLUMNS[group_by].label("key") if group_by else sa.literal(None).label("key")
    stmt = sa.select(
        key, t.energy_source, sa.func.count(), sa.func.sum(t.prompt_tokens), sa.func.sum(t.cached_tokens),
        sa.func.sum(t.completion_tokens), sa.func.sum(t.energy_joules), sa.func.count(t.energy_joules),
        sa.func.sum(t.cost_device_usd), sa.func.sum(t.cost_energy_usd), sa.func.sum(t.cost_usd),
    )
    if since is not None:
        stmt = stmt.where(t.created_at >= since)
    if until is not None:
        stmt = stmt.where(t.created_at < until)
    if tenant is not None:
        stmt = stmt.where(t.tenant == tenant)
    stmt = stmt.group_by(key, t.energy_source) if group_by else stmt.group_by(t.energy_source)
    return [Part(r[0].isoformat() if isinstance(r[0], dt.date) else r[0], r[1], r[2], r[3] or 0, r[4] or 0,
                 r[5] or 0, r[6], r[7], r[8] or 0.0, r[9], r[10]) for r in conn.execute(stmt)]


def _combine(parts: list[Part]) -> list[UsageTotals]:
    """Merge parts (per key and energy source, from either path) into one UsageTotals per key."""
    key_to_parts: dict[str | None, list[Part]] = {}
    for part in parts:
        key_to_parts.setdefault(None if part.key is None else str(part.key), []).append(part)
    totals = []
    for key in sorted(key_to_parts, key=lambda k: (k is None, k or "")):
        group = key_to_parts[key]
        energy = [p.energy_joules for p in group if p.energy_joules is not None]
        energy_costs = [p.cost_energy_usd for p in group if p.cost_energy_usd is not None]
        costs = [p.cost_usd for p in group if p.cost_usd is not None]
        totals.append(UsageTotals(
            key=key,
            num_requests=sum(p.num_requests for p in group),
            prompt_tokens=sum(p.prompt_tokens for p in group),
            cached_tokens=sum(p.cached_tokens for p in group),
            completion_tokens=sum(p.completion_tokens for p in group),
            energy_joules=sum(energy) if energy else None,
            num_requests_with_energy=sum(p.num_with_energy for p in group),
            energy_sources=tuple(sorted({p.energy_source for p in group if p.energy_source is not None})),
            cost_device_usd=sum(p.cost_device_usd for p in group),
            cost_energy_usd=sum(energy_costs) if energy_costs else None,
            cost_usd=sum(costs) if costs else None,
        ))
    return totals
