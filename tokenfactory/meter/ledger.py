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
partial first day, so they cost the same at a thousand rows and at a million; bench/ledger.py says
how fast. Write through Ledger only (or call rebuild_rollup() after writing around it).

A row is never dropped and never counted twice (issue #13). `request_id` is unique, and inserts skip a
request_id already present (INSERT ... ON CONFLICT DO NOTHING), adding to usage_daily only the rows
really inserted.

One row per request id, for the attempt that answered it (issue #25). A request id names one unit of
billable work; work can be tried again under the same id (a batch line cut off by a server restart runs
again at the next start). A row whose request id is present *supersedes* the present row when that row is
`aborted` and the new one is not, or is a newer (by `created_at`) aborted attempt; otherwise it is skipped,
as before. Superseding updates the row in place, moves the old values to `requests_superseded` (audit, never
summed) and moves usage_daily from the old row's figures to the new one's in the same transaction, so
invoices, `totals` and budgets read the same one truth. The outcome does not depend on the order rows
arrive in (a journal replayed late, another process): a finished or failed row is final (of two, the first
recorded), and an aborted one stands only until an answer or a newer attempt arrives.

When the database refuses a write (read-only, disk full, locked, server gone), the row goes to the journal
in the data directory (journal.py) and is replayed when the database is back, by a retry thread and at the
next open; `status()` says whether rows are waiting and why. (Past 400 lines:
the write path, its idempotent insert and the queries share the engine and the schema's invariants.)
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy as sa

from tokenfactory.meter import rollup
from tokenfactory.meter.journal import (
    Journal,
    JournalFile,
    LedgerConfig,
    LedgerStatus,
    Replayed,
    describe_failure,
    driver_message,
)
from tokenfactory.meter.paths import (
    LEDGER_FILENAME,
    journal_path,
    make_private_dir,
    make_private_file,
    resolve_data_dir,
)
from tokenfactory.meter.rollup import Part
from tokenfactory.meter.schema import REQUEST_ID_INDEX, metadata, requests_table, superseded_table
from tokenfactory.types import ParameterError

if TYPE_CHECKING:
    from tokenfactory.meter.attribution import RequestEnergy

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = LedgerConfig()
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
    replica: str | None = None  # the fleet's replica (or replicas, joined by '+') that served it

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
            latency_s: float | None = None, replica: str | None = None) -> LedgerRow:
    """The ledger row for a request the meter has finished (Meter.finish_request's result)."""
    return LedgerRow(
        request_id=energy.request_id, model=model, status=status, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=cached_tokens, tenant=tenant,
        energy_joules=energy.energy_joules, energy_source=energy.energy_source, energy_scope=energy.energy_scope,
        energy_overhead_factor=energy.energy_overhead_factor, device_seconds=energy.device_seconds,
        cost_device_usd=energy.cost_device_usd, cost_energy_usd=energy.cost_energy_usd, cost_usd=energy.cost_usd,
        ttft_s=ttft_s, latency_s=latency_s, replica=replica,
    )


_ROW_FIELDS = tuple(f.name for f in fields(LedgerRow))


def supersedes(new: dict[str, Any], present: Any) -> bool:  # noqa: ANN401 - a row mapping
    """Whether `new` replaces `present` (same request id): only an aborted row is ever replaced, by an answer
    (finished, failed) or by a newer aborted attempt."""
    if present["status"] != "aborted":
        return False
    return new["status"] != "aborted" or present["created_at"] < new["created_at"]


class Inserted(NamedTuple):
    """What one write took: rows inserted or superseding an older aborted attempt (or journalled), and the
    (old, new) column values of each supersession."""

    num_taken: int
    superseded: list[tuple[dict[str, Any], dict[str, Any]]]

    def superseded_row(self, request_id: str) -> LedgerRow | None:
        old = next((o for o, n in self.superseded if n["request_id"] == request_id), None)
        return LedgerRow(**old) if old is not None else None


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
    "replica": requests_table.c.replica,  # from the rows: the daily sums are not kept per replica
}


class Ledger:
    """Thread-safe (one SQLAlchemy engine, a pool of connections); many processes may share a file.
    `journal_path` None: rows the database refuses are held in memory only (see journal.py)."""

    def __init__(self, url: str, create: bool = True, *, journal_path: Path | None = None,
                 config: LedgerConfig = DEFAULT_CONFIG) -> None:
        self._url, self.config = url, config
        self._engine = _make_engine(url, config)
        self._rollup = rollup.supported(self._engine.dialect.name)
        self._upsert_insert = rollup.UPSERT_INSERTS.get(self._engine.dialect.name)
        self._journal = Journal(JournalFile(journal_path) if journal_path else None, self._replay_insert, config)
        if create:
            self._create_tables()
            self._unique = self._ensure_unique_index()
            self._ensure_replica_column()
            self._replay_at_start()
        else:
            self._unique = self._has_unique_index()

    @classmethod
    def open(cls, data_dir: str | Path | None = None, url: str | None = None, create: bool = True,
             config: LedgerConfig = DEFAULT_CONFIG) -> Ledger:
        """`url` if given, else SQLite at <data_dir>/ledger.db (created when `create`). The journal is in
        the data directory either way; `create` also replays what an earlier process left there."""
        directory = resolve_data_dir(data_dir)
        path = directory / LEDGER_FILENAME
        if url is None and not create and not path.exists():
            raise FileNotFoundError(f"no ledger at {path}: nothing has been recorded there yet "
                                    "(the server writes it; --data-dir chooses another directory)")
        if create:
            make_private_dir(directory)
        if url is not None:
            public = sa.make_url(url).render_as_string(hide_password=True)
            return cls(url, create, journal_path=journal_path(directory, public), config=config)
        for name in (LEDGER_FILENAME, LEDGER_FILENAME + "-wal", LEDGER_FILENAME + "-shm"):
            make_private_file(directory / name, create=create and name == LEDGER_FILENAME)
        return cls(f"sqlite:///{path}", create, journal_path=journal_path(directory), config=config)

    @property
    def url(self) -> str:
        return self._url

    @property
    def engine(self) -> sa.Engine:
        return self._engine

    @property
    def journal_path(self) -> Path | None:
        return self._journal.file.path if self._journal.file is not None else None

    def record(self, row: LedgerRow) -> LedgerRow | None:
        """Insert and commit one row and its day's sums, once (a request_id already present is left as it
        is, unless it holds an older aborted attempt, which this row supersedes). If the database refuses,
        the row is journalled and replayed later. Returns once the row is durable in one or the other, with
        the row it superseded (None: new, skipped or journalled); never raises for the database's sake."""
        return self._write([row_values(row)]).superseded_row(row.request_id)

    def record_many(self, rows: Iterable[LedgerRow], batch_size: int = 10_000) -> int:
        """Bulk insert (one transaction per batch). Returns the rows taken: inserted or journalled (a
        request_id already present is not counted)."""
        written, batch = 0, []
        for row in rows:
            batch.append(row_values(row))
            if len(batch) >= batch_size:
                written += self._write(batch).num_taken
                batch = []
        return written + (self._write(batch).num_taken if batch else 0)

    def journal(self, row: LedgerRow, reason: str) -> None:
        """Journal `row` without trying the database (a write that took too long: if it commits late,
        the replay finds the row there and adds nothing)."""
        self._journal.journal([row_values(row)], reason)

    def status(self) -> LedgerStatus:
        """Degraded or not, why, and the journal's counts; from memory, no database round trip."""
        return self._journal.status()

    def replay(self) -> int:
        """Replay the journal now (the retry thread does it with backoff); returns the rows taken.
        Raises what the database raises while it still refuses."""
        return self._journal.replay()

    def _write(self, batch: list[dict[str, Any]]) -> Inserted:
        if self._journal.refusing:  # it refused the last attempt: spare it (and the caller) till a replay works
            reason = self._journal.status().reason or "the database refused an earlier write"
        else:
            try:
                return self._insert(batch)
            except (sa.exc.SQLAlchemyError, OSError) as e:
                reason = describe_failure(e)
                logger.warning("ledger: a write failed (%s: %s)", type(e).__name__, driver_message(e))
        self._journal.journal(batch, reason)
        return Inserted(len(batch), [])

    def _insert(self, batch: list[dict[str, Any]]) -> Inserted:
        """Insert the rows whose request_id is new, let the others supersede older aborted attempts, and
        move the daily sums by exactly what changed. Raises the database's error."""
        id_to_row: dict[str, dict[str, Any]] = {}
        for values in batch:  # one row per id, chosen by the same rule as against the database
            present = id_to_row.get(values["request_id"])
            if present is None or supersedes(values, present):
                id_to_row[values["request_id"]] = values
        batch = list(id_to_row.values())
        try:
            with self._engine.begin() as conn:
                fresh = self._insert_new(conn, batch)
                taken = {v["request_id"] for v in fresh}
                conflicts = [v for v in batch if v["request_id"] not in taken]
                superseded = self._supersede(conn, conflicts) if conflicts else []
                if self._rollup and (fresh or superseded):
                    removed = rollup.deltas([old for old, _ in superseded], -1)
                    rollup.upsert(conn, rollup.merge(rollup.deltas(fresh + [new for _, new in superseded]) + removed))
                    rollup.prune(conn, removed)
        except (sa.exc.DataError, sa.exc.IntegrityError):
            raise  # the rows' fault, not the connection's
        except (sa.exc.SQLAlchemyError, OSError):
            self._engine.dispose()  # connections opened read-only, or to a server gone, are not reused
            raise
        return Inserted(len(fresh) + len(superseded), superseded)

    def _supersede(self, conn: sa.Connection, rows: list[dict[str, Any]]
                   ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Rows whose request id holds an older aborted attempt replace it (see the module's docstring);
        returns (old, new) column values of each replacement. The UPDATE re-checks the old row's state, so
        a writer racing on the same id changes it at most once."""
        t = requests_table
        id_to_row = {v["request_id"]: v for v in rows}
        stmt = sa.select(t).where(t.c.request_id.in_(list(id_to_row))).where(t.c.status == "aborted")
        replaced = []
        for present in conn.execute(stmt).mappings():
            new = id_to_row.pop(present["request_id"], None)  # popped: once per id, even over old duplicates
            if new is None or not supersedes(new, present):
                continue  # the present attempt is the newer one: this row is the stale copy
            done = conn.execute(sa.update(t).where(t.c.id == present["id"]).where(t.c.status == "aborted")
                                .where(t.c.created_at == present["created_at"]).values(**new))
            if done.rowcount != 1:
                continue
            old = {k: v for k, v in present.items() if k != "id"}
            conn.execute(superseded_table.insert(), {**old, "superseded_at": utc_now()})
            replaced.append((old, new))
        return replaced

    def _insert_new(self, conn: sa.Connection, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        t = requests_table
        if self._unique and self._upsert_insert is not None:
            stmt = self._upsert_insert(t).on_conflict_do_nothing(index_elements=["request_id"])
            inserted = set(conn.execute(stmt.returning(t.c.request_id), batch).scalars())
            return [v for v in batch if v["request_id"] in inserted]
        # No unique index (another database, or old duplicates): look first. Two processes racing on
        # one id can still both insert here; with the index they cannot.
        ids = [v["request_id"] for v in batch]
        present = set(conn.execute(sa.select(t.c.request_id).where(t.c.request_id.in_(ids))).scalars())
        fresh = [v for v in batch if v["request_id"] not in present]
        if fresh:
            conn.execute(t.insert(), fresh)
        return fresh

    def _replay_insert(self, batch: list[dict[str, Any]]) -> Replayed:
        """The journal's insert: rows that are not valid rows, or that the database refuses for their
        content (not its state), are handed back as rejected instead of blocking the replay forever."""
        valid, rejected = [], []
        for values in batch:
            try:
                valid.append(row_values(LedgerRow(**values)))
            except (TypeError, ValueError):
                rejected.append(values)
        try:
            return Replayed(self._insert(valid).num_taken, rejected)
        except (sa.exc.DataError, sa.exc.IntegrityError):
            pass
        num_inserted = 0
        for values in valid:  # one of them is refused: find which
            try:
                num_inserted += self._insert([values]).num_taken
            except (sa.exc.DataError, sa.exc.IntegrityError):
                if not self.find(values["request_id"]):  # else a racing writer inserted it first: done
                    rejected.append(values)
        return Replayed(num_inserted, rejected)

    def _has_unique_index(self) -> bool:
        try:
            indexes = sa.inspect(self._engine).get_indexes(requests_table.name)
        except (sa.exc.SQLAlchemyError, OSError):
            return False
        return any(i["unique"] and i["column_names"] == ["request_id"] for i in indexes)

    def _create_tables(self) -> None:
        """Every table of the shared metadata (a newer version's too); a database that refuses the write
        (read-only, full) does not stop a server: its rows go to the journal until it takes them."""
        try:
            metadata.create_all(self._engine)
        except sa.exc.OperationalError as e:
            logger.warning("ledger: cannot create its tables (%s); rows wait in the journal until it can",
                           describe_failure(e))

    def _ensure_replica_column(self) -> None:
        """Ledgers made before the fleet have no replica column: added (nullable, so old rows read NULL)."""
        try:
            columns = {c["name"] for c in sa.inspect(self._engine).get_columns(requests_table.name)}
            if "replica" not in columns:
                with self._engine.begin() as conn:
                    conn.execute(sa.text(f"ALTER TABLE {requests_table.name} ADD COLUMN replica VARCHAR(64)"))
        except (sa.exc.SQLAlchemyError, OSError) as e:
            logger.warning("ledger: cannot add the replica column (%s); rows are written without it",
                           describe_failure(e))

    def _ensure_unique_index(self) -> bool:
        """Ledgers made before request_id was unique get the index now; old duplicates prevent it."""
        try:
            with self._engine.begin() as conn:
                REQUEST_ID_INDEX.create(conn, checkfirst=True)
            return True
        except sa.exc.IntegrityError:
            logger.warning("ledger: request_id cannot be made unique: the ledger holds repeated request_ids "
                           "from an earlier version; writes look for an existing row first instead")
        except (sa.exc.SQLAlchemyError, OSError) as e:
            logger.warning("ledger: cannot check request_id's unique index (%s); writes look for an existing "
                           "row first", describe_failure(e))
        return False

    def _replay_at_start(self) -> None:
        if self._journal.file is None or self._journal.file.is_empty():
            return
        try:
            num = self._journal.replay()
            logger.info("ledger: replayed %d row(s) an earlier process journalled", num)
        except (sa.exc.SQLAlchemyError, OSError) as e:
            self._journal.degrade(describe_failure(e))

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

    def find_many(self, request_ids: Iterable[str], chunk: int = 500) -> dict[str, LedgerRow]:
        """The row of each of `request_ids` that has one, by id (an IN query per `chunk` ids)."""
        columns = [c for c in requests_table.c if c.name != "id"]
        ids, found = list(request_ids), {}
        with self._engine.connect() as conn:
            for start in range(0, len(ids), chunk):
                stmt = sa.select(*columns).where(requests_table.c.request_id.in_(ids[start:start + chunk]))
                found.update({r.request_id: LedgerRow(**r._asdict()) for r in conn.execute(stmt)})
        return found

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
            if not self._rollup or group_by == "replica":
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

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the retry thread, try one last replay, keep the rest in the journal for the next start."""
        self._journal.close(timeout_s)
        self._engine.dispose()


def _make_engine(url: str, config: LedgerConfig) -> sa.Engine:
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = sa.create_engine(url)
        sa.event.listen(engine, "connect", functools.partial(_sqlite_pragmas,
                                                             busy_timeout_ms=round(config.busy_timeout_s * 1000)))
        return engine
    connect_args: dict[str, Any] = {}
    if parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        connect_args["connect_timeout"] = max(1, round(config.connect_timeout_s))  # libpq: whole seconds
    # pre_ping: after a server restart the pool's dead connections are replaced, not failed on
    return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any, busy_timeout_ms: int) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")  # writers wait their turn, then journal
    cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer
    cursor.execute("PRAGMA synchronous=FULL")  # fsync the WAL at every commit: no lost row
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
