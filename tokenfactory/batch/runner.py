"""The OpenAI Batch API: files, jobs, and the runner that feeds their lines through the request path.

Routes (shapes as OpenAI's `FileObject` and `Batch`, so the official client works unchanged):

    POST /v1/files                   multipart: file (JSONL), purpose=batch          -> FileObject
    GET  /v1/files[?purpose=]        GET /v1/files/{id} -> FileObject;  GET /v1/files/{id}/content -> the bytes
    POST /v1/batches                 {input_file_id, endpoint, completion_window, metadata} -> Batch
    GET  /v1/batches/{id}            GET /v1/batches?after=&limit=                 POST /v1/batches/{id}/cancel

Each input line is `{"custom_id", "method": "POST", "url": <the job's endpoint>, "body": {...}}`. A line
runs through the request service as an HTTP request does (`RequestService.completions`/`chat`: validation,
tokenization, the tenant's admission and `Reservation`, one `Settlement` -> one ledger row), as the job's
tenant, in the
batch priority band (the engine's scheduler makes it give way to other traffic within one step and keeps
it a guaranteed share: engine/scheduler.py), with a request id derived from the job and line
(`line_request_id`), so a line is billed once across restarts. A line that fails (malformed, a 400, a
500) goes to the error file; the job goes on. A line refused for a rate limit or a full queue (429,
503) waits and tries again; a budget that runs out (402) stops the job, which keeps its partial output
(status failed, errors naming the budget). At most `max_lines_in_flight` lines are in the engine at
once, server-wide, so batch work never fills the admission queue.

State is durable (batch/store.py): a server killed mid-job resumes its jobs at start-up and runs
only the lines that had not finished.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pydantic

from tokenfactory.batch.store import BatchStore, LineResult, PendingLine, line_request_id, new_id
from tokenfactory.gateway.render import result_body
from tokenfactory.meter.prices import load_price_table
from tokenfactory.service.call import Call, Principal
from tokenfactory.service.errors import APIError, Cancelled, error_body
from tokenfactory.service.protocol import ChatCompletionRequest, CompletionRequest
from tokenfactory.service.results import CompletionResult, Usage
from tokenfactory.service.service import RequestService
from tokenfactory.types import BANDS, ParameterError

logger = logging.getLogger(__name__)

ENDPOINT_TO_KIND = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
WINDOW_TO_SECONDS = {"24h": 86_400}
RETRY_STATUSES = (429, 503)  # a limit or a full queue: the line waits its turn
DEFAULT_BATCH_PRICE_MULTIPLIER = 0.5  # when the prices file has no [batch] table (OpenAI's Batch API: half)


@dataclass(frozen=True)
class BatchSettings:
    max_lines_in_flight: int = 32  # lines in the engine at once, all jobs together
    retry_s: float = 0.5  # a line refused for a rate limit waits at least this long before trying again
    max_lines: int = 50_000  # per input file, as OpenAI's
    prices_path: str | None = None  # the server's --prices override, whose [batch] table prices the summary
    stop_grace_s: float = 10.0  # at shutdown, lines in flight get this long to finish before they are aborted

    def __post_init__(self) -> None:
        if self.max_lines_in_flight < 1:
            raise ParameterError("max_lines_in_flight", f"must be >= 1, got {self.max_lines_in_flight}")


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


def parse_line(number: int, text: str, endpoint: str) -> PendingLine | tuple[int, str | None, dict]:
    """A pending line, or (line, custom_id, error line) for one that cannot run."""
    custom_id = None
    try:
        item = json.loads(text)
        if not isinstance(item, dict):
            raise ValueError("a line must be a JSON object")
        custom_id = item.get("custom_id") if isinstance(item.get("custom_id"), str) else None
        if custom_id is None:
            raise ValueError("custom_id (a string) is required")
        if item.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST, got {item.get('method')!r}")
        if item.get("url") != endpoint:
            raise ValueError(f"url must be the batch's endpoint {endpoint}, got {item.get('url')!r}")
        if not isinstance(item.get("body"), dict):
            raise ValueError("body (a JSON object) is required")
    except ValueError as e:  # json.JSONDecodeError is one
        return number, custom_id, {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                                   "error": {"code": "invalid_request", "message": f"line {number}: {e}"}}
    return PendingLine(number, custom_id, item["body"])


def line_result(request_id: str, line: PendingLine, answer: LineAnswer) -> LineResult:
    """The stored outcome: OpenAI's output-line shape, and the usage the job's totals sum."""
    out = {"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
           "response": {"status_code": answer.status, "request_id": request_id, "body": answer.body}, "error": None}
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


class BatchRunner:
    """Runs jobs on the server's event loop: one task per job, lines limited server-wide."""

    def __init__(self, service: RequestService, store: BatchStore, settings: BatchSettings,
                 principal_of: Callable[[str], Principal | None]) -> None:
        """`principal_of(tenant)`: whom a resumed job runs as (None: the tenant is gone; its lines fail)."""
        self.service, self.store, self.settings, self.principal_of = service, store, settings, principal_of
        self.tasks: dict[str, asyncio.Task] = {}
        self.cancelled: set[str] = set()
        self.stopping = False  # shutdown: no line starts; those in flight may finish (stop_grace_s)
        self._slots: asyncio.Semaphore | None = None

    @property
    def slots(self) -> asyncio.Semaphore:
        if self._slots is None:  # made on the running loop
            self._slots = asyncio.Semaphore(self.settings.max_lines_in_flight)
        return self._slots

    async def start(self) -> None:
        """Resume every job a previous process left unfinished."""
        for job in await asyncio.to_thread(self.store.active_jobs):
            if job["status"] == "cancelling":
                self.cancelled.add(job["batch_id"])
            self.submit(job["batch_id"])

    def submit(self, batch_id: str) -> None:
        task = asyncio.ensure_future(self.run_job(batch_id))
        self.tasks[batch_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(batch_id, None))

    def cancel(self, batch_id: str) -> None:
        self.cancelled.add(batch_id)

    async def stop(self) -> None:
        """Shutdown: no new line starts, the lines in flight get `stop_grace_s` to finish (an aborted one
        keeps an aborted ledger row, and its rerun at the next start is not billed again), then the jobs
        stop; their unfinished lines run at the next start."""
        self.stopping = True
        tasks = list(self.tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.stop_grace_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self, batch_id: str) -> None:
        if (task := self.tasks.get(batch_id)) is not None:
            await asyncio.shield(task)

    async def run_job(self, batch_id: str) -> None:
        try:
            job = await asyncio.to_thread(self.store.get_job, batch_id)
            if job is None:
                return
            if job["status"] == "validating":
                await self.validate(job)
            outcome = await self.run_lines(job)
            if outcome != "stopped":  # a shutdown leaves the job in_progress for the next start
                await self.finalize(job, outcome)
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

    async def validate(self, job: dict) -> None:
        content = await asyncio.to_thread(self.store.read_file, job["input_file_id"])
        pending, rejected = [], []
        for number, text in enumerate(content.decode("utf-8", errors="replace").splitlines(), start=1):
            if not text.strip():
                continue
            if len(pending) + len(rejected) >= self.settings.max_lines:
                raise ParameterError("input_file_id", f"the input file has more than {self.settings.max_lines} "
                                     "lines: split it into several batches")
            parsed = parse_line(number, text, job["endpoint"])
            (pending if isinstance(parsed, PendingLine) else rejected).append(parsed)
        seen: set[str] = set()
        for line in list(pending):  # custom_id is the caller's key into the output: unique, as OpenAI's
            if line.custom_id in seen:
                pending.remove(line)
                rejected.append((line.line, line.custom_id, {
                    "id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
                    "error": {"code": "duplicate_custom_id", "message": f"line {line.line}: custom_id "
                              f"{line.custom_id!r} is used by an earlier line"}}))
            seen.add(line.custom_id or "")
        await asyncio.to_thread(self.store.start_lines, job["batch_id"], pending, rejected)

    async def run_lines(self, job: dict) -> str:
        """Run the pending lines; returns why it stopped: done, cancelled, budget, expired or stopped."""
        batch_id = job["batch_id"]
        principal = await asyncio.to_thread(self.principal_of, job["tenant"])  # a store lookup with auth on
        pending = await asyncio.to_thread(self.store.pending_lines, batch_id)
        stop: list[str] = []
        kind = ENDPOINT_TO_KIND[job["endpoint"]]

        def cancelled() -> bool:
            if not stop and batch_id in self.cancelled:
                stop.append("cancelled")
            elif not stop and time.time() > job["expires_at"]:
                stop.append("expired")
            return bool(stop)

        async def one(line: PendingLine) -> None:
            async with self.slots:
                if self.stopping or cancelled():
                    return
                await self.run_line(batch_id, kind, line, principal, cancelled, stop)

        await asyncio.gather(*(one(line) for line in pending))
        if stop:
            return stop[0]
        return "stopped" if self.stopping else "done"

    async def run_line(self, batch_id: str, kind: str, line: PendingLine, principal: Principal | None,
                       cancelled: Callable[[], bool], stop: list[str]) -> None:
        request_id = line_request_id(batch_id, line.line)
        while True:
            if principal is None:
                answer: LineAnswer | None = LineAnswer(403, error_body(
                    "the tenant that submitted this batch no longer exists", "permission_error",
                    code="tenant_not_found"))
            else:
                answer = await call_route(self.service, kind, line.body, principal, request_id, cancelled)
            if answer is None:
                return  # cancelled or expired: the line stays pending, not in the output
            status, body = answer.status, answer.body
            if status == 402:  # the tenant's budget ran out: the job stops with what it has
                stop.append("budget")
                return
            if status == 503 and body.get("error", {}).get("code") == "engine_unavailable":
                stop.append("stopped")  # the engine is gone: the job waits in_progress for the next start
                return
            if status not in RETRY_STATUSES:
                break
            await asyncio.sleep(self.settings.retry_s)
            if cancelled():
                return
        await asyncio.to_thread(self.store.finish_line, batch_id, line.line, line_result(request_id, line, answer))

    async def finalize(self, job: dict, outcome: str) -> None:
        batch_id = job["batch_id"]
        await asyncio.to_thread(self.store.set_status, batch_id, "finalizing",
                                only_from=("in_progress", "finalizing"))
        output_id, error_id = await asyncio.to_thread(self.store.write_results, batch_id, job["tenant"])
        files = {"output_file_id": output_id, "error_file_id": error_id}
        if outcome == "cancelled":
            await asyncio.to_thread(self.store.set_status, batch_id, "cancelled", **files)
        elif outcome == "budget":
            totals = await asyncio.to_thread(self.store.totals, batch_id)
            errors = [{"code": "budget_exhausted", "param": None, "line": None, "message": (
                f"the tenant's budget ran out; {totals.num_pending} of {totals.num_total} lines were not run "
                "(the output and error files hold the rest)")}]
            await asyncio.to_thread(self.store.set_status, batch_id, "failed", errors_json=json.dumps(errors), **files)
        else:
            status = "expired" if outcome == "expired" else "completed"
            await asyncio.to_thread(self.store.set_status, batch_id, status, **files)
        self.cancelled.discard(batch_id)


def batch_price_multiplier(prices_path: str | None = None) -> tuple[float, str]:
    """(multiplier on the interactive price, its source) from the prices file's [batch] table."""
    table = load_price_table(Path(prices_path) if prices_path else None).get("batch", {})
    value = table.get("usd_multiplier", DEFAULT_BATCH_PRICE_MULTIPLIER)
    return float(value), str(table.get("source", "default: half the interactive price, as OpenAI's Batch API"))
