"""Memory and power of the server under load, each figure labelled with where it came from.

Memory, sampled every `interval_s` during the run (peak and mean):
  - `--server-pid PID` (or, for a loopback URL, the process found listening on its port): resident set
    of the process and its children (psutil), and on NVIDIA GPUs the device memory NVML lists for them;
  - else our server's /metrics `process_resident_memory_bytes`, when it exports one.

Power over the run's window (from just before the first send to just after the last response):
  - our server: its `tokenfactory:energy_joules_total{source,scope}` counter read at both ends,
    watts = ΔJ / Δt, J/token = ΔJ / output tokens (the whole server, idle between steps included: the
    same basis as any other engine's), labelled with the counter's source and scope; the requests'
    own attributed joules (usage.energy_joules) are reported beside it. Without the counter, the
    usage joules alone (labelled as attributed);
  - any other target: a local power source of the meter (`--power-source`, default auto) read at both
    ends of the window: watts = ΔJ / Δt, J/token = ΔJ / output tokens. The `modelled` source is
    CodeCarbon's CPU-load model; its load is taken from the server's processes when their pid is known,
    else from the whole machine's busy CPU time, never from this client alone.
Missing figures are None (null in JSON), never 0.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


# -- Prometheus ------------------------------------------------------------------------------------------

MetricSamples = dict[str, list[tuple[dict[str, str], float]]]


def parse_prometheus(text: str) -> MetricSamples:
    """Sample name -> [(labels, value)]; text that is not Prometheus exposition gives {}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: MetricSamples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    except (ValueError, TypeError):
        return {}
    return out


def metric_sum(samples: MetricSamples, name: str, **labels: str) -> float | None:
    rows = samples.get(name)
    if rows is None:
        return None
    return sum(v for lbl, v in rows if all(lbl.get(k) == want for k, want in labels.items()))


def metric_by_label(samples: MetricSamples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lbl, v in samples.get(name, []):
        key = lbl.get(label, "")
        out[key] = out.get(key, 0.0) + v
    return out


@dataclass(frozen=True)
class Scrape:
    time_s: float  # time.perf_counter() when the response arrived
    samples: MetricSamples


async def scrape(client: Any, base_url: str, headers: dict[str, str]) -> Scrape | None:
    """GET {base_url}/metrics, parsed; None when there is no such endpoint."""
    try:
        response = await client.get(f"{base_url}/metrics", headers=headers)
    except Exception:  # noqa: BLE001 - an optional probe: any failure means "no metrics"
        return None
    if response.status_code != 200:
        return None
    samples = parse_prometheus(response.text)
    return Scrape(time.perf_counter(), samples) if samples else None


# -- processes ---------------------------------------------------------------------------------------------

def is_loopback(base_url: str) -> bool:
    return (urlparse(base_url).hostname or "") in LOOPBACK_HOSTS


def find_listening_pid(base_url: str) -> int | None:
    """The pid of a local process listening on the URL's port (best effort: own processes only)."""
    import psutil

    parsed = urlparse(base_url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.AccessDenied, PermissionError, OSError):
        return None
    return None


def process_tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def tree_rss_bytes(pid: int) -> int | None:
    import psutil

    total, seen = 0, False
    for proc in process_tree(pid):
        try:
            total += proc.memory_info().rss
            seen = True
        except psutil.Error:
            continue
    return total if seen else None


def tree_cpu_seconds(pid: int) -> Callable[[], float]:
    """A clock of the CPU seconds (user + system) the process tree has used (for the modelled source)."""
    import psutil

    def cpu_time() -> float:
        total = 0.0
        for proc in process_tree(pid):
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                continue
        return total

    return cpu_time


def machine_busy_cpu_seconds() -> float:
    """CPU seconds all CPUs have spent not idle (psutil.cpu_times; idle and iowait excluded)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class GpuMemory:
    """Device memory NVML attributes to a set of pids; unavailable without NVML or a GPU."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - no library, no driver or no GPU: the figure is None
            self._nvml = None

    def used_bytes(self, pids: set[int]) -> int | None:
        if self._nvml is None or not self._handles:
            return None
        total, seen = 0, False
        for handle in self._handles:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:  # noqa: BLE001
                continue
            for p in procs:
                if p.pid in pids and p.usedGpuMemory is not None:
                    total, seen = total + int(p.usedGpuMemory), True
        return total if seen else None


# -- sampling during the run --------------------------------------------------------------------------------

@dataclass
class MemoryTrace:
    source: str | None = None  # "pid 1234 (+children)" | "server /metrics"
    rss_bytes: list[int] = field(default_factory=list)
    device_bytes: list[int] = field(default_factory=list)
    metrics: list[tuple[float, MetricSamples]] = field(default_factory=list)  # (t since start, samples)

    def figures(self) -> dict[str, Any]:
        return {
            "server_rss_peak_bytes": max(self.rss_bytes) if self.rss_bytes else None,
            "server_rss_mean_bytes": sum(self.rss_bytes) / len(self.rss_bytes) if self.rss_bytes else None,
            "device_memory_peak_bytes": max(self.device_bytes) if self.device_bytes else None,
            "memory_source": self.source if (self.rss_bytes or self.device_bytes) else None,
        }


class Sampler:
    """Every interval_s: the server's /metrics (if any), RSS and GPU memory of its pid (if known)."""

    def __init__(self, client: Any, base_url: str, headers: dict[str, str], pid: int | None,
                 has_metrics: bool, interval_s: float = 1.0) -> None:
        self.client, self.base_url, self.headers, self.pid = client, base_url, headers, pid
        self.has_metrics, self.interval_s = has_metrics, interval_s
        self.trace = MemoryTrace(source=f"pid {pid} (+children)" if pid else None)
        self._gpu = GpuMemory() if pid else None
        self._t0 = time.perf_counter()

    async def sample_once(self) -> None:
        if self.has_metrics:
            scraped = await scrape(self.client, self.base_url, self.headers)
            if scraped is not None:
                self.trace.metrics.append((scraped.time_s - self._t0, scraped.samples))
                rss = metric_sum(scraped.samples, "process_resident_memory_bytes")
                if self.pid is None and rss is not None:
                    self.trace.source = "server /metrics process_resident_memory_bytes"
                    self.trace.rss_bytes.append(int(rss))
        if self.pid:
            rss = await asyncio.to_thread(tree_rss_bytes, self.pid)
            if rss is not None:
                self.trace.rss_bytes.append(rss)
            if self._gpu is not None:
                pids = {p.pid for p in process_tree(self.pid)}
                used = self._gpu.used_bytes(pids)
                if used is not None:
                    self.trace.device_bytes.append(used)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample_once()
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except TimeoutError:
                pass
        await self.sample_once()


# -- power -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EnergyWindow:
    """Joules a source counted over the run's window."""

    joules: float | None
    seconds: float
    source: str | None
    scope: str | None
    basis: str  # one line: what was measured, how
    measured_watts: float | None = None  # the server's own whole-server watts, when it reports them
    attributed_joules: float | None = None  # our server's per-request attribution (usage), when present

    @property
    def watts(self) -> float | None:
        if self.measured_watts is not None:
            return self.measured_watts
        return self.joules / self.seconds if self.joules is not None and self.seconds > 0 else None


class LocalPower:
    """A meter power source opened for the run and read at both ends of its window."""

    def __init__(self, source_name: str, pid: int | None) -> None:
        self.source: Any = None
        self.basis = ""
        self.unavailable: str | None = None
        self._start: Any = None
        try:
            self.source, self.basis = open_local_source(source_name, pid)
        except (ImportError, ValueError) as e:
            self.unavailable = f"power source {source_name!r} could not be opened: {e}"
        if self.source is not None and self.source.unavailable_reason:
            self.unavailable = f"{self.source.name}: {self.source.unavailable_reason}"

    def start(self) -> None:
        if self.source is not None:
            self._start = self.source.read()

    def stop(self, seconds: float) -> EnergyWindow:
        end = self.source.read() if self.source is not None else None
        if self._start is None or end is None:
            return EnergyWindow(None, seconds, None, None, self.unavailable or "no power reading")
        return EnergyWindow(end.joules - self._start.joules, seconds, end.source, end.scope, self.basis)

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def open_local_source(name: str, pid: int | None) -> tuple[Any, str]:
    """The meter's source `name`; the modelled source is re-pointed at the server's (or machine's) load."""
    from tokenfactory.meter.modelled import ModelledSource, cpu_model_name, lookup_tdp
    from tokenfactory.meter.power import PowerConfig
    from tokenfactory.meter.sources import choose_power_source

    source = choose_power_source(PowerConfig(source=name)).source
    if source.name != "modelled":
        return source, f"{source.describe()} (local, this machine)"
    source.close()
    num_cpus = os.cpu_count() or 1
    cpu = lookup_tdp(cpu_model_name(), num_cpus)
    if pid:
        load, where = tree_cpu_seconds(pid), f"the server's processes (pid {pid} and children)"
    else:
        load, where = machine_busy_cpu_seconds, "the whole machine (no server pid known)"
    modelled = ModelledSource(cpu, num_cpus, cpu_time=load)
    return modelled, (f"modelled: TDP {cpu.tdp_watts:.1f} W × (0.1 + 0.9·load³), load of {where} "
                      f"({cpu.basis}); an estimate, not a measurement")


ENERGY_COUNTER = "tokenfactory:energy_joules_total"


def _labels(samples: MetricSamples, name: str, label: str) -> str | None:
    values = sorted({lbl[label] for lbl, _ in samples.get(name, []) if lbl.get(label)})
    return "+".join(values) or None


def server_energy(usage: list[dict[str, Any]], before: Scrape | None, after: Scrape | None,
                  power_means: list[float], seconds: float) -> EnergyWindow | None:
    """Energy as our server reports it, or None when it reports none.

    Preferred: its whole-server counter over the window (idle between steps included), the same basis
    as a local source's window for any other engine. Else the requests' attributed joules (usage)."""
    joules = [u.get("energy_joules") for u in usage]
    attributed = float(sum(joules)) if joules and all(isinstance(j, int | float) for j in joules) else None
    note = f"; attributed to the requests (usage.energy_joules): {attributed:.4g} J" if attributed is not None else ""
    if before is not None and after is not None and ENERGY_COUNTER in after.samples and \
            ENERGY_COUNTER in before.samples:
        delta = (metric_sum(after.samples, ENERGY_COUNTER) or 0.0) - (metric_sum(before.samples, ENERGY_COUNTER) or 0.0)
        window_s = after.time_s - before.time_s
        return EnergyWindow(delta, window_s, _labels(after.samples, ENERGY_COUNTER, "source"),
                            _labels(after.samples, ENERGY_COUNTER, "scope"),
                            f"server /metrics {ENERGY_COUNTER} over the run ({window_s:.2f} s, idle included){note}",
                            attributed_joules=attributed)
    if attributed is None:
        return None
    sources = "+".join(sorted({str(u["energy_source"]) for u in usage if u.get("energy_source")})) or None
    scopes = "+".join(sorted({str(u["energy_scope"]) for u in usage if u.get("energy_scope")})) or None
    basis = "server usage.energy_joules (attributed to the requests; idle between steps excluded)"
    mean_w = sum(power_means) / len(power_means) if power_means else None
    if mean_w is not None:
        basis += "; watts: mean of tokenfactory:power_watts samples"
    return EnergyWindow(attributed, seconds, sources, scopes, basis, mean_w, attributed)

