"""Request traces for the fleet simulator: Poisson or bursty (gamma) arrivals at a constant rate, a diurnal day,
or a replay of what a server really saw (its ledger, or a JSON-lines file).

    diurnal rate(t) = trough + (peak − trough) · (1 − cos(2π (t − t_low) / day)) / 2        [requests/s]

lowest at `t_low` (04:00 by default), highest twelve hours later; drawn by thinning a Poisson process at the
peak rate (Lewis & Shedler 1979), so the arrivals are an exact non-homogeneous Poisson process.
Lengths are fixed (the default: known answers for tests) or exponential around the mean (`spread`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DAY_S = 86_400.0


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    user: str | None = None


def _lengths(rng: np.random.Generator, n: int, mean: float, spread: bool) -> np.ndarray:
    if not spread:
        return np.full(n, max(1, round(mean)), dtype=np.int64)
    return np.maximum(1, rng.exponential(mean, n).round()).astype(np.int64)


def _build(times: np.ndarray, rng: np.random.Generator, prompt: float, output: float, spread: bool
           ) -> list[SimRequest]:
    p, o = _lengths(rng, len(times), prompt, spread), _lengths(rng, len(times), output, spread)
    return [SimRequest(float(t), int(a), int(b)) for t, a, b in zip(times, p, o, strict=True)]


def poisson(rate: float, duration_s: float, prompt_tokens: float = 512, output_tokens: float = 256,
            seed: int = 0, spread: bool = False, cv: float = 1.0) -> list[SimRequest]:
    """Arrivals at `rate`/s for `duration_s`: Poisson (cv 1) or gamma inter-arrivals of coefficient of variation
    `cv` (> 1: bursty, as `bench serve --burstiness` draws them, burstiness = 1 / cv²)."""
    if rate <= 0 or duration_s <= 0 or cv <= 0:
        raise ValueError("rate, duration and cv must be > 0")
    rng = np.random.default_rng(seed)
    n = int(rate * duration_s * 1.2 + 10 * math.sqrt(rate * duration_s) + 10)
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    times = np.cumsum(gaps)
    return _build(times[times < duration_s], rng, prompt_tokens, output_tokens, spread)


def diurnal(peak_rate: float, trough_rate: float, duration_s: float = DAY_S, prompt_tokens: float = 512,
            output_tokens: float = 256, seed: int = 0, spread: bool = False, t_low_s: float = 4 * 3600.0,
            period_s: float = DAY_S) -> list[SimRequest]:
    """`duration_s` of non-homogeneous Poisson arrivals between `trough_rate` and `peak_rate`, one cycle a
    `period_s` (a day; shorter for a quick look)."""
    if not 0 <= trough_rate <= peak_rate or peak_rate <= 0:
        raise ValueError("need 0 <= trough rate <= peak rate, and a peak > 0")
    rng = np.random.default_rng(seed)
    n = int(peak_rate * duration_s + 10 * math.sqrt(peak_rate * duration_s) + 10)
    times = np.cumsum(rng.exponential(1.0 / peak_rate, n))
    times = times[times < duration_s]
    rate = trough_rate + (peak_rate - trough_rate) * (1 - np.cos(2 * np.pi * (times - t_low_s) / period_s)) / 2
    keep = rng.random(len(times)) < rate / peak_rate
    return _build(times[keep], rng, prompt_tokens, output_tokens, spread)


def replay(path: str | Path) -> list[SimRequest]:
    """A ledger database (`*.db`/`*.sqlite`: its rows' arrival (created_at − latency), prompt and completion
    tokens) or a
    JSON-lines file of `{"arrival_s", "prompt_tokens", "output_tokens"[, "user"]}`; times start at 0."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file {p} does not exist")
    if p.suffix in (".db", ".sqlite", ".sqlite3"):
        return _from_ledger(p)
    out = []
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(SimRequest(float(row["arrival_s"]), int(row["prompt_tokens"]), int(row["output_tokens"]),
                                  row.get("user")))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"trace file {p}, line {i + 1}: needs arrival_s, prompt_tokens, output_tokens ({e})"
                             ) from None
    return _from_zero(out)


def _from_ledger(path: Path) -> list[SimRequest]:
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT created_at, prompt_tokens, completion_tokens, latency_s FROM requests "
                                        "WHERE completion_tokens > 0 ORDER BY created_at")).all()
    finally:
        engine.dispose()
    from datetime import datetime

    def seconds(value: object) -> float:
        t = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
        return t.timestamp()
    # A row is written when its request ends: it arrived its latency earlier.
    return _from_zero([SimRequest(seconds(r[0]) - float(r[3] or 0.0), int(r[1]), int(r[2])) for r in rows])


def _from_zero(requests: list[SimRequest]) -> list[SimRequest]:
    requests.sort(key=lambda r: r.arrival_s)
    if not requests:
        return requests
    t0 = requests[0].arrival_s
    return [SimRequest(r.arrival_s - t0, r.prompt_tokens, r.output_tokens, r.user) for r in requests]
