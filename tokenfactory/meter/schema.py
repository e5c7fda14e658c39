"""The ledger's tables, on one MetaData that later tables (tenants, API keys) extend.

    requests        one row per finished, aborted or failed request (the ledger itself); request_id
                    is unique
    requests_superseded
                    aborted rows a later attempt at the same request id replaced (ledger.py: "One row per
                    request id"), kept for audit with the time they were replaced; never summed
    usage_daily     running sums per (UTC day, tenant, model, energy source), written in the same
                    transaction as each request row, so usage queries read hundreds of rows instead
                    of millions; rollup.py owns it
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()


def request_columns() -> list[sa.Column]:
    """A request row's columns (fresh objects: each table needs its own)."""
    return [
        sa.Column("request_id", sa.String(128), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("cached_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("energy_joules", sa.Double, nullable=True),  # NULL: not measured (never 0 for missing)
        sa.Column("energy_source", sa.String(64), nullable=True),
        sa.Column("energy_scope", sa.String(64), nullable=True),
        sa.Column("energy_overhead_factor", sa.Double, nullable=False),  # psu · pue, inside cost_energy_usd
        sa.Column("device_seconds", sa.Double, nullable=False),
        sa.Column("cost_device_usd", sa.Double, nullable=False),
        sa.Column("cost_energy_usd", sa.Double, nullable=True),
        sa.Column("cost_usd", sa.Double, nullable=True),
        sa.Column("ttft_s", sa.Double, nullable=True),
        sa.Column("latency_s", sa.Double, nullable=True),
        sa.Column("created_at", sa.DateTime, nullable=False),  # naive UTC
        sa.Column("replica", sa.String(64), nullable=True),  # the fleet's replica that served it (NULL: one engine)
    ]


requests_table = sa.Table(
    "requests", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    *request_columns(),
    sa.Index("ix_requests_created_at", "created_at"),
    sa.Index("ix_requests_tenant_created_at", "tenant", "created_at"),
    sa.Index("ix_requests_model_created_at", "model", "created_at"),
    # Unique: a replayed or raced row is skipped, never counted twice. Ledgers made before this carry a
    # plain ix_requests_request_id instead; Ledger adds this one when it opens them.
    sa.Index("ux_requests_request_id", "request_id", unique=True),
)
superseded_table = sa.Table(
    "requests_superseded", metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    *request_columns(),
    sa.Column("superseded_at", sa.DateTime, nullable=False),  # naive UTC: when the later attempt replaced it
    sa.Index("ix_requests_superseded_request_id", "request_id"),
)
REQUEST_ID_INDEX = next(i for i in requests_table.indexes if i.name == "ux_requests_request_id")

usage_daily_table = sa.Table(
    "usage_daily", metadata,
    sa.Column("day", sa.String(10), primary_key=True),  # YYYY-MM-DD, UTC
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("model", sa.String(256), primary_key=True),
    # "" for rows without energy: a key column cannot be NULL and still collide in an upsert.
    sa.Column("energy_source", sa.String(64), primary_key=True),
    sa.Column("num_requests", sa.Integer, nullable=False),
    sa.Column("prompt_tokens", sa.BigInteger, nullable=False),
    sa.Column("cached_tokens", sa.BigInteger, nullable=False),
    sa.Column("completion_tokens", sa.BigInteger, nullable=False),
    sa.Column("energy_joules", sa.Double, nullable=False),  # over num_with_energy rows
    sa.Column("num_with_energy", sa.Integer, nullable=False),
    sa.Column("cost_device_usd", sa.Double, nullable=False),
    sa.Column("cost_energy_usd", sa.Double, nullable=False),  # over num_with_cost_energy rows
    sa.Column("num_with_cost_energy", sa.Integer, nullable=False),
    sa.Column("cost_usd", sa.Double, nullable=False),  # over num_with_cost rows
    sa.Column("num_with_cost", sa.Integer, nullable=False),
)
