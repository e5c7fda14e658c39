"""Tenants and API keys, in two tables beside the ledger (same MetaData, same database).

    tenants     name, priority band, weight, limits (requests/min, tokens/min, concurrency), budget
    api_keys    key_id (public), tenant, admin flag, salt, HMAC digest, created/expires/revoked times

A key reads `tf_<key_id>_<secret>`. Only the key_id and HMAC-SHA256(salt, secret) with a random
per-key salt are stored; the secret is shown once by `keys create` and never stored or logged.
A presented key is found by its key_id and checked with hmac.compare_digest (constant time). Timing
does not say whether a key_id exists: every presented key, well-formed or not, known or not, costs
exactly one indexed query (the key joined to its tenant; a malformed key looks up the id "", which no
key has), one HMAC and one compare_digest (tests/tenants/test_tenants.py counts them).
Times are naive UTC, as in the ledger.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass, fields, replace
from types import UnionType
from typing import Any

import sqlalchemy as sa

from tokenfactory.meter.ledger import Ledger, to_utc_naive, utc_now
from tokenfactory.meter.schema import metadata
from tokenfactory.types import BANDS, ParameterError

RESERVED_TENANTS = ("anonymous", "admin")  # auth off; an admin key without a tenant
ADMIN_TENANT = "admin"
KEY_PREFIX = "tf_"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEY = re.compile(r"tf_([0-9a-f]{12})_([A-Za-z0-9_-]{20,})")

tenants_table = sa.Table(
    "tenants", metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("priority", sa.String(16), nullable=False),  # interactive | standard | batch
    sa.Column("weight", sa.Double, nullable=False),
    sa.Column("rpm", sa.Integer, nullable=True),  # NULL: unlimited
    sa.Column("tpm", sa.Integer, nullable=True),
    sa.Column("max_concurrency", sa.Integer, nullable=True),
    sa.Column("budget_amount", sa.Double, nullable=True),  # in budget_unit per budget_period
    sa.Column("budget_unit", sa.String(8), nullable=True),  # usd | joules | tokens
    sa.Column("budget_period", sa.String(8), nullable=True),  # day | month (UTC)
    sa.Column("created_at", sa.DateTime, nullable=False),
    # The default `context_compression` of the tenant's chat requests (JSON, the request field's shape); NULL:
    # none. Added after the table first shipped: TenantStore adds the column to an older database.
    sa.Column("context_compression", sa.String(512), nullable=True),
)

api_keys_table = sa.Table(
    "api_keys", metadata,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=True),  # NULL: an admin key of no tenant
    sa.Column("is_admin", sa.Boolean, nullable=False),
    sa.Column("salt", sa.String(64), nullable=False),
    sa.Column("digest", sa.String(64), nullable=False),  # hex HMAC-SHA256(salt, secret)
    sa.Column("created_at", sa.DateTime, nullable=False),
    sa.Column("expires_at", sa.DateTime, nullable=True),
    sa.Column("revoked_at", sa.DateTime, nullable=True),
    sa.Index("ix_api_keys_tenant", "tenant"),
)

BUDGET_UNITS = {"usd": "USD", "joules": "J", "tokens": "tok"}
_BUDGET = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kMG]?)\s*(USD|\$|J|tok|tokens)\s*/\s*(day|month)\s*", re.IGNORECASE)
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


@dataclass(frozen=True)
class Budget:
    amount: float
    unit: str  # usd | joules | tokens
    period: str  # day | month (UTC calendar)

    def __post_init__(self) -> None:
        if self.unit not in BUDGET_UNITS:
            raise ParameterError("budget", f"budget unit must be one of {', '.join(BUDGET_UNITS)}, got {self.unit!r}")
        if self.period not in ("day", "month"):
            raise ParameterError("budget", f"budget period must be day or month, got {self.period!r}")
        if not self.amount > 0:
            raise ParameterError("budget", f"budget amount must be > 0, got {self.amount}")

    @classmethod
    def parse(cls, text: str) -> Budget:
        """'50USD/month', '2MJ/month', '10Mtok/day', '500kJ/day'."""
        m = _BUDGET.fullmatch(text)
        if not m:
            raise ParameterError("budget", f"budget must look like 50USD/month, 2MJ/month or 10Mtok/day, got {text!r}")
        value, si, unit, period = m.groups()
        if si.lower() not in _SI or (si == "M" and unit.lower() in ("usd", "$")) or (si == "m" and unit == "J"):
            raise ParameterError("budget", f"unknown multiplier {si!r} in budget {text!r} (use k, M or G)")
        unit_key = {"usd": "usd", "$": "usd", "j": "joules", "tok": "tokens", "tokens": "tokens"}[unit.lower()]
        return cls(float(value) * _SI[si.lower()], unit_key, period.lower())

    def describe(self) -> str:
        if self.unit == "usd":
            return f"{self.amount:.2f} USD/{self.period}"
        scale, prefix = next(((s, p) for s, p in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if self.amount >= s), (1.0, ""))
        return f"{self.amount / scale:g} {prefix}{BUDGET_UNITS[self.unit]}/{self.period}"

    def period_bounds(self, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
        """[start, end) of the UTC day or month holding `now` (naive UTC)."""
        day = dt.datetime(now.year, now.month, now.day)
        if self.period == "day":
            return day, day + dt.timedelta(days=1)
        start = day.replace(day=1)
        end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
        return start, end


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: str = "standard"
    weight: float = 1.0
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    budget: Budget | None = None
    created_at: dt.datetime | None = None
    # JSON object in the request's `context_compression` shape, used when a chat request does not say (e.g.
    # '{"mode": "summarize", "summary_tokens": 256}'); the gateway validates the whole (service/compression.py).
    context_compression: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ParameterError("name", f"tenant name must be 1-64 letters, digits, '_', '.' or '-' (starting "
                                 f"with a letter or digit), got {self.name!r}")
        if self.priority not in BANDS:
            raise ParameterError("priority", f"priority must be one of {', '.join(BANDS)}, got {self.priority!r}")
        if not self.weight > 0:
            raise ParameterError("weight", f"weight must be > 0, got {self.weight}")
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ParameterError(name, f"{name} must be >= 1 (or unset for no limit), got {value}")
        if self.context_compression is not None:
            check_compression_default(self.context_compression)

    @property
    def band(self) -> int:
        return BANDS[self.priority]


COMPRESSION_KEYS = {"mode": str, "model": str, "summary_tokens": int}


def check_compression_default(text: str) -> None:
    """A tenant's context-compression default: a JSON object of the request field's keys, or ParameterError."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict) or len(text) > 512 or any(
            k not in COMPRESSION_KEYS or not isinstance(v, COMPRESSION_KEYS[k] | None) for k, v in value.items()):
        raise ParameterError("context_compression", "context_compression must be a JSON object of mode "
                             f"(off | summarize), model and summary_tokens, got {text!r}")
    if value.get("mode", "summarize") not in ("off", "summarize"):
        raise ParameterError("context_compression", f"context_compression mode must be off or summarize, "
                             f"got {value['mode']!r}")


# A tenant's editable settings, one schema for `tokenfactory tenants add|update` and the admin API's
# POST/PATCH /admin/tenants: each name with the type a person gives it (a budget and a compression default as
# text; the admin API's JSON may give the compression default as an object).
TENANT_SETTINGS: dict[str, type | UnionType] = {
    "priority": str, "weight": float, "rpm": int, "tpm": int, "max_concurrency": int, "budget": str,
    "context_compression": str | dict}
LIMITS = ("rpm", "tpm", "max_concurrency")  # None removes the limit


def tenant_settings(given: dict[str, Any]) -> dict[str, Any]:
    """What a person gave for a tenant's settings, as `Tenant`'s field values: a budget's text
    ('50USD/month'; 'none' or None removes it) parsed, a compression default ('summarize', 'off', a JSON
    object or its text; 'none' or None removes it) kept as the JSON a tenant holds. Unknown names, and None
    for priority or weight, are a ParameterError naming them; the values themselves are checked by `Tenant`."""
    values: dict[str, Any] = {}
    for name, value in given.items():
        if name not in TENANT_SETTINGS:
            raise ParameterError(name, f"unknown tenant setting {name!r}: one of {', '.join(TENANT_SETTINGS)}")
        if name == "budget":
            value = None if value is None or str(value).lower() == "none" else Budget.parse(str(value))
        elif name == "context_compression":
            value = _compression_default(value)
        elif value is None and name not in LIMITS:
            raise ParameterError(name, f"{name} cannot be null")
        values[name] = value
    return values


def _compression_default(value: str | dict | None) -> str | None:
    if isinstance(value, dict):
        return json.dumps(value)
    if value is None or value.lower() == "none":
        return None
    if value.lower() in ("summarize", "off"):
        return json.dumps({"mode": value.lower()})
    return value


@dataclass(frozen=True)
class KeyInfo:
    """What is stored about a key (never its secret)."""

    key_id: str
    tenant: str | None
    is_admin: bool
    created_at: dt.datetime
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None

    def state(self, now: dt.datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


@dataclass(frozen=True)
class KeyCheck:
    """The result of checking a presented key: `info` is set when the key_id exists and the secret
    matches; `state` is active, expired or revoked then, else "invalid"."""

    state: str
    info: KeyInfo | None = None
    tenant: Tenant | None = None


def _digest(salt: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


_DUMMY_SALT = secrets.token_hex(16)
_DUMMY_DIGEST = "0" * 64

# One statement for every presented key: the key row and its tenant's, tenant columns as tenant_<name>.
_KEY_LOOKUP = (sa.select(*api_keys_table.c, *(c.label(f"tenant_{c.name}") for c in tenants_table.c))
               .select_from(api_keys_table.outerjoin(tenants_table, tenants_table.c.name == api_keys_table.c.tenant))
               .where(api_keys_table.c.key_id == sa.bindparam("key_id")))


def _tenant_from_row(row: Any, prefix: str = "") -> Tenant:
    def get(name: str) -> Any:  # noqa: ANN401 - a column's value
        return getattr(row, prefix + name)

    budget = Budget(get("budget_amount"), get("budget_unit"), get("budget_period")) \
        if get("budget_amount") is not None else None
    return Tenant(get("name"), get("priority"), get("weight"), get("rpm"), get("tpm"), get("max_concurrency"),
                  budget, get("created_at"), get("context_compression"))


def _tenant_values(t: Tenant) -> dict[str, Any]:
    b = t.budget
    return {"name": t.name, "priority": t.priority, "weight": t.weight, "rpm": t.rpm, "tpm": t.tpm,
            "max_concurrency": t.max_concurrency, "budget_amount": b.amount if b else None,
            "budget_unit": b.unit if b else None, "budget_period": b.period if b else None,
            "context_compression": t.context_compression}


def add_missing_columns(engine: sa.Engine, table: sa.Table) -> None:
    """Columns added to `table` since an existing database was made (nullable ones only): ALTER TABLE ADD."""
    have = {c["name"] for c in sa.inspect(engine).get_columns(table.name)}
    with engine.begin() as conn:
        for column in table.columns:
            if column.name not in have and column.nullable:
                kind = column.type.compile(dialect=engine.dialect)
                conn.execute(sa.text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))


class TenantStore:
    """Thread-safe over a SQLAlchemy engine (the ledger's): every call is its own transaction."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        metadata.create_all(engine, tables=[tenants_table, api_keys_table])
        add_missing_columns(engine, tenants_table)

    @classmethod
    def open(cls, data_dir: str | None = None, url: str | None = None) -> tuple[TenantStore, Ledger]:
        ledger = Ledger.open(data_dir, url)
        return cls(ledger.engine), ledger

    # -- tenants ----------------------------------------------------------------------------------------

    def add_tenant(self, tenant: Tenant) -> Tenant:
        if tenant.name in RESERVED_TENANTS:
            raise ParameterError("name", f"the tenant name {tenant.name!r} is reserved ({', '.join(RESERVED_TENANTS)})")
        tenant = replace(tenant, created_at=utc_now())
        with self.engine.begin() as conn:
            if conn.execute(sa.select(tenants_table.c.name).where(tenants_table.c.name == tenant.name)).first():
                raise ParameterError("name", f"a tenant named {tenant.name!r} already exists (use tenants update)")
            conn.execute(tenants_table.insert().values(**_tenant_values(tenant), created_at=tenant.created_at))
        return tenant

    def get_tenant(self, name: str) -> Tenant | None:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(tenants_table).where(tenants_table.c.name == name)).first()
        return _tenant_from_row(row) if row is not None else None

    def require_tenant(self, name: str) -> Tenant:
        tenant = self.get_tenant(name)
        if tenant is None:
            raise ParameterError("tenant", f"no tenant named {name!r} (see `tokenfactory tenants list`)")
        return tenant

    def list_tenants(self) -> list[Tenant]:
        with self.engine.connect() as conn:
            return [_tenant_from_row(r) for r in conn.execute(sa.select(tenants_table).order_by(tenants_table.c.name))]

    def update_tenant(self, name: str, **changes: Any) -> Tenant:
        """Change some fields (names as in Tenant; budget=None removes the budget)."""
        known = {f.name for f in fields(Tenant)} - {"name", "created_at"}
        unknown = set(changes) - known
        if unknown:
            raise ParameterError(sorted(unknown)[0], f"cannot update {', '.join(sorted(unknown))} of a tenant")
        updated = replace(self.require_tenant(name), **changes)
        with self.engine.begin() as conn:
            conn.execute(tenants_table.update().where(tenants_table.c.name == name).values(**_tenant_values(updated)))
        return updated

    def remove_tenant(self, name: str) -> int:
        """Delete the tenant and its keys (its ledger rows stay). Returns the number of keys deleted."""
        self.require_tenant(name)
        with self.engine.begin() as conn:
            keys = conn.execute(api_keys_table.delete().where(api_keys_table.c.tenant == name)).rowcount
            conn.execute(tenants_table.delete().where(tenants_table.c.name == name))
        return keys

    # -- keys ---------------------------------------------------------------------------------------------

    def create_key(self, tenant: str | None, is_admin: bool = False,
                   expires_at: dt.datetime | None = None) -> tuple[str, KeyInfo]:
        """A new key: (the secret key string, shown once; what is stored)."""
        if tenant is None and not is_admin:
            raise ParameterError("tenant", "a key needs a tenant (only an admin key may have none)")
        if tenant is not None:
            self.require_tenant(tenant)
        key_id, secret, salt = secrets.token_hex(6), secrets.token_urlsafe(32), secrets.token_hex(16)
        info = KeyInfo(key_id, tenant, is_admin, utc_now(), to_utc_naive(expires_at) if expires_at else None, None)
        with self.engine.begin() as conn:
            conn.execute(api_keys_table.insert().values(
                key_id=key_id, tenant=tenant, is_admin=is_admin, salt=salt, digest=_digest(salt, secret),
                created_at=info.created_at, expires_at=info.expires_at, revoked_at=None))
        return f"{KEY_PREFIX}{key_id}_{secret}", info

    def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        c = api_keys_table.c
        stmt = sa.select(c.key_id, c.tenant, c.is_admin, c.created_at, c.expires_at, c.revoked_at)
        if tenant is not None:
            stmt = stmt.where(c.tenant == tenant)
        with self.engine.connect() as conn:
            return [KeyInfo(*r) for r in conn.execute(stmt.order_by(c.created_at))]

    def revoke_key(self, key_id: str) -> KeyInfo:
        """Revoke a key by its id (or the whole key string); revoking twice keeps the first time."""
        key_id = key_id.removeprefix(KEY_PREFIX).split("_")[0]
        with self.engine.begin() as conn:
            c = api_keys_table.c
            conn.execute(api_keys_table.update().where((c.key_id == key_id) & c.revoked_at.is_(None))
                         .values(revoked_at=utc_now()))
        matches = [k for k in self.list_keys() if k.key_id == key_id]
        if not matches:
            raise ParameterError("key_id", f"no API key with id {key_id!r} (see `tokenfactory keys list`)")
        return matches[0]

    def check_key(self, presented: str, now: dt.datetime | None = None) -> KeyCheck:
        """Look a presented key up and compare its secret in constant time."""
        m = _KEY.fullmatch(presented.strip())
        key_id, secret = (m.group(1), m.group(2)) if m else ("", presented)  # "": no key has it
        with self.engine.connect() as conn:
            row = conn.execute(_KEY_LOOKUP, {"key_id": key_id}).first()
        salt, digest = (row.salt, row.digest) if row is not None else (_DUMMY_SALT, _DUMMY_DIGEST)
        if not hmac.compare_digest(_digest(salt, secret), digest) or row is None:  # the same work either way
            return KeyCheck("invalid")
        info = KeyInfo(row.key_id, row.tenant, row.is_admin, row.created_at, row.expires_at, row.revoked_at)
        tenant = _tenant_from_row(row, "tenant_") if row.tenant_name is not None else None
        if row.tenant is not None and tenant is None:
            return KeyCheck("invalid", info)  # its tenant was removed
        return KeyCheck(info.state(now or utc_now()), info, tenant)
