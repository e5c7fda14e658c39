"""Fleet size for a demand, and what a million tokens costs: rented on demand, rented reserved, or owned.

Fleet: replica-hours per day = tokens_per_day / (tokens_per_s * 3600); a window of H hours needs
ceil(replica-hours / H) replicas. (5,000,000 tokens/day at 60 tokens/s is 23.1 GPU-hours: an 8-hour
window needs 3 cards.)

One replica of n cards, busy a share u of the hours, makes T = tokens/s * 3600 / 1e6 million tokens a busy hour:
    on demand  rent_h * n / T                       rented only while busy: the same at any u
    reserved   reserved_h * n / (T * u)             committed: paid every hour, busy or not
    owned      (capex_h + E(u)) * n / (T * u)       paid every hour
      capex_h = (card price + host price per card) / (lifetime_years * 8766 h)            straight-line
      E(u)    = (u * P_busy + (1 - u) * P_idle) / 1000 * PUE * price per kWh             at the wall
      P       = (card W + host W per card) / PSU efficiency                               DC -> AC
Break-even: owning costs what renting on demand does when capex_h + E_idle + u (E_busy - E_idle) = u rent_h,
    u* = (capex_h + E_idle) / (rent_h - (E_busy - E_idle));
owning falls with u and renting on demand does not move, so above u* owning is cheaper (the essay's rule: low use,
rent; high use, buy). A reserved rental beats renting on demand above reserved_h / rent_h. The verdict names the
cheapest of the figures as they are printed, so the sentence cannot contradict the lines above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenfactory.meter.prices import HOURS_PER_YEAR
from tokenfactory.planner.units import amount, pct

HOURS_PER_MONTH = HOURS_PER_YEAR / 12  # 730.5
SYMBOLS = {"USD": "$", "CNY": "¥", "EUR": "€", "GBP": "£"}


@dataclass(frozen=True)
class Currency:
    """Money as the user counts it: an ISO code and its units per US dollar (catalog prices are in US$)."""

    code: str = "USD"
    per_usd: float = 1.0

    def __post_init__(self) -> None:
        if not (len(self.code) == 3 and self.code.isalpha() and self.code.isupper()):
            raise ValueError(f"--currency must be an ISO 4217 code such as USD or CNY, got {self.code!r}")
        if not self.per_usd > 0:
            raise ValueError(f"--currency-per-usd must be > 0, got {self.per_usd}")

    def from_usd(self, usd: float) -> float:
        return usd * self.per_usd

    def format(self, value: float) -> str:
        """'$1.23', '¥700.00', '12.30 CHF'."""
        symbol = SYMBOLS.get(self.code)
        sign, value = ("-", -value) if value < 0 else ("", value)
        return f"{sign}{symbol}{amount(value)}" if symbol else f"{sign}{amount(value)} {self.code}"

    def shown(self, value: float) -> float:
        """`value` as `format` prints it (the verdict compares figures as printed)."""
        return float(amount(value).replace(",", ""))


def currency_for(code: str | None, per_usd: float | None) -> Currency:
    """--currency and --currency-per-usd: the rate given, else the prices file's for that code."""
    from tokenfactory.meter.prices import shared_defaults

    code = (code or "USD").upper()
    if per_usd is None:
        known = shared_defaults().currencies
        if code not in known:
            raise ValueError(f"--currency {code}: the prices file has no rate for it; give --currency-per-usd "
                             f"(units of {code} per US dollar)")
        per_usd = known[code]
    return Currency(code, per_usd)


@dataclass(frozen=True)
class Prices:
    """What renting and owning cost, per card, in `currency`; the overheads that turn card watts into a bill."""

    currency: Currency
    electricity_per_kwh: float
    pue: float
    psu_efficiency: float
    lifetime_years: float
    utilisation: float
    rent_per_hour: float | None = None  # on demand
    reserved_per_hour: float | None = None  # a committed rental, paid every hour
    purchase_price: float | None = None
    host_price: float = 0.0  # the card's share of the machine around it

    def __post_init__(self) -> None:
        if self.electricity_per_kwh < 0:
            raise ValueError(f"--electricity-per-kwh must be >= 0, got {self.electricity_per_kwh}")
        if self.pue < 1.0:
            raise ValueError(f"--pue must be >= 1.0, got {self.pue}")
        if not 0.0 < self.psu_efficiency <= 1.0:
            raise ValueError(f"--psu-efficiency must be in (0, 1], got {self.psu_efficiency}")
        if self.lifetime_years <= 0:
            raise ValueError(f"--lifetime-years must be > 0, got {self.lifetime_years}")
        if not 0.0 < self.utilisation <= 1.0:
            raise ValueError(f"--utilisation must be in (0, 1], got {self.utilisation}")
        for name in ("rent_per_hour", "reserved_per_hour", "purchase_price", "host_price"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")

    @property
    def capex_per_hour(self) -> float | None:
        """Card and host share, straight-line over the lifetime, per card and hour (every hour)."""
        if self.purchase_price is None:
            return None
        return (self.purchase_price + self.host_price) / (self.lifetime_years * HOURS_PER_YEAR)

    def wall_w(self, dc_w: float) -> float:
        """Facility watts for `dc_w` drawn by cards and host: through the power supply, then the PUE."""
        return dc_w / self.psu_efficiency * self.pue

    def busy_wall_w(self, power: Power) -> float:
        """A busy replica's facility watts: the measured socket figure times the PUE, else the modelled DC draw."""
        return power.wall_busy_w * self.pue if power.wall_busy_w is not None else self.wall_w(power.busy_w)


@dataclass(frozen=True)
class Power:
    """One replica's DC power (after the power supply), busy and idle: its cards and its share of the host; or, when
    measured with a meter at the socket (`wall_busy_w`), that figure for busy hours (PSU loss already in it)."""

    card_busy_w: float
    card_idle_w: float
    host_busy_w: float = 0.0
    host_idle_w: float = 0.0
    wall_busy_w: float | None = None  # measured at the wall (--wall-watts)

    @property
    def busy_w(self) -> float:
        return self.card_busy_w + self.host_busy_w

    @property
    def idle_w(self) -> float:
        return self.card_idle_w + self.host_idle_w


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

    @property
    def utilisation(self) -> float:
        """Share of the fleet's hours (all 24 of each day) it is busy making the demand."""
        return min(1.0, self.replica_hours / (self.replicas * 24.0))

    def to_dict(self) -> dict[str, float]:
        return {"tokens_per_day": self.tokens_per_day, "window_hours": self.window_hours,
                "tokens_per_s_per_replica": self.tokens_per_s_per_replica,
                "cards_per_replica": self.cards_per_replica, "replica_hours": self.replica_hours,
                "gpu_hours": self.gpu_hours, "replicas": self.replicas, "cards": self.cards,
                "utilisation": self.utilisation}


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
    """Per million output tokens of one replica, in the prices' currency; None where a price is missing."""

    tokens_per_s: float  # per replica, while busy
    cards: int  # per replica
    utilisation: float
    power: Power
    wall_busy_w: float  # per replica, at the wall (PSU and PUE included)
    wall_idle_w: float
    on_demand_per_mtok: float | None
    reserved_per_mtok: float | None
    own_per_mtok: float | None
    own_capex_per_mtok: float | None
    own_energy_per_mtok: float
    kwh_per_mtok: float  # at the wall
    break_even_own: float | None  # u* where owning = on demand; None: owning never wins (or no prices)
    break_even_reserved: float | None  # where a reserved rental = on demand
    currency: str

    def options(self) -> list[tuple[str, float]]:
        """(name, per Mtok) for every option that has a price, in a fixed order."""
        out = [("renting on demand", self.on_demand_per_mtok), ("a reserved rental", self.reserved_per_mtok),
               ("owning", self.own_per_mtok)]
        return [(name, value) for name, value in out if value is not None]

    def to_dict(self) -> dict[str, object]:
        return {**{k: v for k, v in self.__dict__.items() if k != "power"}, "power": dict(self.power.__dict__)}


def estimate_cost(tokens_per_s: float, power: Power, cards: int, prices: Prices) -> CostEstimate:
    """Money per million output tokens for one replica of `cards` cards drawing `power`."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens per second must be > 0, got {tokens_per_s}")
    u = prices.utilisation
    mtok_per_busy_hour = tokens_per_s * 3600.0 / 1e6
    wall_busy, wall_idle = prices.busy_wall_w(power), prices.wall_w(power.idle_w)
    e_busy = wall_busy / 1000.0 * prices.electricity_per_kwh  # per replica-hour while busy
    e_idle = wall_idle / 1000.0 * prices.electricity_per_kwh
    energy_per_hour = u * e_busy + (1 - u) * e_idle
    mtok_per_hour = mtok_per_busy_hour * u  # averaged over every hour
    rent_h = prices.rent_per_hour * cards if prices.rent_per_hour is not None else None
    reserved_h = prices.reserved_per_hour * cards if prices.reserved_per_hour is not None else None
    capex_h = prices.capex_per_hour * cards if prices.capex_per_hour is not None else None
    break_even = None
    if rent_h is not None and capex_h is not None and rent_h > e_busy - e_idle:
        u_star = (capex_h + e_idle) / (rent_h - (e_busy - e_idle))
        break_even = u_star if u_star <= 1.0 else None
    reserved_even = reserved_h / rent_h if rent_h and reserved_h is not None and reserved_h <= rent_h else None
    return CostEstimate(
        tokens_per_s=tokens_per_s, cards=cards, utilisation=u, power=power, wall_busy_w=wall_busy,
        wall_idle_w=wall_idle,
        on_demand_per_mtok=rent_h / mtok_per_busy_hour if rent_h is not None else None,
        reserved_per_mtok=reserved_h / mtok_per_hour if reserved_h is not None else None,
        own_per_mtok=(capex_h + energy_per_hour) / mtok_per_hour if capex_h is not None else None,
        own_capex_per_mtok=capex_h / mtok_per_hour if capex_h is not None else None,
        own_energy_per_mtok=energy_per_hour / mtok_per_hour,
        kwh_per_mtok=(u * wall_busy + (1 - u) * wall_idle) / 1000.0 / mtok_per_hour,
        break_even_own=break_even, break_even_reserved=reserved_even, currency=prices.currency.code)


def _threshold(u_star: float, u: float) -> str:
    """A break-even as a percentage, with a decimal when whole percents would print it equal to `u`."""
    return f"{u_star * 100:.1f}%" if round(u_star * 100) == round(u * 100) else pct(u_star)


def verdict(cost: CostEstimate, currency: Currency) -> str:
    """One sentence from the figures as printed: the cheapest option at this utilisation and where that changes."""
    options = cost.options()
    if not options:
        return "No rental or purchase price: give --rent-per-hour or --purchase-price."
    u = cost.utilisation
    shown = [(name, currency.shown(value), value) for name, value in options]
    low = min(s for _, s, _ in shown)
    cheapest = [name for name, s, _ in shown if s == low]
    figure = currency.format(next(v for _, s, v in shown if s == low))
    if len(cheapest) == 1:
        text = f"At {pct(u)} utilisation {cheapest[0]} is cheapest ({figure}/M tokens)"
    else:
        text = f"At {pct(u)} utilisation {' and '.join(cheapest)} cost the same ({figure}/M tokens)"
    names = dict((name, s) for name, s, _ in shown)
    if "owning" in names and "renting on demand" in names:
        if cost.break_even_own is None:
            text += "; owning never beats renting on demand at these prices, even fully busy"
        elif names["owning"] < names["renting on demand"]:
            text += f"; owning beats renting on demand above {_threshold(cost.break_even_own, u)} utilisation"
        elif names["owning"] > names["renting on demand"]:
            text += f"; owning would beat it above {_threshold(cost.break_even_own, u)} utilisation"
        else:
            text += f": {_threshold(cost.break_even_own, u)} is the break-even"
    return text + "."


@dataclass(frozen=True)
class MonthlyBill:
    """A month (8766 h / 12) of `cards` cards busy a share of the hours: power at the wall, kWh and money."""

    replicas: int
    cards: int
    utilisation: float
    card_busy_w: float  # all cards
    card_idle_w: float
    host_busy_w: float
    host_idle_w: float
    psu_efficiency: float
    pue: float
    wall_w: float  # average over the month
    measured_wall_busy_w: float | None  # all replicas, when --wall-watts gave it
    kwh_per_day: float
    kwh_per_month: float
    electricity: float  # money a month
    ownership: float | None  # purchase (cards and host) spread over the lifetime, a month's share
    on_demand: float | None  # renting the busy hours instead
    reserved: float | None  # renting every hour on a commitment

    @property
    def owned_total(self) -> float | None:
        return self.electricity + self.ownership if self.ownership is not None else None

    def to_dict(self) -> dict[str, float | int | None]:
        return {**self.__dict__, "owned_total": self.owned_total}


def monthly_bill(power: Power, cards_per_replica: int, replicas: int, prices: Prices) -> MonthlyBill:
    """The month of `replicas` replicas each drawing `power` (DC), busy `prices.utilisation` of the hours."""
    u, n = prices.utilisation, replicas
    wall = (u * prices.busy_wall_w(power) + (1 - u) * prices.wall_w(power.idle_w)) * n
    kwh_month = wall / 1000.0 * HOURS_PER_MONTH
    cards = cards_per_replica * n
    capex = prices.capex_per_hour
    return MonthlyBill(
        replicas=n, cards=cards, utilisation=u, card_busy_w=power.card_busy_w * n, card_idle_w=power.card_idle_w * n,
        host_busy_w=power.host_busy_w * n, host_idle_w=power.host_idle_w * n, psu_efficiency=prices.psu_efficiency,
        pue=prices.pue, wall_w=wall,
        measured_wall_busy_w=power.wall_busy_w * n if power.wall_busy_w is not None else None,
        kwh_per_day=wall / 1000.0 * 24.0, kwh_per_month=kwh_month,
        electricity=kwh_month * prices.electricity_per_kwh,
        ownership=capex * cards * HOURS_PER_MONTH if capex is not None else None,
        on_demand=prices.rent_per_hour * cards * HOURS_PER_MONTH * u if prices.rent_per_hour is not None else None,
        reserved=prices.reserved_per_hour * cards * HOURS_PER_MONTH if prices.reserved_per_hour is not None else None)
