"""Fleet size for a demand, and what a million tokens costs rented or bought.

Fleet: replica-hours per day = tokens_per_day / (tokens_per_s * 3600); a window of H hours needs
ceil(replica-hours / H) replicas. (5,000,000 tokens/day at 60 tokens/s is 23.1 GPU-hours: an 8-hour
window needs 3 cards.)

Cost per million output tokens, with the fleet busy a fraction u of the time:
    rented: rent_per_hour * cards / (tokens_per_hour * u) * 1e6
    owned:  (capex_per_hour + energy_per_hour(u)) * ... / (tokens_per_hour * u) * 1e6
      capex_per_hour  = purchase * cards / (lifetime_years * 8760)         (straight-line)
      energy_per_hour = (u * P_busy + (1 - u) * P_idle) / 1000 * PUE * $/kWh
Break-even utilisation: owning (paid every hour) costs the same per token as renting only the busy
hours when capex_h + E_idle + u (E_busy - E_idle) = u * rent_h, i.e.
    u* = (capex_h + E_idle) / (rent_h - (E_busy - E_idle));   above u*, buying is cheaper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HOURS_PER_YEAR = 8760.0


@dataclass(frozen=True)
class Prices:
    electricity_usd_per_kwh: float
    pue: float
    lifetime_years: float
    utilisation: float
    rent_usd_per_hour: float | None = None  # per card
    purchase_usd: float | None = None  # per card

    def __post_init__(self) -> None:
        if self.electricity_usd_per_kwh < 0:
            raise ValueError(f"--electricity-usd-per-kwh must be >= 0, got {self.electricity_usd_per_kwh}")
        if self.pue < 1.0:
            raise ValueError(f"--pue must be >= 1.0, got {self.pue}")
        if self.lifetime_years <= 0:
            raise ValueError(f"--lifetime-years must be > 0, got {self.lifetime_years}")
        if not 0.0 < self.utilisation <= 1.0:
            raise ValueError(f"--utilisation must be in (0, 1], got {self.utilisation}")
        for name in ("rent_usd_per_hour", "purchase_usd"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")


@dataclass(frozen=True)
class FleetPlan:
    tokens_per_day: float
    window_hours: float
    tokens_per_s_per_replica: float
    cards_per_replica: int
    replica_hours: float  # per day
    replicas: int

    @property
    def cards(self) -> int:
        return self.replicas * self.cards_per_replica

    @property
    def gpu_hours(self) -> float:
        return self.replica_hours * self.cards_per_replica

    def to_dict(self) -> dict[str, float]:
        return {"tokens_per_day": self.tokens_per_day, "window_hours": self.window_hours,
                "tokens_per_s_per_replica": self.tokens_per_s_per_replica,
                "cards_per_replica": self.cards_per_replica, "replica_hours": self.replica_hours,
                "gpu_hours": self.gpu_hours, "replicas": self.replicas, "cards": self.cards}


def fleet_for_demand(tokens_per_day: float, window_hours: float, tokens_per_s_per_replica: float,
                     cards_per_replica: int = 1) -> FleetPlan:
    """Replicas needed to produce `tokens_per_day` output tokens inside a `window_hours` window."""
    if tokens_per_day <= 0:
        raise ValueError(f"--tokens-per-day must be > 0, got {tokens_per_day}")
    if not 0 < window_hours <= 24:
        raise ValueError(f"--window-hours must be in (0, 24], got {window_hours}")
    if tokens_per_s_per_replica <= 0:
        raise ValueError(f"--tokens-per-second must be > 0, got {tokens_per_s_per_replica}")
    replica_hours = tokens_per_day / (tokens_per_s_per_replica * 3600.0)
    # A hair of tolerance so 24.000000001 replica-hours over 8 hours is still 3 replicas.
    replicas = max(1, math.ceil(replica_hours / window_hours - 1e-9))
    return FleetPlan(tokens_per_day, window_hours, tokens_per_s_per_replica, cards_per_replica,
                     replica_hours, replicas)


@dataclass(frozen=True)
class CostEstimate:
    tokens_per_s: float  # per replica
    cards: int  # per replica
    utilisation: float
    busy_power_w: float  # per replica
    idle_power_w: float  # per replica
    rent_usd_per_mtok: float | None
    own_usd_per_mtok: float | None
    energy_usd_per_mtok: float
    energy_kwh_per_mtok: float  # at the wall (PUE included)
    break_even_utilisation: float | None  # None: renting is cheaper at any utilisation (or no prices)

    def to_dict(self) -> dict[str, float | int | None]:
        return dict(self.__dict__)


def estimate_cost(tokens_per_s: float, busy_power_w: float, idle_power_w: float, cards: int,
                  prices: Prices) -> CostEstimate:
    """Dollars per million output tokens for one replica of `cards` cards."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens per second must be > 0, got {tokens_per_s}")
    u = prices.utilisation
    mtok_per_busy_hour = tokens_per_s * 3600.0 / 1e6
    kwh_price = prices.electricity_usd_per_kwh * prices.pue
    e_busy = busy_power_w / 1000.0 * kwh_price  # $/h while busy
    e_idle = idle_power_w / 1000.0 * kwh_price
    energy_per_hour = u * e_busy + (1 - u) * e_idle
    wall_kwh_per_hour = (u * busy_power_w + (1 - u) * idle_power_w) / 1000.0 * prices.pue
    mtok_per_hour = mtok_per_busy_hour * u
    rent_h = prices.rent_usd_per_hour * cards if prices.rent_usd_per_hour is not None else None
    capex_h = (prices.purchase_usd * cards / (prices.lifetime_years * HOURS_PER_YEAR)
               if prices.purchase_usd is not None else None)
    own = (capex_h + energy_per_hour) / mtok_per_hour if capex_h is not None else None
    break_even = None
    if rent_h is not None and capex_h is not None and rent_h > e_busy - e_idle:
        u_star = (capex_h + e_idle) / (rent_h - (e_busy - e_idle))
        break_even = u_star if u_star <= 1.0 else None
    return CostEstimate(
        tokens_per_s=tokens_per_s, cards=cards, utilisation=u, busy_power_w=busy_power_w,
        idle_power_w=idle_power_w,
        rent_usd_per_mtok=rent_h / mtok_per_hour if rent_h is not None else None,
        own_usd_per_mtok=own, energy_usd_per_mtok=energy_per_hour / mtok_per_hour,
        energy_kwh_per_mtok=wall_kwh_per_hour / mtok_per_hour,
        break_even_utilisation=break_even)
