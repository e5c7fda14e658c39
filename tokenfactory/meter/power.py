"""Power sources: where the meter's joules come from, each reading labelled with its source and scope.

Every source is a cumulative energy counter. `read()` returns the joules spent since the source was
opened (never decreasing: wraparound and counter resets are handled inside the source), the
monotonic time of the reading, the source's label and what the joules cover (`scope`). A source that
cannot measure returns None: missing energy is None, never 0.

Scopes say what the joules cover, so that GPU-only energy is never called whole-machine energy:

    gpu            NVIDIA board power of the selected GPUs (nvml)
    cpu-package    CPU package(s): cores, caches, uncore (rapl, modelled)
    dram           memory attached to the CPU (rapl, when the domain exists)
    machine        the whole machine, as the operator declares it (constant)

A combination joins scopes with "+" ("gpu+cpu-package+dram"). Power-supply losses and a facility's
PUE are not applied here: prices.py applies them, and shows them, separately.

The implementations live in nvml.py, rapl.py and modelled.py; sources.py is the registry that chooses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tokenfactory.types import ParameterError

Clock = Callable[[], float]

SCOPES = ("gpu", "cpu-package", "dram", "machine")


@dataclass(frozen=True)
class EnergyReading:
    """One reading of a cumulative counter."""

    joules: float  # J spent since the source was opened; never decreases
    timestamp: float  # time.monotonic() seconds (or the source's injected clock)
    source: str  # label: nvml | rapl | modelled | constant | a+b
    scope: str  # gpu | cpu-package | dram | machine, joined with "+"
    # J per part since the source was opened, e.g. {"gpu0": 12.5, "gpu1": 11.0}; sums to `joules`.
    joules_by_component: dict[str, float] = field(default_factory=dict)


class PowerSource(Protocol):
    """A cumulative energy counter.

    Implementations must keep true:
    - `read()` is safe to call from any thread (implementations lock), and cheap: no I/O beyond
      reading the counter itself (the engine's step loop calls it after every step).
    - Successive readings have non-decreasing `joules` and `timestamp`.
    - `read()` returns None exactly when no energy can be measured now; `unavailable_reason` then
      says why when the source could not start at all.
    - `name` and `scope` never change, and `scope` names only what is measured (see module docstring).
    """

    @property
    def name(self) -> str: ...

    @property
    def scope(self) -> str: ...

    @property
    def unavailable_reason(self) -> str | None: ...

    def describe(self) -> str: ...

    def read(self) -> EnergyReading | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PowerConfig:
    """Which source to open and how. `source` is a registry name, "auto", or names joined with "+"."""

    source: str = "auto"  # auto | nvml | rapl | modelled | constant | e.g. nvml+rapl
    gpu_indices: tuple[int, ...] | None = None  # nvml: NVML device indices; None: every GPU
    nvml_poll_interval_s: float = 0.1  # nvml: power-polling fallback's sampling period
    rapl_root: Path = Path("/sys/class/powercap")
    rapl_include_dram: bool = True
    cpu_tdp_watts: float | None = None  # modelled: the machine's CPU TDP; None: from the table
    cpu_model: str | None = None  # modelled: CPU model string; None: read from /proc/cpuinfo
    count_child_processes: bool = False  # modelled: the load includes child processes (a fleet's replicas)
    cpu_share: int | None = None  # modelled: this many of the machine's CPUs are ours (a replica's share); None: all
    constant_watts: float | None = None  # constant: required
    constant_scope: str = "machine"  # constant: what the declared watts cover

    def __post_init__(self) -> None:
        if not self.source or any(not part for part in self.source.split("+")):
            raise ParameterError("power_source", f"power_source must be a name, got {self.source!r}")
        if self.nvml_poll_interval_s <= 0:
            raise ParameterError("nvml_poll_interval_s",
                                 f"nvml_poll_interval_s must be > 0, got {self.nvml_poll_interval_s}")
        if self.cpu_share is not None and self.cpu_share < 1:
            raise ParameterError("cpu_share", f"cpu_share must be >= 1, got {self.cpu_share}")
        if self.cpu_tdp_watts is not None and self.cpu_tdp_watts <= 0:
            raise ParameterError("cpu_tdp_watts", f"cpu_tdp_watts must be > 0, got {self.cpu_tdp_watts}")
        if self.constant_watts is not None and self.constant_watts < 0:
            raise ParameterError("constant_watts", f"constant_watts must be >= 0, got {self.constant_watts}")
        if any(part not in SCOPES for part in self.constant_scope.split("+")):
            raise ParameterError("constant_scope", f"constant_scope must be made of {', '.join(SCOPES)} "
                                                   f"joined with '+', got {self.constant_scope!r}")
        if self.gpu_indices is not None:
            object.__setattr__(self, "gpu_indices", tuple(self.gpu_indices))
        object.__setattr__(self, "rapl_root", Path(self.rapl_root))


class UnavailableSource:
    """The null source: it cannot measure, says why, and every read is None."""

    def __init__(self, name: str, reason: str, scope: str = "") -> None:
        self._name, self._reason, self._scope = name, reason, scope

    @property
    def name(self) -> str:
        return self._name

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def unavailable_reason(self) -> str | None:
        return self._reason

    def describe(self) -> str:
        return f"{self._name}: unavailable ({self._reason})"

    def read(self) -> EnergyReading | None:
        return None

    def close(self) -> None:
        pass


class ConstantSource:
    """Watts declared by the operator: energy = watts × seconds since opened. Labelled `constant`."""

    def __init__(self, watts: float, scope: str = "machine", clock: Clock = time.monotonic) -> None:
        if watts < 0:
            raise ParameterError("constant_watts", f"constant_watts must be >= 0, got {watts}")
        self._watts, self._scope, self._clock = watts, scope, clock
        self._opened = clock()

    @property
    def name(self) -> str:
        return "constant"

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def unavailable_reason(self) -> str | None:
        return None

    def describe(self) -> str:
        return f"constant: {self._watts:g} W declared by the operator, scope {self._scope}"

    def read(self) -> EnergyReading | None:
        now = self._clock()
        joules = self._watts * (now - self._opened)  # W × s = J
        return EnergyReading(joules, now, "constant", self._scope, {"declared": joules})

    def close(self) -> None:
        pass


class SumSource:
    """Several sources read together (e.g. nvml+rapl: GPUs plus CPU packages and DRAM).

    A reading exists only when every part can be read: a partial sum would understate the energy
    without saying so."""

    def __init__(self, parts: Sequence[PowerSource]) -> None:
        if len(parts) < 2:
            raise ValueError("SumSource needs at least two sources")
        self._parts = tuple(parts)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return "+".join(p.name for p in self._parts)

    @property
    def scope(self) -> str:
        return "+".join(p.scope for p in self._parts)

    @property
    def unavailable_reason(self) -> str | None:
        reasons = [f"{p.name}: {p.unavailable_reason}" for p in self._parts if p.unavailable_reason]
        return "; ".join(reasons) or None

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self._parts)

    def read(self) -> EnergyReading | None:
        with self._lock:
            readings = [p.read() for p in self._parts]
        if any(r is None for r in readings):
            return None
        components = {f"{r.source}/{k}": v for r in readings for k, v in r.joules_by_component.items()}
        return EnergyReading(sum(r.joules for r in readings), max(r.timestamp for r in readings),
                             self.name, self.scope, components)

    def close(self) -> None:
        for p in self._parts:
            p.close()


def counter_delta(previous: float, current: float, max_range: float | None) -> float:
    """Increase of a hardware counter between two reads, across at most one wraparound or reset.

    A counter that went down either wrapped at `max_range` (RAPL's max_energy_range_uj) or was reset
    to zero (an NVML counter after a driver reload): the increase is then the distance to the top
    plus the new value, or just the new value when the range is unknown."""
    if current >= previous:
        return current - previous
    if max_range is not None and previous <= max_range:
        return max_range - previous + current
    return current
