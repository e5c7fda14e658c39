"""Advice from a finished plan: each rule reads the plan and returns one sentence (or None).
Rules are a registry (RULES), applied in order; add one by appending a function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tokenfactory.planner.core import Plan
from tokenfactory.planner.memory import MemoryPlan, plan_memory, resolve_weights
from tokenfactory.planner.perf import StepModel
from tokenfactory.planner.precision import PRECISIONS, parse_kv_dtype
from tokenfactory.planner.units import count, gib, ms, pct, round_down_len

Rule = Callable[[Plan], "str | None"]


def recommend(plan: Plan) -> list[str]:
    return [text for rule in RULES if (text := rule(plan))]


def _memory_with(plan: Plan, precision: str | None = None, kv_dtype: str | None = None,
                 cards: int | None = None, max_model_len: int | None = None) -> MemoryPlan:
    req = plan.request
    hw = replace(req.hardware, count=cards) if cards else req.hardware
    weights = resolve_weights(req.model, precision or req.precision)
    kv = parse_kv_dtype(kv_dtype or req.kv_dtype, weights.precision)
    return plan_memory(hw, req.model, weights, kv, max_model_len or plan.max_model_len, req.max_num_seqs,
                       req.max_num_batched_tokens)


def _smaller_precisions(plan: Plan) -> list[str]:
    current = plan.weights.precision.bytes_per_param
    return [name for name in ("fp8", "int8", "int4") if PRECISIONS[name].bytes_per_param < current * 0.99
            and (name != "fp8" or "fp8" in plan.request.hardware.device.flops)]


def weights_do_not_fit(plan: Plan) -> str | None:
    mem = plan.memory
    if mem.weights_fit:
        return None
    hw = plan.request.hardware
    options, quantized = [], []
    for name in _smaller_precisions(plan):
        alt = _memory_with(plan, precision=name)
        if alt.fits:
            quantized.append(f"{name} ({gib(alt.weights_bytes)} per card)")
    if quantized:
        options.append("quantize to " + " or ".join(quantized))
    for cards in (2, 4, 8):
        if cards > hw.count and _memory_with(plan, cards=cards).fits:
            options.append(f"run {cards} cards in tensor parallel")
            break
    options.append("pick a card with more memory")
    return (f"The weights need {gib(mem.weights_bytes)} per card in {plan.weights.label} plus "
            f"{gib(mem.reserve_bytes)} of runtime reserve, but only {gib(mem.usable_bytes)} of the "
            f"{hw.device.name}'s {gib(mem.device_bytes)} is usable ({pct(hw.memory_utilization)}): "
            + ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1] + ".")


def kv_cache_too_small(plan: Plan) -> str | None:
    mem = plan.memory
    if not mem.weights_fit or mem.fits:
        return None
    cap = mem.kv_capacity_tokens
    fp8 = ""
    if plan.kv_dtype.value_bytes > 1:  # the engine's --kv-cache-dtype int8: one byte a value (and a small scale)
        fp8 = (f", or use an 8-bit KV cache (--kv-cache-dtype int8: "
               f"{count(_memory_with(plan, kv_dtype='int8').kv_capacity_tokens)} tokens)")
    return (f"The KV cache holds {count(cap)} tokens but max_model_len is {count(mem.max_model_len)}: "
            f"lower --max-model-len to {count(round_down_len(cap))} or give the cache more memory{fp8}.")


def concurrency_at_full_length(plan: Plan) -> str | None:
    mem, req = plan.memory, plan.request
    if not mem.fits or mem.max_seqs_at_max_len >= req.max_num_seqs:
        return None
    per_seq = round_down_len(mem.kv_capacity_tokens // req.max_num_seqs)
    fp8 = ""
    if plan.kv_dtype.value_bytes > 1:
        seqs = _memory_with(plan, kv_dtype="int8").max_seqs_at_max_len
        fp8 = f", or use an 8-bit KV cache (--kv-cache-dtype int8: {seqs})"
    return (f"At max_model_len {count(mem.max_model_len)} only {mem.max_seqs_at_max_len} of "
            f"{req.max_num_seqs} sequences fit in the KV cache ({count(mem.kv_capacity_tokens)} tokens); "
            f"long requests will be preempted. Lower --max-model-len to {count(per_seq)} to hold "
            f"{req.max_num_seqs} full-length sequences, cap --max-num-seqs at {mem.max_seqs_at_max_len}{fp8}.")


def bigger_batch(plan: Plan) -> str | None:
    serving, req = plan.serving, plan.request
    if serving is None or serving.bound != "memory" or plan.effective_batch < req.max_num_seqs:
        return None
    wl = req.workload
    kv_limit = plan.memory.max_seqs(wl.prompt_tokens + wl.output_tokens)
    target = min(kv_limit, 4 * plan.effective_batch, 1024)
    if plan.crossover_batch is not None:
        target = min(target, max(int(plan.crossover_batch), plan.effective_batch))
    if target < 2 * plan.effective_batch:
        return None
    steps = StepModel(req.hardware, req.model, plan.weights, plan.kv_dtype)
    bigger = steps.serving(target, wl)
    gain = bigger.tokens_per_s / serving.tokens_per_s - 1
    if gain < 0.2:
        return None
    return (f"The step is memory-bound at batch {plan.effective_batch}: with "
            f"{count(wl.prompt_tokens)}+{count(wl.output_tokens)}-token requests, raising --max-num-seqs "
            f"to {target} would lift throughput from {count(serving.tokens_per_s)} to "
            f"{count(bigger.tokens_per_s)} tokens/s (+{pct(gain)}) and cut energy from "
            f"{serving.joules_per_token:.3f} to {bigger.joules_per_token:.3f} J/token, at a TPOT of "
            f"{ms(bigger.seconds)} instead of {ms(serving.seconds)}.")


def quantize_for_speed(plan: Plan) -> str | None:
    serving, req = plan.serving, plan.request
    if serving is None or serving.bound != "memory" or plan.weights.precision.bits < 16:
        return None
    best = None
    for name in _smaller_precisions(plan):
        if name == "int4":
            continue
        weights = resolve_weights(req.model, name)
        step = StepModel(req.hardware, req.model, weights, plan.kv_dtype).serving(plan.effective_batch,
                                                                                   req.workload)
        if best is None or step.tokens_per_s > best[1].tokens_per_s:
            best = (name, step, weights)
    if best is None:
        return None
    name, step, weights = best
    gain = step.tokens_per_s / serving.tokens_per_s - 1
    if gain < 0.15:
        return None
    return (f"Weights dominate the memory traffic: {name} weights ({gib(weights.total_bytes)}) would raise "
            f"throughput to {count(step.tokens_per_s)} tokens/s (+{pct(gain)}) and free memory for the "
            "KV cache; check the quality on your own evaluation first.")


def slo_misses(plan: Plan) -> str | None:
    slo, out = plan.request.slo, []
    if slo.tpot_s is not None and plan.effective_batch == 0 and plan.memory.fits:
        one = StepModel(plan.request.hardware, plan.request.model, plan.weights,
                        plan.kv_dtype).serving(1, plan.request.workload)
        out.append(f"even batch 1 takes {ms(one.seconds)} per token, over the TPOT SLO of {ms(slo.tpot_s)}: "
                   "quantize the weights or use a card with more bandwidth")
    if slo.ttft_s is not None and plan.ttft_s is not None and plan.ttft_s > slo.ttft_s:
        out.append(f"the expected TTFT is {ms(plan.ttft_s)} (prefill of {count(plan.request.workload.prompt_tokens)} "
                   f"tokens {ms(plan.prefill.seconds)} plus one step), over the TTFT SLO of {ms(slo.ttft_s)}: "
                   "lower concurrency, shorten prompts (prefix caching helps shared prefixes) or add compute")
    return ("SLO: " + "; ".join(out) + ".") if out else None


def different_card(plan: Plan) -> str | None:
    """Compares modelled with modelled: every other card's speed is the model's (default factors), so this card's
    is too, even when fleet and cost use a measured --tokens-per-second (which is said, with what it implies)."""
    alts = [a for a in plan.alternatives if a.on_demand_per_mtok is not None]
    if not alts:
        return None
    best, money = alts[0], plan.request.currency.format
    here = plan.modelled_on_demand_per_mtok
    device = plan.request.hardware.device.name
    if best.device == device:
        return None
    cards = f"{best.cards} x {best.device}" if best.cards > 1 else best.device
    if here is None:
        if plan.memory.fits:
            return None
        return (f"A card that fits: {cards} would serve this at {count(best.tokens_per_s)} tokens/s per "
                f"replica (modelled), {money(best.on_demand_per_mtok)}/M tokens rented on demand.")
    if best.on_demand_per_mtok > 0.8 * here:
        return None
    text = (f"A different card: {cards} would serve this workload at {money(best.on_demand_per_mtok)}/M tokens "
            f"rented on demand ({count(best.tokens_per_s)} tokens/s per replica) versus {money(here)} here, both "
            "modelled")
    if plan.measured and plan.serving is not None:
        measured = plan.request.tokens_per_second or 0.0
        text += (f"; you measured {count(measured)} tokens/s here where the model says "
                 f"{count(plan.serving.tokens_per_s)}, so calibrate (--calibrate) before trusting either side")
    return text + "."


RULES: tuple[Rule, ...] = (weights_do_not_fit, kv_cache_too_small, concurrency_at_full_length, slo_misses,
                           bigger_batch, quantize_for_speed, different_card)
