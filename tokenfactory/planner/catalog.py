"""The planner's catalog: devices, models and default factors, read from data files in which every
number carries a source and a date.

The bundled files live in `tokenfactory/planner/data/` (TOML). Users extend or override them with
`--catalog PATH`, where PATH is a TOML or JSON file of the same schema, or a directory of such files;
later files win by (case-insensitive) name. A file may hold `[[device]]`, `[[model]]`,
`[[efficiency]]` (per-device factor overrides) and `[sources]` (short keys for long citations).

A bundled card's rent and purchase price come from the meter's prices file (meter/prices.toml, the profile whose
`catalog` names it): one definition for the bill a server writes and the plan made before it.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

DATA_DIR = Path(__file__).parent / "data"
BUNDLED_FILES = ("devices.toml", "models.toml", "defaults.toml")
GIB = 1024**3

T = TypeVar("T")

# Compute dtypes a device may list a dense peak for, and the catalog key holding it (TFLOP/s or TOP/s).
FLOPS_KEYS = {"bf16": "tflops_bf16", "fp16": "tflops_fp16", "fp8": "tflops_fp8",
              "int8": "tops_int8", "fp32": "tflops_fp32"}
DEVICE_KINDS = ("gpu", "cpu")


class CatalogError(ValueError):
    """A catalog file is malformed; the message names the file, the entry and the field."""


@dataclass(frozen=True)
class Sourced:
    """A number with where it came from and when."""

    value: float
    source: str
    date: str

    def to_dict(self) -> dict[str, float | str]:
        return {"value": self.value, "source": self.source, "date": self.date}


@dataclass(frozen=True)
class Device:
    """One accelerator (or a CPU server), with its dense peaks, power and prices."""

    name: str
    kind: str  # "gpu" | "cpu"
    description: str
    memory_gib: Sourced
    bandwidth_gbps: Sourced  # 10^9 bytes/s
    flops: Mapping[str, Sourced]  # compute dtype -> dense TFLOP/s (TOP/s for int8)
    tdp_w: Sourced
    idle_w: Sourced
    price_usd: Sourced | None = None
    rent_usd_per_hour: Sourced | None = None
    aliases: tuple[str, ...] = ()
    host: str = "server"  # the machine around the card: a key of defaults.toml [host.*]

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib.value * GIB)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps.value * 1e9

    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for `dtype`; a dtype without its own units (fp8 on an A100) runs at
        the 16-bit rate, and fp16/bf16 stand in for each other."""
        for key in (dtype, "bf16" if dtype == "fp16" else "fp16", "bf16", "fp32"):
            if key in self.flops:
                return self.flops[key].value * 1e12
        raise CatalogError(f"device {self.name!r} lists no compute peak (tflops_bf16, tflops_fp32, ...)")

    def compute_dtype(self, dtype: str) -> str:
        """The dtype whose peak `peak_flops(dtype)` actually uses (for reports)."""
        for key in (dtype, "bf16" if dtype == "fp16" else "fp16", "bf16", "fp32"):
            if key in self.flops:
                return key
        return dtype


@dataclass(frozen=True)
class ModelEntry:
    """A catalog model: the fields of tokenfactory.config.ModelConfig plus provenance."""

    name: str
    fields: Mapping[str, Any]
    source: str
    date: str
    published_params_b: Sourced | None = None
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Catalog:
    devices: Mapping[str, Device]  # lower-case name -> device
    models: Mapping[str, ModelEntry]  # lower-case name -> model
    defaults: Mapping[str, Mapping[str, Sourced]]  # section -> key -> number
    device_efficiency: Mapping[str, Mapping[str, Sourced]] = field(default_factory=dict)  # device -> key
    files: tuple[str, ...] = ()

    def device(self, name: str) -> Device:
        found = _lookup(self.devices, name)
        if found is None:
            raise CatalogError(f"unknown device {name!r}; known devices: {', '.join(self.device_names())} "
                               "(add one with --catalog my-devices.toml)")
        return found

    def model(self, name: str) -> ModelEntry | None:
        return _lookup(self.models, name)

    def device_names(self) -> list[str]:
        return sorted({d.name for d in self.devices.values()})

    def model_names(self) -> list[str]:
        return sorted({m.name for m in self.models.values()})

    def default(self, section: str, key: str) -> Sourced:
        try:
            return self.defaults[section][key]
        except KeyError:
            raise CatalogError(f"the catalog has no default {section}.{key}") from None


def _lookup(table: Mapping[str, T], name: str) -> T | None:
    return table.get(name.strip().lower())


@cache
def _bundled() -> Catalog:
    return _merge([_read_file(DATA_DIR / f) for f in BUNDLED_FILES])


def load_catalog(extra: Iterable[str | Path] = ()) -> Catalog:
    """The bundled catalog, extended by each file or directory in `extra` (later wins by name), its cards priced
    from the meter's prices file where their own entry gives no price."""
    paths = [Path(p) for p in extra]
    if not paths:
        return _priced(_bundled())
    raw = [_read_file(DATA_DIR / f) for f in BUNDLED_FILES]
    for path in paths:
        raw.extend(_read_file(f) for f in _catalog_files(path))
    return _priced(_merge(raw))


def _priced(catalog: Catalog) -> Catalog:
    from tokenfactory.meter.prices import catalog_prices  # the one source of money figures (#30)

    prices = catalog_prices()
    priced: dict[int, Device] = {}
    for dev in {id(d): d for d in catalog.devices.values()}.values():
        p = prices.get(dev.name.lower())
        if p is None:
            continue
        rent = dev.rent_usd_per_hour or (Sourced(p.rent_usd_per_hour, p.rent_source, p.rent_as_of)
                                         if p.rent_usd_per_hour is not None else None)
        price = dev.price_usd or (Sourced(p.purchase_usd, p.purchase_source, p.purchase_as_of)
                                  if p.purchase_usd is not None else None)
        priced[id(dev)] = replace(dev, rent_usd_per_hour=rent, price_usd=price)
    devices = {k: priced.get(id(d), d) for k, d in catalog.devices.items()}
    return replace(catalog, devices=devices)


def _catalog_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".toml", ".json"))
        if not files:
            raise CatalogError(f"--catalog directory {path} holds no .toml or .json files")
        return files
    if not path.exists():
        raise FileNotFoundError(f"--catalog file {path} does not exist")
    return [path]


@dataclass
class _RawFile:
    path: Path
    data: dict[str, Any]


def _read_file(path: Path) -> _RawFile:
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            with path.open("rb") as f:
                data = tomllib.load(f)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise CatalogError(f"catalog file {path}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise CatalogError(f"catalog file {path}: expected a table at the top level")
    return _RawFile(path, data)


def _merge(files: list[_RawFile]) -> Catalog:
    devices: dict[str, Device] = {}
    models: dict[str, ModelEntry] = {}
    defaults: dict[str, dict[str, Sourced]] = {}
    overrides: dict[str, dict[str, Sourced]] = {}
    for raw in files:
        sources = {str(k): str(v) for k, v in raw.data.get("sources", {}).items()}
        ctx = _Ctx(raw.path, sources)
        for entry in raw.data.get("device", []):
            dev = _parse_device(entry, ctx)
            for key in (dev.name, *dev.aliases):
                devices[key.lower()] = dev
        for entry in raw.data.get("model", []):
            model = _parse_model(entry, ctx)
            for key in (model.name, *model.aliases):
                models[key.lower()] = model
        for section in ("efficiency", "kernel_bandwidth", "tensor_parallel", "power", "runtime", "host"):
            _merge_defaults(raw.data.get(section), section, ctx, defaults, overrides)
    return Catalog(devices, models, defaults, overrides, tuple(str(f.path) for f in files))


def _merge_defaults(section_data: Any, section: str, ctx: _Ctx, defaults: dict[str, dict[str, Sourced]],
                    overrides: dict[str, dict[str, Sourced]]) -> None:
    if section_data is None:
        return
    if section == "efficiency" and isinstance(section_data, list):  # [[efficiency]] device = "..."
        for entry in section_data:
            dev = ctx.text(entry, "device", "efficiency")
            factors = {k: ctx.number(entry, k, f"efficiency[{dev}]") for k in entry if k != "device"}
            overrides.setdefault(dev.lower(), {}).update(factors)
        return
    if not isinstance(section_data, dict):
        raise CatalogError(f"catalog file {ctx.path}: [{section}] must be a table")
    if section in ("efficiency", "host"):  # [efficiency.gpu], [efficiency.cpu]; [host.server], [host.desktop]
        for kind, table in section_data.items():
            defaults.setdefault(f"{section}.{kind}", {}).update(
                {k: ctx.number(table, k, f"{section}.{kind}") for k in table})
        return
    defaults.setdefault(section, {}).update({k: ctx.number(section_data, k, section) for k in section_data})


@dataclass(frozen=True)
class _Ctx:
    path: Path
    sources: Mapping[str, str]

    def number(self, entry: Mapping[str, Any], key: str, where: str) -> Sourced:
        item = entry.get(key)
        if not isinstance(item, dict) or "value" not in item:
            raise CatalogError(f"catalog file {self.path}: {where}.{key} must be "
                               "{ value = ..., source = \"...\", date = \"YYYY-MM\" }")
        missing = [k for k in ("source", "date") if not str(item.get(k, "")).strip()]
        if missing:
            raise CatalogError(f"catalog file {self.path}: {where}.{key} has no {' and no '.join(missing)}; "
                               "every number needs a source and a date")
        value = item["value"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CatalogError(f"catalog file {self.path}: {where}.{key}.value must be a number, got {value!r}")
        return Sourced(float(value), self.expand(str(item["source"])), str(item["date"]))

    def expand(self, source: str) -> str:
        """`key` or `key: note` where key is in [sources] becomes the full citation (plus the note)."""
        key, _, note = source.partition(":")
        if key.strip() in self.sources:
            full = self.sources[key.strip()]
            return f"{full} ({note.strip()})" if note.strip() else full
        return source

    def text(self, entry: Mapping[str, Any], key: str, where: str) -> str:
        value = entry.get(key)
        if not isinstance(value, str) or not value.strip():
            raise CatalogError(f"catalog file {self.path}: {where} entry needs a non-empty {key!r}")
        return value


_DEVICE_REQUIRED = ("memory_gib", "bandwidth_gbps", "tdp_w", "idle_w")


def _parse_device(entry: Mapping[str, Any], ctx: _Ctx) -> Device:
    name = ctx.text(entry, "name", "device")
    where = f"device[{name}]"
    kind = entry.get("kind", "gpu")
    if kind not in DEVICE_KINDS:
        raise CatalogError(f"catalog file {ctx.path}: {where}.kind must be one of {DEVICE_KINDS}, got {kind!r}")
    num = {k: ctx.number(entry, k, where) for k in _DEVICE_REQUIRED}
    flops = {dtype: ctx.number(entry, key, where) for dtype, key in FLOPS_KEYS.items() if key in entry}
    if not flops:
        raise CatalogError(f"catalog file {ctx.path}: {where} needs at least one compute peak "
                           f"({', '.join(FLOPS_KEYS.values())})")
    optional = {k: ctx.number(entry, k, where) if k in entry else None
                for k in ("price_usd", "rent_usd_per_hour")}
    for key, item in {**num, **flops}.items():
        if item.value <= 0:
            raise CatalogError(f"catalog file {ctx.path}: {where}.{key} must be > 0, got {item.value}")
    host = str(entry.get("host", "server" if kind == "gpu" else "none"))
    return Device(name=name, kind=kind, description=str(entry.get("description", name)),
                  memory_gib=num["memory_gib"], bandwidth_gbps=num["bandwidth_gbps"], flops=flops,
                  tdp_w=num["tdp_w"], idle_w=num["idle_w"], price_usd=optional["price_usd"],
                  rent_usd_per_hour=optional["rent_usd_per_hour"], aliases=tuple(entry.get("aliases", ())),
                  host=host)


_MODEL_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings")
_MODEL_OPTIONAL = ("rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "sliding_window")


def _parse_model(entry: Mapping[str, Any], ctx: _Ctx) -> ModelEntry:
    name = ctx.text(entry, "name", "model")
    where = f"model[{name}]"
    source = ctx.text(entry, "source", where)
    date = ctx.text(entry, "date", where)
    fields: dict[str, Any] = {"architecture": ctx.text(entry, "architecture", where), "name": name}
    for key in _MODEL_INT_FIELDS:
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise CatalogError(f"catalog file {ctx.path}: {where}.{key} must be a positive integer, got {value!r}")
        fields[key] = value
    fields.update({k: entry[k] for k in _MODEL_OPTIONAL if k in entry})
    published = ctx.number(entry, "published_params_b", where) if "published_params_b" in entry else None
    return ModelEntry(name=name, fields=fields, source=ctx.expand(source), date=date,
                      published_params_b=published, aliases=tuple(entry.get("aliases", ())))
