"""The Batch API's routes and object shapes (OpenAI's `FileObject`, `Batch`); the runner is batch.py.

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
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Form, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import SQLAlchemyError

from tokenfactory.batch.runner import (
    ENDPOINT_TO_KIND,
    WINDOW_TO_SECONDS,
    BatchRunner,
    BatchSettings,
    batch_price_multiplier,
)
from tokenfactory.batch.store import BatchStore, JobTotals, new_id
from tokenfactory.gateway.auth import principal_of
from tokenfactory.meter.paths import resolve_data_dir
from tokenfactory.service.call import ANONYMOUS_PRINCIPAL, Principal
from tokenfactory.service.errors import APIError
from tokenfactory.service.service import RequestService
from tokenfactory.service.tenancy import Tenancy
from tokenfactory.types import ParameterError

logger = logging.getLogger(__name__)

TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def file_object(row: dict) -> dict:
    return {"id": row["file_id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


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
    def principal_of(tenant: str) -> Principal | None:
        if tenancy.store is None:
            return ANONYMOUS_PRINCIPAL
        found = tenancy.store.get_tenant(tenant)
        return Principal(found, None, is_admin=False) if found is not None else None
    return principal_of


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
    app.post("/v1/batches")(routes.create_batch)
    app.get("/v1/batches")(routes.list_batches)
    app.get("/v1/batches/{batch_id}")(routes.get_batch)
    app.post("/v1/batches/{batch_id}/cancel")(routes.cancel_batch)
    return runner


class _Routes:
    def __init__(self, service: RequestService, store: BatchStore | None, runner: BatchRunner | None) -> None:
        self.service, self._store, self.runner = service, store, runner

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

    async def create_file(self, request: Request, file: UploadFile, purpose: str = Form(...)) -> dict:
        store = self.store
        if purpose != "batch":
            raise ParameterError("purpose", f"this server takes files for purpose 'batch' only, got {purpose!r}")
        content = await file.read()
        if not content.strip():
            raise ParameterError("file", "the file is empty: upload JSONL, one request per line")
        tenant = principal_of(request).tenant.name
        row = await asyncio.to_thread(store.add_file, content, file.filename or "upload.jsonl", purpose, tenant)
        return file_object(row)

    async def list_files(self, request: Request, purpose: str | None = None) -> dict:
        rows = await asyncio.to_thread(self.store.list_files, self.tenant_filter(request), purpose)
        return {"object": "list", "data": [file_object(r) for r in rows], "has_more": False}

    async def get_file(self, request: Request, file_id: str) -> dict:
        row = await asyncio.to_thread(self.store.get_file, file_id)
        return file_object(self.check_owner(request, row, "file", file_id))

    async def file_content(self, request: Request, file_id: str) -> Response:
        row = self.check_owner(request, await asyncio.to_thread(self.store.get_file, file_id), "file", file_id)
        content = await asyncio.to_thread(self.store.read_file, row["file_id"])
        return Response(content, media_type="application/octet-stream")

    async def create_batch(self, request: Request, body: CreateBatch) -> dict:
        store = self.store
        if body.endpoint not in ENDPOINT_TO_KIND:
            raise ParameterError("endpoint", f"endpoint must be one of {', '.join(ENDPOINT_TO_KIND)}, "
                                 f"got {body.endpoint!r}")
        if body.completion_window not in WINDOW_TO_SECONDS:
            raise ParameterError("completion_window", f"completion_window must be one of "
                                 f"{', '.join(WINDOW_TO_SECONDS)}, got {body.completion_window!r}")
        source = self.check_owner(request, await asyncio.to_thread(store.get_file, body.input_file_id),
                                  "input file", body.input_file_id)
        if source["purpose"] != "batch":
            raise ParameterError("input_file_id", f"file {body.input_file_id} has purpose {source['purpose']!r}, "
                                 "not 'batch'")
        self.service.check_alive(self.service.model(None))
        now = int(time.time())
        job = {"batch_id": new_id("batch_"), "tenant": principal_of(request).tenant.name,
               "endpoint": body.endpoint, "input_file_id": body.input_file_id,
               "completion_window": body.completion_window, "status": "validating", "created_at": now,
               "expires_at": now + WINDOW_TO_SECONDS[body.completion_window],
               "metadata_json": json.dumps(body.metadata) if body.metadata else None}
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
        prices = self.runner.settings.prices_path if self.runner is not None else None
        return batch_object(job, totals, self.service.default_model, prices)
