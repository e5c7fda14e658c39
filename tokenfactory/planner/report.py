"""A plan as text (for people) and as a dict (for `--json` and other tools). Every figure says whether it is
modelled (the step model with its factors), measured (given with --tokens-per-second) or a datasheet roofline."""

from __future__ import annotations

from typing import Any

from tokenfactory.planner.core import Plan
from tokenfactory.planner.cost import HOURS_PER_MONTH
from tokenfactory.planner.units import count, gib, ms, pct


def render_plan(plan: Plan) -> str:
    sections = (_header(plan), _memory(plan), _speed(plan), _fleet_and_cost(plan), _bill(plan), _advice(plan),
                _alternatives(plan), _sources(plan))
    return "\n\n".join(s for s in sections if s) + "\n"


def _header(plan: Plan) -> str:
    req, cfg, dev = plan.request, plan.request.model.config, plan.request.hardware.device
    model = req.model
    gqa = " (GQA)" if cfg.num_kv_heads < cfg.num_heads else ""
    cards = f"{req.hardware.count} x " if req.hardware.count > 1 else ""
    compute = dev.compute_dtype(plan.weights.precision.compute_dtype)
    max_len = count(plan.max_model_len) + ("" if plan.memory.max_model_len_given else " (default)")
    return "\n".join([
        f"Model   {model.name} [{model.origin}: {model.location}]",
        f"        {model.num_params / 1e9:.2f} B params, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads{gqa}, head_dim {cfg.head_dim}, "
        f"vocab {count(cfg.vocab_size)}, context {count(cfg.max_position_embeddings)}",
        f"Device  {cards}{dev.name}: {dev.description}; {gib(dev.memory_bytes)}, "
        f"{count(dev.bandwidth_gbps.value)} GB/s, {count(dev.peak_flops(compute) / 1e12)} TFLOP/s {compute} "
        f"dense, {count(dev.tdp_w.value)} W",
        f"Setup   weights {plan.weights.label}, KV cache {plan.kv_dtype.name}, max_model_len {max_len}, "
        f"max_num_seqs {req.max_num_seqs}, max_num_batched_tokens {count(req.max_num_batched_tokens)}, requests "
        f"{count(req.workload.prompt_tokens)} -> {count(req.workload.output_tokens)} tokens",
    ] + [f"Note    {n}" for n in plan.notes])


def _kv_formula(plan: Plan) -> str:
    cfg, kv = plan.request.model.config, plan.kv_dtype
    per_head = (f"{cfg.head_dim} x {kv.value_bytes} B" if kv.engine_name == "auto"
                else f"({cfg.head_dim} x 1 B + a 2 B scale)")
    return f"2 x {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {per_head}"


def _memory(plan: Plan) -> str:
    mem = plan.memory
    fits = (f"yes; {mem.max_seqs_at_max_len} sequences of max_model_len {count(mem.max_model_len)} at once"
            if mem.fits else "NO")
    return "\n".join([
        "Memory (per card)",
        f"  usable           {gib(mem.usable_bytes):>12}  ({pct(plan.request.hardware.memory_utilization)} "
        f"of {gib(mem.device_bytes)})",
        f"  weights          {gib(mem.weights_bytes):>12}",
        f"  runtime reserve  {gib(mem.reserve_bytes):>12}  (runtime {gib(mem.runtime_bytes)} + activations "
        f"{gib(mem.activation_bytes)})",
        f"  KV cache         {gib(mem.kv_cache_bytes):>12}  = {count(mem.kv_capacity_tokens)} tokens at "
        f"{count(mem.kv_bytes_per_token / 1024)} KiB/token ({_kv_formula(plan)})",
        f"  fits             {fits}",
    ] + ([f"  our engine       {gib(plan.engine_weights_bytes['copy']):>12}  of weights with its dense copy for "
          f"large steps, {gib(plan.engine_weights_bytes['on-the-fly'])} on-the-fly"
          + (f", {gib(plan.engine_weights_bytes['prepacked'])} prepacked" if "prepacked" in plan.engine_weights_bytes
             else "") + " (--quantization-dense; all cards)"]
         if plan.engine_weights_bytes else []))


def _speed(plan: Plan) -> str:
    wl, hw = plan.request.workload, plan.request.hardware
    dev = hw.device
    compute = dev.compute_dtype(plan.weights.precision.compute_dtype)
    cross = (f"compute-bound from batch ~{count(round(plan.crossover_batch))}"
             if plan.crossover_batch is not None else "memory-bound at every batch size")
    eff = hw.efficiency
    lines = [f"Decode speed per replica (mean context {count(wl.mean_context_tokens)} tokens; {cross})",
             f"  modelled: {pct(eff.bandwidth)} of the peak bandwidth and {pct(eff.compute)} of the peak compute "
             "(the factors below), the two added; roofline: the datasheet's "
             f"{count(hw.count * dev.bandwidth_gbps.value)} GB/s and "
             f"{count(hw.count * dev.peak_flops(compute) / 1e12)} TFLOP/s, nothing discounted, a bound no engine beats",
             "  batch  modelled tok/s  TPOT        roofline tok/s  TPOT        bound     J/token   power"]
    for s in plan.decode:
        lines.append(f"  {s.batch_size:>5} {count(s.tokens_per_s):>15}  {ms(s.seconds):<11} "
                     f"{count(s.roofline_tokens_per_s):>14}  {ms(s.roofline_seconds):<11} {s.bound:<9} "
                     f"{s.joules_per_token:>7.3f}   {count(s.power_w)} W")
    if plan.serving is None:
        lines.append("Serving: nothing fits, no speed to report")
        return "\n".join(lines)
    s = plan.serving
    lines.append(f"Serving at batch {plan.effective_batch} with prefill (modelled): {count(s.tokens_per_s)} output "
                 f"tokens/s, TPOT {ms(s.seconds)}, TTFT ~{ms(plan.ttft_s or 0.0)} (prefill of "
                 f"{count(wl.prompt_tokens)} tokens alone {ms(plan.prefill.seconds)}), "
                 f"{s.joules_per_token:.3f} J/token at {count(s.power_w)} W")
    return "\n".join(lines)


def _speed_source(plan: Plan) -> str:
    return "measured" if plan.measured else "modelled"


def _fleet_and_cost(plan: Plan) -> str:
    lines = []
    req = plan.request
    money = req.currency.format
    if plan.measured:
        model = f"; the model says {count(plan.serving.tokens_per_s)}" if plan.serving else ""
        lines.append(f"Speed   {count(req.tokens_per_second or 0)} tokens/s per replica, measured "
                     f"(--tokens-per-second){model}: fleet and cost below use the measured figure")
    if plan.fleet:
        f = plan.fleet
        lines.append(f"Fleet   {count(f.tokens_per_day)} tokens/day at {count(f.tokens_per_s_per_replica)} tokens/s "
                     f"({_speed_source(plan)}) = {f.gpu_hours:,.1f} GPU-hours/day; a {count(f.window_hours)}-hour "
                     f"window needs {f.replicas} replica(s) = {f.cards} card(s), busy {pct(f.utilisation)} of the day")
    if not plan.cost:
        return "\n".join(lines)
    c, p = plan.cost, req.prices
    busy = "the fleet's own share of the day" if plan.fleet and req.utilisation_from_fleet else "--utilisation"
    lines.append(f"Cost    per million output tokens at {pct(c.utilisation)} utilisation ({busy}), "
                 f"{count(c.tokens_per_s)} tokens/s per busy replica ({_speed_source(plan)}), {c.cards} card(s):")
    if c.on_demand_per_mtok is not None:
        lines.append(f"  rent on demand   {money(c.on_demand_per_mtok):>10}  ({money(p.rent_per_hour or 0)}/h per "
                     "card, busy hours only: the same at any utilisation)")
    if c.reserved_per_mtok is not None:
        lines.append(f"  rent reserved    {money(c.reserved_per_mtok):>10}  ({money(p.reserved_per_hour or 0)}/h "
                     "per card, every hour)")
    if c.own_per_mtok is not None:
        lines.append(f"  own              {money(c.own_per_mtok):>10}  = purchase {money(c.own_capex_per_mtok or 0)}"
                     f" ({money(p.purchase_price or 0)} per card + {money(p.host_price)} of host over "
                     f"{count(p.lifetime_years)} y) + electricity {money(c.own_energy_per_mtok)} "
                     f"({c.kwh_per_mtok:.3f} kWh/M at the wall, {money(p.electricity_per_kwh)}/kWh)")
    even = []
    if c.break_even_own is not None:
        even.append(f"owning beats renting on demand above {pct(c.break_even_own)} utilisation")
    elif c.own_per_mtok is not None and c.on_demand_per_mtok is not None:
        even.append("owning never beats renting on demand at these prices")
    if c.break_even_reserved is not None:
        even.append(f"a reserved rental beats it above {pct(c.break_even_reserved)}")
    if even:
        lines.append(f"  break-even       {'; '.join(even)}")
    if plan.verdict:
        lines.append(f"  verdict          {plan.verdict}")
    return "\n".join(lines)


def _bill(plan: Plan) -> str:
    b = plan.bill
    if b is None:
        return ""
    money, cards = plan.request.currency.format, "card" if b.cards == 1 else "cards"
    supply = f"through the power supply ({pct(b.psu_efficiency)})"
    if b.measured_wall_busy_w is not None:
        drawn = (f"{count(b.measured_wall_busy_w)} W busy at the wall (measured, --wall-watts), "
                 f"{count(b.card_idle_w)} + {count(b.host_idle_w)} W idle (modelled cards + host, {supply})")
    else:
        drawn = (f"{cards} {count(b.card_busy_w)} W busy / {count(b.card_idle_w)} W idle (modelled), host "
                 f"{count(b.host_busy_w)} / {count(b.host_idle_w)} W, {supply}")
    lines = [f"Bill    a month ({count(HOURS_PER_MONTH)} h) of {b.replicas} replica(s) = {b.cards} {cards} busy "
             f"{pct(b.utilisation)} of the hours: {drawn}; PUE {b.pue:.2f}: {b.wall_w / 1000:,.2f} kW at the "
             "wall on average",
             f"        {b.kwh_per_day:,.1f} kWh a day, {count(b.kwh_per_month)} kWh a month = "
             f"{money(b.electricity)} of electricity"
             + (f"; owning adds {money(b.ownership)} of purchase a month = {money(b.owned_total or 0)}"
                if b.ownership is not None else "")]
    rent = [f"{money(b.on_demand)} on demand (busy hours)" if b.on_demand is not None else "",
            f"{money(b.reserved)} reserved (every hour)" if b.reserved is not None else ""]
    if any(rent):
        lines.append("        renting instead: " + ", ".join(r for r in rent if r))
    return "\n".join(lines)


def _advice(plan: Plan) -> str:
    if not plan.recommendations:
        return "Advice\n  * Fits with headroom at this max_num_seqs; nothing to change."
    return "Advice\n" + "\n".join(f"  * {r}" for r in plan.recommendations)


def _alternatives(plan: Plan) -> str:
    rows = [a for a in plan.alternatives if a.on_demand_per_mtok is not None][:6]
    if not rows:
        return ""
    money = plan.request.currency.format
    lines = ["Other cards (modelled with the default factors; smallest tensor-parallel group that fits; renting on "
             "demand)"]
    for a in rows:
        lines.append(f"  {a.cards} x {a.device:<18} batch {a.batch_size:<5} {count(a.tokens_per_s):>9} tokens/s  "
                     f"{money(a.on_demand_per_mtok or 0):>10}/M tokens  {a.joules_per_token:.3f} J/token")
    return "\n".join(lines)


def _sources(plan: Plan) -> str:
    hw = plan.request.hardware
    return (f"Factors  bandwidth {hw.efficiency.bandwidth:.2f}, compute {hw.efficiency.compute:.2f}, step overhead "
            f"{ms(hw.efficiency.step_overhead_s)}; sources: {hw.efficiency.source}")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    req, mem, dev = plan.request, plan.memory, plan.request.hardware.device
    return {
        "model": {"name": req.model.name, "origin": req.model.origin, "location": req.model.location,
                  "num_params": req.model.num_params, **{k: v for k, v in req.model.config.__dict__.items()
                                                         if isinstance(v, int | float | str | bool)}},
        "device": {"name": dev.name, "count": req.hardware.count, "memory_gib": dev.memory_gib.to_dict(),
                   "bandwidth_gbps": dev.bandwidth_gbps.to_dict(), "tdp_w": dev.tdp_w.to_dict(),
                   "flops_tflops": {k: v.to_dict() for k, v in dev.flops.items()}},
        "efficiency": dict(req.hardware.efficiency.__dict__),
        "setup": {"weights": plan.weights.label, "weights_bytes_per_param": plan.weights.precision.bytes_per_param,
                  "kv_cache_dtype": plan.kv_dtype.name, "kv_dtype_bytes": plan.kv_dtype.value_bytes,
                  "max_model_len": plan.max_model_len, "max_model_len_given": mem.max_model_len_given,
                  "max_num_seqs": req.max_num_seqs, "max_num_batched_tokens": req.max_num_batched_tokens,
                  "prompt_tokens": req.workload.prompt_tokens, "output_tokens": req.workload.output_tokens,
                  "engine": req.engine},
        "memory": {**mem.__dict__, "reserve_bytes": mem.reserve_bytes, "kv_capacity_tokens": mem.kv_capacity_tokens,
                   "fits": mem.fits, "max_seqs_at_max_len": mem.max_seqs_at_max_len},
        "decode": [s.to_dict() for s in plan.decode],
        "crossover_batch": plan.crossover_batch,
        "effective_batch": plan.effective_batch,
        "serving": plan.serving.to_dict() if plan.serving else None,
        "prefill": plan.prefill.to_dict(),
        "ttft_s": plan.ttft_s, "tpot_s": plan.tpot_s, "tokens_per_s": plan.tokens_per_s,
        "speed_source": _speed_source(plan),
        "fleet": plan.fleet.to_dict() if plan.fleet else None,
        "engine_weights_bytes": plan.engine_weights_bytes,
        "currency": {"code": req.currency.code, "per_usd": req.currency.per_usd},
        "prices": dict(req.prices.__dict__, currency=req.currency.code),
        "cost": plan.cost.to_dict() if plan.cost else None,
        "modelled_on_demand_per_mtok": plan.modelled_on_demand_per_mtok,
        "verdict": plan.verdict,
        "bill": plan.bill.to_dict() if plan.bill else None,
        "alternatives": [dict(a.__dict__) for a in plan.alternatives],
        "recommendations": list(plan.recommendations),
        "notes": list(plan.notes),
    }
