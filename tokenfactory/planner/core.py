"""The planner's shared nouns: what a plan is asked (`PlanRequest`) and what it answers (`Plan`). They sit below
plan.py (which builds a plan) and recommend.py (whose rules read one), so neither imports the other's module for
its types (mini-sglang's core.py: shared nouns go to the lower module)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenfactory.levers import engine_default
from tokenfactory.planner.cost import CostEstimate, Currency, FleetPlan, MonthlyBill, Prices
from tokenfactory.planner.hardware import Hardware
from tokenfactory.planner.memory import MemoryPlan, Weights
from tokenfactory.planner.modelsrc import ModelSpec
from tokenfactory.planner.perf import StepEstimate, Workload
from tokenfactory.planner.precision import KVDtype

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
    prices: Prices | None = None  # None: memory and speed only (the doctor's pre-flight)
    precision: str | None = None  # None: as stored (GGUF) or the config's dtype
    kv_dtype: str = "auto"
    max_model_len: int | None = None  # None: the engine's rule, the model's context capped at what the cache holds
    max_num_seqs: int = engine_default("max_num_seqs")
    max_num_batched_tokens: int = engine_default("max_num_batched_tokens")
    workload: Workload = field(default_factory=Workload)
    demand: Demand | None = None
    slo: SLO = field(default_factory=SLO)
    tokens_per_second: float | None = None  # measured per-replica speed, used for fleet and cost instead of the model
    wall_watts: float | None = None  # measured busy power of one replica at the socket, used for cost and the bill
    batch_sizes: tuple[int, ...] | None = None
    # Whose weight bytes decide what fits: "reference" (the format's own size, what an engine that keeps each
    # weight once holds) or "tokenfactory" (our engine's accounting for int8/int4, as serve's start-up check
    # counts it, in the form `serve --quantization-dense auto` would keep).
    engine: str = "reference"
    # With a demand and no --utilisation, cost at the fleet's own busy share (replica-hours / 24 h per replica).
    utilisation_from_fleet: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")

    @property
    def currency(self) -> Currency:
        return self.prices.currency if self.prices is not None else Currency()


@dataclass(frozen=True)
class Alternative:
    """Another card for the same request: its speed is always modelled (default factors), so it is compared with
    this card's modelled speed, never with a measured one."""

    device: str
    cards: int
    batch_size: int
    tokens_per_s: float  # modelled
    on_demand_per_mtok: float | None  # renting the busy hours, in the request's currency
    joules_per_token: float


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    weights: Weights
    kv_dtype: KVDtype
    memory: MemoryPlan
    effective_batch: int  # max_num_seqs, capped by the KV cache (and the TPOT SLO)
    decode: tuple[StepEstimate, ...]  # pure decode per batch size, at the workload's mean context
    serving: StepEstimate | None  # steady state at effective_batch, prefill included
    prefill: StepEstimate  # one prompt alone
    crossover_batch: float | None
    fleet: FleetPlan | None
    cost: CostEstimate | None
    bill: MonthlyBill | None = None
    verdict: str | None = None
    alternatives: tuple[Alternative, ...] = ()
    recommendations: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # int8/int4: what tokenfactory's engine keeps for these weights on this kind of card, by its own accounting
    # (the start-up check's), per --quantization-dense form in the order auto tries them (layers/weight_bytes.py
    # `dense_order`: on a CPU "prepacked", then "copy", "on-the-fly"). None for other precisions.
    engine_weights_bytes: dict[str, int] | None = None
    # The modelled cost of this card (modelled speed), beside `cost` when that used a measured --tokens-per-second.
    modelled_on_demand_per_mtok: float | None = None

    @property
    def max_model_len(self) -> int:
        return self.memory.max_model_len

    @property
    def measured(self) -> bool:
        """Fleet and cost use a measured speed (--tokens-per-second), not the model's."""
        return self.request.tokens_per_second is not None

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
