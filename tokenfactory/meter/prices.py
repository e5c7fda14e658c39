"""Prices: device time and joules into US dollars, from a TOML file with dated, sourced defaults, the one source
of every money default (the meter's, and `tokenfactory plan`/`doctor`/`simulate`'s through `shared_defaults` and
`catalog_prices`).

    cost_device_usd = device_seconds / 3600 · usd_per_device_hour
    cost_energy_usd = joules / psu_efficiency · pue / 3.6e6 [J/kWh] · usd_per_kwh
    cost_usd        = cost_device_usd + cost_energy_usd

A device is rented (usd_per_hour as billed) or owned, its purchase price amortised over its lifetime
at a utilisation, so that the hours it stands idle are paid for by the hours it works:

    usd_per_hour = purchase_usd / (lifetime_years · 8766 h/year · utilisation)

Defaults live in prices.toml next to this file; an override file (argument, or TOKENFACTORY_PRICES)
has the same shape, and each key it sets replaces the default's.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfactory.types import ParameterError

DEFAULT_PRICES_PATH = Path(__file__).with_name("prices.toml")
PRICES_ENV = "TOKENFACTORY_PRICES"
HOURS_PER_YEAR = 8766.0  # 365.25 · 24
J_PER_KWH = 3.6e6
GENERIC_GPU_PROFILE = "gpu"  # an accelerator that no profile's `match` names


def owned_usd_per_hour(purchase_usd: float, lifetime_years: float, utilisation: float) -> float:
    """Amortised cost of one busy hour: purchase / (lifetime hours · utilisation)."""
    return purchase_usd / (lifetime_years * HOURS_PER_YEAR * utilisation)


@dataclass(frozen=True)
class DevicePrice:
    profile: str  # key under [devices] in the prices file
    basis: str  # "rented" | "owned"
    usd_per_hour: float  # per device; for owned devices, the amortised figure
    as_of: str
    source: str


@dataclass(frozen=True)
class Prices:
    """Everything cost needs. The overhead factors are applied to joules only inside cost and shown."""

    device: DevicePrice
    usd_per_kwh: float
    psu_efficiency: float  # DC out / AC in: counters measure after the power supply, the bill before it
    pue: float
    electricity_as_of: str
    electricity_source: str
    path: str  # the file(s) the figures came from

    @property
    def psu_loss_factor(self) -> float:
        """Wall joules per joule drawn after the power supply: 1 / psu_efficiency."""
        return 1.0 / self.psu_efficiency

    @property
    def energy_overhead_factor(self) -> float:
        """Wall-and-facility joules per measured joule: pue / psu_efficiency."""
        return self.psu_loss_factor * self.pue

    def device_cost_usd(self, device_seconds: float) -> float:
        return device_seconds / 3600.0 * self.device.usd_per_hour

    def energy_cost_usd(self, joules: float) -> float:
        return joules * self.energy_overhead_factor / J_PER_KWH * self.usd_per_kwh

    def describe(self) -> str:
        return (f"{self.device.profile} ({self.device.basis}) {self.device.usd_per_hour:.4g} USD/h as of "
                f"{self.device.as_of}; electricity {self.usd_per_kwh:g} USD/kWh as of {self.electricity_as_of}; "
                f"overheads psu efficiency {self.psu_efficiency:g}, pue {self.pue:g}")


def load_price_table(path: Path | None = None) -> dict[str, Any]:
    """The default table, with `path` (or $TOKENFACTORY_PRICES) merged over it key by key."""
    table = _read_toml(DEFAULT_PRICES_PATH)
    override = path if path is not None else os.environ.get(PRICES_ENV)
    if override:
        _merge(table, _legacy_keys(_read_toml(Path(override)), Path(override)))
    return table


def _legacy_keys(table: dict[str, Any], path: Path) -> dict[str, Any]:
    """An override file's [overheads] psu_loss_factor (wall / DC, the older spelling) as psu_efficiency."""
    overheads = table.get("overheads", {})
    if "psu_loss_factor" in overheads:
        if "psu_efficiency" in overheads:
            raise ParameterError("overheads.psu_loss_factor", f"prices file {path} gives both overheads.psu_efficiency "
                                 "and overheads.psu_loss_factor (its inverse): keep one")
        factor = overheads.pop("psu_loss_factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1.0:
            raise ParameterError("overheads.psu_loss_factor",
                                 f"overheads.psu_loss_factor must be a number >= 1, got {factor!r}")
        overheads["psu_efficiency"] = 1.0 / factor
    return table


def load_prices(path: Path | None = None, device: str | None = None, device_name: str | None = None,
                device_type: str = "cpu") -> Prices:
    """Prices for one device profile: `device` names it; else select_device_profile(device_type,
    device_name)."""
    table = load_price_table(path)
    profiles = table.get("devices", {})
    profile = device if device is not None else select_device_profile(profiles, device_type, device_name)
    if profile not in profiles:
        raise ParameterError("device_profile", f"device_profile {profile!r} is not in the prices file; "
                                               f"known: {', '.join(sorted(profiles))}")
    electricity, overheads = table.get("electricity", {}), table.get("overheads", {})
    override = path if path is not None else os.environ.get(PRICES_ENV)
    return Prices(
        device=_device_price(profile, resolve_profile(profiles, profile), _number(
            table.get("owning", {}), "owning", "lifetime_years", minimum=1e-9), _number(
            table.get("owning", {}), "owning", "utilisation", minimum=0.0)),
        usd_per_kwh=_number(electricity, "electricity", "usd_per_kwh", minimum=0.0),
        psu_efficiency=_efficiency(overheads),
        pue=_number(overheads, "overheads", "pue", minimum=1.0),
        electricity_as_of=str(electricity.get("as_of", "unknown")),
        electricity_source=str(electricity.get("source", "unknown")),
        path=f"{DEFAULT_PRICES_PATH}" + (f" + {override}" if override else ""),
    )


def select_device_profile(profiles: dict[str, Any], device_type: str, device_name: str | None) -> str:
    """The profile for the device a server runs on: the first whose `match` substrings occur in its name
    (torch's or NVML's, e.g. "NVIDIA H100 80GB HBM3"); an accelerator no profile matches gets the generic
    "gpu" profile, never the CPU's rate (serving on a GPU used to be priced as a CPU unless
    --device-profile was given); a CPU gets "cpu"."""
    matched = match_device_profile(profiles, device_name)
    if matched == "cpu" and device_type != "cpu" and GENERIC_GPU_PROFILE in profiles:
        return GENERIC_GPU_PROFILE
    return matched


def match_device_profile(profiles: dict[str, Any], device_name: str | None) -> str:
    if device_name:
        for key, profile in profiles.items():
            if any(m.lower() in device_name.lower() for m in profile.get("match", [])):
                return key
    return "cpu"


def resolve_profile(profiles: dict[str, Any], key: str) -> dict[str, Any]:
    """A device profile with the keys of the profile it is `like` (and that one's, ...) filled in."""
    entry, seen = dict(profiles[key]), {key}
    while "like" in entry:
        base = entry.pop("like")
        if base not in profiles or base in seen:
            raise ParameterError(f"devices.{key}.like", f"devices.{key}.like names {base!r}, which is not a profile "
                                 "(or makes a loop)")
        seen.add(base)
        entry = {**profiles[base], **entry}
    return entry


def _efficiency(overheads: dict[str, Any]) -> float:
    value = _number(overheads, "overheads", "psu_efficiency", minimum=0.0)
    if not 0.0 < value <= 1.0:
        raise ParameterError("overheads.psu_efficiency", f"overheads.psu_efficiency must be in (0, 1], got {value}")
    return value


@dataclass(frozen=True)
class SharedDefaults:
    """The money defaults every command shares (plan, doctor, simulate and the meter), in US$, each with its
    date and source: one definition, in prices.toml."""

    usd_per_kwh: float
    psu_efficiency: float
    pue: float
    lifetime_years: float
    utilisation: float
    reserved_fraction: float
    host_usd_per_card: dict[str, float]  # host kind (server, desktop) -> purchase price per card
    currencies: dict[str, float]  # ISO code -> units per US dollar
    sources: dict[str, str]  # section -> "as_of: source"


def shared_defaults(path: Path | None = None) -> SharedDefaults:
    table = load_price_table(path)
    owning, renting = table.get("owning", {}), table.get("renting", {})
    utilisation = _number(owning, "owning", "utilisation", minimum=0.0)
    if not 0.0 < utilisation <= 1.0:
        raise ParameterError("owning.utilisation", f"owning.utilisation must be in (0, 1], got {utilisation}")
    currencies = {str(k).upper(): float(v) for k, v in table.get("currencies", {}).items()
                  if isinstance(v, int | float) and not isinstance(v, bool)}
    hosts = {kind: _number(entry, f"host.{kind}", "purchase_usd_per_card", minimum=0.0)
             for kind, entry in table.get("host", {}).items()}
    sections = ("electricity", "overheads", "owning", "renting", "currencies")
    return SharedDefaults(
        usd_per_kwh=_number(table.get("electricity", {}), "electricity", "usd_per_kwh", minimum=0.0),
        psu_efficiency=_efficiency(table.get("overheads", {})),
        pue=_number(table.get("overheads", {}), "overheads", "pue", minimum=1.0),
        lifetime_years=_number(owning, "owning", "lifetime_years", minimum=1e-9), utilisation=utilisation,
        reserved_fraction=_number(renting, "renting", "reserved_fraction", minimum=0.0),
        host_usd_per_card=hosts, currencies=currencies,
        sources={s: f"{table.get(s, {}).get('as_of', 'unknown')}: {table.get(s, {}).get('source', 'unknown')}"
                 for s in sections})


@dataclass(frozen=True)
class CatalogPrice:
    """A planner catalog device's prices, from the profile whose `catalog` names it (US$)."""

    profile: str
    rent_usd_per_hour: float | None
    rent_as_of: str
    rent_source: str
    purchase_usd: float | None
    purchase_as_of: str
    purchase_source: str
    host: str  # a key of [host] ("server", "desktop") or "none"


def catalog_prices(path: Path | None = None) -> dict[str, CatalogPrice]:
    """Planner device name (lower-case) -> its prices: the one definition of every card's rent and price."""
    profiles = load_price_table(path).get("devices", {})
    out = {}
    for key, raw in profiles.items():
        if "catalog" not in raw:
            continue
        entry = resolve_profile(profiles, key)
        rent = entry.get("usd_per_hour") if entry.get("basis", "rented") == "rented" else None
        out[str(raw["catalog"]).lower()] = CatalogPrice(
            key, float(rent) if rent is not None else None, str(entry.get("as_of", "unknown")),
            str(entry.get("source", "unknown")), float(entry["purchase_usd"]) if "purchase_usd" in entry else None,
            str(entry.get("purchase_as_of", "unknown")), str(entry.get("purchase_source", "unknown")),
            str(entry.get("host", "server")))
    return out


def _device_price(key: str, entry: dict[str, Any], lifetime_years: float, utilisation: float) -> DevicePrice:
    where = f"devices.{key}"
    basis = entry.get("basis", "rented")
    if basis == "rented":
        usd_per_hour = _number(entry, where, "usd_per_hour", minimum=0.0)
    elif basis == "owned":
        utilisation = _number(entry, where, "utilisation", minimum=0.0) if "utilisation" in entry else utilisation
        if not 0.0 < utilisation <= 1.0:
            raise ParameterError(f"{where}.utilisation", f"{where}.utilisation must be in (0, 1], got {utilisation}")
        lifetime = _number(entry, where, "lifetime_years", minimum=1e-9) if "lifetime_years" in entry else \
            lifetime_years
        usd_per_hour = owned_usd_per_hour(_number(entry, where, "purchase_usd", minimum=0.0), lifetime, utilisation)
    else:
        raise ParameterError(f"{where}.basis", f"{where}.basis must be 'rented' or 'owned', got {basis!r}")
    return DevicePrice(key, basis, usd_per_hour, str(entry.get("as_of", "unknown")),
                       str(entry.get("source", "unknown")))


def _number(table: dict[str, Any], where: str, key: str, minimum: float) -> float:
    if key not in table:
        raise ParameterError(f"{where}.{key}", f"the prices file has no {where}.{key}")
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ParameterError(f"{where}.{key}", f"{where}.{key} must be a number >= {minimum:g}, got {value!r}")
    return float(value)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"prices file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"prices file {path} is not valid TOML: {e}") from None


def _merge(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
