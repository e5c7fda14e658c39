"""Stored responses (`store: true`) in the ledger's database, one row each, per tenant, kept `retention_s`.

    responses   response_id, tenant, created_at, expires_at, status, previous_response_id, and three JSON texts:
                the Response object as the API returns it, this response's input items (input_items.list), and
                the conversation through its output as chat messages (what previous_response_id continues)

Every read names the tenant (None: an admin's, any tenant), so one tenant never sees, continues or deletes
another's; a background response keeps its request body while it runs, so a server stopped under it runs it
again at its next start; an expired row reads as absent at once and is deleted by `sweep` (the API's service runs it at
start-up and then hourly). Blocking: callers run it in a worker thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from tokenfactory.meter.schema import metadata

RUNNING_STATUSES = ("queued", "in_progress")

responses_table = sa.Table(
    "responses", metadata,
    sa.Column("response_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("created_at", sa.Integer, nullable=False),  # unix seconds
    sa.Column("expires_at", sa.Integer, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("previous_response_id", sa.String(64), nullable=True),
    sa.Column("response_json", sa.Text, nullable=False),
    sa.Column("input_json", sa.Text, nullable=False),
    sa.Column("messages_json", sa.Text, nullable=False),
    sa.Column("request_json", sa.Text, nullable=True),  # a background one's body, to run it again after a restart
    sa.Index("ix_responses_tenant", "tenant"),
    sa.Index("ix_responses_expires_at", "expires_at"),
)


@dataclass(frozen=True)
class StoredResponse:
    response_id: str
    tenant: str
    status: str
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    messages: list[dict[str, Any]]
    request_json: str | None = None


class ResponseStore:
    def __init__(self, engine: sa.Engine, retention_s: int, clock: Callable[[], float] = time.time) -> None:
        self.engine, self.retention_s, self.clock = engine, retention_s, clock
        metadata.create_all(engine, tables=[responses_table])

    def put(self, tenant: str, response: dict[str, Any], input_items: list[dict[str, Any]],
            messages: list[dict[str, Any]], request_json: str | None = None) -> None:
        """Insert or replace the response (a background one is written when queued, then when it ends)."""
        row = {"tenant": tenant, "created_at": int(response["created_at"]), "status": response["status"],
               "expires_at": int(response["created_at"]) + self.retention_s,
               "previous_response_id": response.get("previous_response_id"),
               "response_json": json.dumps(response), "input_json": json.dumps(input_items),
               "messages_json": json.dumps(messages), "request_json": request_json}
        t = responses_table
        with self.engine.begin() as conn:
            updated = conn.execute(t.update().where(t.c.response_id == response["id"]).values(**row)).rowcount
            if not updated:
                conn.execute(t.insert().values(response_id=response["id"], **row))

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        t = responses_table
        query = sa.select(t).where(t.c.response_id == response_id, t.c.expires_at > int(self.clock()))
        if tenant is not None:
            query = query.where(t.c.tenant == tenant)
        with self.engine.connect() as conn:
            row = conn.execute(query).mappings().first()
        return None if row is None else stored(row)

    def delete(self, response_id: str, tenant: str | None) -> bool:
        t = responses_table
        query = t.delete().where(t.c.response_id == response_id)
        if tenant is not None:
            query = query.where(t.c.tenant == tenant)
        with self.engine.begin() as conn:
            return conn.execute(query).rowcount > 0

    def running(self) -> list[StoredResponse]:
        """At start-up: the background responses a stopped server left queued or running (to run again)."""
        t = responses_table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t).where(t.c.status.in_(RUNNING_STATUSES))).mappings().all()
        return [stored(row) for row in rows]

    def sweep(self) -> int:
        """Delete the expired rows; returns how many."""
        t = responses_table
        with self.engine.begin() as conn:
            return conn.execute(t.delete().where(t.c.expires_at <= int(self.clock()))).rowcount


def stored(row: Any) -> StoredResponse:  # noqa: ANN401 - a row mapping
    return StoredResponse(row["response_id"], row["tenant"], row["status"], json.loads(row["response_json"]),
                          json.loads(row["input_json"]), json.loads(row["messages_json"]), row["request_json"])
