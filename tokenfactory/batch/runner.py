"""The OpenAI Batch API's runner: it feeds each job's lines through the request path, as the job's tenant.

Routes (batch/routes.py; shapes as OpenAI's `FileObject` and `Batch`, so the official client works unchanged):
files (upload, list, get, content, delete, with an expiry and a per-tenant quota) and batches (create, get,
list, cancel). Each input line is `{"custom_id", "method": "POST", "url": <the job's endpoint>, "body": {...}}`.

One line through the request path is `call_route`: a `Call` into the request service (validation,
tokenization, the tenant's admission and `Reservation`, one `Settlement` -> one ledger row), as the job's
tenant, in the batch priority band (the engine's scheduler makes it give way to other traffic within one step
and keeps it a guaranteed share), with the request id `line_request_id(batch id, line)`. Around it, the rules
(docs/batch.md):

- **Validation** (parsing, `custom_id` de-duplication, the rows' insert) runs in a worker thread and is linear:
  a hostile file cannot stall the event loop. Lines are split on `\n` only, as OpenAI's JSONL.
- **Bounded per tenant**: at most `max_lines_in_flight` lines in the engine, all jobs together, and at most
  `max_lines_in_flight_per_tenant` of one tenant, handed out in turn between tenants (batch/slots.py). A job
  runs that many workers over its lines, read a page at a time, so a queued 50,000-line job holds a few dozen
  lines in memory, not 50,000 tasks. A tenant has at most `max_active_jobs_per_tenant` jobs (routes.py).
- **A refused line gives its slot back**: a 429 (rate limit) or 503 (full queue) frees the slot and the
  tenant's lines wait (doubling from `retry_s` to `max_retry_s`) without holding one, so a rate-limited
  tenant never blocks another's jobs.
- **The tenant as it is now**: its limits, budget and existence are read for every line (one indexed read in
  a thread; `tenant_ttl_s` may let a busy server reuse it briefly), so a budget cut stops the job at its
  next line (402: status failed, `budget_exhausted`) and a removed tenant stops it too (failed,
  `tenant_not_found`).
- **Stopping** (a cancel, the window passing, a budget, a removed tenant) starts no new line; lines in flight
  get `cancel_grace_s` to finish, then are aborted. Every line that ran is reported: in the output file, or
  in the error file (a line cut off carries the usage its aborted ledger row bills), and the Batch object's
  usage is the sum of the lines' ledger rows. A job acknowledged as `cancelling` always ends `cancelled`.
- **Billed once, whatever the restarts**: SIGTERM starts no new line and gives those in flight
  `stop_grace_s`, then aborts them; they stay pending, run again at the next start, and the rerun's row
  supersedes the aborted one (meter/ledger.py), so the ledger bills each line once, for its answer.

State is durable (batch/store.py): a server killed mid-job resumes its jobs at start-up and runs only the lines
that had not finished. (Past 400 lines: the job's life, its lines' rules and the stop semantics change together.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic

from tokenfactory.batch.slots import FairSlots, TenantBackoff
from tokenfactory.batch.store import (
    BatchStore,
    LineResult,
    PendingLine,
    RejectedLine,
    line_request_id,
    new_id,
)
from tokenfactory.gateway.render import embedding_body, result_body
from tokenfactory.meter.prices import load_price_table
from tokenfactory.service.call import Call, Principal
from tokenfactory.service.errors import APIError, Cancelled, error_body
from tokenfactory.service.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from tokenfactory.service.results import CompletionResult, Usage
from tokenfactory.service.service import RequestService
from tokenfactory.types import BANDS, ParameterError

if TYPE_CHECKING:
    from tokenfactory.meter.ledger import LedgerRow

logger = logging.getLogger(__name__)

ENDPOINT_TO_KIND = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/embeddings": "embeddings"}
WINDOW_TO_SECONDS = {"24h": 86_400}
RETRY_STATUSES = (429, 503)  # a limit or a full queue: the line waits its turn, without a slot
DEFAULT_BATCH_PRICE_MULTIPLIER = 0.5  # when the prices file has no [batch] table (OpenAI's Batch API: half)
MAX_CUSTOM_ID_CHARS = 512  # the column's size
ANONYMOUS_TENANT = "anonymous"  # auth off: the only tenant, which may use every slot
# Why a job stopped early -> (the code a line it cut off carries, in words).
STOP_TO_CUT = {"cancelled": ("batch_cancelled", "the batch was cancelled"),
               "expired": ("batch_expired", "the batch's completion window passed"),
               "budget": ("budget_exhausted", "the tenant's budget ran out"),
               "tenant_gone": ("tenant_not_found", "the tenant that submitted the batch was removed")}


@dataclass(frozen=True)
class BatchSettings:
    max_lines_in_flight: int = 32  # lines in the engine at once, all jobs together
    max_lines_in_flight_per_tenant: int | None = None  # None: half of max_lines_in_flight (all of it for anonymous)
    max_active_jobs_per_tenant: int = 16  # validating, in progress, finalizing or cancelling at once
    retry_s: float = 0.5  # a tenant refused for a rate limit waits at least this long, doubling while refused
    max_retry_s: float = 10.0
    max_lines: int = 50_000  # per input file, as OpenAI's
    prices_path: str | None = None  # the server's --prices override, whose [batch] table prices the summary
    stop_grace_s: float = 10.0  # at shutdown, lines in flight get this long to finish before they are aborted
    cancel_grace_s: float = 60.0  # a stopped job's lines in flight get this long to finish before they are aborted
    page_lines: int = 256  # a job's pending lines read from the store at a time
    tenant_ttl_s: float = 0.0  # how old a tenant's limits, budget and existence may be at a line's start (0: fresh)
    file_ttl_s: int = 30 * 86_400  # a file's life unless its upload (or the batch, for outputs) says otherwise
    max_bytes_per_tenant: int = 1 << 30  # the bytes of files one tenant may keep
    max_files_per_tenant: int = 1000
    min_free_disk_bytes: int = 256 << 20  # an upload that would leave less free on the data disk is refused
    sweep_interval_s: float = 60.0  # how often expired files are deleted

    def __post_init__(self) -> None:
        for name in ("max_lines_in_flight", "max_active_jobs_per_tenant", "max_lines", "page_lines",
                     "max_files_per_tenant"):
            if getattr(self, name) < 1:
                raise ParameterError(name, f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_lines_in_flight_per_tenant is not None and self.max_lines_in_flight_per_tenant < 1:
            raise ParameterError("max_lines_in_flight_per_tenant", f"must be >= 1, got "
                                 f"{self.max_lines_in_flight_per_tenant}")
        for name in ("retry_s", "max_retry_s", "sweep_interval_s"):
            if not getattr(self, name) > 0:
                raise ParameterError(name, f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("stop_grace_s", "cancel_grace_s", "tenant_ttl_s", "min_free_disk_bytes"):
            if getattr(self, name) < 0:
                raise ParameterError(name, f"{name} must be >= 0, got {getattr(self, name)}")
        if self.file_ttl_s < 1 or self.max_bytes_per_tenant < 1:
            raise ParameterError("file_ttl_s", "file_ttl_s and max_bytes_per_tenant must be >= 1")

    def tenant_cap(self, tenant: str) -> int:
        """Lines of one tenant in flight at once."""
        if self.max_lines_in_flight_per_tenant is not None:
            return min(self.max_lines_in_flight_per_tenant, self.max_lines_in_flight)
        if tenant == ANONYMOUS_TENANT:
            return self.max_lines_in_flight
        return max(1, self.max_lines_in_flight // 2)


def validation_error_body(e: pydantic.ValidationError) -> dict:
    err = e.errors()[0] if e.errors() else {}
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    if err.get("type") == "extra_forbidden":
        return error_body(f"unrecognized request argument: {param}", param=param)
    if err.get("type") == "missing":
        return error_body(f"missing required parameter: {param}", param=param)
    return error_body(f"invalid value for {param}: {err.get('msg', 'invalid')}", param=param)


@dataclass(frozen=True)
class LineAnswer:
    """One line's outcome: OpenAI's status and body, and the typed usage when it succeeded."""

    status: int
    body: dict
    usage: Usage | None = None


async def call_route(service: RequestService, kind: str, body: dict, principal: Principal, request_id: str,
                     cancelled: Callable[[], bool]) -> LineAnswer | None:
    """One line through the request service as its tenant, in the batch band, with its durable request id;
    None if `cancelled()` stopped it (its engine request aborted, its ledger row written as aborted)."""
    call = Call(principal, request_id, BANDS["batch"])
    watcher = asyncio.ensure_future(_watch(cancelled, call))
    try:
        if body.get("stream"):
            raise ParameterError("stream", "a batch line cannot stream: remove stream (the output file has the answer)")
        if kind == "embeddings":
            request = EmbeddingRequest.model_validate(body)
            vectors = await service.embeddings(call, request)
            return LineAnswer(200, embedding_body(vectors, request.encoding_format), vectors.usage)
        if kind == "chat":
            result = await service.chat(call, ChatCompletionRequest.model_validate(body))
        else:
            result = await service.completions(call, CompletionRequest.model_validate(body))
        assert isinstance(result, CompletionResult)  # stream is refused above
    except Cancelled:
        return None
    except APIError as e:  # Refusal is one
        return LineAnswer(e.status, e.error())
    except ParameterError as e:
        return LineAnswer(400, error_body(str(e), param=e.param))
    except pydantic.ValidationError as e:
        return LineAnswer(400, validation_error_body(e))
    except Exception:  # noqa: BLE001 - one line fails alone, as one HTTP request would (the log has why)
        logger.exception("batch line %s failed", request_id)
        return LineAnswer(500, error_body("internal server error; the server's log has the details", "server_error",
                                          code="internal_error"))
    finally:
        watcher.cancel()
    return LineAnswer(200, result_body(result), result.usage)


async def _watch(cancelled: Callable[[], bool], call: Call, interval_s: float = 0.25) -> None:
    """Set the call's cancel signal once the job is cancelled or expires."""
    while not cancelled():
        await asyncio.sleep(interval_s)
    call.cancelled.set()


def rejected(number: int, custom_id: str | None, code: str, message: str) -> RejectedLine:
    return RejectedLine(number, custom_id, {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                                            "error": {"code": code, "message": f"line {number}: {message}"}})


def parse_line(number: int, text: str, endpoint: str) -> PendingLine | RejectedLine:
    """A pending line, or the error line of one that cannot run."""
    custom_id = None
    try:
        item = json.loads(text)
        if not isinstance(item, dict):
            raise ValueError("a line must be a JSON object")
        custom_id = item.get("custom_id") if isinstance(item.get("custom_id"), str) else None
        if custom_id is None:
            raise ValueError("custom_id (a string) is required")
        if len(custom_id) > MAX_CUSTOM_ID_CHARS:
            custom_id = custom_id[:MAX_CUSTOM_ID_CHARS]
            raise ValueError(f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters")
        if item.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST, got {item.get('method')!r}")
        if item.get("url") != endpoint:
            raise ValueError(f"url must be the batch's endpoint {endpoint}, got {item.get('url')!r}")
        if not isinstance(item.get("body"), dict):
            raise ValueError("body (a JSON object) is required")
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        message = str(e) if not isinstance(e, RecursionError) else "the line nests too deeply"
        return rejected(number, custom_id, "invalid_request", message)
    return PendingLine(number, custom_id, item["body"])


def parse_input(content: bytes, endpoint: str, max_lines: int) -> Iterator[PendingLine | RejectedLine]:
    """Every line of a JSONL input file, parsed, in order, in one pass: split on `\n` only (as OpenAI's; a
    U+2028 or U+0085 inside a string is part of its line), a trailing `\r` dropped, each line UTF-8, and a
    `custom_id` used by an earlier line refused (a set: linear, whatever the file). Raises ParameterError
    past `max_lines` non-empty lines."""
    seen: set[str] = set()
    num_lines = 0
    for number, raw in enumerate(split_lines(content.removeprefix(b"\xef\xbb\xbf")), start=1):
        raw = raw.removesuffix(b"\r")
        if not raw.strip():
            continue
        num_lines += 1
        if num_lines > max_lines:
            raise ParameterError("input_file_id", f"the input file has more than {max_lines} lines: split it into "
                                 "several batches")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield rejected(number, None, "invalid_request", f"not valid UTF-8 (byte {e.start})")
            continue
        parsed = parse_line(number, text, endpoint)
        if isinstance(parsed, PendingLine):
            if parsed.custom_id in seen:  # custom_id is the caller's key into the output: unique, as OpenAI's
                yield rejected(number, parsed.custom_id, "duplicate_custom_id",
                               f"custom_id {parsed.custom_id!r} is used by an earlier line")
                continue
            seen.add(parsed.custom_id or "")
        yield parsed


def split_lines(content: bytes) -> Iterator[bytes]:
    """`content.split(b"\n")`, one line at a time (a 4 MiB file is never a list of 50,000 lines)."""
    start = 0
    while (end := content.find(b"\n", start)) != -1:
        yield content[start:end]
        start = end + 1
    yield content[start:]


def usage_of_row(row: LedgerRow) -> dict[str, Any]:
    return {"prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens,
            "total_tokens": row.prompt_tokens + row.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": row.cached_tokens}, "energy_joules": row.energy_joules,
            "energy_source": row.energy_source, "cost_usd": row.cost_usd, "device_seconds": row.device_seconds}


def line_result(request_id: str, line: PendingLine, answer: LineAnswer, ledger_row: LedgerRow | None) -> LineResult:
    """The stored outcome: OpenAI's output-line shape, and the usage the job's totals sum: the line's ledger
    row's when it has one (what is billed: after a kill between a line's row and its state, the rerun's answer
    is not the attempt billed), else its answer's."""
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
           "response": {"status_code": answer.status, "request_id": request_id, "body": answer.body}, "error": None}
    if ledger_row is not None:
        if answer.status != 200:  # a line that failed after it reached the engine says what its row bills
            out["usage"] = usage_of_row(ledger_row)
        return billed_result("done" if answer.status == 200 else "error", out, ledger_row)
    usage = answer.usage
    if answer.status != 200 or usage is None:
        return LineResult("error", out)
    energy = usage.energy
    return LineResult("done", out, prompt_tokens=usage.num_prompt_tokens, completion_tokens=usage.num_completion_tokens,
                      cached_tokens=usage.num_cached_tokens,
                      energy_joules=energy.energy_joules if energy is not None else None,
                      energy_source=energy.energy_source if energy is not None else None,
                      cost_usd=energy.cost_usd if energy is not None else None,
                      device_seconds=energy.device_seconds if energy is not None else 0.0)


def billed_result(state: str, out: dict, row: LedgerRow) -> LineResult:
    return LineResult(state, out, prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                      cached_tokens=row.cached_tokens, energy_joules=row.energy_joules,
                      energy_source=row.energy_source, cost_usd=row.cost_usd, device_seconds=row.device_seconds)


def cut_result(batch_id: str, line: PendingLine, row: LedgerRow, reason: str) -> LineResult:
    """The error line of a line that started and was cut off (a stop's grace passed, or a restart), with the
    usage its aborted ledger row bills."""
    code, why = STOP_TO_CUT.get(reason, ("batch_cancelled", "the batch stopped"))
    request_id = line_request_id(batch_id, line.line)
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id, "response": None,
           "error": {"code": code, "message": f"line {line.line}: cut off after it started ({why}); the "
                     f"{row.completion_tokens} tokens it made are billed"},
           "usage": usage_of_row(row)}
    return billed_result("error", out, row)


@dataclass
class JobRun:
    """One job's life in this process: why it stops, whether its lines in flight are aborted."""

    batch_id: str
    stop_reason: str | None = None  # cancelled | expired | budget | tenant_gone | engine_gone
    abort: bool = False  # lines in flight are aborted (their grace is over, or the server stops)
    num_cut: int = 0  # lines aborted in this process
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def stop(self, reason: str, grace_s: float | None) -> None:
        """No line starts any more; lines in flight are aborted after `grace_s` (None: never)."""
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        if grace_s is not None:
            self.timer = asyncio.get_running_loop().call_later(grace_s, self.abort_now)

    def abort_now(self) -> None:
        self.abort = True


class LineFeed:
    """A job's pending lines, a page at a time, shared by its workers."""

    def __init__(self, store: BatchStore, batch_id: str, page: int) -> None:
        self.store, self.batch_id, self.page = store, batch_id, page
        self.buffer: deque[PendingLine] = deque()
        self.after = 0
        self.exhausted = False
        self.lock = asyncio.Lock()

    async def next(self) -> PendingLine | None:
        async with self.lock:
            if not self.buffer and not self.exhausted:
                page = await asyncio.to_thread(self.store.pending_lines, self.batch_id, self.after, self.page)
                self.buffer.extend(page)
                self.exhausted = len(page) < self.page
                if page:
                    self.after = page[-1].line
            return self.buffer.popleft() if self.buffer else None


class BatchRunner:
    """Runs jobs on the server's event loop: a task per job, a few workers per job, slots fair across tenants."""

    def __init__(self, service: RequestService, store: BatchStore, settings: BatchSettings,
                 principal_of: Callable[[str], Principal | None]) -> None:
        """`principal_of(tenant)`: whom a line runs as, read fresh (None: the tenant is gone); blocking."""
        self.service, self.store, self.settings, self.principal_of = service, store, settings, principal_of
        self.tasks: dict[str, asyncio.Task] = {}
        self.runs: dict[str, JobRun] = {}
        self.stopping = False  # shutdown: no line starts; those in flight may finish (stop_grace_s)
        self.backoff = TenantBackoff(settings.retry_s, settings.max_retry_s)
        self._slots: FairSlots | None = None
        self._tenant_to_principal: dict[str, tuple[float, Principal | None]] = {}
        self._sweeper: asyncio.Task | None = None

    @property
    def slots(self) -> FairSlots:
        if self._slots is None:  # made on the running loop
            self._slots = FairSlots(self.settings.max_lines_in_flight, self.settings.tenant_cap)
        return self._slots

    async def start(self) -> None:
        """Resume every job a previous process left unfinished, and start sweeping expired files."""
        for job in await asyncio.to_thread(self.store.active_jobs):
            self.submit(job["batch_id"])
            if job["status"] == "cancelling":
                self.cancel(job["batch_id"])
        self._sweeper = asyncio.ensure_future(self._sweep())

    def submit(self, batch_id: str) -> None:
        self.runs.setdefault(batch_id, JobRun(batch_id))
        task = asyncio.ensure_future(self.run_job(batch_id))
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self._forget(batch_id))

    def _forget(self, batch_id: str) -> None:
        self.tasks.pop(batch_id, None)
        run = self.runs.pop(batch_id, None)
        if run is not None and run.timer is not None:
            run.timer.cancel()

    def cancel(self, batch_id: str) -> None:
        if (run := self.runs.get(batch_id)) is not None:
            run.stop("cancelled", self.settings.cancel_grace_s)

    async def stop(self) -> None:
        """Shutdown: no new line starts, the lines in flight get `stop_grace_s` to finish, then they are
        aborted (each keeps an aborted ledger row; its rerun at the next start supersedes it), then the
        jobs stop; their unfinished lines run at the next start."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = list(self.tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.stop_grace_s)
        for run in self.runs.values():
            run.abort_now()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)  # an abort reaches a line within one disconnect poll
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self, batch_id: str) -> None:
        if (task := self.tasks.get(batch_id)) is not None:
            await asyncio.shield(task)

    async def principal(self, tenant: str) -> Principal | None:
        """The tenant as it is now (limits, budget, existence), at most `tenant_ttl_s` old."""
        now = time.monotonic()
        cached = self._tenant_to_principal.get(tenant)
        if cached is not None and now - cached[0] < self.settings.tenant_ttl_s:
            return cached[1]
        principal = await asyncio.to_thread(self.principal_of, tenant)  # a store read with auth on
        self._tenant_to_principal[tenant] = (time.monotonic(), principal)
        return principal

    # -- a job ----------------------------------------------------------------------------------------

    async def run_job(self, batch_id: str) -> None:
        run = self.runs.setdefault(batch_id, JobRun(batch_id))
        try:
            job = await asyncio.to_thread(self.store.get_job, batch_id)
            if job is None:
                return
            if job["status"] == "validating":
                await asyncio.to_thread(self.validate, job)  # off the event loop: linear, but CPU-bound
            outcome = await self.run_lines(job, run)
            if outcome != "stopped":  # a shutdown or a dead engine leaves the job in_progress for the next start
                await self.finalize(job, run, outcome)
        except asyncio.CancelledError:
            raise
        except ParameterError as e:  # the input file itself cannot run
            await asyncio.to_thread(self.store.set_status, batch_id, "failed", errors_json=json.dumps(
                [{"code": "invalid_file", "message": str(e), "param": e.param, "line": None}]))
        except Exception as e:  # noqa: BLE001 - the job fails, the server goes on
            logger.exception("batch %s failed", batch_id)
            await asyncio.to_thread(self.store.set_status, batch_id, "failed", errors_json=json.dumps(
                [{"code": "internal_error", "message": f"the job failed ({type(e).__name__}); see the server's log",
                  "param": None, "line": None}]))

    def validate(self, job: dict) -> None:
        """Parse the input file and store its lines, in one pass and one transaction (a worker thread's)."""
        try:
            content = self.store.read_file(job["input_file_id"])
        except (FileNotFoundError, KeyError):
            raise ParameterError("input_file_id", f"the input file {job['input_file_id']} was deleted before "
                                 "the batch read it") from None
        self.store.start_lines(job["batch_id"], parse_input(content, job["endpoint"], self.settings.max_lines))

    async def run_lines(self, job: dict, run: JobRun) -> str:
        """Run the pending lines; returns why it stopped: done, cancelled, budget, expired, tenant_gone or
        stopped (a shutdown, a dead engine)."""
        feed = LineFeed(self.store, job["batch_id"], self.settings.page_lines)
        kind = ENDPOINT_TO_KIND[job["endpoint"]]
        num_workers = self.settings.tenant_cap(job["tenant"])
        await asyncio.gather(*(self.worker(job, run, feed, kind) for _ in range(num_workers)))
        if run.stop_reason == "engine_gone" or (self.stopping and run.stop_reason is None):
            return "stopped"
        return run.stop_reason or "done"

    def halted(self, job: dict, run: JobRun) -> bool:
        """No line may start (it checks the window too)."""
        if run.stop_reason is None and time.time() > job["expires_at"]:
            run.stop("expired", self.settings.cancel_grace_s)
        return self.stopping or run.stop_reason is not None

    async def worker(self, job: dict, run: JobRun, feed: LineFeed, kind: str) -> None:
        while not self.halted(job, run):
            line = await feed.next()
            if line is None:
                return
            await self.run_line(job, run, kind, line)

    async def run_line(self, job: dict, run: JobRun, kind: str, line: PendingLine) -> None:
        batch_id, tenant = job["batch_id"], job["tenant"]
        request_id = line_request_id(batch_id, line.line)
        while True:
            await self.backoff.wait(tenant)  # refused for a limit: wait without a slot
            if self.halted(job, run):
                return  # the line stays pending
            principal = await self.principal(tenant)
            if principal is None:
                run.stop("tenant_gone", self.settings.cancel_grace_s)
                return
            await self.slots.acquire(tenant)
            try:
                if self.halted(job, run):
                    return
                answer = await call_route(self.service, kind, line.body, principal, request_id,
                                          lambda: run.abort)
            finally:
                self.slots.release(tenant)
            if answer is None:  # aborted: it stays pending (finalize reports it, or the next start reruns it)
                run.num_cut += 1
                return
            status, body = answer.status, answer.body
            if status == 402:  # the tenant's budget ran out: the job stops with what it has
                run.stop("budget", self.settings.cancel_grace_s)
                return
            if status == 503 and body.get("error", {}).get("code") == "engine_unavailable":
                run.stop("engine_gone", None)  # the engine is gone: the job waits in_progress for the next start
                return
            if status not in RETRY_STATUSES:
                self.backoff.passed(tenant)
                break
            self.backoff.refused(tenant)
        await self.finish(batch_id, line, request_id, answer)

    async def finish(self, batch_id: str, line: PendingLine, request_id: str, answer: LineAnswer) -> None:
        """Store the line's outcome with the usage its ledger row bills."""
        ledger_row = None
        if self.service.accounting is not None:
            if answer.status >= 500:  # a failed request's row is settled in the background: wait for it
                await self.service.drain(5.0)
            rows = await asyncio.to_thread(self.service.accounting.ledger.find, request_id)
            ledger_row = rows[0] if rows else None
        await asyncio.to_thread(self.store.finish_line, batch_id, line.line,
                                line_result(request_id, line, answer, ledger_row))

    async def finalize(self, job: dict, run: JobRun, outcome: str) -> None:
        batch_id = job["batch_id"]
        if outcome != "done":  # lines cut off, now or by a restart before: reported with what they billed
            if run.num_cut:
                await self.service.drain(10.0)  # their aborted rows are settled in the background
            await asyncio.to_thread(self.report_cut_lines, batch_id, outcome)
        expires_after = job.get("output_expires_after") or self.settings.file_ttl_s
        current = await asyncio.to_thread(self.store.get_job, batch_id)
        cancelled = outcome == "cancelled" or (current is not None and current["status"] == "cancelling")
        if not cancelled and not await asyncio.to_thread(self.store.set_status, batch_id, "finalizing",
                                                         only_from=("in_progress", "finalizing")):
            cancelled = True  # a cancel was acknowledged first: it ends cancelled, whatever ran
        output_id, error_id = await asyncio.to_thread(self.store.write_results, batch_id, job["tenant"],
                                                      int(time.time()) + expires_after)
        files = {"output_file_id": output_id, "error_file_id": error_id}
        if cancelled:
            await asyncio.to_thread(self.store.set_status, batch_id, "cancelled", only_from=("cancelling",), **files)
        elif outcome in ("budget", "tenant_gone"):
            totals = await asyncio.to_thread(self.store.totals, batch_id)
            code, why = STOP_TO_CUT[outcome]
            errors = [{"code": code, "param": None, "line": None, "message": (
                f"{why}; {totals.num_pending} of {totals.num_total} lines were not run (the output and error "
                "files hold the rest)")}]
            await asyncio.to_thread(self.store.set_status, batch_id, "failed", only_from=("finalizing",),
                                    errors_json=json.dumps(errors), **files)
        else:
            status = "expired" if outcome == "expired" else "completed"
            await asyncio.to_thread(self.store.set_status, batch_id, status, only_from=("finalizing",), **files)

    def report_cut_lines(self, batch_id: str, reason: str) -> int:
        """Pending lines that hold a ledger row (they started and were cut off) become error lines with that
        row's usage, so the job reports every line it billed; a thread's work. Returns how many."""
        if self.service.accounting is None:
            return 0
        ledger, num, after = self.service.accounting.ledger, 0, 0
        while page := self.store.pending_lines(batch_id, after, 500):
            after = page[-1].line
            id_to_row = ledger.find_many(line_request_id(batch_id, p.line) for p in page)
            for p in page:
                if (row := id_to_row.get(line_request_id(batch_id, p.line))) is not None:
                    self.store.finish_line(batch_id, p.line, cut_result(batch_id, p, row, reason))
                    num += 1
        return num

    async def _sweep(self) -> None:
        """Delete expired files, now and every `sweep_interval_s`."""
        while True:
            try:
                for file_id in await asyncio.to_thread(self.store.expired_files, int(time.time())):
                    await asyncio.to_thread(self.store.delete_file, file_id)
            except Exception:  # noqa: BLE001 - the next sweep tries again; serving goes on
                logger.exception("batch: sweeping expired files failed")
            await asyncio.sleep(self.settings.sweep_interval_s)


def batch_price_multiplier(prices_path: str | None = None) -> tuple[float, str]:
    """(multiplier on the interactive price, its source) from the prices file's [batch] table."""
    table = load_price_table(Path(prices_path) if prices_path else None).get("batch", {})
    value = table.get("usd_multiplier", DEFAULT_BATCH_PRICE_MULTIPLIER)
    return float(value), str(table.get("source", "default: half the interactive price, as OpenAI's Batch API"))
