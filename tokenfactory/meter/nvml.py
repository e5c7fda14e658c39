"""`nvml`: NVIDIA GPU energy through nvidia-ml-py (`pynvml`), per GPU, scope `gpu`.

Preferred: deltas of nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded; Volta and
newer). A counter that goes down was reset (driver reload) and restarts from zero, so the delta is
the new value. Fallback, for GPUs without the counter: nvmlDeviceGetPowerUsage (mW) sampled by a
background thread every `nvml_poll_interval_s` and integrated with the trapezoid rule,
E += (P_prev + P_now) / 2 · Δt. NVML's own power figure is an average over a window the driver picks
(about 1 s on many boards, see Yang et al. 2024, "Part-time Power Measurements: nvidia-smi's
Lackluster Truth"), so the fallback blurs short steps; the counter does not need polling.

Both measure the board only: never the CPU, memory or power supply of the host (scope `gpu`).
Importing this module needs nothing; without the library, driver or a GPU, `open_nvml` returns an
UnavailableSource whose reason says which is missing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import ModuleType

from tokenfactory.meter.power import (
    Clock,
    EnergyReading,
    PowerConfig,
    PowerSource,
    UnavailableSource,
    counter_delta,
)
from tokenfactory.types import ParameterError

MJ_PER_J = 1000.0
MW_PER_W = 1000.0


@dataclass
class _Gpu:
    index: int
    name: str
    handle: object
    uses_counter: bool  # False: power polling
    last_value: float  # counter mode: mJ; polling mode: W
    last_time: float
    joules: float = 0.0


class NvmlSource:
    """Energy of the selected GPUs, summed; per-GPU joules in `joules_by_component` ("gpu0", ...)."""

    def __init__(self, nvml: ModuleType, gpus: list[_Gpu], poll_interval_s: float,
                 clock: Clock = time.monotonic) -> None:
        self._nvml, self._gpus, self._clock = nvml, gpus, clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if any(not g.uses_counter for g in gpus):
            self._poller = threading.Thread(target=self._poll, args=(poll_interval_s,),
                                            name="nvml-power-poller", daemon=True)
            self._poller.start()

    @property
    def name(self) -> str:
        return "nvml"

    @property
    def scope(self) -> str:
        return "gpu"

    @property
    def unavailable_reason(self) -> str | None:
        return None

    @property
    def device_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self._gpus)

    def describe(self) -> str:
        parts = [f"gpu{g.index} {g.name} ({'energy counter' if g.uses_counter else 'power polling'})"
                 for g in self._gpus]
        return f"nvml: {', '.join(parts)} (scope gpu: boards only, not the host)"

    def read(self) -> EnergyReading | None:
        with self._lock:
            now = self._clock()
            try:
                for gpu in self._gpus:
                    self._advance(gpu, now)
            except self._nvml.NVMLError:
                return None
            components = {f"gpu{g.index}": g.joules for g in self._gpus}
            return EnergyReading(sum(components.values()), now, "nvml", "gpu", components)

    def _advance(self, gpu: _Gpu, now: float) -> None:
        if gpu.uses_counter:
            mj = float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(gpu.handle))
            gpu.joules += counter_delta(gpu.last_value, mj, None) / MJ_PER_J
            gpu.last_value = mj
        else:
            watts = self._nvml.nvmlDeviceGetPowerUsage(gpu.handle) / MW_PER_W
            gpu.joules += (gpu.last_value + watts) / 2 * (now - gpu.last_time)  # trapezoid, W·s = J
            gpu.last_value = watts
        gpu.last_time = now

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._lock:
                now = self._clock()
                for gpu in self._gpus:
                    if not gpu.uses_counter:
                        try:
                            self._advance(gpu, now)
                        except self._nvml.NVMLError:
                            pass  # the next sample integrates across the gap

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def open_nvml(config: PowerConfig, nvml: ModuleType | None = None,
              clock: Clock = time.monotonic) -> PowerSource:
    """An NvmlSource, or an UnavailableSource naming what is missing. `nvml` replaces pynvml in tests."""
    if nvml is None:
        try:
            import pynvml as nvml  # nvidia-ml-py
        except ImportError:
            return UnavailableSource("nvml", "nvidia-ml-py is not installed (pip install nvidia-ml-py)", "gpu")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return UnavailableSource("nvml", f"NVML did not start ({e}): no NVIDIA driver or GPU here", "gpu")
    try:
        return _open_devices(nvml, config, clock)
    except nvml.NVMLError as e:
        nvml.nvmlShutdown()
        return UnavailableSource("nvml", f"NVML error while opening the GPUs: {e}", "gpu")
    except _NoMeasurement as e:
        nvml.nvmlShutdown()
        return UnavailableSource("nvml", str(e), "gpu")
    except ParameterError:
        nvml.nvmlShutdown()
        raise


class _NoMeasurement(Exception):
    pass


def _open_devices(nvml: ModuleType, config: PowerConfig, clock: Clock) -> NvmlSource:
    count = nvml.nvmlDeviceGetCount()
    if count == 0:
        raise _NoMeasurement("NVML found no GPU")
    indices = config.gpu_indices if config.gpu_indices is not None else tuple(range(count))
    if not indices or any(not 0 <= i < count for i in indices):
        raise ParameterError("gpu_indices", f"gpu_indices must be NVML indices in [0, {count}), "
                                            f"got {list(indices)}")
    gpus = []
    for index in indices:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        now = clock()
        try:
            mj = float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            gpus.append(_Gpu(index, name, handle, True, mj, now))
            continue
        except nvml.NVMLError:
            pass  # pre-Volta, or not exposed on this board: fall back to power polling
        try:
            watts = nvml.nvmlDeviceGetPowerUsage(handle) / MW_PER_W
        except nvml.NVMLError as e:
            raise _NoMeasurement(f"gpu{index} ({name}) reports neither an energy counter nor power: {e}") from e
        gpus.append(_Gpu(index, name, handle, False, watts, now))
    return NvmlSource(nvml, gpus, config.nvml_poll_interval_s, clock)
