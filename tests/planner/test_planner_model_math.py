"""Memory, roofline, energy and cost arithmetic, including the worked examples everyone checks first."""

import math

import pytest

from tokenfactory.config import ModelConfig
from tokenfactory.planner.catalog import GIB, load_catalog
from tokenfactory.planner.cost import Currency, Power, Prices, estimate_cost, fleet_for_demand
from tokenfactory.planner.hardware import hardware_from_catalog
from tokenfactory.planner.memory import kv_bytes_per_token_per_card, plan_memory, resolve_weights
from tokenfactory.planner.modelsrc import ModelSpec, load_model
from tokenfactory.planner.perf import StepModel, Workload
from tokenfactory.planner.precision import KVDtype, parse_kv_dtype, parse_precision

BF16 = KVDtype("bf16", 2)


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def _llama7b_shape() -> ModelConfig:
    # "a 32-layer, 32-head, head_dim-128 model" (Llama-2-7B shaped, no GQA)
    return ModelConfig("llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32,
                       num_heads=32, num_kv_heads=32, head_dim=128)


def test_worked_example_kv_cache_sizes():
    cfg = _llama7b_shape()
    per_token = parse_kv_dtype("fp16", parse_precision("fp16")).bytes_per_token(cfg)
    assert per_token == 512 * 1024  # 2 x 32 x 32 x 128 x 2 B = 0.5 MiB
    assert per_token * 2048 == 1 * GIB  # one 2,048-token sequence: 1 GiB
    assert per_token * 4096 * 10 == 20 * GIB  # ten 4,096-token sequences: 20 GiB


def test_worked_example_fleet():
    fleet = fleet_for_demand(tokens_per_day=5_000_000, window_hours=8, tokens_per_s_per_replica=60)
    assert fleet.gpu_hours == pytest.approx(23.15, abs=0.01)  # "about 23 GPU-hours"
    assert fleet.cards == 3  # "an 8-hour window needs 3 cards"
    assert fleet_for_demand(5_000_000, 24, 60).cards == 1
    assert fleet_for_demand(5_000_000, 8, 60, cards_per_replica=2).cards == 6


def test_gqa_counts_kv_heads_not_query_heads(catalog):
    model = load_model("Llama-3.1-8B", catalog)  # 32 query heads, 8 KV heads
    assert model.config.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2  # 128 KiB, a quarter of MHA
    # Tensor parallel: KV heads split across cards, replicated (one each) beyond the head count.
    assert kv_bytes_per_token_per_card(model, BF16, 4) == 2 * 32 * 2 * 128 * 2
    assert kv_bytes_per_token_per_card(model, BF16, 16) == 2 * 32 * 1 * 128 * 2
    # An 8-bit cache: one byte a value and a float16 scale per KV head and token, as the engine's pool counts it.
    assert kv_bytes_per_token_per_card(model, KVDtype("int8", 1), 1) == 2 * 32 * 8 * (128 + 2)


def test_weight_bytes_by_precision(catalog):
    model = load_model("Llama-2-7B", catalog)
    bf16, int8, int4 = (resolve_weights(model, p) for p in ("bf16", "int8", "int4-g32"))
    assert bf16.total_bytes == pytest.approx(model.num_params * 2)
    # Quantised: linear layers shrink, the embedding table stays 16-bit (and is not read per step).
    emb = model.embedding_params * 2
    assert int8.total_bytes == pytest.approx((model.num_params - model.embedding_params) * 1 + emb)
    assert int4.total_bytes == pytest.approx((model.num_params - model.embedding_params) * 0.625 + emb)
    assert int8.read_bytes_per_step == pytest.approx(int8.total_bytes - emb)
    assert parse_precision("int4").bytes_per_param == pytest.approx(0.5 + 4 / 128)
    with pytest.raises(ValueError, match="--quantization 'int3'"):
        parse_precision("int3")


def test_tied_embeddings_are_read_every_step(catalog):
    model = load_model("Qwen2.5-0.5B", catalog)  # tied: the LM head is the embedding table
    w = resolve_weights(model, "bf16")
    assert w.read_bytes_per_step == pytest.approx(w.total_bytes)


def test_memory_plan_fits_and_concurrency(catalog):
    model = load_model("Llama-3.1-8B", catalog)
    hw = hardware_from_catalog(catalog, catalog.device("H100-SXM"))
    mem = plan_memory(hw, model, resolve_weights(model, "bf16"), BF16, 8192, 64, 2048)
    assert mem.fits
    assert mem.usable_bytes == int(80 * GIB * 0.9)
    assert mem.weights_bytes == pytest.approx(model.num_params * 2, rel=1e-6)
    assert mem.kv_capacity_tokens % 16 == 0
    assert mem.kv_capacity_tokens == pytest.approx(mem.kv_cache_bytes / (128 * 1024), abs=16)
    assert mem.max_seqs_at_max_len == mem.kv_capacity_tokens // 8192
    small = plan_memory(hw, load_model("Llama-2-70B", catalog), resolve_weights(load_model("Llama-2-70B", catalog),
                        "bf16"), BF16, 4096, 64, 2048)
    assert not small.weights_fit and not small.fits and small.kv_capacity_tokens == 0
    assert small.shortfall_bytes == small.weights_bytes + small.reserve_bytes - small.usable_bytes
    assert small.shortfall_bytes > 55 * GIB  # 128.5 GiB of bf16 weights on a 72 GiB budget


def test_roofline_regimes_and_crossover(catalog):
    model = load_model("Llama-2-7B", catalog)
    hw = hardware_from_catalog(catalog, catalog.device("A100-80GB"))
    steps = StepModel(hw, model, resolve_weights(model, "bf16"), BF16)
    one = steps.decode(1, 128)
    assert one.bound == "memory"
    # Batch 1 is the weight stream at the achievable bandwidth.
    assert one.memory_s == pytest.approx(model.matmul_params * 2 / (2039e9 * 0.70), rel=0.02)
    cross = steps.crossover_batch(128)
    assert cross is not None and 100 < cross < 600
    at = steps.decode(round(cross), 128)
    assert at.memory_s == pytest.approx(at.compute_s, rel=0.02)
    assert steps.decode(round(cross * 2), 128).bound == "compute"
    # Throughput rises with batch; the additive estimate never beats the roofline bound.
    previous = 0.0
    for b in (1, 2, 8, 32, 128, 512):
        s = steps.decode(b, 128)
        assert s.tokens_per_s > previous
        assert s.seconds >= s.roofline_seconds
        previous = s.tokens_per_s
    # MHA at long context: KV reads grow as fast as FLOPs, compute never catches up.
    assert steps.crossover_batch(100_000) is None


def test_serving_includes_prefill_and_energy_falls_with_batch(catalog):
    model = load_model("Llama-3.1-8B", catalog)
    hw = hardware_from_catalog(catalog, catalog.device("H100-SXM"))
    steps = StepModel(hw, model, resolve_weights(model, "bf16"), BF16)
    wl = Workload(prompt_tokens=1000, output_tokens=250)
    decode, serving = steps.decode(64, wl.mean_context_tokens), steps.serving(64, wl)
    assert serving.prefill_tokens == pytest.approx(64 * 4)
    assert serving.tokens_per_s < decode.tokens_per_s
    j = [steps.serving(b, wl).joules_per_token for b in (1, 8, 64)]
    assert j[0] > j[1] > j[2]
    assert hw.device.idle_w.value < steps.serving(1, wl).power_w <= hw.device.tdp_w.value
    prefill = steps.prefill(2048)
    assert prefill.bound == "compute" and prefill.batch_size == 1


def test_tensor_parallel_scales_sublinearly(catalog):
    model = load_model("Llama-2-70B", catalog)
    w = resolve_weights(model, "bf16")
    speeds = [StepModel(hardware_from_catalog(catalog, catalog.device("A100-80GB"), n), model, w, BF16)
              .decode(1, 128).tokens_per_s for n in (2, 4, 8)]
    assert speeds[0] < speeds[1] < speeds[2] < speeds[0] * 4
    assert speeds[1] / speeds[0] == pytest.approx(2 * 0.85, rel=0.02)


def _prices(**kw) -> Prices:
    base = {"currency": Currency(), "electricity_per_kwh": 0.10, "pue": 1.5, "psu_efficiency": 0.9,
            "lifetime_years": 4, "utilisation": 0.5, "rent_per_hour": 2.0, "reserved_per_hour": 1.2,
            "purchase_price": 20_000, "host_price": 4_000}
    return Prices(**{**base, **kw})


def test_cost_formulas():
    """On demand pays busy hours, reserved and owned pay every hour; owning counts card and host, through the
    power supply and the PUE (planner/cost.py's docstring, term by term)."""
    power = Power(card_busy_w=600, card_idle_w=100, host_busy_w=150, host_idle_w=60)
    cost = estimate_cost(tokens_per_s=1000, power=power, cards=1, prices=_prices())
    busy_hour_mtok = 1000 * 3600 / 1e6
    assert cost.on_demand_per_mtok == pytest.approx(2.0 / busy_hour_mtok)  # the same at any utilisation
    assert cost.reserved_per_mtok == pytest.approx(1.2 / (busy_hour_mtok * 0.5))
    wall_busy, wall_idle = (600 + 150) / 0.9 * 1.5, (100 + 60) / 0.9 * 1.5
    assert cost.wall_busy_w == pytest.approx(wall_busy) and cost.wall_idle_w == pytest.approx(wall_idle)
    capex_h = (20_000 + 4_000) / (4 * 8766)
    energy_h = (0.5 * wall_busy + 0.5 * wall_idle) / 1000 * 0.10
    assert cost.own_per_mtok == pytest.approx((capex_h + energy_h) / (busy_hour_mtok * 0.5))
    assert cost.kwh_per_mtok == pytest.approx((0.5 * wall_busy + 0.5 * wall_idle) / 1000 / (busy_hour_mtok * 0.5))
    e_busy, e_idle = wall_busy / 1000 * 0.10, wall_idle / 1000 * 0.10
    u = cost.break_even_own
    assert u == pytest.approx((capex_h + e_idle) / (2.0 - (e_busy - e_idle)))
    assert cost.break_even_reserved == pytest.approx(1.2 / 2.0)
    # At the break-even utilisation, owning costs what renting the busy hours costs.
    at_u = estimate_cost(1000, power, 1, _prices(utilisation=u))
    assert at_u.own_per_mtok == pytest.approx(at_u.on_demand_per_mtok)
    # Renting cheaper than the power bill: owning never wins.
    assert estimate_cost(1000, power, 1, _prices(rent_per_hour=0.01)).break_even_own is None


@pytest.mark.parametrize("kwargs, param", [({"pue": 0.9}, "--pue"), ({"utilisation": 0.0}, "--utilisation"),
                                           ({"lifetime_years": 0}, "--lifetime-years"),
                                           ({"psu_efficiency": 1.2}, "--psu-efficiency"),
                                           ({"rent_per_hour": -1.0}, "--rent-per-hour")])
def test_bad_prices_name_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        _prices(**kwargs)


def test_bad_demand_names_the_parameter():
    with pytest.raises(ValueError, match="--window-hours"):
        fleet_for_demand(1e6, 30, 60)
    with pytest.raises(ValueError, match="--tokens-per-day"):
        fleet_for_demand(0, 8, 60)
    with pytest.raises(ValueError, match="--output-tokens"):
        Workload(100, 0)


def test_spec_params_split_adds_up(catalog):
    for name in ("Llama-2-7B", "Qwen2.5-0.5B", "SmolLM2-135M"):
        m: ModelSpec = load_model(name, catalog)
        assert m.body_params + m.embedding_params + m.lm_head_params == m.num_params
        assert math.isclose(m.matmul_params, m.body_params + m.embedding_params)
