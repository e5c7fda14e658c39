"""Utilisation joined to tokens and power: per device, busy and idle device-seconds, the energy of each,
the tokens the busy time computed, and their ratios.

Exported in /metrics (gateway/metrics.py, from `Meter.totals()`) and kept in the ledger's database per UTC
hour and device (`device_usage_hourly`, an upserted rollup like usage_daily), so that "the device was 80 %
busy, made 2.1 M tokens for 0.9 kWh, and idle cost $3.10" is one query (`device_usage`, shown by
`tokenfactory usage --utilisation`):

    utilisation       = busy_device_seconds / (busy_device_seconds + idle_device_seconds)
    joules_per_token  = busy_joules / (prefill_tokens + decode_tokens)                  [J/token]
    idle_cost_usd     = idle_device_seconds / 3600 · usd_per_hour + idle_joules · overheads / 3.6e6 · usd_per_kwh

`UtilisationRecorder` adds the meter's counter deltas to the current hour's row every `interval_s`, on its
own thread (the step loop does nothing for it), and once more when closed. Energy missing is NULL, never 0:
an interval whose source could not measure adds its device-seconds and tokens but no joules, and a row
whose intervals never measured reads back as None.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from tokenfactory.meter.attribution import Meter, MeterTotals
from tokenfactory.meter.rollup import NO_SOURCE, UPSERT_INSERTS
from tokenfactory.meter.schema import metadata

logger = logging.getLogger(__name__)

device_usage_table = sa.Table(
    "device_usage_hourly", metadata,
    sa.Column("hour", sa.String(13), primary_key=True),  # YYYY-MM-DDTHH, UTC
    sa.Column("device", sa.String(128), primary_key=True),
    sa.Column("energy_source", sa.String(64), primary_key=True),  # "" when not measured
    sa.Column("busy_device_seconds", sa.Double, nullable=False),
    sa.Column("idle_device_seconds", sa.Double, nullable=False),
    sa.Column("busy_joules", sa.Double, nullable=False),  # over num_measured intervals
    sa.Column("idle_joules", sa.Double, nullable=False),
    sa.Column("num_measured", sa.Integer, nullable=False),
    sa.Column("prefill_tokens", sa.BigInteger, nullable=False),
    sa.Column("decode_tokens", sa.BigInteger, nullable=False),
    sa.Column("idle_cost_usd", sa.Double, nullable=False),  # idle device time, and idle energy when measured
)
SUM_COLUMNS = ("busy_device_seconds", "idle_device_seconds", "busy_joules", "idle_joules", "num_measured",
               "prefill_tokens", "decode_tokens", "idle_cost_usd")


@dataclass(frozen=True)
class DeviceUsage:
    """One device's busy and idle time, their energy, and the tokens made (a span of hours, or live)."""

    device: str
    energy_source: str | None  # None when no interval measured energy
    busy_device_seconds: float
    idle_device_seconds: float
    busy_joules: float | None
    idle_joules: float | None
    num_prefill_tokens: int
    num_decode_tokens: int
    idle_cost_usd: float

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def utilisation(self) -> float | None:
        total = self.busy_device_seconds + self.idle_device_seconds
        return self.busy_device_seconds / total if total > 0 else None

    @property
    def joules_per_token(self) -> float | None:
        return self.busy_joules / self.num_tokens if self.busy_joules is not None and self.num_tokens else None

    @property
    def energy_kwh(self) -> float | None:
        if self.busy_joules is None or self.idle_joules is None:
            return None
        return (self.busy_joules + self.idle_joules) / 3.6e6

    def describe(self) -> str:
        """The one-line answer: busy share, tokens, energy, idle cost."""
        util = "-" if self.utilisation is None else f"{self.utilisation:.0%}"
        kwh = "energy not measured" if self.energy_kwh is None else f"{self.energy_kwh:.4g} kWh ({self.energy_source})"
        return (f"{self.device}: {util} busy ({self.busy_device_seconds / 3600:.3g} of "
                f"{(self.busy_device_seconds + self.idle_device_seconds) / 3600:.3g} device-hours), made "
                f"{self.num_tokens:,} tokens for {kwh}, idle cost ${self.idle_cost_usd:.2f}")


def from_totals(t: MeterTotals) -> DeviceUsage:
    """The meter's counters since it started, as a DeviceUsage (live: /metrics and the dashboard)."""
    return DeviceUsage(
        device=t.device, energy_source=t.source if t.busy_joules is not None else None,
        busy_device_seconds=t.busy_device_seconds, idle_device_seconds=t.idle_device_seconds,
        busy_joules=t.busy_joules, idle_joules=t.idle_joules, num_prefill_tokens=t.num_prefill_tokens,
        num_decode_tokens=t.num_decode_tokens, idle_cost_usd=t.idle_cost_usd or 0.0)


def create_table(engine: sa.Engine) -> None:
    metadata.create_all(engine, tables=[device_usage_table])


def delta(before: DeviceUsage, after: DeviceUsage) -> DeviceUsage:
    """What happened between two readings of the same meter."""
    def diff(a: float | None, b: float | None) -> float | None:  # a None before: all of it is new
        return b if a is None or b is None else b - a

    return DeviceUsage(
        device=after.device, energy_source=after.energy_source,
        busy_device_seconds=after.busy_device_seconds - before.busy_device_seconds,
        idle_device_seconds=max(after.idle_device_seconds - before.idle_device_seconds, 0.0),
        busy_joules=diff(before.busy_joules, after.busy_joules),
        idle_joules=diff(before.idle_joules, after.idle_joules),
        num_prefill_tokens=after.num_prefill_tokens - before.num_prefill_tokens,
        num_decode_tokens=after.num_decode_tokens - before.num_decode_tokens,
        idle_cost_usd=max(after.idle_cost_usd - before.idle_cost_usd, 0.0))


def record(conn: sa.Connection, hour: dt.datetime, usage: DeviceUsage) -> None:
    """Add `usage` to its hour's row (upsert on SQLite and PostgreSQL; elsewhere a read-modify-write)."""
    measured = usage.busy_joules is not None and usage.idle_joules is not None
    values = {"hour": hour.strftime("%Y-%m-%dT%H"), "device": usage.device,
              "energy_source": usage.energy_source if measured and usage.energy_source else NO_SOURCE,
              "busy_device_seconds": usage.busy_device_seconds, "idle_device_seconds": usage.idle_device_seconds,
              "busy_joules": usage.busy_joules if measured else 0.0,
              "idle_joules": usage.idle_joules if measured else 0.0, "num_measured": int(measured),
              "prefill_tokens": usage.num_prefill_tokens, "decode_tokens": usage.num_decode_tokens,
              "idle_cost_usd": usage.idle_cost_usd}
    t = device_usage_table
    insert = UPSERT_INSERTS.get(conn.dialect.name)
    if insert is not None:
        stmt = insert(t)
        conn.execute(stmt.on_conflict_do_update(
            index_elements=["hour", "device", "energy_source"],
            set_={name: t.c[name] + stmt.excluded[name] for name in SUM_COLUMNS}), values)
        return
    key = (t.c.hour == values["hour"]) & (t.c.device == values["device"]) & (
        t.c.energy_source == values["energy_source"])
    if conn.execute(sa.select(t.c.hour).where(key)).first() is None:
        conn.execute(t.insert(), values)
    else:
        conn.execute(t.update().where(key).values({n: t.c[n] + values[n] for n in SUM_COLUMNS}))


def device_usage(engine: sa.Engine, since: dt.datetime | None = None, until: dt.datetime | None = None,
                 device: str | None = None) -> list[DeviceUsage]:
    """Sums of whole hours in [since, until) (naive UTC), one DeviceUsage per device, ordered by device."""
    t = device_usage_table
    stmt = sa.select(t.c.device, t.c.energy_source, *(sa.func.sum(t.c[n]) for n in SUM_COLUMNS))
    if since is not None:
        stmt = stmt.where(t.c.hour >= since.strftime("%Y-%m-%dT%H"))
    if until is not None:
        stmt = stmt.where(t.c.hour < until.strftime("%Y-%m-%dT%H"))
    if device is not None:
        stmt = stmt.where(t.c.device == device)
    device_to_parts: dict[str, list[DeviceUsage]] = {}
    with engine.connect() as conn:
        for row in conn.execute(stmt.group_by(t.c.device, t.c.energy_source)):
            s = dict(zip(SUM_COLUMNS, row[2:], strict=True))
            measured = int(s["num_measured"]) > 0
            device_to_parts.setdefault(row[0], []).append(DeviceUsage(
                device=row[0], energy_source=row[1] or None, busy_device_seconds=float(s["busy_device_seconds"]),
                idle_device_seconds=float(s["idle_device_seconds"]),
                busy_joules=float(s["busy_joules"]) if measured else None,
                idle_joules=float(s["idle_joules"]) if measured else None,
                num_prefill_tokens=int(s["prefill_tokens"]), num_decode_tokens=int(s["decode_tokens"]),
                idle_cost_usd=float(s["idle_cost_usd"])))
    return [_merge(parts) for _, parts in sorted(device_to_parts.items())]


def _merge(parts: list[DeviceUsage]) -> DeviceUsage:
    def total(name: str) -> float | None:
        values = [getattr(p, name) for p in parts if getattr(p, name) is not None]
        return sum(values) if values else None

    sources = sorted({p.energy_source for p in parts if p.energy_source})
    return DeviceUsage(
        device=parts[0].device, energy_source="+".join(sources) or None,
        busy_device_seconds=sum(p.busy_device_seconds for p in parts),
        idle_device_seconds=sum(p.idle_device_seconds for p in parts),
        busy_joules=total("busy_joules"), idle_joules=total("idle_joules"),
        num_prefill_tokens=sum(p.num_prefill_tokens for p in parts),
        num_decode_tokens=sum(p.num_decode_tokens for p in parts),
        idle_cost_usd=sum(p.idle_cost_usd for p in parts))


class UtilisationRecorder:
    """Keeps `device_usage_hourly` up to date from a meter: the counters' deltas, every `interval_s` (None:
    only when `flush` is called, as tests do), added to the hour `wall()` is in."""

    def __init__(self, meter: Meter, engine: sa.Engine, interval_s: float | None = 60.0,
                 wall: Callable[[], dt.datetime] | None = None) -> None:
        from tokenfactory.meter.ledger import utc_now

        self._meter, self._engine, self._interval_s = meter, engine, interval_s
        self._wall = wall if wall is not None else utc_now
        self._lock = threading.Lock()
        self._last = from_totals(meter.totals())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._table_ready = False
        try:
            self._ensure_table()
        except sa.exc.SQLAlchemyError as e:  # the database refuses now: serving starts anyway, flush retries
            logger.warning("utilisation rollup table not created yet (retried at each flush): %s", e)

    def start(self) -> UtilisationRecorder:
        if self._interval_s is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="utilisation-recorder", daemon=True)
            self._thread.start()
        return self

    def flush(self) -> DeviceUsage:
        """Record what the meter counted since the last flush; returns it."""
        with self._lock:
            self._ensure_table()
            now = from_totals(self._meter.totals())
            change = delta(self._last, now)
            with self._engine.begin() as conn:
                record(conn, self._wall(), change)
            self._last = now
            return change

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._flush_logged()

    def _ensure_table(self) -> None:
        if not self._table_ready:
            create_table(self._engine)
            self._table_ready = True

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._flush_logged()

    def _flush_logged(self) -> None:
        try:
            self.flush()
        except sa.exc.SQLAlchemyError as e:  # the database refused: the counters stay, the next flush adds them
            logger.warning("utilisation rollup not written (kept for the next try): %s", e)
