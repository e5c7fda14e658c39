"""`make_plan`: memory, speed, fleet, cost and advice for one model on one kind of card."""

from __future__ import annotations

from dataclasses import replace

from tokenfactory.layers.weight_bytes import auto_dense, dense_order
from tokenfactory.planner.catalog import Catalog, Device
from tokenfactory.planner.core import Alternative, Plan, PlanRequest
from tokenfactory.planner.cost import Power, estimate_cost, fleet_for_demand, monthly_bill, verdict
from tokenfactory.planner.hardware import Hardware, hardware_from_catalog
from tokenfactory.planner.memory import MemoryPlan, Weights, engine_weight_bytes, plan_memory, resolve_weights
from tokenfactory.planner.perf import StepEstimate, StepModel
from tokenfactory.planner.precision import parse_kv_dtype
from tokenfactory.planner.recommend import recommend
from tokenfactory.planner.units import count, gib

TP_COUNTS = (1, 2, 4, 8)


def fitted_memory(req: PlanRequest, hw: Hardware) -> tuple[Weights, MemoryPlan, str | None]:
    """The weights as `req.engine` keeps them on `hw`, the memory plan they leave, and a note when our engine's
    form (`serve --quantization-dense auto`: layers/weight_bytes.py `dense_order` and `auto_dense`) is not its
    first choice: on a CPU oneDNN's prepacked copy beside the plain one, elsewhere the plain copy."""
    weights = resolve_weights(req.model, req.precision)
    kv = parse_kv_dtype(req.kv_dtype, weights.precision)

    def memory(w: Weights) -> MemoryPlan:
        return plan_memory(hw, req.model, w, kv, req.max_model_len, req.max_num_seqs, req.max_num_batched_tokens)

    ours = _engine_weights(req, hw) if req.engine == "tokenfactory" else None
    if ours is None:
        return weights, memory(weights), None
    labels = {"prepacked": "with its dense copy twice (plain, and oneDNN's for decode batches)",
              "copy": "with its dense copy", "on-the-fly": "on-the-fly"}
    forms = list(ours)
    unquantized = resolve_weights(req.model, "bf16").total_bytes
    device_type = "cpu" if hw.device.kind == "cpu" else "cuda"
    # On CUDA a copy bigger than bf16 is never kept, fits or not (auto_dense); on a CPU the first form that fits.
    copy_allowed = auto_dense(device_type, ours["copy"], ours["on-the-fly"], int(unquantized), True) == "copy"
    plans: dict[str, MemoryPlan] = {}
    for form in forms:
        kept = replace(weights, total_bytes=ours[form], label=f"{weights.label}, tokenfactory {labels[form]}")
        plans[form] = plan = memory(kept)
        if form == "on-the-fly" or (plan.fits and copy_allowed):
            break
    if form == forms[0]:
        return kept, plan, None
    skipped = [f"{labels[f]} ({gib(ours[f])})" for f in forms[:forms.index(form)]]
    why = (f"with its dense copy the weights would be {gib(ours['copy'])}, more than bf16's {gib(unquantized)}"
           if device_type == "cuda" and plans["copy"].fits
           else f"neither {' nor '.join(skipped)} fits" if len(skipped) > 1 else f"{skipped[0]} does not fit")
    return kept, plan, (
        f"our engine keeps {weights.label} {labels[form]} ({gib(ours[form])}): {why}; "
        f"this is what serve --quantization-dense auto chooses here")


def make_plan(request: PlanRequest, catalog: Catalog | None = None) -> Plan:
    """The whole plan; `catalog` enables the 'a different card?' comparison."""
    req, model, hw = request, request.model, request.hardware
    weights, memory, form = fitted_memory(req, hw)
    kv = parse_kv_dtype(req.kv_dtype, weights.precision)
    steps = StepModel(hw, model, weights, kv)
    wl = req.workload
    final_len = wl.prompt_tokens + wl.output_tokens
    kv_limit = memory.max_seqs(final_len) if memory.weights_fit else 0
    batch = min(req.max_num_seqs, kv_limit)
    notes = [form] if form else []
    if memory.max_model_len_capped:
        notes.append(f"max_model_len is the model's context ({count(memory.context_tokens)}) capped at the "
                     f"{count(memory.max_model_len)} tokens the KV cache holds, as the engine does when "
                     "--max-model-len is not given")
    if req.slo.tpot_s is not None and batch > 0:
        slo_batch = steps.max_batch_within(req.slo.tpot_s, wl, batch)
        if slo_batch < batch:
            notes.append(f"batch capped at {slo_batch} (from {batch}) to meet the TPOT SLO of "
                         f"{req.slo.tpot_s * 1000:.0f} ms")
            batch = slo_batch
    serving = steps.serving(batch, wl) if batch > 0 else None
    decode = tuple(steps.decode(b, wl.mean_context_tokens)
                   for b in req.batch_sizes or _batch_sizes(req.max_num_seqs, max(kv_limit, 1)))
    plan = Plan(request=req, weights=weights, kv_dtype=kv, memory=memory, effective_batch=batch,
                decode=decode, serving=serving, prefill=steps.prefill(wl.prompt_tokens),
                crossover_batch=steps.crossover_batch(wl.mean_context_tokens), fleet=None, cost=None,
                notes=tuple(notes), engine_weights_bytes=_engine_weights(req, hw))
    plan = _with_fleet_and_cost(plan)
    if catalog is not None:
        plan = replace(plan, alternatives=tuple(compare_devices(req, catalog)))
    return replace(plan, recommendations=tuple(recommend(plan)))


def _engine_weights(req: PlanRequest, hw: Hardware) -> dict[str, int] | None:
    """Our engine's weight bytes per --quantization-dense form, in the order auto tries them."""
    kind = hw.device.kind
    sizes = {dense: engine_weight_bytes(req.model, req.precision, kind, dense)
             for dense in dense_order("cpu" if kind == "cpu" else "cuda")}
    return None if None in sizes.values() else sizes  # type: ignore[return-value]


def _batch_sizes(max_num_seqs: int, kv_limit: int) -> tuple[int, ...]:
    top = max(1, min(max(max_num_seqs, 256), kv_limit, 1024))
    sizes = {1 << i for i in range(11) if (1 << i) <= top} | {min(max_num_seqs, kv_limit)}
    return tuple(sorted(s for s in sizes if s >= 1))


def replica_power(hw: Hardware, serving: StepEstimate | None, wall_watts: float | None = None) -> Power:
    """One replica's DC power: its cards busy at the serving step (modelled; TDP when nothing fits) or idle, and
    their share of the host; busy at the wall as measured, when `wall_watts` is given."""
    busy = serving.power_w if serving else hw.count * hw.device.tdp_w.value
    return Power(busy, hw.count * hw.device.idle_w.value, hw.count * hw.host_busy_w, hw.count * hw.host_idle_w,
                 wall_watts)


def _with_fleet_and_cost(plan: Plan) -> Plan:
    req, tps = plan.request, plan.tokens_per_s
    if tps is None or tps <= 0:
        return plan
    hw = req.hardware
    fleet = (fleet_for_demand(req.demand.tokens_per_day, req.demand.window_hours, tps, hw.count)
             if req.demand else None)
    prices = req.prices
    if prices is None:
        return replace(plan, fleet=fleet)
    if fleet is not None and req.utilisation_from_fleet:
        prices = replace(prices, utilisation=fleet.utilisation)
    power = replica_power(hw, plan.serving, req.wall_watts)
    cost = estimate_cost(tps, power, hw.count, prices)
    modelled = None
    if plan.serving is not None and prices.rent_per_hour is not None:
        modelled = estimate_cost(plan.serving.tokens_per_s, power, hw.count, prices).on_demand_per_mtok
    return replace(plan, fleet=fleet, cost=cost, verdict=verdict(cost, prices.currency),
                   bill=monthly_bill(power, hw.count, fleet.replicas if fleet else 1, prices),
                   modelled_on_demand_per_mtok=modelled)


def min_cards(request: PlanRequest, device: Device, catalog: Catalog) -> tuple[Hardware, Weights, MemoryPlan] | None:
    """The smallest tensor-parallel group of `device` that holds the weights and one max_model_len
    sequence, with the catalog's default factors; None if even 8 cards are not enough."""
    for count_ in TP_COUNTS:
        hw = hardware_from_catalog(catalog, device, count_)
        weights, mem, _ = fitted_memory(request, hw)
        if mem.fits:
            return hw, weights, mem
    return None


def compare_devices(request: PlanRequest, catalog: Catalog) -> list[Alternative]:
    """Every catalog device (smallest group that fits), at the request's max_num_seqs (capped by its KV cache and
    the TPOT SLO) and workload, all modelled with default factors, cheapest on-demand rent per Mtok first."""
    out = []
    wl = request.workload
    currency = request.currency
    for device in {id(d): d for d in catalog.devices.values()}.values():
        found = min_cards(request, device, catalog)
        if found is None:
            continue
        hw, weights, mem = found
        steps = StepModel(hw, request.model, weights, parse_kv_dtype(request.kv_dtype, weights.precision))
        batch = min(request.max_num_seqs, mem.max_seqs(wl.prompt_tokens + wl.output_tokens))
        if request.slo.tpot_s is not None:
            batch = steps.max_batch_within(request.slo.tpot_s, wl, batch)
        if batch < 1:
            continue
        step = steps.serving(batch, wl)
        rent = currency.from_usd(device.rent_usd_per_hour.value) if device.rent_usd_per_hour else None
        per_mtok = rent * hw.count / (step.tokens_per_s * 3600 / 1e6) if rent is not None else None
        out.append(Alternative(device.name, hw.count, batch, step.tokens_per_s, per_mtok, step.joules_per_token))
    return sorted(out, key=lambda a: (a.on_demand_per_mtok is None, a.on_demand_per_mtok or 0.0))
