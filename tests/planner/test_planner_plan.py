"""make_plan end to end: advice, report, JSON, calibration and plots."""

import json

import pytest

from tokenfactory.planner.calibrate import calibrate, load_bench_result
from tokenfactory.planner.catalog import load_catalog
from tokenfactory.planner.core import SLO, Demand, PlanRequest
from tokenfactory.planner.cost import Currency, Prices
from tokenfactory.planner.hardware import Efficiency, hardware_from_catalog
from tokenfactory.planner.memory import resolve_weights
from tokenfactory.planner.modelsrc import load_model
from tokenfactory.planner.perf import StepModel, Workload
from tokenfactory.planner.plan import make_plan
from tokenfactory.planner.precision import KVDtype
from tokenfactory.planner.report import plan_to_dict, render_plan

PRICES = Prices(Currency(), electricity_per_kwh=0.13, pue=1.56, psu_efficiency=0.92, lifetime_years=5,
                utilisation=0.5, rent_per_hour=2.69, reserved_per_hour=1.75, purchase_price=30_000)
BF16 = KVDtype("bf16", 2)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _plan(catalog, model="Llama-3.1-8B", device="H100-SXM", cards=1, **kwargs):
    m = load_model(model, catalog)
    hw = hardware_from_catalog(catalog, catalog.device(device), cards)
    return make_plan(PlanRequest(m, hw, PRICES, **kwargs), catalog)


def test_plan_for_a_model_that_fits(catalog):
    plan = _plan(catalog, max_model_len=4096, max_num_seqs=32, demand=Demand(5e6, 8))
    assert plan.memory.fits and plan.effective_batch == 32
    assert plan.serving is not None and plan.serving.batch_size == 32
    assert plan.tpot_s == plan.serving.seconds and plan.ttft_s > plan.prefill.seconds
    assert plan.fleet.replicas == 1 and plan.fleet.tokens_per_s_per_replica == plan.serving.tokens_per_s
    # On demand pays the busy hours only: the same per token at any utilisation; reserved pays every hour.
    assert plan.cost.on_demand_per_mtok == pytest.approx(2.69 / (plan.serving.tokens_per_s * 3600 / 1e6))
    assert plan.cost.reserved_per_mtok == pytest.approx(1.75 / (plan.serving.tokens_per_s * 3600 * 0.5 / 1e6))
    assert any("memory-bound at batch 32" in r for r in plan.recommendations)  # a bigger batch pays
    text = render_plan(plan)
    for needle in ("Memory (per card)", "128 KiB/token", "Decode speed", "Fleet", "Cost", "Advice", "Factors"):
        assert needle in text
    data = json.loads(json.dumps(plan_to_dict(plan), default=str))
    assert data["memory"]["fits"] is True and data["serving"]["batch_size"] == 32
    assert data["model"]["num_kv_heads"] == 8 and data["device"]["memory_gib"]["source"]


def test_plan_for_a_model_that_does_not_fit_says_what_to_change(catalog):
    plan = _plan(catalog, model="Llama-2-70B", device="A100-80GB", max_model_len=4096)
    assert not plan.memory.fits and plan.serving is None and plan.cost is None
    advice = plan.recommendations[0]
    assert "The weights need 128.5 GiB per card in bf16" in advice
    assert "quantize to int8" in advice and "run 2 cards in tensor parallel" in advice
    assert any(a.device == "A100-80GB" and a.cards == 2 for a in plan.alternatives)
    assert "NO" in render_plan(plan)


def test_fp8_kv_and_shorter_context_advice(catalog):
    plan = _plan(catalog, model="Llama-3.1-8B", device="RTX-4090", max_model_len=8192, max_num_seqs=64)
    text = " ".join(plan.recommendations)
    assert "sequences fit in the KV cache" in text and "--kv-cache-dtype int8" in text
    kv_fp8 = _plan(catalog, model="Llama-3.1-8B", device="RTX-4090", max_model_len=8192, kv_dtype="fp8")
    # One byte a value and a 2-byte scale per head of 128: 2 x 128 / 130 the tokens of bf16.
    assert kv_fp8.memory.kv_capacity_tokens == pytest.approx(2 * 128 / 130 * plan.memory.kv_capacity_tokens, rel=0.002)


def test_tpot_slo_caps_the_batch(catalog):
    free = _plan(catalog, max_model_len=4096, max_num_seqs=256)
    slo = _plan(catalog, max_model_len=4096, max_num_seqs=256, slo=SLO(tpot_s=0.015))
    assert slo.effective_batch < free.effective_batch
    assert slo.serving.seconds <= 0.015
    assert "TPOT SLO" in slo.notes[0]
    assert slo.alternatives and all(a.batch_size / a.tokens_per_s <= 0.015 for a in slo.alternatives)
    assert any(a.batch_size / a.tokens_per_s > 0.015 for a in free.alternatives)


def test_measured_speed_overrides_the_model(catalog):
    plan = _plan(catalog, demand=Demand(5_000_000, 8), tokens_per_second=60)
    assert plan.fleet.gpu_hours == pytest.approx(23.15, abs=0.01) and plan.fleet.cards == 3


def test_different_card_advice_when_much_cheaper(catalog):
    plan = _plan(catalog, model="SmolLM2-135M", device="CPU-Xeon-8480-2S", max_model_len=2048)
    assert any(r.startswith("A different card:") for r in plan.recommendations)


def _synthetic_bench(tmp_path, catalog, bandwidth, compute, shape="results"):
    """A bench result the model itself produces with known factors (and known power)."""
    model = load_model("Llama-3.1-8B", catalog)
    hw = hardware_from_catalog(catalog, catalog.device("H100-SXM"))
    truth = StepModel(hw.with_efficiency(Efficiency(bandwidth, compute)), model, resolve_weights(model, "bf16"), BF16)
    wl = Workload(256, 256)
    rows = [{"batch_size": b, "output_tokens_per_s": truth.serving(b, wl).tokens_per_s,
             "power_w": truth.serving(b, wl).power_w} for b in (1, 8, 32, 128, 512)]
    config = {"device": "H100-SXM", "model": "Llama-3.1-8B", "dtype": "bf16", "prompt_tokens": 256,
              "output_tokens": 256}
    body = {**config, "results": rows} if shape == "results" else {"config": config, "figures": rows}
    path = tmp_path / f"bench-{shape}.json"
    path.write_text(json.dumps(body))
    return path, StepModel(hw, model, resolve_weights(model, "bf16"), BF16)


@pytest.mark.parametrize("shape", ["results", "figures"])
def test_calibration_recovers_known_factors(tmp_path, catalog, shape):
    path, steps = _synthetic_bench(tmp_path, catalog, bandwidth=0.55, compute=0.40, shape=shape)
    result = load_bench_result(path)
    assert result.device == "H100-SXM" and len(result.points) == 5
    cal = calibrate(result, steps)
    assert cal.efficiency.bandwidth == pytest.approx(0.55, rel=0.03)
    assert cal.efficiency.compute == pytest.approx(0.40, rel=0.05)
    assert cal.rms_log_error_after < 0.01 < cal.rms_log_error_before
    assert set(cal.fitted) >= {"bandwidth", "compute"}
    toml = cal.to_toml("H100-SXM", str(path))
    assert 'device = "H100-SXM"' in toml and "bandwidth = { value = 0.5" in toml
    extra = tmp_path / "calibrated.toml"
    extra.write_text(toml)
    calibrated = load_catalog([extra])
    hw = hardware_from_catalog(calibrated, calibrated.device("H100-SXM"))
    assert hw.efficiency.bandwidth == pytest.approx(cal.efficiency.bandwidth, abs=1e-3)  # 3 decimals


def test_calibration_reads_bench_figures_spellings(tmp_path):
    path = tmp_path / "fig.json"
    path.write_text(json.dumps({"config": {"device": "L40S", "model": "Qwen2.5-7B", "concurrency": 64,
                                           "input_len": 300, "output_len": 120},
                                "figures": {"output_throughput": 900.0, "mean_concurrency": 47.6,
                                            "avg_power_w": 310.0}}))
    result = load_bench_result(path)
    (point,) = result.points
    assert (point.batch_size, point.output_tokens_per_s, point.power_w) == (48, 900.0, 310.0)
    assert (result.prompt_tokens, result.output_tokens) == (300, 120)


def test_calibration_keeps_what_batch_one_cannot_identify(tmp_path, catalog):
    path = tmp_path / "b1.json"
    path.write_text(json.dumps({"device": "A100-80GB", "model": "Llama-2-7B", "dtype": "bf16",
                                "prompt_tokens": 5, "output_tokens": 200,
                                "results": [{"concurrency": 1, "output_throughput": 104.9}]}))
    model = load_model("Llama-2-7B", catalog)
    hw = hardware_from_catalog(catalog, catalog.device("A100-80GB"))
    cal = calibrate(load_bench_result(path), StepModel(hw, model, resolve_weights(model, "bf16"), BF16))
    assert cal.fitted == ("bandwidth",) and cal.kept == ("compute",)
    assert cal.efficiency.compute == hw.efficiency.compute
    assert cal.efficiency.bandwidth == pytest.approx(0.69, abs=0.02)  # gpt-fast: 1,397 of 2,039 GB/s


@pytest.mark.parametrize("body, message", [
    ({"results": []}, "non-empty"),
    ({"results": [{"output_tokens_per_s": 10}]}, r"results\[0\] needs batch_size"),
    ({"results": [{"batch_size": 4}]}, r"results\[0\] needs output_tokens_per_s"),
])
def test_bad_bench_files_name_the_field(tmp_path, body, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(ValueError, match=message):
        load_bench_result(path)


def test_plots_are_png_files(tmp_path, catalog):
    from tokenfactory.planner.plot import write_plots

    plan = _plan(catalog, max_model_len=4096)
    paths = write_plots(plan, tmp_path / "charts")
    assert [p.name for p in paths] == ["tokens_per_second.png", "joules_per_token.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
