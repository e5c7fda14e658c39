"""The Batch API's routes and object shapes (OpenAI's `FileObject`, `Batch`); the runner is runner.py.

    POST   /v1/files                multipart: file (JSONL), purpose=batch[, expires_after[anchor]=created_at,
                                    expires_after[seconds]=N]                               -> FileObject
    GET    /v1/files[?purpose=]     GET /v1/files/{id} -> FileObject;  GET /v1/files/{id}/content -> the bytes
    DELETE /v1/files/{id}           -> {"id", "object": "file", "deleted": true}
    POST   /v1/batches              {input_file_id, endpoint, completion_window, metadata, output_expires_after}
    GET    /v1/batches/{id}         GET /v1/batches?after=&limit=        POST /v1/batches/{id}/cancel

Files expire (OpenAI's default for batch files: 30 days; `expires_after` between an hour and 30 days); an
expired file is gone from every route at once and its bytes are deleted by the runner's sweeper. A tenant keeps
at most `max_files_per_tenant` files and `max_bytes_per_tenant` bytes, and no upload may leave the data disk
(where the ledger lives) with less than `min_free_disk_bytes` free. A filename longer than the column (512
characters) and `metadata` beyond OpenAI's 16 pairs of 64-character keys and 512-character values are 400s
naming the parameter, refused before anything is written. A tenant has at most `max_active_jobs_per_tenant`
jobs running (429 `too_many_active_batches`).

`install_batch_routes(app, service)` adds the routes and the `BatchRunner` to the app's services, which the
app starts (resuming unfinished jobs) and stops with it. Without a ledger there is nowhere durable to keep jobs,
so every route answers 404, as /v1/usage does. With auth, a tenant sees its own files and jobs; an admin
key sees all.

Beyond OpenAI's fields, a Batch carries `tokenfactory`: the job's energy (with its sources; null when
unmeasured, never 0), its cost at the interactive price and at the batch price (the prices file's
[batch] table), and the device time its lines used, which is capacity the server would otherwise
have left idle, since batch lines only take seats other traffic does not want.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, field_validator
from sqlalchemy.exc import SQLAlchemyError

from tokenfactory.batch.runner import (
    ENDPOINT_TO_KIND,
    WINDOW_TO_SECONDS,
    BatchRunner,
    BatchSettings,
    batch_price_multiplier,
)
from tokenfactory.batch.store import MAX_FILENAME_CHARS, BatchStore, JobTotals, new_id
from tokenfactory.gateway.auth import principal_of
from tokenfactory.meter.paths import resolve_data_dir
from tokenfactory.service.call import ADMIN, ANONYMOUS_PRINCIPAL, Principal
from tokenfactory.service.errors import APIError
from tokenfactory.service.service import RequestService
from tokenfactory.service.tenancy import Tenancy
from tokenfactory.types import ParameterError

logger = logging.getLogger(__name__)


TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")
MIN_EXPIRES_S, MAX_EXPIRES_S = 3600, 30 * 86_400  # OpenAI's bounds for expires_after.seconds
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int

    @field_validator("seconds")
    @classmethod
    def in_range(cls, seconds: int) -> int:
        if not MIN_EXPIRES_S <= seconds <= MAX_EXPIRES_S:
            raise ValueError(f"must be between {MIN_EXPIRES_S} (an hour) and {MAX_EXPIRES_S} (30 days), got {seconds}")
        return seconds


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def bounded(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE} (key {key[:40]!r}...: {len(key)} and {len(value)})")
        return metadata


def file_object(row: dict) -> dict:
    return {"id": row["file_id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": row.get("expires_at")}


def batch_object(job: dict, totals: JobTotals, model: str, prices_path: str | None = None) -> dict:
    multiplier, source = batch_price_multiplier(prices_path)
    errors = json.loads(job["errors_json"]) if job["errors_json"] else None
    return {
        "id": job["batch_id"], "object": "batch", "endpoint": job["endpoint"], "model": model,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": job["input_file_id"], "completion_window": job["completion_window"],
        "status": job["status"], "output_file_id": job["output_file_id"], "error_file_id": job["error_file_id"],
        "created_at": job["created_at"], "expires_at": job["expires_at"], **{k: job[k] for k in TIMESTAMPS},
        "request_counts": {"total": totals.num_total, "completed": totals.num_done, "failed": totals.num_error},
        "metadata": json.loads(job["metadata_json"]) if job["metadata_json"] else None,
        "usage": {"input_tokens": totals.prompt_tokens, "output_tokens": totals.completion_tokens,
                  "total_tokens": totals.prompt_tokens + totals.completion_tokens,
                  "input_tokens_details": {"cached_tokens": totals.cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "tokenfactory": {
            "num_pending": totals.num_pending, "energy_joules": totals.energy_joules,
            "energy_sources": list(totals.energy_sources), "cost_usd": totals.cost_usd,
            "batch_cost_usd": totals.cost_usd * multiplier if totals.cost_usd is not None else None,
            "batch_price_multiplier": multiplier, "batch_price_source": source,
            "device_seconds": totals.device_seconds,
        },
    }


def data_dir_of(service: RequestService) -> Path | None:
    """The server's data directory: where its ledger journals (Ledger.open puts the journal there)."""
    if service.accounting is None:
        return None
    journal = service.accounting.ledger.journal_path
    return journal.parent if journal is not None else resolve_data_dir(None)


def principal_lookup(tenancy: Tenancy) -> Any:  # noqa: ANN401 - Callable[[str], Principal | None]
    """Whom a job's line runs as, read from the tenant store each time (blocking): the tenant's current limits
    and budget (its spent-so-far primed here, off the event loop), None once it is removed. A job made with an
    admin key of no tenant runs as that admin, as its interactive requests do."""
    def lookup(tenant: str) -> Principal | None:
        if tenancy.store is None:
            return ANONYMOUS_PRINCIPAL
        if tenant == ADMIN.name:
            return Principal(ADMIN, None, is_admin=True)
        found = tenancy.store.get_tenant(tenant)
        if found is None:
            return None
        tenancy.admission.prime(found)
        return Principal(found, None, is_admin=False)
    return lookup


def open_store(service: RequestService, directory: Path) -> BatchStore | None:
    """The jobs' store; a database that refuses its tables turns the Batch API off, never the server."""
    assert service.accounting is not None
    try:
        return BatchStore(service.accounting.ledger.engine, directory)
    except (SQLAlchemyError, OSError) as e:
        logger.warning("the Batch API is off: its tables cannot be made in the ledger's database (%s)",
                       type(e).__name__ + ": " + str(e).splitlines()[0])
        return None


def install_batch_routes(app: FastAPI, service: RequestService,
                         settings: BatchSettings | None = None) -> BatchRunner | None:
    """The routes; the runner to start and stop with the app (None without a ledger: routes answer 404)."""
    directory = data_dir_of(service)
    store = open_store(service, directory) if service.accounting and directory else None
    runner = (BatchRunner(service, store, settings or BatchSettings(), principal_lookup(service.tenancy))
              if store is not None else None)
    routes = _Routes(service, store, runner)
    app.state.batches = runner
    if runner is not None:
        app.state.services.append(runner)
    app.post("/v1/files")(routes.create_file)
    app.get("/v1/files")(routes.list_files)
    app.get("/v1/files/{file_id}")(routes.get_file)
    app.get("/v1/files/{file_id}/content")(routes.file_content)
    app.delete("/v1/files/{file_id}")(routes.delete_file)
    app.post("/v1/batches")(routes.create_batch)
    app.get("/v1/batches")(routes.list_batches)
    app.get("/v1/batches/{batch_id}")(routes.get_batch)
    app.post("/v1/batches/{batch_id}/cancel")(routes.cancel_batch)
    return runner


class _Routes:
    def __init__(self, service: RequestService, store: BatchStore | None, runner: BatchRunner | None) -> None:
        self.service, self._store, self.runner = service, store, runner
        self.settings = runner.settings if runner is not None else BatchSettings()

    @property
    def store(self) -> BatchStore:
        if self._store is None:
            raise APIError(404, "batches are not kept by this server (it runs without a ledger)", "not_found_error")
        return self._store

    def tenant_filter(self, request: Request) -> str | None:
        """The tenant whose files and jobs the caller may see (None: all of them)."""
        principal = principal_of(request)
        return None if principal.is_admin or not self.service.tenancy.auth_on else principal.tenant.name

    def check_owner(self, request: Request, row: dict | None, what: str, name: str) -> dict:
        tenant = self.tenant_filter(request)
        if row is None or (tenant is not None and row["tenant"] != tenant):
            raise APIError(404, f"no {what} with id {name!r}", "not_found_error", what.replace(" ", "_") + "_id")
        return row

    async def create_file(self, request: Request, file: UploadFile, purpose: str = Form(...),
                          expires_anchor: str | None = Form(None, alias="expires_after[anchor]"),
                          expires_seconds: int | None = Form(None, alias="expires_after[seconds]")) -> dict:
        store = self.store
        if purpose != "batch":
            raise ParameterError("purpose", f"this server takes files for purpose 'batch' only, got {purpose!r}")
        filename = file.filename or "upload.jsonl"
        if len(filename) > MAX_FILENAME_CHARS:
            raise ParameterError("file", f"the file's name has {len(filename)} characters; at most "
                                 f"{MAX_FILENAME_CHARS}")
        expires_s = self.settings.file_ttl_s
        if expires_anchor is not None or expires_seconds is not None:
            try:
                expires_s = ExpiresAfter(anchor=expires_anchor or "", seconds=expires_seconds or 0).seconds
            except ValueError as e:
                raise ParameterError("expires_after", f"expires_after needs anchor 'created_at' and seconds between "
                                     f"{MIN_EXPIRES_S} and {MAX_EXPIRES_S}") from e
        content = await file.read()
        if not content.strip():
            raise ParameterError("file", "the file is empty: upload JSONL, one request per line")
        tenant = principal_of(request).tenant.name
        await asyncio.to_thread(self.check_room, tenant, len(content))
        row = await asyncio.to_thread(store.add_file, content, filename, purpose, tenant, None,
                                      int(time.time()) + expires_s)
        return file_object(row)

    def check_room(self, tenant: str, num_bytes: int) -> None:
        """The tenant's quota and the disk's free space allow `num_bytes` more (a thread's work)."""
        settings = self.settings
        num_files, used = self.store.storage(tenant)
        if num_files >= settings.max_files_per_tenant or used + num_bytes > settings.max_bytes_per_tenant:
            raise APIError(400, f"tenant {tenant} keeps {num_files} files of {used} bytes; this upload of {num_bytes} "
                           f"bytes would pass its quota of {settings.max_files_per_tenant} files and "
                           f"{settings.max_bytes_per_tenant} bytes: delete files it no longer needs "
                           "(DELETE /v1/files/{id})", param="file", code="storage_quota_exceeded")
        free = shutil.disk_usage(self.store.directory).free
        if free - num_bytes < settings.min_free_disk_bytes:
            raise APIError(507, "the server's data disk is nearly full (it holds the ledger): this upload is "
                           "refused; retry later", "server_error", code="insufficient_storage")

    async def list_files(self, request: Request, purpose: str | None = None) -> dict:
        rows = await asyncio.to_thread(self.store.list_files, self.tenant_filter(request), purpose, int(time.time()))
        return {"object": "list", "data": [file_object(r) for r in rows], "has_more": False}

    async def live_file(self, request: Request, file_id: str, what: str = "file") -> dict:
        row = await asyncio.to_thread(self.store.get_file, file_id, int(time.time()))
        return self.check_owner(request, row, what, file_id)

    async def get_file(self, request: Request, file_id: str) -> dict:
        return file_object(await self.live_file(request, file_id))

    async def file_content(self, request: Request, file_id: str) -> Response:
        row = await self.live_file(request, file_id)
        try:
            content = await asyncio.to_thread(self.store.read_file, row["file_id"])
        except FileNotFoundError:
            raise APIError(404, f"no file with id {file_id!r}", "not_found_error", "file_id") from None
        return Response(content, media_type="application/octet-stream")

    async def delete_file(self, request: Request, file_id: str) -> dict:
        row = await self.live_file(request, file_id)
        await asyncio.to_thread(self.store.delete_file, row["file_id"])
        return {"id": file_id, "object": "file", "deleted": True}

    async def create_batch(self, request: Request, body: CreateBatch) -> dict:
        store = self.store
        if body.endpoint not in ENDPOINT_TO_KIND:
            raise ParameterError("endpoint", f"endpoint must be one of {', '.join(ENDPOINT_TO_KIND)}, "
                                 f"got {body.endpoint!r}")
        if body.completion_window not in WINDOW_TO_SECONDS:
            raise ParameterError("completion_window", f"completion_window must be one of "
                                 f"{', '.join(WINDOW_TO_SECONDS)}, got {body.completion_window!r}")
        source = await self.live_file(request, body.input_file_id, "input file")
        if source["purpose"] != "batch":
            raise ParameterError("input_file_id", f"file {body.input_file_id} has purpose {source['purpose']!r}, "
                                 "not 'batch'")
        self.service.check_alive(self.service.model(None))
        tenant = principal_of(request).tenant.name
        active = await asyncio.to_thread(store.num_active_jobs, tenant)
        if active >= self.settings.max_active_jobs_per_tenant:
            raise APIError(429, f"tenant {tenant} already has {active} batches running (at most "
                           f"{self.settings.max_active_jobs_per_tenant}): wait for one to end, or cancel one",
                           "rate_limit_error", code="too_many_active_batches")
        now = int(time.time())
        job = {"batch_id": new_id("batch_"), "tenant": tenant,
               "endpoint": body.endpoint, "input_file_id": body.input_file_id,
               "completion_window": body.completion_window, "status": "validating", "created_at": now,
               "expires_at": now + WINDOW_TO_SECONDS[body.completion_window],
               "metadata_json": json.dumps(body.metadata) if body.metadata else None,
               "output_expires_after": body.output_expires_after.seconds if body.output_expires_after else None}
        await asyncio.to_thread(store.add_job, job)
        assert self.runner is not None
        self.runner.submit(job["batch_id"])
        return await self.render(job["batch_id"])

    async def get_batch(self, request: Request, batch_id: str) -> dict:
        self.check_owner(request, await asyncio.to_thread(self.store.get_job, batch_id), "batch", batch_id)
        return await self.render(batch_id)

    async def list_batches(self, request: Request, after: str | None = None, limit: int = 20) -> dict:
        if not 1 <= limit <= 100:
            raise ParameterError("limit", f"limit must be in [1, 100], got {limit}")
        jobs = await asyncio.to_thread(self.store.list_jobs, self.tenant_filter(request), after, limit + 1)
        data = [await self.render(j["batch_id"]) for j in jobs[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}

    async def cancel_batch(self, request: Request, batch_id: str) -> dict:
        store = self.store
        self.check_owner(request, await asyncio.to_thread(store.get_job, batch_id), "batch", batch_id)
        if await asyncio.to_thread(store.set_status, batch_id, "cancelling", only_from=("validating", "in_progress")):
            assert self.runner is not None
            self.runner.cancel(batch_id)
        return await self.render(batch_id)

    async def render(self, batch_id: str) -> dict:
        job = await asyncio.to_thread(self.store.get_job, batch_id)
        assert job is not None
        totals = await asyncio.to_thread(self.store.totals, batch_id)
        prices = self.settings.prices_path
        return batch_object(job, totals, self.service.default_model, prices)
