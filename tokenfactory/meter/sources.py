"""The registry of power sources, and `auto`: nvml if a GPU answers, else rapl if readable, else modelled.

    open_power_source(PowerConfig(source="auto"))       # what a server does by default
    open_power_source(PowerConfig(source="nvml+rapl"))  # GPUs plus CPU packages and DRAM
    open_power_source(PowerConfig(source="constant", constant_watts=450))

A named source that cannot measure comes back as an UnavailableSource (reads are None, the reason is
in `unavailable_reason`): asking for nvml on a machine without a GPU is not an error, it is a meter
that reports energy as null and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenfactory.meter.modelled import open_modelled
from tokenfactory.meter.nvml import open_nvml
from tokenfactory.meter.power import ConstantSource, PowerConfig, PowerSource, SumSource, UnavailableSource
from tokenfactory.meter.rapl import open_rapl
from tokenfactory.types import ParameterError

SourceFactory = Callable[[PowerConfig], PowerSource]


def open_constant(config: PowerConfig) -> PowerSource:
    if config.constant_watts is None:
        raise ParameterError("constant_watts", "the constant power source needs constant_watts "
                                               "(the watts the operator declares for its scope)")
    return ConstantSource(config.constant_watts, config.constant_scope)


SOURCE_FACTORIES: dict[str, SourceFactory] = {
    "nvml": open_nvml,
    "rapl": open_rapl,
    "modelled": open_modelled,
    "constant": open_constant,
}

AUTO_ORDER: tuple[str, ...] = ("nvml", "rapl", "modelled")


@dataclass(frozen=True)
class SourceChoice:
    """The opened source, and why each source tried before it by `auto` was skipped."""

    source: PowerSource
    skipped: tuple[str, ...] = ()


def open_power_source(config: PowerConfig) -> PowerSource:
    """Open the configured source (a name, "auto", or names joined with "+")."""
    return choose_power_source(config).source


def choose_power_source(config: PowerConfig) -> SourceChoice:
    """Like open_power_source, also saying what `auto` skipped (for the server's start-up line)."""
    choices = [_open_one(name, config) for name in config.source.split("+")]
    skipped = tuple(reason for choice in choices for reason in choice.skipped)
    if len(choices) == 1:
        return SourceChoice(choices[0].source, skipped)
    return SourceChoice(SumSource([c.source for c in choices]), skipped)


def _open_one(name: str, config: PowerConfig) -> SourceChoice:
    if name == "auto":
        return open_auto(config)
    factory = SOURCE_FACTORIES.get(name)
    if factory is None:
        raise ParameterError("power_source", f"power_source {name!r} is unknown; choose auto or one of "
                                             f"{', '.join(SOURCE_FACTORIES)} (joined with '+' to add)")
    return SourceChoice(factory(config))


def open_auto(config: PowerConfig) -> SourceChoice:
    """The first source of AUTO_ORDER that can measure (modelled always can)."""
    skipped: list[str] = []
    for name in AUTO_ORDER:
        source = SOURCE_FACTORIES[name](config)
        if source.unavailable_reason is None:
            return SourceChoice(source, tuple(skipped))
        skipped.append(f"{name}: {source.unavailable_reason}")
    return SourceChoice(UnavailableSource("auto", "; ".join(skipped)), tuple(skipped))
