"""`rapl`: CPU package and DRAM energy from Linux powercap (Intel RAPL; AMD Zen exposes the same files).

Layout under the powercap root (flat symlinks in /sys/class/powercap):

    intel-rapl:0/      name=package-0   energy_uj  max_energy_range_uj   <- counted
    intel-rapl:0:0/    name=core        (inside package-0: skipped, it would count twice)
    intel-rapl:0:1/    name=uncore      (inside package-0: skipped)
    intel-rapl:0:2/    name=dram        <- counted when include_dram (not inside the package figure)
    intel-rapl:1/      name=psys        (the whole SoC platform, overlaps the package: skipped)

`energy_uj` is a µJ counter that wraps to 0 after `max_energy_range_uj` (about 262 kJ on many Xeons:
some minutes at full power), so it must be read at least once per wrap period; the meter's idle
ticker does that. Since Linux 5.10 `energy_uj` is readable by root only (CVE-2020-8694, the PLATYPUS
power side channel), so an unprivileged server usually finds the files but cannot read them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tokenfactory.meter.power import Clock, EnergyReading, PowerConfig, PowerSource, UnavailableSource, counter_delta

UJ_PER_J = 1e6


@dataclass(frozen=True)
class RaplZone:
    label: str  # e.g. "intel-rapl:0/package-0"
    kind: str  # "cpu-package" | "dram"
    energy_path: Path
    max_range_uj: float | None


def find_zones(root: Path, include_dram: bool = True) -> list[RaplZone]:
    """The zones whose energies add up without double counting (packages, and DRAM if asked)."""
    zones = []
    for zone_dir in sorted(root.glob("intel-rapl:*")):
        name_file = zone_dir / "name"
        if not name_file.is_file():
            continue
        name = name_file.read_text().strip()
        top_level = zone_dir.name.count(":") == 1
        if name.startswith("package") and top_level:
            kind = "cpu-package"
        elif name == "dram" and include_dram:
            kind = "dram"
        else:
            continue
        zones.append(RaplZone(f"{zone_dir.name}/{name}", kind, zone_dir / "energy_uj",
                              _read_optional_float(zone_dir / "max_energy_range_uj")))
    return zones


def _read_optional_float(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


class RaplSource:
    """Sum of the package (and DRAM) counters, wraparound-corrected. Labelled `rapl`."""

    def __init__(self, zones: list[RaplZone], clock: Clock = time.monotonic) -> None:
        self._zones = zones
        self._clock = clock
        self._lock = threading.Lock()
        self._last_uj = [float(z.energy_path.read_text()) for z in zones]
        self._joules = [0.0] * len(zones)
        kinds = [k for k in ("cpu-package", "dram") if any(z.kind == k for z in zones)]
        self._scope = "+".join(kinds)

    @property
    def name(self) -> str:
        return "rapl"

    @property
    def scope(self) -> str:
        return self._scope

    @property
    def unavailable_reason(self) -> str | None:
        return None

    def describe(self) -> str:
        return f"rapl: {', '.join(z.label for z in self._zones)} (scope {self._scope})"

    def read(self) -> EnergyReading | None:
        with self._lock:
            try:
                values_uj = [float(z.energy_path.read_text()) for z in self._zones]
            except (OSError, ValueError):
                return None
            now = self._clock()
            for i, (zone, value) in enumerate(zip(self._zones, values_uj, strict=True)):
                self._joules[i] += counter_delta(self._last_uj[i], value, zone.max_range_uj) / UJ_PER_J
                self._last_uj[i] = value
            components = {z.label: j for z, j in zip(self._zones, self._joules, strict=True)}
            return EnergyReading(sum(self._joules), now, "rapl", self._scope, components)

    def close(self) -> None:
        pass


def open_rapl(config: PowerConfig, clock: Clock = time.monotonic) -> PowerSource:
    """A RaplSource, or an UnavailableSource that says what is missing or needs privileges."""
    root = config.rapl_root
    if not root.is_dir():
        return UnavailableSource("rapl", f"{root} does not exist (not Linux, or a virtual machine "
                                         "without powercap)", "cpu-package")
    zones = find_zones(root, config.rapl_include_dram)
    if not zones:
        return UnavailableSource("rapl", f"no intel-rapl package zone under {root}", "cpu-package")
    for zone in zones:
        try:
            float(zone.energy_path.read_text())
        except PermissionError:
            return UnavailableSource(
                "rapl", f"permission denied reading {zone.energy_path}: since Linux 5.10 it is readable "
                        "by root only (CVE-2020-8694); an administrator can grant read access "
                        f"(e.g. `sudo chmod o+r {root}/intel-rapl:*/energy_uj`, which re-opens that "
                        "power side channel) or choose another source", "cpu-package")
        except (OSError, ValueError) as e:
            return UnavailableSource("rapl", f"cannot read {zone.energy_path}: {e}", "cpu-package")
    return RaplSource(zones, clock)
