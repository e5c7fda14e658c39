"""Batch jobs (the OpenAI Batch API) made durable: files on disk, jobs and their lines in the ledger's database.

    batch_files     one row per uploaded input or written output/error file, with its expiry; the bytes
                    are <data_dir>/batch/<file_id>.jsonl (0600), written before the row and removed
                    with it
    batch_jobs      one row per job: OpenAI's Batch fields (status and its timestamps, files, counts)
    batch_lines     one row per input line: pending, done (a 200) or error, with the line's output
                    line (JSON) and its usage (tokens, joules, cost, device time) for the job's totals

A job's lines are parsed and inserted in one transaction with the job's move to in_progress (streamed in
chunks: a 50,000-line file is never a list in memory), and a line becomes done in one UPDATE that carries
its output, so a server killed at any point resumes with exactly the lines that finished, and runs only the
others, read back a page at a time. Each line's ledger row has the request id `line_request_id(batch_id,
line)`: a line that finished its ledger row but not its UPDATE before the kill runs again and its second
row is skipped (never billed twice); a line cut off by a shutdown (an aborted row) runs again and its
answer supersedes the aborted row (meter/ledger.py: one row per request id, for the attempt that answered).

Light: SQLAlchemy and the standard library only (the gateway's runner and `tokenfactory batch run` use it).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa

from tokenfactory.meter.paths import PRIVATE_FILE_MODE, make_private_dir
from tokenfactory.meter.schema import metadata

BATCH_DIRNAME = "batch"
MAX_FILENAME_CHARS = 512  # the column's size
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
LINE_STATES = ("pending", "done", "error")

files_table = sa.Table(
    "batch_files", metadata,
    sa.Column("file_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),  # batch | batch_output
    sa.Column("filename", sa.String(MAX_FILENAME_CHARS), nullable=False),
    sa.Column("bytes", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),  # unix seconds, as OpenAI's objects carry them
    sa.Column("expires_at", sa.Integer, nullable=True),  # unix seconds; NULL: kept until deleted (older rows)
    sa.Index("ix_batch_files_tenant", "tenant"),
    sa.Index("ix_batch_files_expires_at", "expires_at"),
)

jobs_table = sa.Table(
    "batch_jobs", metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("input_file_id", sa.String(64), nullable=False),
    sa.Column("completion_window", sa.String(16), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),
    sa.Column("expires_at", sa.Integer, nullable=False),
    *(sa.Column(f"{name}_at", sa.Integer, nullable=True) for name in (
        "in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
    sa.Column("output_file_id", sa.String(64), nullable=True),
    sa.Column("error_file_id", sa.String(64), nullable=True),
    sa.Column("metadata_json", sa.Text, nullable=True),
    sa.Column("errors_json", sa.Text, nullable=True),  # OpenAI's errors.data: job-level failures
    sa.Column("output_expires_after", sa.Integer, nullable=True),  # seconds the output files live; NULL: default
    sa.Index("ix_batch_jobs_tenant_created_at", "tenant", "created_at"),
)

lines_table = sa.Table(
    "batch_lines", metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("line", sa.Integer, primary_key=True),  # 1-based line number in the input file
    sa.Column("custom_id", sa.String(512), nullable=True),
    sa.Column("state", sa.String(16), nullable=False),  # pending | done | error
    sa.Column("request_json", sa.Text, nullable=True),  # the line's body, while pending
    sa.Column("result_json", sa.Text, nullable=True),  # its output (or error) line once run
    sa.Column("prompt_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("completion_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("cached_tokens", sa.Integer, nullable=False, default=0),
    sa.Column("energy_joules", sa.Double, nullable=True),  # NULL: not measured (never 0 for missing)
    sa.Column("energy_source", sa.String(64), nullable=True),
    sa.Column("cost_usd", sa.Double, nullable=True),
    sa.Column("device_seconds", sa.Double, nullable=False, default=0.0),
)

TABLES = [files_table, jobs_table, lines_table]
ADDED_COLUMNS = ((files_table, "expires_at", "INTEGER"), (jobs_table, "output_expires_after", "INTEGER"))
LINE_CHUNK = 1000  # lines per INSERT while a file is validated


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def line_request_id(batch_id: str, line: int) -> str:
    """The ledger's request id for one line: stable across restarts, so a line is billed once."""
    return f"{batch_id}-l{line}"


@dataclass(frozen=True)
class LineResult:
    """One line's outcome as stored: its output (or error) line and, for a line that ran, its usage."""

    state: str  # done | error
    result: dict[str, Any]
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    energy_joules: float | None = None
    energy_source: str | None = None
    cost_usd: float | None = None
    device_seconds: float = 0.0


@dataclass(frozen=True)
class PendingLine:
    line: int
    custom_id: str | None
    body: dict[str, Any]


class RejectedLine(NamedTuple):
    """A line that cannot run: its error line is the outcome."""

    line: int
    custom_id: str | None
    result: dict[str, Any]


@dataclass(frozen=True)
class JobTotals:
    """Sums over a job's lines: its counts and usage (energy None when no line measured any)."""

    num_total: int
    num_done: int
    num_error: int
    num_pending: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    energy_joules: float | None
    energy_sources: tuple[str, ...]
    cost_usd: float | None
    device_seconds: float


class BatchStore:
    """Thread-safe over a SQLAlchemy engine (the ledger's); every call is its own transaction. Calls block:
    the gateway runs them in a worker thread."""

    def __init__(self, engine: sa.Engine, data_dir: Path) -> None:
        self.engine = engine
        self.directory = Path(data_dir) / BATCH_DIRNAME
        make_private_dir(self.directory)
        metadata.create_all(engine, tables=TABLES)
        self._add_columns()

    def _add_columns(self) -> None:
        """Tables made before a column existed get it (nullable: old rows read NULL)."""
        inspector = sa.inspect(self.engine)
        for table, column, kind in ADDED_COLUMNS:
            if column not in {c["name"] for c in inspector.get_columns(table.name)}:
                with self.engine.begin() as conn:
                    conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column} {kind}"))

    # -- files --------------------------------------------------------------------------------------------

    def path(self, file_id: str) -> Path:
        if not file_id.replace("-", "").replace("_", "").isalnum():  # ids are ours: never a path
            raise KeyError(file_id)
        return self.directory / f"{file_id}.jsonl"

    def add_file(self, content: bytes, filename: str, purpose: str, tenant: str, file_id: str | None = None,
                 expires_at: int | None = None) -> dict:
        """Write the bytes (fsynced) then the row (the bytes removed again if the row is refused); `file_id`
        given: a known id (the offline runner's, or a job's output)."""
        file_id = file_id or new_id("file-")
        path = self.path(file_id)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        row = {"file_id": file_id, "tenant": tenant, "purpose": purpose, "filename": filename[:MAX_FILENAME_CHARS],
               "bytes": len(content), "created_at": int(time.time()), "expires_at": expires_at}
        try:
            with self.engine.begin() as conn:
                conn.execute(sa.delete(files_table).where(files_table.c.file_id == file_id))
                conn.execute(files_table.insert(), row)
        except BaseException:
            path.unlink(missing_ok=True)  # no bytes without their row
            raise
        return row

    def get_file(self, file_id: str, now: int | None = None) -> dict | None:
        """The file's row; with `now`, None once it has expired (the sweeper removes it soon after)."""
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(files_table).where(files_table.c.file_id == file_id)).first()
        if row is None or (now is not None and row.expires_at is not None and row.expires_at <= now):
            return None
        return row._asdict()

    def list_files(self, tenant: str | None, purpose: str | None, now: int | None = None) -> list[dict]:
        """Newest first, unexpired at `now` (if given); `tenant` None: everyone's."""
        t = files_table
        stmt = sa.select(t).order_by(t.c.created_at.desc(), t.c.file_id)
        if tenant is not None:
            stmt = stmt.where(t.c.tenant == tenant)
        if purpose is not None:
            stmt = stmt.where(t.c.purpose == purpose)
        if now is not None:
            stmt = stmt.where(sa.or_(t.c.expires_at.is_(None), t.c.expires_at > now))
        with self.engine.connect() as conn:
            return [r._asdict() for r in conn.execute(stmt.limit(10_000))]

    def delete_file(self, file_id: str) -> bool:
        """The row, then the bytes; False if there was no such file."""
        with self.engine.begin() as conn:
            deleted = conn.execute(sa.delete(files_table).where(files_table.c.file_id == file_id)).rowcount > 0
        with contextlib.suppress(KeyError):
            self.path(file_id).unlink(missing_ok=True)
        return deleted

    def storage(self, tenant: str) -> tuple[int, int]:
        """(files, bytes) the tenant keeps (expired ones not yet swept included: they still take the disk)."""
        t = files_table
        with self.engine.connect() as conn:
            num, size = conn.execute(sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(t.c.bytes), 0))
                                     .where(t.c.tenant == tenant)).one()
        return int(num), int(size)

    def expired_files(self, now: int, limit: int = 1000) -> list[str]:
        """Files past their expiry, except the input of a job still being validated (it reads it)."""
        t, j = files_table, jobs_table
        in_use = sa.select(j.c.input_file_id).where(j.c.status == "validating")
        stmt = (sa.select(t.c.file_id).where(t.c.expires_at.is_not(None)).where(t.c.expires_at <= now)
                .where(t.c.file_id.not_in(in_use)).limit(limit))
        with self.engine.connect() as conn:
            return list(conn.execute(stmt).scalars())

    def read_file(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    # -- jobs ---------------------------------------------------------------------------------------------

    def add_job(self, job: dict) -> dict:
        with self.engine.begin() as conn:
            conn.execute(jobs_table.insert(), job)
        return job

    def get_job(self, batch_id: str) -> dict | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(jobs_table).where(jobs_table.c.batch_id == batch_id)).first()
        return row._asdict() if row is not None else None

    def list_jobs(self, tenant: str | None, after: str | None, limit: int) -> list[dict]:
        """Newest first; `after`: the page after that job id (OpenAI's cursor)."""
        t = jobs_table
        stmt = sa.select(t).order_by(t.c.created_at.desc(), t.c.batch_id.desc())
        if tenant is not None:
            stmt = stmt.where(t.c.tenant == tenant)
        if after is not None and (cursor := self.get_job(after)) is not None:
            stmt = stmt.where(sa.or_(t.c.created_at < cursor["created_at"],
                                     sa.and_(t.c.created_at == cursor["created_at"], t.c.batch_id < after)))
        with self.engine.connect() as conn:
            return [r._asdict() for r in conn.execute(stmt.limit(limit))]

    def num_active_jobs(self, tenant: str) -> int:
        t = jobs_table
        with self.engine.connect() as conn:
            return conn.execute(sa.select(sa.func.count()).where(t.c.tenant == tenant)
                                .where(t.c.status.in_(ACTIVE_STATUSES))).scalar_one()

    def active_jobs(self) -> list[dict]:
        """Jobs a restart must resume, oldest first."""
        t = jobs_table
        stmt = sa.select(t).where(t.c.status.in_(ACTIVE_STATUSES)).order_by(t.c.created_at, t.c.batch_id)
        with self.engine.connect() as conn:
            return [r._asdict() for r in conn.execute(stmt)]

    def set_status(self, batch_id: str, status: str, only_from: Iterable[str] | None = None, **fields: Any) -> bool:
        """Move a job to `status` (stamping `<status>_at`), only from one of `only_from` if given; False if
        it was not there (a cancel that raced the job's end)."""
        t = jobs_table
        values = {"status": status, **fields}
        if f"{status}_at" in t.c:
            values.setdefault(f"{status}_at", int(time.time()))
        stmt = sa.update(t).where(t.c.batch_id == batch_id).values(**values)
        if only_from is not None:
            stmt = stmt.where(t.c.status.in_(list(only_from)))
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount > 0

    # -- lines --------------------------------------------------------------------------------------------

    def start_lines(self, batch_id: str, lines: Iterable[PendingLine | RejectedLine]) -> None:
        """Validation's outcome in one transaction: every line (pending, or an error line for one that cannot
        run), inserted `LINE_CHUNK` at a time as `lines` yields them, and the job in_progress; run again after
        a kill before it committed, it starts over. An exception from `lines` rolls it all back."""
        with self.engine.begin() as conn:
            conn.execute(sa.delete(lines_table).where(lines_table.c.batch_id == batch_id))
            for rows in _chunks((_line_row(batch_id, item) for item in lines), LINE_CHUNK):
                conn.execute(lines_table.insert(), rows)
            conn.execute(sa.update(jobs_table).where(jobs_table.c.batch_id == batch_id)
                         .where(jobs_table.c.status == "validating")
                         .values(status="in_progress", in_progress_at=int(time.time())))

    def pending_lines(self, batch_id: str, after: int = 0, limit: int | None = None) -> list[PendingLine]:
        """Pending lines numbered above `after`, in order, at most `limit` (a page: the runner never holds a
        job's lines all at once)."""
        t = lines_table
        stmt = sa.select(t.c.line, t.c.custom_id, t.c.request_json).where(t.c.batch_id == batch_id) \
            .where(t.c.state == "pending").where(t.c.line > after).order_by(t.c.line)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self.engine.connect() as conn:
            return [PendingLine(r.line, r.custom_id, json.loads(r.request_json)) for r in conn.execute(stmt)]

    def finish_line(self, batch_id: str, line: int, result: LineResult) -> None:
        t = lines_table
        values = {"state": result.state, "result_json": json.dumps(result.result), "request_json": None,
                  "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                  "cached_tokens": result.cached_tokens, "energy_joules": result.energy_joules,
                  "energy_source": result.energy_source, "cost_usd": result.cost_usd,
                  "device_seconds": result.device_seconds}
        with self.engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.batch_id == batch_id).where(t.c.line == line)
                         .where(t.c.state == "pending").values(**values))

    def results(self, batch_id: str, state: str) -> list[dict]:
        """The output (state done) or error lines, in input order."""
        t = lines_table
        stmt = sa.select(t.c.result_json).where(t.c.batch_id == batch_id).where(t.c.state == state).order_by(t.c.line)
        with self.engine.connect() as conn:
            return [json.loads(r) for r in conn.execute(stmt).scalars()]

    def totals(self, batch_id: str) -> JobTotals:
        t = lines_table
        stmt = sa.select(
            t.c.state, t.c.energy_source, sa.func.count(), sa.func.sum(t.c.prompt_tokens),
            sa.func.sum(t.c.completion_tokens), sa.func.sum(t.c.cached_tokens), sa.func.sum(t.c.energy_joules),
            sa.func.count(t.c.energy_joules), sa.func.sum(t.c.cost_usd), sa.func.count(t.c.cost_usd),
            sa.func.sum(t.c.device_seconds),
        ).where(t.c.batch_id == batch_id).group_by(t.c.state, t.c.energy_source)
        with self.engine.connect() as conn:
            rows = list(conn.execute(stmt))
        count = {s: sum(r[2] for r in rows if r[0] == s) for s in LINE_STATES}
        joules = [r[6] for r in rows if r[7]]
        costs = [r[8] for r in rows if r[9]]
        return JobTotals(
            num_total=sum(count.values()), num_done=count["done"], num_error=count["error"],
            num_pending=count["pending"], prompt_tokens=sum(r[3] or 0 for r in rows),
            completion_tokens=sum(r[4] or 0 for r in rows), cached_tokens=sum(r[5] or 0 for r in rows),
            energy_joules=sum(joules) if joules else None,
            energy_sources=tuple(sorted({r[1] for r in rows if r[1] is not None})),
            cost_usd=sum(costs) if costs else None, device_seconds=sum(r[10] or 0.0 for r in rows))

    def write_results(self, batch_id: str, tenant: str, expires_at: int | None = None
                      ) -> tuple[str | None, str | None]:
        """The output and error files from the lines (ids derived from the job's, so a finalization
        interrupted and run again rewrites the same files); None for an empty one."""
        ids = []
        for state, suffix in (("done", "output"), ("error", "errors")):
            lines = self.results(batch_id, state)
            if not lines:
                ids.append(None)
                continue
            content = "".join(json.dumps(line) + "\n" for line in lines).encode()
            file_id = f"file-{batch_id.removeprefix('batch_')}-{suffix}"
            self.add_file(content, f"{batch_id}_{suffix}.jsonl", "batch_output", tenant, file_id=file_id,
                          expires_at=expires_at)
            ids.append(file_id)
        return ids[0], ids[1]


def _line_row(batch_id: str, item: PendingLine | RejectedLine) -> dict[str, Any]:
    if isinstance(item, PendingLine):
        return {"batch_id": batch_id, "line": item.line, "custom_id": item.custom_id, "state": "pending",
                "request_json": json.dumps(item.body), "result_json": None}
    return {"batch_id": batch_id, "line": item.line, "custom_id": item.custom_id, "state": "error",
            "request_json": None, "result_json": json.dumps(item.result)}


def _chunks(rows: Iterable[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    chunk: list[dict[str, Any]] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
