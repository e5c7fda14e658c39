"""`modelled`: an estimate of CPU package power when no counter exists (a VM without powercap, say).

CodeCarbon's CPU-load model (mlco2/codecarbon, codecarbon/external/hardware.py,
`CPU._get_power_from_cpu_load`, "machine" mode), with the load taken from this process:

    load  = Δ(process CPU time) / (Δ wall time · num_cpus)          clamped to [0, 1]
    P [W] = TDP [W] · (0.1 + 0.9 · load³)                            10 % of TDP at rest
    E [J] += P · Δ wall time                                          between two reads

TDP is for the CPUs this machine exposes: `cpu_tdp_watts` when configured; else a package's TDP from
CPU_TDP_TABLE scaled by visible hardware threads over the package's threads (a per-thread figure, so a
4-vCPU slice of a 192-thread EPYC is not charged the whole socket, and two sockets count twice); else
GENERIC_WATTS_PER_THREAD × num_cpus, the table's median per-thread figure. Readings are always
labelled `modelled`: they are a model, not a measurement. Scope `cpu-package`.
"""

from __future__ import annotations

import os
import platform
import re
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tokenfactory.meter.power import Clock, EnergyReading, PowerConfig, PowerSource

# CPU model (as in /proc/cpuinfo "model name", without (R)/(TM)) -> (TDP in W, hardware threads) per
# package. Source: the vendors' product pages (ark.intel.com, amd.com/en/products), default TDP.
CPU_TDP_TABLE: dict[str, tuple[float, int]] = {
    "AMD EPYC 9754": (360.0, 256),
    "AMD EPYC 9654": (360.0, 192),
    "AMD EPYC 9554": (360.0, 128),
    "AMD EPYC 9454": (290.0, 96),
    "AMD EPYC 7763": (280.0, 128),
    "AMD EPYC 7742": (225.0, 128),
    "AMD EPYC 7713": (225.0, 128),
    "AMD EPYC 7543": (225.0, 64),
    "Intel Xeon Platinum 8592+": (350.0, 128),
    "Intel Xeon Platinum 8480+": (350.0, 112),
    "Intel Xeon Platinum 8468": (350.0, 96),
    "Intel Xeon Platinum 8380": (270.0, 80),
    "Intel Xeon Gold 6338": (205.0, 64),
    "Intel Xeon Gold 6248R": (205.0, 48),
    "Intel Core i9-14900K": (125.0, 32),
    "Intel Core i9-13900K": (125.0, 32),
    "AMD Ryzen 9 7950X": (170.0, 32),
    "AMD Ryzen 9 5950X": (105.0, 32),
    "AMD Ryzen 7 5800X": (105.0, 16),
}

# W per hardware thread when the model is unknown: the median of the table above.
GENERIC_WATTS_PER_THREAD = statistics.median(tdp / threads for tdp, threads in CPU_TDP_TABLE.values())

IDLE_FRACTION = 0.1  # CodeCarbon: "Minimum power consumption is 10% of TDP"


def modelled_watts(tdp_watts: float, load: float) -> float:
    """P = TDP · (0.1 + 0.9 · load³), load in [0, 1] (CodeCarbon's cubic CPU-load model)."""
    load = min(max(load, 0.0), 1.0)
    return tdp_watts * (IDLE_FRACTION + (1.0 - IDLE_FRACTION) * load**3)


@dataclass(frozen=True)
class CpuPower:
    tdp_watts: float  # for all the CPUs this machine exposes
    basis: str  # where the figure came from, shown in describe()


def _normalise(model: str) -> str:
    model = re.sub(r"\((R|TM|tm|r)\)", "", model)
    return " ".join(model.replace(" CPU", " ").split())


def lookup_tdp(model: str | None, num_cpus: int, configured_watts: float | None = None) -> CpuPower:
    """The TDP for `num_cpus` visible hardware threads of `model`: configured, table, or generic."""
    if configured_watts is not None:
        return CpuPower(configured_watts, f"{configured_watts:g} W configured")
    if model:
        name = _normalise(model)
        matches = [key for key in CPU_TDP_TABLE if key in name]
        if matches:
            key = max(matches, key=len)
            tdp, threads = CPU_TDP_TABLE[key]
            watts = tdp * num_cpus / threads
            return CpuPower(watts, f"table: {key} {tdp:g} W / {threads} threads × {num_cpus} visible")
    watts = GENERIC_WATTS_PER_THREAD * num_cpus
    return CpuPower(watts, f"generic {GENERIC_WATTS_PER_THREAD:.2f} W/thread × {num_cpus} "
                           f"(CPU model {model!r} not in the table; set cpu_tdp_watts)")


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first "model name" in /proc/cpuinfo, else platform.processor(), else None."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


class TreeCpuTime:
    """CPU seconds of this process and its descendants (a fleet's replica processes), from /proc; a child
    that exits keeps the seconds it was last seen with, so the sum never goes back. Linux only: elsewhere
    it is this process's time alone."""

    SCAN_INTERVAL_S = 0.05

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._last_scan = float("-inf")
        self.pid_to_seconds: dict[int, float] = {}
        self._ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __call__(self) -> float:
        now = time.monotonic()
        if now - self._last_scan >= self.SCAN_INTERVAL_S:  # /proc costs ~0.1 ms a scan; steps come faster
            self._last_scan = now
            self._scan()
        return time.process_time() + sum(self.pid_to_seconds.values())

    def _scan(self) -> None:
        for pid in self._descendants(os.getpid()):
            try:
                fields = (self.proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            self.pid_to_seconds[pid] = (int(fields[11]) + int(fields[12])) / self._ticks  # utime + stime

    def _descendants(self, pid: int) -> list[int]:
        found, todo = [], [pid]
        while todo:
            parent = todo.pop()
            try:
                tasks = list((self.proc / str(parent) / "task").iterdir())
            except OSError:
                continue
            for task in tasks:
                try:
                    children = [int(c) for c in (task / "children").read_text().split()]
                except (OSError, ValueError):
                    continue
                found += children
                todo += children
        return found


class ModelledSource:
    """Integrates modelled_watts() between reads, with the load measured over the same interval."""

    def __init__(self, cpu: CpuPower, num_cpus: int, clock: Clock = time.monotonic,
                 cpu_time: Clock = time.process_time) -> None:
        self._cpu, self._num_cpus, self._clock, self._cpu_time = cpu, num_cpus, clock, cpu_time
        self._whose = "its replicas' and this process's" if isinstance(cpu_time, TreeCpuTime) else "this process's"
        self._lock = threading.Lock()
        self._last_wall, self._last_cpu = clock(), cpu_time()
        self._joules = 0.0

    @property
    def name(self) -> str:
        return "modelled"

    @property
    def scope(self) -> str:
        return "cpu-package"

    @property
    def unavailable_reason(self) -> str | None:
        return None

    @property
    def tdp_watts(self) -> float:
        return self._cpu.tdp_watts

    def describe(self) -> str:
        return (f"modelled: TDP {self._cpu.tdp_watts:.1f} W × (0.1 + 0.9·load³), load from {self._whose} "
                f"CPU time over {self._num_cpus} CPUs ({self._cpu.basis}); an estimate, not a measurement")

    def read(self) -> EnergyReading | None:
        with self._lock:
            wall, cpu = self._clock(), self._cpu_time()
            elapsed = wall - self._last_wall
            if elapsed > 0:
                load = (cpu - self._last_cpu) / (elapsed * self._num_cpus)
                self._joules += modelled_watts(self._cpu.tdp_watts, load) * elapsed  # W × s = J
                self._last_wall, self._last_cpu = wall, cpu
            return EnergyReading(self._joules, wall, "modelled", "cpu-package", {"cpu": self._joules})

    def close(self) -> None:
        pass


def open_modelled(config: PowerConfig, clock: Clock = time.monotonic,
                  cpu_time: Clock = time.process_time) -> PowerSource:
    """With `cpu_share` (a replica's threads), the TDP of that many CPUs and the load over them: the share of
    the machine this process was given, so replicas sharing a node count its power once between them."""
    machine_cpus = os.cpu_count() or 1
    num_cpus = min(config.cpu_share, machine_cpus) if config.cpu_share else machine_cpus
    if config.count_child_processes and cpu_time is time.process_time:
        cpu_time = TreeCpuTime()
    model = config.cpu_model if config.cpu_model is not None else cpu_model_name()
    configured = (config.cpu_tdp_watts * num_cpus / machine_cpus if config.cpu_tdp_watts is not None
                  else None)  # the machine's TDP, our share of it
    return ModelledSource(lookup_tdp(model, num_cpus, configured), num_cpus, clock, cpu_time)
