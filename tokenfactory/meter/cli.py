"""`tokenfactory usage`: totals from the ledger (requests, tokens, joules, cost), as a table, CSV or JSON.

Registration is light (argparse only); the ledger, SQLAlchemy and rich are imported when it runs.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import re
import sys
from typing import Any, TextIO

from tokenfactory.types import ParameterError

FORMATS = ("table", "csv", "json")
GROUP_BYS = ("day", "tenant", "model", "replica")
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)\s*([mhdw])$")
_UNIT_TO_SECONDS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("usage", help="totals from the ledger: requests, tokens, joules, cost",
                              description="Totals of the requests recorded in the ledger.")
    p.add_argument("--data-dir", default=None,
                   help="directory holding ledger.db (default: $TOKENFACTORY_DATA_DIR or the per-user "
                        "data directory, e.g. ~/.local/share/tokenfactory)")
    p.add_argument("--database-url", default=None,
                   help="a SQLAlchemy database URL instead of the SQLite file (e.g. postgresql+psycopg://...)")
    p.add_argument("--since", default=None,
                   help="only requests since then: an ISO date or time (UTC unless it has an offset), "
                        "or a span back from now such as 30m, 24h, 7d, 2w")
    p.add_argument("--group-by", choices=GROUP_BYS, default=None, help="one row per day, tenant, model or replica")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    g = p.add_argument_group("statements and utilisation")
    g.add_argument("--invoice", action="store_true",
                   help="a tenant's statement for --month (CSV and an HTML page in --out; docs/dashboard.md)")
    g.add_argument("--tenant", default=None, help="the tenant of --invoice")
    g.add_argument("--month", default=None, help="the UTC calendar month of --invoice, e.g. 2026-11")
    g.add_argument("--out", default=".", help="directory for the statement's files (default: here)")
    g.add_argument("--prices", default=None, help="a prices TOML file merged over the defaults (the markup)")
    g.add_argument("--utilisation", action="store_true",
                   help="per device: busy and idle device-hours, tokens, kWh and idle cost (since --since)")
    p.set_defaults(func=run)


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """An aware UTC datetime from an ISO date/time or a relative span ("24h", "7d")."""
    now = now if now is not None else dt.datetime.now(dt.UTC)
    match = _RELATIVE.match(text.strip())
    if match:
        try:
            return now - dt.timedelta(seconds=float(match.group(1)) * _UNIT_TO_SECONDS[match.group(2)])
        except (OverflowError, ValueError):
            raise ParameterError("since", f"since={text!r} reaches back before the year 1: give a shorter span "
                                          "or a date") from None
    try:
        when = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ParameterError("since", f"--since must be an ISO date or time (2025-01-31, "
                                      f"2025-01-31T12:00) or a span like 30m, 24h, 7d, 2w; got {text!r}") from None
    return when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)


def run(args: argparse.Namespace) -> int:
    from tokenfactory.meter.ledger import Ledger

    if args.invoice or args.utilisation:
        return run_statement(args)
    since = parse_since(args.since) if args.since else None
    ledger = Ledger.open(args.data_dir, args.database_url, create=False)
    try:
        totals = ledger.totals(since=since, group_by=args.group_by)
    finally:
        ledger.close()
    rows = [totals_to_dict(t) for t in totals]
    key_name = args.group_by or "total"
    WRITERS[args.format](rows, key_name, sys.stdout)
    return 0


def run_statement(args: argparse.Namespace) -> int:
    """--invoice (files plus a one-line summary) or --utilisation (one line per device)."""
    from pathlib import Path

    from tokenfactory.meter.invoice import make_invoice, summary, write_invoice
    from tokenfactory.meter.ledger import Ledger
    from tokenfactory.meter.utilisation import create_table, device_usage

    if args.invoice and (not args.tenant or not args.month):
        raise ParameterError("tenant" if not args.tenant else "month", "--invoice needs --tenant T and --month YYYY-MM")
    ledger = Ledger.open(args.data_dir, args.database_url, create=False)
    try:
        if args.invoice:
            invoice = make_invoice(ledger.engine, args.tenant, args.month, Path(args.prices) if args.prices else None)
            csv_path, html_path = write_invoice(invoice, Path(args.out))
            if args.format == "json":
                json.dump(summary(invoice), sys.stdout, indent=2)
                sys.stdout.write("\n")
            else:
                print(f"{invoice.tenant} {invoice.month}: {invoice.num_requests} requests, "
                      f"{invoice.device_hours:.4f} device-hours, total ${invoice.total_usd:.2f}\n"
                      f"  {csv_path}\n  {html_path}")
            return 0
        create_table(ledger.engine)  # a ledger from before the rollup existed reads as empty
        since = parse_since(args.since).replace(tzinfo=None) if args.since else None
        for usage in device_usage(ledger.engine, since):
            print(usage.describe())
        return 0
    finally:
        ledger.close()


def totals_to_dict(t: Any) -> dict[str, Any]:
    return {
        "key": t.key, "requests": t.num_requests, "prompt_tokens": t.prompt_tokens,
        "cached_tokens": t.cached_tokens, "completion_tokens": t.completion_tokens,
        "energy_joules": t.energy_joules, "requests_with_energy": t.num_requests_with_energy,
        "energy_sources": list(t.energy_sources), "joules_per_completion_token": t.joules_per_completion_token,
        "cost_device_usd": t.cost_device_usd, "cost_energy_usd": t.cost_energy_usd, "cost_usd": t.cost_usd,
    }


def write_json(rows: list[dict[str, Any]], key_name: str, out: TextIO) -> None:
    json.dump([{key_name: r["key"], **{k: v for k, v in r.items() if k != "key"}} for r in rows], out, indent=2)
    out.write("\n")


def write_csv(rows: list[dict[str, Any]], key_name: str, out: TextIO) -> None:
    writer = csv.writer(out)
    columns = [k for k in rows[0] if k != "key"] if rows else []
    writer.writerow([key_name, *columns])
    for r in rows:
        writer.writerow([_csv_cell(r["key"]), *(_csv_cell(r[c]) for c in columns)])


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""  # missing, not zero
    if isinstance(value, list):
        return "+".join(value)
    return str(value)


def write_table(rows: list[dict[str, Any]], key_name: str, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tokenfactory usage")
    for name in (key_name, "requests", "prompt", "cached", "completion", "energy (J)", "J/token", "source",
                 "device $", "energy $", "cost $"):
        table.add_column(name, justify="left" if name in (key_name, "source") else "right")
    for r in rows:
        table.add_row(
            "all" if r["key"] is None else str(r["key"]), f"{r['requests']:,}", f"{r['prompt_tokens']:,}",
            f"{r['cached_tokens']:,}", f"{r['completion_tokens']:,}", _fmt(r["energy_joules"], ",.1f"),
            _fmt(r["joules_per_completion_token"], ".3g"), "+".join(r["energy_sources"]) or "-",
            _fmt(r["cost_device_usd"], ".6f"), _fmt(r["cost_energy_usd"], ".6f"), _fmt(r["cost_usd"], ".6f"),
        )
    Console(file=out, width=160).print(table)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


WRITERS = {"table": write_table, "csv": write_csv, "json": write_json}
