"""A tenant's statement for one UTC calendar month, from the ledger's request rows: CSV and an HTML page.

    lines            requests (by status), tokens in / out / cached, joules by energy source (measured
                     scope, and at the facility: × psu · pue), device-hours
    dollars          device time    Σ cost_device_usd of the rows (priced when each request was served)
                     energy         Σ cost_energy_usd (rows without measured energy add none: missing ≠ 0)
                     markup         (device + energy) · markup_fraction, from the prices file's [billing]
                     total          device + energy + markup, rounded to the cent once, at the end

Every figure is a sum over the same rows (`requests` through its tenant × created_at index), so the
statement equals the ledger to the joule and the cent (tested against the rows and the meter's totals);
the prices it used (the file, its [billing] table's date and source) and the energy sources are printed
with it. Dollars are summed in full precision and rounded only for display.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import sqlalchemy as sa

from tokenfactory.meter.paths import PRIVATE_FILE_MODE
from tokenfactory.meter.prices import DEFAULT_PRICES_PATH, PRICES_ENV, load_price_table
from tokenfactory.meter.schema import requests_table
from tokenfactory.types import ParameterError


@dataclass(frozen=True)
class EnergyLine:
    source: str  # nvml | rapl | modelled | constant | a+b
    scope: str
    num_requests: int
    joules: float
    facility_joules: float  # joules · the row's energy_overhead_factor


@dataclass(frozen=True)
class Invoice:
    tenant: str
    month: str  # YYYY-MM
    start: dt.datetime  # naive UTC, inclusive
    end: dt.datetime  # exclusive
    status_to_requests: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    energy: tuple[EnergyLine, ...]
    num_requests_without_energy: int
    device_seconds: float
    cost_device_usd: float
    cost_energy_usd: float
    markup_fraction: float
    prices_source: str  # where the markup came from, with its date and source

    @property
    def num_requests(self) -> int:
        return sum(self.status_to_requests.values())

    @property
    def device_hours(self) -> float:
        return self.device_seconds / 3600.0

    @property
    def energy_joules(self) -> float | None:
        return sum(e.joules for e in self.energy) if self.energy else None

    @property
    def subtotal_usd(self) -> float:
        return self.cost_device_usd + self.cost_energy_usd

    @property
    def markup_usd(self) -> float:
        return self.subtotal_usd * self.markup_fraction

    @property
    def total_usd(self) -> float:
        return self.subtotal_usd + self.markup_usd

    def lines(self) -> list[tuple[str, str, str, str]]:
        """(section, item, quantity, unit) rows: what CSV and HTML both show."""
        rows = [("requests", status, str(n), "requests") for status, n in sorted(self.status_to_requests.items())]
        rows += [("tokens", "prompt (in)", str(self.prompt_tokens), "tokens"),
                 ("tokens", "completion (out)", str(self.completion_tokens), "tokens"),
                 ("tokens", "cached (of prompt)", str(self.cached_tokens), "tokens")]
        for e in self.energy:
            rows += [("energy", f"{e.source} ({e.scope}), {e.num_requests} requests", f"{e.joules:.6f}", "J"),
                     ("energy", f"{e.source} at the facility (psu x pue)", f"{e.facility_joules:.6f}", "J")]
        if self.num_requests_without_energy:
            rows.append(("energy", "not measured", str(self.num_requests_without_energy), "requests"))
        rows += [("device", "device time", f"{self.device_hours:.6f}", "device-hours"),
                 ("usd", "device time", f"{self.cost_device_usd:.6f}", "USD"),
                 ("usd", "energy", f"{self.cost_energy_usd:.6f}", "USD"),
                 ("usd", f"markup ({self.markup_fraction:.2%})", f"{self.markup_usd:.6f}", "USD"),
                 ("usd", "total", f"{self.total_usd:.2f}", "USD")]
        return rows


def month_range(month: str) -> tuple[dt.datetime, dt.datetime]:
    """'2026-11' -> [2026-11-01, 2026-12-01), naive UTC."""
    try:
        start = dt.datetime.strptime(month.strip(), "%Y-%m")
    except ValueError:
        raise ParameterError("month", f"--month must be a year and month like 2026-11, got {month!r}") from None
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


def billing_terms(prices_path: Path | None = None) -> tuple[float, str]:
    """The markup fraction and a line naming the file(s), date and source it came from."""
    billing = load_price_table(prices_path).get("billing", {})
    markup = billing.get("markup_fraction", 0.0)
    if isinstance(markup, bool) or not isinstance(markup, int | float) or markup < 0:
        raise ParameterError("billing.markup_fraction", f"billing.markup_fraction must be a number >= 0, "
                             f"got {markup!r}")
    override = prices_path if prices_path is not None else os.environ.get(PRICES_ENV)
    files = f"{DEFAULT_PRICES_PATH}" + (f" + {override}" if override else "")
    return float(markup), (f"{files}; billing as of {billing.get('as_of', 'unknown')}: "
                           f"{billing.get('source', 'unknown')}")


def make_invoice(engine: sa.Engine, tenant: str, month: str, prices_path: Path | None = None) -> Invoice:
    start, end = month_range(month)
    t = requests_table.c
    where = (t.tenant == tenant) & (t.created_at >= start) & (t.created_at < end)
    with engine.connect() as conn:
        status_to_requests = {s: int(n) for s, n in conn.execute(
            sa.select(t.status, sa.func.count()).where(where).group_by(t.status))}
        sums = conn.execute(sa.select(
            sa.func.coalesce(sa.func.sum(t.prompt_tokens), 0), sa.func.coalesce(sa.func.sum(t.completion_tokens), 0),
            sa.func.coalesce(sa.func.sum(t.cached_tokens), 0), sa.func.coalesce(sa.func.sum(t.device_seconds), 0.0),
            sa.func.coalesce(sa.func.sum(t.cost_device_usd), 0.0),
            sa.func.coalesce(sa.func.sum(t.cost_energy_usd), 0.0)).where(where)).one()
        energy = tuple(EnergyLine(source, scope or "", int(n), float(j), float(fj)) for source, scope, n, j, fj in
                       conn.execute(sa.select(t.energy_source, t.energy_scope, sa.func.count(),
                                              sa.func.sum(t.energy_joules),
                                              sa.func.sum(t.energy_joules * t.energy_overhead_factor))
                                    .where(where & t.energy_joules.is_not(None))
                                    .group_by(t.energy_source, t.energy_scope).order_by(t.energy_source)))
    markup, prices_source = billing_terms(prices_path)
    return Invoice(tenant=tenant, month=start.strftime("%Y-%m"), start=start, end=end,
                   status_to_requests=status_to_requests, prompt_tokens=int(sums[0]),
                   completion_tokens=int(sums[1]), cached_tokens=int(sums[2]), energy=energy,
                   num_requests_without_energy=sum(status_to_requests.values()) - sum(e.num_requests for e in energy),
                   device_seconds=float(sums[3]), cost_device_usd=float(sums[4]), cost_energy_usd=float(sums[5]),
                   markup_fraction=markup, prices_source=prices_source)


def invoice_csv(invoice: Invoice) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["tenant", "month", "section", "item", "quantity", "unit"])
    for row in invoice.lines():
        writer.writerow([invoice.tenant, invoice.month, *row])
    writer.writerow([invoice.tenant, invoice.month, "sources", "prices", invoice.prices_source, ""])
    writer.writerow([invoice.tenant, invoice.month, "sources", "dollars",
                     "device time and energy as priced when each request was served (ledger rows)", ""])
    return out.getvalue()


HTML_TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Statement: {{ inv.tenant }}, {{ inv.month }}</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 2em auto; max-width: 52em; color: #222; }
table { border-collapse: collapse; width: 100%; } td, th { padding: .3em .6em; border-bottom: 1px solid #ddd; }
td.q { text-align: right; font-variant-numeric: tabular-nums; } tr.total td { font-weight: bold; }
.small { color: #666; font-size: 12px; }
</style></head><body>
<h1>Statement for {{ inv.tenant }}</h1>
<p>{{ inv.month }}: {{ inv.start.isoformat() }} to {{ inv.end.isoformat() }} (UTC), {{ inv.num_requests }} requests.</p>
<table><tr><th>section</th><th>item</th><th>quantity</th><th>unit</th></tr>
{% for section, item, quantity, unit in inv.lines() %}
<tr{% if item == 'total' %} class="total"{% endif %}><td>{{ section }}</td><td>{{ item }}</td>
<td class="q">{{ quantity }}</td><td>{{ unit }}</td></tr>
{% endfor %}</table>
<p class="small">Dollars for device time and energy are the ledger's, priced when each request was served.
Markup and billing terms: {{ inv.prices_source }}.</p>
</body></html>
"""


def invoice_html(invoice: Invoice) -> str:
    import jinja2

    env = jinja2.Environment(autoescape=True)
    return env.from_string(HTML_TEMPLATE).render(inv=invoice)


def invoice_stem(tenant: str, month: str) -> str:
    """`invoice-<tenant>-<YYYY-MM>`: the whole tenant name (a dot in it is not a suffix) with anything a file
    name must not hold ('/' among them) percent-encoded, so two tenants never share a file and none leaves the
    directory."""
    return f"invoice-{quote(tenant, safe='.-_')}-{month}"


def write_invoice(invoice: Invoice, out_dir: Path) -> tuple[Path, Path]:
    """invoice-<tenant>-<month>.csv and .html in `out_dir`, private (0600) like the ledger they come from."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = invoice_stem(invoice.tenant, invoice.month)
    csv_path, html_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.html"
    _write_private(csv_path, invoice_csv(invoice))
    _write_private(html_path, invoice_html(invoice))
    return csv_path, html_path


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), PRIVATE_FILE_MODE)  # a statement written before this rule was 0644
        f.write(text)


def summary(invoice: Invoice) -> dict[str, Any]:
    """The totals, for a terminal line or JSON."""
    return {"tenant": invoice.tenant, "month": invoice.month, "requests": invoice.num_requests,
            "prompt_tokens": invoice.prompt_tokens, "completion_tokens": invoice.completion_tokens,
            "cached_tokens": invoice.cached_tokens, "energy_joules": invoice.energy_joules,
            "device_hours": invoice.device_hours, "cost_device_usd": invoice.cost_device_usd,
            "cost_energy_usd": invoice.cost_energy_usd, "markup_usd": invoice.markup_usd,
            "total_usd": round(invoice.total_usd, 2)}


def recent_requests(engine: sa.Engine, limit: int) -> list[dict[str, Any]]:
    """The last `limit` ledger rows, newest first, with their usage (the dashboard's admin table)."""
    t = requests_table.c
    columns = (t.request_id, t.tenant, t.model, t.status, t.prompt_tokens, t.cached_tokens, t.completion_tokens,
               t.energy_joules, t.energy_source, t.cost_usd, t.ttft_s, t.latency_s, t.created_at)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(*columns).order_by(t.id.desc()).limit(limit)).mappings().all()
    return [{**row, "created_at": row["created_at"].isoformat() + "Z"} for row in rows]
