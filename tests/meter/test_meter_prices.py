"""Prices: the dated defaults load, overrides merge key by key, amortisation, errors name the key."""

import pytest

from tokenfactory.meter.prices import (
    HOURS_PER_YEAR,
    PRICES_ENV,
    load_price_table,
    load_prices,
    owned_usd_per_hour,
)


def test_defaults_are_dated_and_sourced():
    table = load_price_table()
    for key, profile in table["devices"].items():
        assert profile.get("as_of") and profile.get("source"), key
    assert table["electricity"]["as_of"] and table["electricity"]["source"]
    prices = load_prices()
    assert prices.device.profile == "cpu" and prices.usd_per_kwh > 0


def test_profile_matched_from_gpu_name():
    assert load_prices(device_name="NVIDIA H100 80GB HBM3").device.profile == "h100"
    assert load_prices(device_name="NVIDIA H200").device.profile == "h200"
    assert load_prices(device_name="Some Future GPU").device.profile == "cpu"


def test_owned_device_amortised_at_utilisation():
    table = load_price_table()
    prices = load_prices(device="h100-owned")  # the h100 profile's purchase price, [owning]'s lifetime and share
    assert prices.device.basis == "owned"
    assert prices.device.usd_per_hour == pytest.approx(table["devices"]["h100"]["purchase_usd"] / (
        table["owning"]["lifetime_years"] * HOURS_PER_YEAR * table["owning"]["utilisation"]))
    assert owned_usd_per_hour(8766.0, 1.0, 1.0) == pytest.approx(1.0)


def test_override_file_merges_and_costs_follow(tmp_path, monkeypatch):
    override = tmp_path / "prices.toml"
    override.write_text('[electricity]\nusd_per_kwh = 0.30\n[overheads]\npue = 1.5\npsu_loss_factor = 1.06\n'
                        '[devices.mine]\nbasis = "rented"\nusd_per_hour = 7.2\nmatch = ["Mine"]\n')
    prices = load_prices(override, device_name="Mine X1")
    assert prices.device.profile == "mine" and prices.usd_per_kwh == 0.30
    assert prices.energy_overhead_factor == pytest.approx(1.59)
    assert prices.energy_cost_usd(3.6e6) == pytest.approx(0.30 * 1.59)  # one kWh measured
    assert prices.device_cost_usd(1800.0) == pytest.approx(3.6)
    assert load_prices(override, device="h100").device.usd_per_hour == load_prices(device="h100").device.usd_per_hour
    monkeypatch.setenv(PRICES_ENV, str(override))
    assert load_prices().usd_per_kwh == 0.30


def test_bad_prices_name_the_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[overheads]\npue = 0.5\n")
    with pytest.raises(ValueError, match="overheads.pue"):
        load_prices(bad)
    bad.write_text('[devices.x]\nbasis = "owned"\npurchase_usd = 1.0\nlifetime_years = 1.0\nutilisation = 2.0\n')
    with pytest.raises(ValueError, match="devices.x.utilisation"):
        load_prices(bad, device="x")
    with pytest.raises(ValueError, match="device_profile"):
        load_prices(device="tpu-v9")
    bad.write_text("not = [toml")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_prices(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prices(tmp_path / "missing.toml")


def test_a_gpu_server_is_never_priced_at_the_cpu_rate():
    """serve passes the device type and torch's name of the card (serve/engine.py build_accounting): a
    CUDA device gets its matched profile, or the generic GPU one, never the CPU's."""
    cpu = load_prices(device_type="cpu").device
    h100 = load_prices(device_name="NVIDIA H100 80GB HBM3", device_type="cuda").device
    unknown = load_prices(device_name="NVIDIA Future X9", device_type="cuda").device
    assert cpu.profile == "cpu" and h100.profile == "h100" and unknown.profile == "gpu"
    assert unknown.usd_per_hour > cpu.usd_per_hour and unknown.source
    assert load_prices(device="h100-owned", device_type="cuda").device.profile == "h100-owned"  # explicit wins
    prices = load_prices(device_name="NVIDIA H200", device_type="cuda")
    h200_rate = load_price_table()["devices"]["h200"]["usd_per_hour"]
    assert prices.device_cost_usd(3600.0) == pytest.approx(h200_rate)  # an hour of device time at the H200 rate


def test_serve_selects_the_profile_from_the_cuda_device_name(monkeypatch, tmp_path):
    import argparse

    import torch

    from tests.fake_engine import FAKE_MODEL_CONFIG
    from tokenfactory.serve.engine import accelerator_name, build_accounting

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert accelerator_name("cuda") == "NVIDIA H100 80GB HBM3" and accelerator_name("cpu") is None
    args = argparse.Namespace(power_source="constant", power_watts=100.0, cpu_tdp_watts=None, prices=None,
                              device_profile=None, data_dir=str(tmp_path), database_url=None)
    accounting, _, prices_line = build_accounting(args, FAKE_MODEL_CONFIG, "cuda", "m")
    try:
        assert accounting.meter.prices.device.profile == "h100" and "h100" in prices_line
    finally:
        accounting.meter.close()
        accounting.close()


def test_psu_efficiency_and_its_older_spelling(tmp_path):
    """The meter counts joules at the wall through the power supply (prices.toml psu_efficiency, the default every
    command shares); an override may still give psu_loss_factor, its inverse, but not both."""
    assert load_prices().psu_efficiency == pytest.approx(load_price_table()["overheads"]["psu_efficiency"])
    assert load_prices().energy_overhead_factor == pytest.approx(load_prices().pue / load_prices().psu_efficiency)
    both = tmp_path / "both.toml"
    both.write_text("[overheads]\npsu_efficiency = 0.9\npsu_loss_factor = 1.1\n")
    with pytest.raises(ValueError, match="psu_loss_factor"):
        load_prices(both)
    bad = tmp_path / "bad.toml"
    bad.write_text("[overheads]\npsu_efficiency = 1.5\n")
    with pytest.raises(ValueError, match="overheads.psu_efficiency"):
        load_prices(bad)


def test_profiles_like_another_and_the_planners_cards():
    """`like` fills in another profile's keys (the generic GPU is the a10g's rate, the owned H100 the h100's price):
    one definition each; `catalog` ties a profile to the planner's card."""
    from tokenfactory.meter.prices import catalog_prices, resolve_profile

    table = load_price_table()["devices"]
    assert load_prices(device="gpu").device.usd_per_hour == table["a10g"]["usd_per_hour"]
    assert "usd_per_hour" not in table["gpu"] and "purchase_usd" not in table["h100-owned"]
    assert resolve_profile(table, "h100-owned")["purchase_usd"] == table["h100"]["purchase_usd"]
    cards = catalog_prices()
    assert cards["h100-sxm"].profile == "h100" and cards["h100-sxm"].rent_usd_per_hour == table["h100"]["usd_per_hour"]
    assert cards["rtx-4090"].host == "desktop" and cards["cpu-epyc-9654-2s"].rent_usd_per_hour is None
