"""`make_plan`: memory, speed, fleet, cost and advice for one model on one kind of card."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenfactory.planner.catalog import Catalog, Device
from tokenfactory.planner.cost import CostEstimate, FleetPlan, Prices, estimate_cost, fleet_for_demand
from tokenfactory.planner.hardware import Hardware, hardware_from_catalog
from tokenfactory.planner.memory import MemoryPlan, Weights, engine_weight_bytes, plan_memory, resolve_weights
from tokenfactory.planner.modelsrc import ModelSpec
from tokenfactory.planner.perf import StepEstimate, StepModel, Workload
from tokenfactory.planner.precision import parse_kv_dtype
from tokenfactory.planner.recommend import recommend

DEFAULT_MAX_MODEL_LEN_CAP = 8192
TP_COUNTS = (1, 2, 4, 8)
ENGINES = ("reference", "tokenfactory")


@dataclass(frozen=True)
class Demand:
    tokens_per_day: float  # output tokens
    window_hours: float = 24.0


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_s', '')}-slo must be > 0 seconds, got {value}")


@dataclass(frozen=True)
class PlanRequest:
    model: ModelSpec
    hardware: Hardware
    prices: Prices
    precision: str | None = None  # None: as stored (GGUF) or the config's dtype
    kv_dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's context, capped at 8,192
    concurrency: int = 64  # max_num_seqs
    max_num_batched_tokens: int = 2048
    workload: Workload = field(default_factory=Workload)
    demand: Demand | None = None
    slo: SLO = field(default_factory=SLO)
    tokens_per_second: float | None = None  # measured per-replica speed, overrides the model
    batch_sizes: tuple[int, ...] | None = None
    # Whose weight bytes decide what fits: "reference" (the format's own size, what an engine that keeps each
    # weight once holds) or "tokenfactory" (our engine's accounting for int8/int4, as serve's start-up check
    # counts it: the dense copy where it fits, else on-the-fly, as `--quantization-dense auto` chooses).
    engine: str = "reference"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @property
    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return min(self.model.config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN_CAP)


@dataclass(frozen=True)
class Alternative:
    device: str
    cards: int
    batch_size: int
    tokens_per_s: float
    rent_usd_per_mtok: float | None
    joules_per_token: float


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    weights: Weights
    kv_dtype_bytes: int
    memory: MemoryPlan
    effective_batch: int  # concurrency, capped by the KV cache (and the TPOT SLO)
    decode: tuple[StepEstimate, ...]  # pure decode per batch size, at the workload's mean context
    serving: StepEstimate | None  # steady state at effective_batch, prefill included
    prefill: StepEstimate  # one prompt alone
    crossover_batch: float | None
    fleet: FleetPlan | None
    cost: CostEstimate | None
    alternatives: tuple[Alternative, ...] = ()
    recommendations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # int8/int4: what tokenfactory's engine keeps for these weights on this kind of card, by its own accounting
    # (the start-up check's): with the dense copy for large steps, and on-the-fly. None for other precisions.
    engine_weights_bytes: tuple[int, int] | None = None

    @property
    def max_model_len(self) -> int:
        return self.memory.max_model_len

    @property
    def tokens_per_s(self) -> float | None:
        """Per-replica output tokens/s used for fleet and cost (measured if given, else modelled)."""
        if self.request.tokens_per_second is not None:
            return self.request.tokens_per_second
        return self.serving.tokens_per_s if self.serving else None

    @property
    def ttft_s(self) -> float | None:
        """Prefill of one prompt plus, under load, one in-flight step to wait for."""
        return self.prefill.seconds + (self.serving.seconds if self.serving else 0.0)

    @property
    def tpot_s(self) -> float | None:
        return self.serving.seconds if self.serving else None


def fitted_memory(req: PlanRequest, hw: Hardware) -> tuple[Weights, MemoryPlan]:
    """The weights as `req.engine` keeps them on `hw`, and the memory plan they leave."""
    weights = resolve_weights(req.model, req.precision)
    kv_bytes = parse_kv_dtype(req.kv_dtype, weights.precision)

    def memory(w: Weights) -> MemoryPlan:
        return plan_memory(hw, req.model, w, kv_bytes, req.resolved_max_model_len, req.concurrency,
                           req.max_num_batched_tokens)

    ours = _engine_weights(req, hw) if req.engine == "tokenfactory" else None
    if ours is None:
        return weights, memory(weights)
    copy, lean = ours
    with_copy = replace(weights, total_bytes=copy, label=f"{weights.label}, tokenfactory with its dense copy")
    plan = memory(with_copy)
    if plan.fits:
        return with_copy, plan
    lean_weights = replace(weights, total_bytes=lean, label=f"{weights.label}, tokenfactory on-the-fly")
    return lean_weights, memory(lean_weights)


def make_plan(request: PlanRequest, catalog: Catalog | None = None) -> Plan:
    """The whole plan; `catalog` enables the 'a different card?' comparison."""
    req, model, hw = request, request.model, request.hardware
    weights, memory = fitted_memory(req, hw)
    kv_bytes = parse_kv_dtype(req.kv_dtype, weights.precision)
    steps = StepModel(hw, model, weights, kv_bytes)
    wl = req.workload
    final_len = wl.prompt_tokens + wl.output_tokens
    kv_limit = memory.max_seqs(final_len) if memory.weights_fit else 0
    batch = min(req.concurrency, kv_limit)
    notes = []
    if req.slo.tpot_s is not None and batch > 0:
        slo_batch = steps.max_batch_within(req.slo.tpot_s, wl, batch)
        if slo_batch < batch:
            notes.append(f"batch capped at {slo_batch} (from {batch}) to meet the TPOT SLO of "
                         f"{req.slo.tpot_s * 1000:.0f} ms")
            batch = slo_batch
    serving = steps.serving(batch, wl) if batch > 0 else None
    decode = tuple(steps.decode(b, wl.mean_context_tokens)
                   for b in req.batch_sizes or _batch_sizes(req.concurrency, max(kv_limit, 1)))
    plan = Plan(request=req, weights=weights, kv_dtype_bytes=kv_bytes, memory=memory, effective_batch=batch,
                decode=decode, serving=serving, prefill=steps.prefill(wl.prompt_tokens),
                crossover_batch=steps.crossover_batch(wl.mean_context_tokens), fleet=None, cost=None,
                notes=tuple(notes), engine_weights_bytes=_engine_weights(req, hw))
    plan = _with_fleet_and_cost(plan)
    if catalog is not None:
        plan = replace(plan, alternatives=tuple(compare_devices(req, catalog)))
    return replace(plan, recommendations=tuple(recommend(plan)))


def _engine_weights(req: PlanRequest, hw: Hardware) -> tuple[int, int] | None:
    kind = hw.device.kind
    copy, lean = (engine_weight_bytes(req.model, req.precision, kind, dense) for dense in ("copy", "on-the-fly"))
    return None if copy is None or lean is None else (copy, lean)


def _batch_sizes(concurrency: int, kv_limit: int) -> tuple[int, ...]:
    top = max(1, min(max(concurrency, 256), kv_limit, 1024))
    sizes = {1 << i for i in range(11) if (1 << i) <= top} | {min(concurrency, kv_limit)}
    return tuple(sorted(s for s in sizes if s >= 1))


def _with_fleet_and_cost(plan: Plan) -> Plan:
    req, tps = plan.request, plan.tokens_per_s
    if tps is None or tps <= 0:
        return plan
    hw = req.hardware
    fleet = (fleet_for_demand(req.demand.tokens_per_day, req.demand.window_hours, tps, hw.count)
             if req.demand else None)
    busy_w = plan.serving.power_w if plan.serving else hw.count * hw.device.tdp_w.value
    idle_w = hw.count * hw.device.idle_w.value
    cost = estimate_cost(tps, busy_w, idle_w, hw.count, req.prices)
    return replace(plan, fleet=fleet, cost=cost)


def min_cards(request: PlanRequest, device: Device, catalog: Catalog) -> tuple[Hardware, MemoryPlan] | None:
    """The smallest tensor-parallel group of `device` that holds the weights and one max_model_len
    sequence, with the catalog's default factors; None if even 8 cards are not enough."""
    for count in TP_COUNTS:
        hw = hardware_from_catalog(catalog, device, count)
        _, mem = fitted_memory(request, hw)
        if mem.fits:
            return hw, mem
    return None


def compare_devices(request: PlanRequest, catalog: Catalog) -> list[Alternative]:
    """Every catalog device (smallest group that fits), at the request's concurrency (capped by its KV
    cache and the TPOT SLO) and workload, cheapest rented $/Mtok first."""
    out = []
    wl = request.workload
    weights = resolve_weights(request.model, request.precision)
    kv_bytes = parse_kv_dtype(request.kv_dtype, weights.precision)
    for device in {id(d): d for d in catalog.devices.values()}.values():
        found = min_cards(request, device, catalog)
        if found is None:
            continue
        hw, mem = found
        steps = StepModel(hw, request.model, weights, kv_bytes)
        batch = min(request.concurrency, mem.max_seqs(wl.prompt_tokens + wl.output_tokens))
        if request.slo.tpot_s is not None:
            batch = steps.max_batch_within(request.slo.tpot_s, wl, batch)
        if batch < 1:
            continue
        step = steps.serving(batch, wl)
        rent = device.rent_usd_per_hour.value if device.rent_usd_per_hour else None
        prices = request.prices
        per_mtok = (rent * hw.count / (step.tokens_per_s * 3600 * prices.utilisation / 1e6)
                    if rent is not None else None)
        out.append(Alternative(device.name, hw.count, batch, step.tokens_per_s, per_mtok, step.joules_per_token))
    return sorted(out, key=lambda a: (a.rent_usd_per_mtok is None, a.rent_usd_per_mtok or 0.0))
