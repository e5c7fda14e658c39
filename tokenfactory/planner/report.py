"""A plan as text (for people) and as a dict (for `--json` and other tools)."""

from __future__ import annotations

from typing import Any

from tokenfactory.planner.plan import Plan
from tokenfactory.planner.units import count, gib, ms, pct, usd


def render_plan(plan: Plan) -> str:
    sections = (_header(plan), _memory(plan), _speed(plan), _fleet_and_cost(plan), _advice(plan),
                _alternatives(plan), _sources(plan))
    return "\n\n".join(s for s in sections if s) + "\n"


def _header(plan: Plan) -> str:
    req, cfg, dev = plan.request, plan.request.model.config, plan.request.hardware.device
    model = req.model
    gqa = " (GQA)" if cfg.num_kv_heads < cfg.num_heads else ""
    cards = f"{req.hardware.count} x " if req.hardware.count > 1 else ""
    compute = dev.compute_dtype(plan.weights.precision.compute_dtype)
    return "\n".join([
        f"Model   {model.name} [{model.origin}: {model.location}]",
        f"        {model.num_params / 1e9:.2f} B params, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads{gqa}, head_dim {cfg.head_dim}, "
        f"vocab {count(cfg.vocab_size)}, context {count(cfg.max_position_embeddings)}",
        f"Device  {cards}{dev.name}: {dev.description}; {gib(dev.memory_bytes)}, "
        f"{count(dev.bandwidth_gbps.value)} GB/s, {count(dev.peak_flops(compute) / 1e12)} TFLOP/s {compute} "
        f"dense, {count(dev.tdp_w.value)} W",
        f"Setup   weights {plan.weights.label}, KV cache {plan.kv_dtype_bytes * 8}-bit, max_model_len "
        f"{count(plan.max_model_len)}, concurrency {req.concurrency}, requests "
        f"{count(req.workload.prompt_tokens)} -> {count(req.workload.output_tokens)} tokens",
    ] + [f"Note    {n}" for n in plan.notes])


def _memory(plan: Plan) -> str:
    mem = plan.memory
    kv_token = mem.kv_bytes_per_token
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
        f"{count(kv_token / 1024)} KiB/token (2 x {plan.request.model.config.num_layers} layers x "
        f"{plan.request.model.config.num_kv_heads} KV heads x {plan.request.model.config.head_dim} x "
        f"{plan.kv_dtype_bytes} B)",
        f"  fits             {fits}",
    ] + ([f"  our engine       {gib(plan.engine_weights_bytes[0]):>12}  of weights with its dense copy for large "
          f"steps, {gib(plan.engine_weights_bytes[1])} on-the-fly (--quantization-dense; all cards)"]
         if plan.engine_weights_bytes else []))


def _speed(plan: Plan) -> str:
    wl = plan.request.workload
    cross = (f"compute-bound from batch ~{count(round(plan.crossover_batch))}"
             if plan.crossover_batch is not None else "memory-bound at every batch size")
    lines = [f"Decode speed per replica (mean context {count(wl.mean_context_tokens)} tokens; {cross})",
             "  batch    tokens/s   roofline   TPOT        bound     J/token   power"]
    for s in plan.decode:
        lines.append(f"  {s.batch_size:>5} {count(s.tokens_per_s):>11} {count(s.roofline_tokens_per_s):>10}   "
                     f"{ms(s.seconds):<11} {s.bound:<9} {s.joules_per_token:>7.3f}   {count(s.power_w)} W")
    if plan.serving is None:
        lines.append("Serving: nothing fits, no speed to report")
        return "\n".join(lines)
    s = plan.serving
    lines.append(f"Serving at batch {plan.effective_batch} with prefill: {count(s.tokens_per_s)} output tokens/s, "
                 f"TPOT {ms(s.seconds)}, TTFT ~{ms(plan.ttft_s or 0.0)} (prefill of "
                 f"{count(wl.prompt_tokens)} tokens alone {ms(plan.prefill.seconds)}), "
                 f"{s.joules_per_token:.3f} J/token at {count(s.power_w)} W")
    return "\n".join(lines)


def _fleet_and_cost(plan: Plan) -> str:
    lines = []
    req = plan.request
    if req.tokens_per_second is not None:
        lines.append(f"Speed   {count(req.tokens_per_second)} tokens/s per replica (given with --tokens-per-second)")
    if plan.fleet:
        f = plan.fleet
        lines.append(f"Fleet   {count(f.tokens_per_day)} tokens/day at {count(f.tokens_per_s_per_replica)} tokens/s "
                     f"= {f.gpu_hours:,.1f} GPU-hours/day; a {count(f.window_hours)}-hour window needs "
                     f"{f.replicas} replica(s) = {f.cards} card(s)")
    if plan.cost:
        c, p = plan.cost, req.prices
        rent = (f"rented {usd(c.rent_usd_per_mtok)}/M tokens ({usd(p.rent_usd_per_hour or 0)}/h per card)"
                if c.rent_usd_per_mtok is not None else "rented: no rental price")
        own = (f"owned {usd(c.own_usd_per_mtok)}/M tokens ({usd(p.purchase_usd or 0)} per card over "
               f"{count(p.lifetime_years)} y, {usd(p.electricity_usd_per_kwh)}/kWh, PUE {p.pue:.2f})"
               if c.own_usd_per_mtok is not None else "owned: no purchase price")
        lines.append(f"Cost    at {pct(c.utilisation)} utilisation: {rent}; {own}")
        lines.append(f"        energy {usd(c.energy_usd_per_mtok)}/M tokens ({c.energy_kwh_per_mtok:.3f} kWh/M at "
                     "the wall)" + (f"; buying beats renting on demand above {pct(c.break_even_utilisation)} "
                                    "utilisation" if c.break_even_utilisation is not None else ""))
    return "\n".join(lines)


def _advice(plan: Plan) -> str:
    if not plan.recommendations:
        return "Advice\n  * Fits with headroom at this concurrency; nothing to change."
    return "Advice\n" + "\n".join(f"  * {r}" for r in plan.recommendations)


def _alternatives(plan: Plan) -> str:
    rows = [a for a in plan.alternatives if a.rent_usd_per_mtok is not None][:6]
    if not rows:
        return ""
    lines = ["Other cards (smallest tensor-parallel group that fits, default factors, rented)"]
    for a in rows:
        lines.append(f"  {a.cards} x {a.device:<18} batch {a.batch_size:<5} {count(a.tokens_per_s):>9} tokens/s  "
                     f"{usd(a.rent_usd_per_mtok or 0):>8}/M tokens  {a.joules_per_token:.3f} J/token")
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
                  "kv_dtype_bytes": plan.kv_dtype_bytes, "max_model_len": plan.max_model_len,
                  "concurrency": req.concurrency, "prompt_tokens": req.workload.prompt_tokens,
                  "output_tokens": req.workload.output_tokens},
        "memory": {**mem.__dict__, "reserve_bytes": mem.reserve_bytes, "kv_capacity_tokens": mem.kv_capacity_tokens,
                   "fits": mem.fits, "max_seqs_at_max_len": mem.max_seqs_at_max_len},
        "decode": [s.to_dict() for s in plan.decode],
        "crossover_batch": plan.crossover_batch,
        "effective_batch": plan.effective_batch,
        "serving": plan.serving.to_dict() if plan.serving else None,
        "prefill": plan.prefill.to_dict(),
        "ttft_s": plan.ttft_s, "tpot_s": plan.tpot_s, "tokens_per_s": plan.tokens_per_s,
        "fleet": plan.fleet.to_dict() if plan.fleet else None,
        "engine_weights_bytes": ({"copy": plan.engine_weights_bytes[0], "on-the-fly": plan.engine_weights_bytes[1]}
                                 if plan.engine_weights_bytes else None),
        "cost": plan.cost.to_dict() if plan.cost else None,
        "alternatives": [dict(a.__dict__) for a in plan.alternatives],
        "recommendations": list(plan.recommendations),
        "notes": list(plan.notes),
    }
