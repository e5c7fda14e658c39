"""A replica's hardware as the model sees it: a catalog device times a tensor-parallel count, with the
efficiency factors that turn datasheet peaks into achievable rates."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from tokenfactory.planner.catalog import GIB, Catalog, Device
from tokenfactory.planner.precision import Precision


@dataclass(frozen=True)
class Efficiency:
    """Achievable shares of the peaks, and a fixed host cost per engine step."""

    bandwidth: float  # of peak memory bandwidth, for a bf16 weight stream and KV reads
    compute: float  # of the dense peak of the compute dtype
    step_overhead_s: float = 0.0  # per step, not hidden behind device work
    source: str = "catalog defaults"

    def __post_init__(self) -> None:
        for name in ("bandwidth", "compute"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {value}")
        if self.step_overhead_s < 0:
            raise ValueError(f"efficiency step_overhead_s must be >= 0, got {self.step_overhead_s}")


@dataclass(frozen=True)
class PowerModel:
    """Board power = idle + (TDP - idle) * activity (Fan, Weber & Barroso 2007, per-resource activity):
    activity is `memory_bound_activity` while streaming memory and `compute_bound_activity` while the
    tensor cores are the bottleneck; host overhead time counts as idle."""

    memory_bound_activity: float
    compute_bound_activity: float

    def __post_init__(self) -> None:
        for name in ("memory_bound_activity", "compute_bound_activity"):
            if not 0.0 <= getattr(self, name) <= 1.5:
                raise ValueError(f"power {name} must be in [0, 1.5], got {getattr(self, name)}")


@dataclass(frozen=True)
class Hardware:
    """One model replica: `count` cards of `device` in tensor parallel."""

    device: Device
    count: int
    efficiency: Efficiency
    power: PowerModel
    tp_scaling_per_doubling: float
    kernel_bandwidth: Mapping[str, float] = field(default_factory=dict)  # precision family -> factor
    runtime_overhead_bytes: int = GIB  # per card
    memory_utilization: float = 0.9  # share of a card's memory the engine may use
    host_busy_w: float = 0.0  # per card: its share of the machine around it (defaults.toml [host.*])
    host_idle_w: float = 0.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"--devices must be >= 1, got {self.count}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory utilisation must be in (0, 1], got {self.memory_utilization}")

    @cached_property
    def tp_factor(self) -> float:
        """Aggregate speed-up of `count` cards over one is count * tp_factor (communication losses)."""
        return self.tp_scaling_per_doubling ** math.log2(self.count)

    def weight_bandwidth(self, precision: Precision) -> float:
        """Bytes/s at which the replica streams weights of `precision` (dequantising kernels are slower)."""
        kernel = self.kernel_bandwidth.get(precision.family, 1.0)
        return self.kv_bandwidth * kernel

    @cached_property
    def kv_bandwidth(self) -> float:
        """Bytes/s of the replica for KV reads (and a bf16 weight stream), before TP losses."""
        return self.count * self.device.bandwidth_bytes_per_s * self.efficiency.bandwidth

    def flops(self, dtype: str) -> float:
        """Achievable FLOP/s of the replica in `dtype`, before TP losses."""
        return self.count * self.device.peak_flops(dtype) * self.efficiency.compute

    def communication_s(self, busy_s: float) -> float:
        """Time tensor parallelism adds to `busy_s` of ideal device time: the replica runs at
        count * tp_factor cards' speed, so the rest is spent waiting on all-reduces."""
        return busy_s * (1.0 / self.tp_factor - 1.0)

    def card_power_w(self, memory_s: float, compute_s: float, idle_s: float) -> float:
        """Average power of one card over a step split into memory-bound, compute-bound and idle time
        (host overhead, all-reduce waits)."""
        total = memory_s + compute_s + idle_s
        if total <= 0:
            return self.device.idle_w.value
        activity = (self.power.memory_bound_activity * memory_s
                    + self.power.compute_bound_activity * compute_s) / total
        idle, tdp = self.device.idle_w.value, self.device.tdp_w.value
        return idle + (tdp - idle) * min(activity, 1.0)

    def with_efficiency(self, efficiency: Efficiency) -> Hardware:
        return replace(self, efficiency=efficiency)


def default_efficiency(catalog: Catalog, device: Device) -> Efficiency:
    """The catalog's factors for this device kind, overridden by any [[efficiency]] entry for it."""
    section = f"efficiency.{device.kind}"
    values = {k: catalog.default(section, k) for k in ("bandwidth", "compute", "step_overhead_s")}
    override = {}
    for key in (device.name, *device.aliases):
        override.update(catalog.device_efficiency.get(key.lower(), {}))
    values.update({k: v for k, v in override.items() if k in values})
    source = "; ".join(sorted({f"{k}: {v.source} ({v.date})" for k, v in values.items()}))
    return Efficiency(values["bandwidth"].value, values["compute"].value,
                      values["step_overhead_s"].value, source=source)


def hardware_from_catalog(catalog: Catalog, device: Device, count: int = 1,
                          efficiency: Efficiency | None = None, power: PowerModel | None = None) -> Hardware:
    kind = device.kind
    return Hardware(
        device=device, count=count,
        efficiency=efficiency or default_efficiency(catalog, device),
        power=power or PowerModel(catalog.default("power", "memory_bound_activity").value,
                                  catalog.default("power", "compute_bound_activity").value),
        tp_scaling_per_doubling=catalog.default("tensor_parallel", "scaling_per_doubling").value,
        kernel_bandwidth={k: v.value for k, v in catalog.defaults.get("kernel_bandwidth", {}).items()},
        runtime_overhead_bytes=int(catalog.default("runtime", f"{kind}_overhead_gib").value * GIB),
        memory_utilization=catalog.default("runtime", f"{kind}_memory_utilization").value,
        host_busy_w=catalog.default(f"host.{device.host}", "busy_w").value,
        host_idle_w=catalog.default(f"host.{device.host}", "idle_w").value,
    )
