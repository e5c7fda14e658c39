"""`tokenfactory tenants add|list|update|remove` and `tokenfactory keys create|list|revoke`.

Both read and write the tables beside the ledger in --data-dir (or --database-url), like `serve`.
Registration is light; SQLAlchemy is imported when a command runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from typing import Any

from tokenfactory.types import ParameterError

PRIORITIES = ("interactive", "standard", "batch")
_SPAN = re.compile(r"^(\d+(?:\.\d+)?)\s*([mhdw])$")
_UNIT_TO_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def add_store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="directory holding ledger.db, as for `serve`")
    p.add_argument("--database-url", default=None, help="a SQLAlchemy URL instead of SQLite in --data-dir")
    p.add_argument("--format", choices=("table", "json"), default="table")


def add_limit_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    p.add_argument("--priority", choices=PRIORITIES, default="standard" if defaults else None)
    p.add_argument("--weight", type=float, default=1.0 if defaults else None, help="fair-share weight (> 0)")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=int, default=None, help="model tokens per minute (prompt + max_tokens, settled)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once")
    p.add_argument("--budget", default=None, help="e.g. 50USD/month, 2MJ/month, 10Mtok/day ('none' to remove)")
    p.add_argument("--context-compression", default=None,
                   help="the default for chat requests that do not say: summarize, off, a JSON object as the "
                        "request's context_compression field ('{\"summary_tokens\": 128}'), or none to remove")


def register(subparsers: argparse._SubParsersAction) -> None:
    tenants = subparsers.add_parser("tenants", help="tenants: priority, weight, limits, budget")
    sub = tenants.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)
    p = sub.add_parser("add", help="add a tenant")
    p.add_argument("name")
    add_limit_args(p, defaults=True)
    add_store_args(p)
    p.set_defaults(func=tenants_add)
    p = sub.add_parser("update", help="change a tenant's priority, weight, limits, budget or compression default")
    p.add_argument("name")
    add_limit_args(p, defaults=False)
    for name in ("rpm", "tpm", "max-concurrency"):
        p.add_argument(f"--no-{name}", action="store_true", help=f"remove the {name} limit")
    add_store_args(p)
    p.set_defaults(func=tenants_update)
    p = sub.add_parser("list", help="list tenants")
    add_store_args(p)
    p.set_defaults(func=tenants_list)
    p = sub.add_parser("remove", help="remove a tenant and its keys (its ledger rows stay)")
    p.add_argument("name")
    add_store_args(p)
    p.set_defaults(func=tenants_remove)

    keys = subparsers.add_parser("keys", help="API keys: create (printed once), list, revoke")
    sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    p = sub.add_parser("create", help="create an API key and print it once")
    p.add_argument("--tenant", default=None, help="the tenant the key acts for")
    p.add_argument("--admin", action="store_true", help="an admin key: may use /admin routes and see all usage")
    p.add_argument("--expires", default=None, help="a span from now (30d, 12h, 2w) or an ISO date/time (UTC)")
    add_store_args(p)
    p.set_defaults(func=keys_create)
    p = sub.add_parser("list", help="list keys (ids and states, never secrets)")
    p.add_argument("--tenant", default=None)
    add_store_args(p)
    p.set_defaults(func=keys_list)
    p = sub.add_parser("revoke", help="revoke a key by its id")
    p.add_argument("key_id")
    add_store_args(p)
    p.set_defaults(func=keys_revoke)


def parse_expires(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """Naive UTC time from a span ahead ('30d') or an ISO date/time (UTC unless it has an offset)."""
    now = now if now is not None else dt.datetime.now(dt.UTC).replace(tzinfo=None)
    m = _SPAN.match(text.strip())
    if m:
        return now + dt.timedelta(seconds=float(m.group(1)) * _UNIT_TO_SECONDS[m.group(2)])
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ParameterError("expires", f"--expires must be a span such as 30d, 12h, 2w or an ISO date/time, "
                                        f"got {text!r}") from None
    return when.astimezone(dt.UTC).replace(tzinfo=None) if when.tzinfo is not None else when


def _open(args: argparse.Namespace):  # noqa: ANN202 - (TenantStore, Ledger)
    from tokenfactory.tenants.store import TenantStore

    return TenantStore.open(args.data_dir, args.database_url)


def tenant_dict(t: Any) -> dict[str, Any]:
    return {"name": t.name, "priority": t.priority, "weight": t.weight, "rpm": t.rpm, "tpm": t.tpm,
            "max_concurrency": t.max_concurrency, "budget": t.budget.describe() if t.budget else None,
            "context_compression": t.context_compression,
            "created_at": t.created_at.isoformat() if t.created_at else None}


def key_dict(k: Any, now: dt.datetime) -> dict[str, Any]:
    def iso(d: dt.datetime | None) -> str | None:
        return d.isoformat() if d else None
    return {"key_id": k.key_id, "tenant": k.tenant, "admin": k.is_admin, "state": k.state(now),
            "created_at": iso(k.created_at), "expires_at": iso(k.expires_at), "revoked_at": iso(k.revoked_at)}


def emit(rows: list[dict[str, Any]], fmt: str) -> None:
    if fmt == "json":
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    if not rows:
        print("(none)")
        return
    columns = list(rows[0])
    widths = {c: max(len(c), *(len("-" if r[c] is None else str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(("-" if r[c] is None else str(r[c])).ljust(widths[c]) for c in columns))


def tenants_add(args: argparse.Namespace) -> int:
    from tokenfactory.tenants.store import TENANT_SETTINGS, Tenant, tenant_settings

    given = {k: getattr(args, k) for k in TENANT_SETTINGS if getattr(args, k) is not None}
    tenant = Tenant(args.name, **tenant_settings(given))  # checked before the store opens
    store, ledger = _open(args)
    try:
        tenant = store.add_tenant(tenant)
    finally:
        ledger.close()
    emit([tenant_dict(tenant)], args.format)
    return 0


def tenants_update(args: argparse.Namespace) -> int:
    from tokenfactory.tenants.store import LIMITS, TENANT_SETTINGS, tenant_settings

    given: dict[str, Any] = {k: getattr(args, k) for k in TENANT_SETTINGS if getattr(args, k) is not None}
    given.update({name: None for name in LIMITS if getattr(args, f"no_{name}")})
    changes = tenant_settings(given)
    if not changes:
        raise ParameterError("tenants update", "nothing to change: give --priority, --weight, --rpm, --tpm, "
                             "--max-concurrency, --budget, --context-compression or a --no-... flag")
    store, ledger = _open(args)
    try:
        tenant = store.update_tenant(args.name, **changes)
    finally:
        ledger.close()
    emit([tenant_dict(tenant)], args.format)
    return 0


def tenants_list(args: argparse.Namespace) -> int:
    store, ledger = _open(args)
    try:
        emit([tenant_dict(t) for t in store.list_tenants()], args.format)
    finally:
        ledger.close()
    return 0


def tenants_remove(args: argparse.Namespace) -> int:
    store, ledger = _open(args)
    try:
        num_keys = store.remove_tenant(args.name)
    finally:
        ledger.close()
    print(f"removed tenant {args.name} and {num_keys} API key(s); its ledger rows stay")
    return 0


def keys_create(args: argparse.Namespace) -> int:
    expires = parse_expires(args.expires) if args.expires else None
    store, ledger = _open(args)
    try:
        secret, info = store.create_key(args.tenant, is_admin=args.admin, expires_at=expires)
    finally:
        ledger.close()
    if args.format == "json":
        emit([{"key": secret, **key_dict(info, info.created_at)}], "json")
    else:
        who = f"tenant {info.tenant}" if info.tenant else "no tenant"
        print(f"{secret}\n\nAPI key {info.key_id} for {who}{' (admin)' if info.is_admin else ''}"
              f"{', expires ' + info.expires_at.isoformat() + ' UTC' if info.expires_at else ''}.\n"
              "This is the only time the key is shown: it is stored hashed. "
              "Send it as 'Authorization: Bearer <key>'.", file=sys.stdout)
    return 0


def keys_list(args: argparse.Namespace) -> int:
    store, ledger = _open(args)
    try:
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        emit([key_dict(k, now) for k in store.list_keys(args.tenant)], args.format)
    finally:
        ledger.close()
    return 0


def keys_revoke(args: argparse.Namespace) -> int:
    store, ledger = _open(args)
    try:
        info = store.revoke_key(args.key_id)
    finally:
        ledger.close()
    print(f"revoked API key {info.key_id} (tenant {info.tenant or '-'}) at {info.revoked_at.isoformat()} UTC")
    return 0
