"""Power sources: rapl on a fake sysfs tree, the modelled formula, nvml without a GPU and with a fake
NVML library, constant, and the registry's choices."""

import os
import pathlib
import types

import pytest

from tokenfactory.meter.modelled import (
    CPU_TDP_TABLE,
    GENERIC_WATTS_PER_THREAD,
    ModelledSource,
    cpu_model_name,
    lookup_tdp,
    modelled_watts,
)
from tokenfactory.meter.nvml import open_nvml
from tokenfactory.meter.power import ConstantSource, PowerConfig, SumSource, UnavailableSource, counter_delta
from tokenfactory.meter.rapl import open_rapl
from tokenfactory.meter.sources import choose_power_source, open_power_source


class Clock:
    def __init__(self, now: float = 10.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- rapl -------------------------------------------------------------------------------------------

def make_zone(root, name, label, energy_uj, max_uj=1_000_000):
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(label + "\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def fake_powercap(tmp_path):
    root = tmp_path / "powercap"
    zones = {
        "pkg0": make_zone(root, "intel-rapl:0", "package-0", 100),
        "core": make_zone(root, "intel-rapl:0:0", "core", 50),
        "dram": make_zone(root, "intel-rapl:0:2", "dram", 10),
        "pkg1": make_zone(root, "intel-rapl:1", "package-1", 200),
        "psys": make_zone(root, "intel-rapl:2", "psys", 999),
    }
    (root / "intel-rapl").mkdir()  # the control-type directory has no counter
    return root, zones


def test_rapl_sums_packages_and_dram_without_double_counting(tmp_path):
    root, zones = fake_powercap(tmp_path)
    clock = Clock()
    source = open_rapl(PowerConfig(source="rapl", rapl_root=root), clock)
    assert source.unavailable_reason is None and source.scope == "cpu-package+dram"
    first = source.read()
    assert first.joules == 0.0 and first.source == "rapl"
    (zones["pkg0"] / "energy_uj").write_text("1100\n")  # +1000 µJ
    (zones["pkg1"] / "energy_uj").write_text("2200\n")  # +2000 µJ
    (zones["dram"] / "energy_uj").write_text("510\n")  # +500 µJ
    (zones["core"] / "energy_uj").write_text("900000\n")  # inside the package: ignored
    clock.now += 1
    reading = source.read()
    assert reading.joules == pytest.approx(3500e-6)
    assert reading.joules_by_component["intel-rapl:0:2/dram"] == pytest.approx(500e-6)
    assert not any("core" in k or "psys" in k for k in reading.joules_by_component)


def test_rapl_wraparound_uses_max_energy_range(tmp_path):
    root, zones = fake_powercap(tmp_path)
    source = open_rapl(PowerConfig(source="rapl", rapl_root=root, rapl_include_dram=False), Clock())
    assert source.scope == "cpu-package"
    (zones["pkg0"] / "energy_uj").write_text("999900\n")  # +999 800 µJ
    assert source.read().joules == pytest.approx(0.9998 + 0.0)
    (zones["pkg0"] / "energy_uj").write_text("300\n")  # wrapped at 1 000 000: +100 to the top, +300
    assert source.read().joules == pytest.approx(0.9998 + 400e-6)


def test_counter_delta_reset_without_range():
    assert counter_delta(5000.0, 7000.0, None) == 2000.0
    assert counter_delta(5000.0, 300.0, None) == 300.0  # reset: counts from zero again
    assert counter_delta(900.0, 100.0, 1000.0) == 200.0


def test_rapl_permission_denied_is_reported_clearly(tmp_path, monkeypatch):
    root, zones = fake_powercap(tmp_path)
    denied = zones["pkg0"] / "energy_uj"
    if os.geteuid() == 0:  # root reads any file whatever its mode: make the kernel's answer by hand
        real_read_text = pathlib.Path.read_text

        def read_text(self, *args, **kwargs):
            if self == denied:
                raise PermissionError(13, "Permission denied", str(self))
            return real_read_text(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "read_text", read_text)
    else:
        denied.chmod(0o000)
    source = open_rapl(PowerConfig(source="rapl", rapl_root=root), Clock())
    assert source.read() is None
    assert "permission denied" in source.unavailable_reason and "root" in source.unavailable_reason
    assert str(denied) in source.unavailable_reason


def test_rapl_absent_root_and_no_zones(tmp_path):
    missing = open_rapl(PowerConfig(source="rapl", rapl_root=tmp_path / "nope"), Clock())
    assert missing.read() is None and "does not exist" in missing.unavailable_reason
    (tmp_path / "empty").mkdir()
    empty = open_rapl(PowerConfig(source="rapl", rapl_root=tmp_path / "empty"), Clock())
    assert "no intel-rapl package zone" in empty.unavailable_reason


# --- modelled ---------------------------------------------------------------------------------------

def test_modelled_formula_endpoints_and_cube():
    assert modelled_watts(200.0, 0.0) == pytest.approx(20.0)  # 10 % of TDP at rest
    assert modelled_watts(200.0, 1.0) == pytest.approx(200.0)
    assert modelled_watts(200.0, 0.5) == pytest.approx(200.0 * (0.1 + 0.9 * 0.125))
    assert modelled_watts(200.0, 3.0) == pytest.approx(200.0)  # clamped


def test_modelled_source_integrates_load_from_cpu_time():
    wall, cpu = Clock(0.0), Clock(0.0)
    tdp = lookup_tdp(None, 4, configured_watts=100.0)
    source = ModelledSource(tdp, num_cpus=4, clock=wall, cpu_time=cpu)
    wall.now, cpu.now = 10.0, 20.0  # 2 of 4 CPUs busy for 10 s: load 0.5
    reading = source.read()
    assert reading.joules == pytest.approx(10.0 * 100.0 * (0.1 + 0.9 * 0.5**3))
    assert reading.source == "modelled" and reading.scope == "cpu-package"
    wall.now = 20.0  # 10 s idle
    assert source.read().joules == pytest.approx(reading.joules + 10.0 * 10.0)
    assert "modelled" in source.describe() and "not a measurement" in source.describe()


def test_tdp_lookup_table_scaling_and_generic():
    tdp, threads = CPU_TDP_TABLE["AMD EPYC 9654"]
    slice_ = lookup_tdp("AMD EPYC 9654 96-Core Processor", 4)
    assert slice_.tdp_watts == pytest.approx(tdp * 4 / threads) and "table" in slice_.basis
    two_sockets = lookup_tdp("Intel(R) Xeon(R) Platinum 8480+", 224)
    assert two_sockets.tdp_watts == pytest.approx(2 * 350.0)
    generic = lookup_tdp("AMD EPYC", 2)
    assert generic.tdp_watts == pytest.approx(2 * GENERIC_WATTS_PER_THREAD) and "generic" in generic.basis
    assert lookup_tdp("AMD EPYC 9654", 4, configured_watts=55.0).tdp_watts == 55.0


def test_cpu_model_name_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7763 64-Core Processor\n")
    assert cpu_model_name(info) == "AMD EPYC 7763 64-Core Processor"


# --- nvml ---------------------------------------------------------------------------------------

def test_nvml_degrades_cleanly_without_a_gpu():
    source = open_nvml(PowerConfig(source="nvml"))  # this machine has no NVIDIA driver
    assert source.read() is None
    assert source.name == "nvml" and source.scope == "gpu"
    assert source.unavailable_reason and ("NVML" in source.unavailable_reason
                                          or "nvidia-ml-py" in source.unavailable_reason)
    source.close()


class NVMLError(Exception):
    pass


def fake_nvml(energy_mj, power_mw, names=("NVIDIA H100 80GB HBM3",)):
    """A stand-in for pynvml: energy_mj[i] None means "not supported" (the polling fallback)."""
    def energy(handle):
        if energy_mj[handle] is None:
            raise NVMLError("Not Supported")
        return energy_mj[handle]

    return types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(names), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: names[h].encode(), nvmlDeviceGetTotalEnergyConsumption=energy,
        nvmlDeviceGetPowerUsage=lambda h: power_mw[h],
    )


def test_nvml_counter_deltas_and_reset():
    energy_mj, clock = [1_000_000], Clock()
    source = open_nvml(PowerConfig(source="nvml"), fake_nvml(energy_mj, [0]), clock)
    assert source.device_names == ("NVIDIA H100 80GB HBM3",)
    assert source.read().joules == 0.0
    energy_mj[0] = 1_250_000  # +250 J
    assert source.read().joules == pytest.approx(250.0)
    energy_mj[0] = 40_000  # driver reloaded: counter restarted, 40 J since
    reading = source.read()
    assert reading.joules == pytest.approx(290.0) and reading.joules_by_component == {"gpu0": pytest.approx(290.0)}
    source.close()


def test_nvml_power_polling_fallback_trapezoid():
    clock, power_mw = Clock(0.0), [100_000, 300_000]
    nvml = fake_nvml([None, 5_000], power_mw, names=("Tesla P100", "NVIDIA A100"))
    source = open_nvml(PowerConfig(source="nvml", nvml_poll_interval_s=1000.0), nvml, clock)
    assert "power polling" in source.describe() and "energy counter" in source.describe()
    clock.now = 2.0
    power_mw[0] = 200_000
    reading = source.read()
    assert reading.joules_by_component["gpu0"] == pytest.approx((100 + 200) / 2 * 2.0)  # 300 J
    assert reading.joules_by_component["gpu1"] == 0.0
    source.close()


def test_nvml_bad_gpu_index_names_parameter():
    with pytest.raises(ValueError, match="gpu_indices"):
        open_nvml(PowerConfig(source="nvml", gpu_indices=(3,)), fake_nvml([0], [0]))


def test_nvml_neither_energy_nor_power_is_unavailable():
    nvml = fake_nvml([None], [0])
    nvml.nvmlDeviceGetPowerUsage = lambda h: (_ for _ in ()).throw(NVMLError("Not Supported"))
    source = open_nvml(PowerConfig(source="nvml"), nvml)
    assert source.read() is None and "neither" in source.unavailable_reason


# --- constant, sum, registry ---------------------------------------------------------------------

def test_constant_source_is_watts_times_seconds():
    clock = Clock(5.0)
    source = ConstantSource(450.0, "machine", clock)
    clock.now = 7.5
    reading = source.read()
    assert reading.joules == pytest.approx(1125.0) and reading.scope == "machine"
    assert reading.source == "constant"


def test_sum_source_is_none_when_any_part_is_missing():
    clock = Clock(0.0)
    both = SumSource([ConstantSource(10.0, "gpu", clock), ConstantSource(5.0, "cpu-package", clock)])
    clock.now = 2.0
    reading = both.read()
    assert reading.joules == pytest.approx(30.0) and reading.scope == "gpu+cpu-package"
    partial = SumSource([ConstantSource(10.0, "gpu", clock), UnavailableSource("rapl", "no", "cpu-package")])
    assert partial.read() is None and "rapl" in partial.unavailable_reason


def test_auto_falls_back_to_modelled_and_says_why(tmp_path):
    choice = choose_power_source(PowerConfig(source="auto", rapl_root=tmp_path / "none"))
    assert choice.source.name == "modelled" and choice.source.read() is not None
    assert [s.split(":")[0] for s in choice.skipped] == ["nvml", "rapl"]


def test_auto_prefers_readable_rapl_over_modelled(tmp_path):
    root, _ = fake_powercap(tmp_path)
    assert open_power_source(PowerConfig(source="auto", rapl_root=root)).name == "rapl"


def test_registry_errors_name_the_parameter():
    with pytest.raises(ValueError, match="power_source"):
        open_power_source(PowerConfig(source="solar"))
    with pytest.raises(ValueError, match="constant_watts"):
        open_power_source(PowerConfig(source="constant"))
    with pytest.raises(ValueError, match="constant_scope"):
        PowerConfig(source="constant", constant_watts=1.0, constant_scope="planet")
    combined = open_power_source(PowerConfig(source="constant+modelled", constant_watts=1.0, constant_scope="gpu"))
    assert combined.name == "constant+modelled" and combined.scope == "gpu+cpu-package"
