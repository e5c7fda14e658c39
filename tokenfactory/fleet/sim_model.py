"""What one simulated replica costs per engine step: the planner's first-principles step time and power
(`planner/perf.py`, calibrated when a bench result is given), or a plain linear model for tests with known
answers. The simulator asks only `cost(batch, context, prefill, prompt) -> (seconds, watts)`.

    seconds, watts = planner StepModel.step(B, c, P, p)  (memory + compute time, the power model)
    linear:  seconds = base + per_seq · B + per_prefill_token · P;  watts = busy_w while stepping

`ReplicaSpec` is a replica kind the simulator can start: its step cost, limits (max_num_seqs, the token
budget per step, KV capacity in tokens from the planner's memory plan), watts, rent, cold start, and the
autoscaler's `ReplicaOption` (the SLO concurrency: the planner's largest batch whose step meets the TPOT SLO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tokenfactory.fleet.autoscaler import ReplicaOption
from tokenfactory.levers import OUTPUT_TOKENS, PROMPT_TOKENS, engine_default


class StepCost(Protocol):
    def cost(self, batch: int, context: float, prefill: float, prompt: float) -> tuple[float, float]: ...


@dataclass(frozen=True)
class LinearCost:
    base_s: float
    per_seq_s: float = 0.0
    per_prefill_token_s: float = 0.0
    busy_w: float = 100.0
    prefill_step_s: float = 0.0  # more for a step with prompt tokens (on a CPU: the Python forward, not the plan)

    def cost(self, batch: int, context: float, prefill: float, prompt: float) -> tuple[float, float]:
        mixed = self.prefill_step_s if prefill > 0 else 0.0
        return self.base_s + mixed + self.per_seq_s * batch + self.per_prefill_token_s * prefill, self.busy_w


class PlannerCost:
    """The planner's step model of one replica (`hw.count` cards), made cheap to call a million times.

    Its times are linear in (1, B, B·c, P, P·p): memory_s reads the weights once and every cached token,
    compute_s is 2·N FLOPs per token plus attention's pairs, the all-reduce wait is a fixed share of both, the
    host overhead a constant (planner/perf.py). So the coefficients are read off the planner once, at basis
    points, and each call is a dot product; the power is the planner's own `card_power_w` of the two times.
    tests/fleet/test_simulator.py checks it equals `StepModel.step` everywhere it is used."""

    def __init__(self, steps: object) -> None:
        self.steps = steps  # planner.perf.StepModel (typed loosely: the planner is imported lazily)
        def terms(b: int, c: float, p: float, pr: float) -> tuple[float, float, float]:
            e = steps.step(b, c, p, pr)  # type: ignore[attr-defined]
            return e.memory_s, e.compute_s, e.communication_s
        zero, one, bc = terms(0, 0.0, 0.0, 0.0), terms(1, 0.0, 0.0, 0.0), terms(1, 1.0, 0.0, 0.0)
        pp, pq = terms(0, 0.0, 1.0, 0.0), terms(0, 0.0, 1.0, 2.0)
        # per time term (memory, compute, all-reduce): (constant, per B, per B·c, per P, per P·p/2)
        self.coef = [(zero[i], one[i] - zero[i], bc[i] - one[i], pp[i] - zero[i], pq[i] - pp[i]) for i in range(3)]
        self.overhead_s = steps.step(0, 0.0).overhead_s  # type: ignore[attr-defined]
        self.hw = steps.hw  # type: ignore[attr-defined]

    def cost(self, batch: int, context: float, prefill: float, prompt: float) -> tuple[float, float]:
        x = (batch, batch * context, prefill, prefill * prompt / 2)
        mem, comp, comm = (k0 + k1 * x[0] + k2 * x[1] + k3 * x[2] + k4 * x[3] for k0, k1, k2, k3, k4 in self.coef)
        power = self.hw.count * self.hw.card_power_w(mem, comp, comm + self.overhead_s)
        return mem + comp + comm + self.overhead_s, power


@dataclass(frozen=True)
class ReplicaSpec:
    name: str
    device: str
    step: StepCost
    idle_w: float
    busy_w: float  # the router's view: waking it costs busy − idle
    max_num_seqs: int = engine_default("max_num_seqs")
    max_num_batched_tokens: int = engine_default("max_num_batched_tokens")
    kv_capacity_tokens: int = 10**9
    usd_per_hour: float = 0.0
    cold_start_s: float = 60.0
    target_seqs: int = 64
    tokens_per_s: float = 1000.0

    @property
    def option(self) -> ReplicaOption:
        return ReplicaOption(self.name, self.device, self.idle_w, self.busy_w, self.target_seqs, self.tokens_per_s,
                             self.usd_per_hour)

    def prefill_tokens_per_s(self, prompt: float) -> float:
        seconds, _ = self.step.cost(1, 0.0, prompt, prompt)
        return prompt / seconds if seconds > 0 else 1e9


def planner_spec(model: str, device: str, *, devices: int = 1, precision: str | None = None, kv_dtype: str = "auto",
                 max_num_seqs: int = engine_default("max_num_seqs"),
                 max_num_batched_tokens: int = engine_default("max_num_batched_tokens"),
                 max_model_len: int | None = None,
                 prompt_tokens: float = PROMPT_TOKENS, output_tokens: float = OUTPUT_TOKENS, tpot_slo_s: float = 0.1,
                 cold_start_s: float = 60.0, calibrate: str | None = None, name: str | None = None) -> ReplicaSpec:
    """A replica of `model` on `devices` x `device` from the planner's catalog (calibrated by a bench result)."""
    from dataclasses import replace

    from tokenfactory.planner.calibrate import calibrate as fit
    from tokenfactory.planner.calibrate import load_bench_result
    from tokenfactory.planner.catalog import load_catalog
    from tokenfactory.planner.hardware import hardware_from_catalog
    from tokenfactory.planner.memory import plan_memory, resolve_weights
    from tokenfactory.planner.modelsrc import load_model
    from tokenfactory.planner.perf import StepModel, Workload
    from tokenfactory.planner.precision import parse_kv_dtype

    catalog = load_catalog()
    spec, dev = load_model(model, catalog), catalog.device(device)
    hw = hardware_from_catalog(catalog, dev, devices)
    weights = resolve_weights(spec, precision)
    kv = parse_kv_dtype(kv_dtype, weights.precision)
    if calibrate is not None:
        cal = fit(load_bench_result(calibrate), StepModel(hw, spec, weights, kv))
        hw = replace(hw, efficiency=cal.efficiency, power=cal.power)
    steps = StepModel(hw, spec, weights, kv)
    # max_model_len None: the engine's rule (the model's context, capped at what the KV cache holds).
    memory = plan_memory(hw, spec, weights, kv, max_model_len, max_num_seqs, max_num_batched_tokens)
    if not memory.weights_fit:
        raise ValueError(f"{spec.name} does not fit on {devices} x {dev.name}")
    workload = Workload(prompt_tokens, output_tokens)
    kv_seqs = memory.max_seqs(prompt_tokens + output_tokens)
    target = max(1, steps.max_batch_within(tpot_slo_s, workload, max(1, min(max_num_seqs, kv_seqs))))
    rent = dev.rent_usd_per_hour.value * devices if dev.rent_usd_per_hour else 0.0
    return ReplicaSpec(name or dev.name.lower(), dev.name, PlannerCost(steps), dev.idle_w.value * devices,
                       dev.tdp_w.value * devices, max_num_seqs, max_num_batched_tokens,
                       memory.kv_capacity_tokens, rent, cold_start_s, target,
                       steps.serving(target, workload).tokens_per_s)
