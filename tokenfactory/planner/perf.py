"""Speed and energy of one engine step, from first principles.

A decode step of batch B, each sequence with c tokens already cached, moves
    bytes = W_read + (B*c + P) * kv_bytes_per_token            (weights once; every cached K/V once)
and computes
    FLOPs = 2 * N_matmul * (B + P)                             (2 FLOPs per weight per token)
          + 4 * B * c * L * q_size + 2 * P * p * L * q_size    (QK^T and PV; causal prefill halves it)
where P = prompt tokens prefilled in the same step (continuous batching) and p the prompt length.
Sources: the 2*N FLOPs/token rule (Kaplan et al. 2020, Table 1) and the decode memory-bound
argument (Pope et al. 2022, 'Efficiently Scaling Transformer Inference', section 3.1).

Time. The roofline is the datasheet's: max(bytes / BW, FLOPs / peak) with the cards' peak bandwidth and dense
FLOP/s, nothing discounted (the essay's 14 GB / 1 TB/s = 14 ms a token). The *modelled* (expected) time divides
each term by the achievable share of its peak (catalog factors: 70% of bandwidth and 60% of compute on a GPU by
default, or --calibrate's fit) and adds them,
    seconds = bytes / (BW * eff_bw) + FLOPs / (peak * eff_compute) + step_overhead,
because an engine's kernels mostly run one after another, each limited by one resource, so memory
and tensor-core time overlap little. The additive form reproduces published measurements across
batch sizes (ML.ENERGY v3, tests/planner/test_planner_published.py); the max form overestimates
throughput by 40-70% at large batches there. Both are reported; the step is "memory-bound" or
"compute-bound" by which term is larger, and the crossover batch is where they are equal.

Energy. Power per card = idle + (TDP - idle) * activity (see hardware.PowerModel); joules per
output token = power * seconds / B.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfactory.levers import OUTPUT_TOKENS, PROMPT_TOKENS
from tokenfactory.planner.hardware import Hardware
from tokenfactory.planner.memory import Weights
from tokenfactory.planner.modelsrc import ModelSpec
from tokenfactory.planner.precision import KVDtype


@dataclass(frozen=True)
class Workload:
    """Mean request shape: prompt tokens in, output tokens out."""

    prompt_tokens: float = PROMPT_TOKENS
    output_tokens: float = OUTPUT_TOKENS

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0:
            raise ValueError(f"--prompt-tokens must be >= 0, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"--output-tokens must be >= 1, got {self.output_tokens}")

    @property
    def mean_context_tokens(self) -> float:
        """Tokens a decoding sequence has cached, on average over its life."""
        return self.prompt_tokens + self.output_tokens / 2

    @property
    def prompt_per_output(self) -> float:
        return self.prompt_tokens / self.output_tokens


@dataclass(frozen=True)
class StepEstimate:
    """One engine step of one replica."""

    batch_size: int  # sequences producing a token this step
    context_tokens: float  # mean tokens already cached per decoding sequence
    prefill_tokens: float  # prompt tokens computed in the same step
    bytes_moved: float
    flops: float
    memory_s: float
    compute_s: float
    communication_s: float  # tensor-parallel all-reduce waits (0 on one card)
    overhead_s: float
    power_w: float  # all cards of the replica
    peak_memory_s: float = 0.0  # bytes at the cards' datasheet bandwidth, nothing discounted
    peak_compute_s: float = 0.0  # FLOPs at the cards' dense datasheet peak

    @property
    def seconds(self) -> float:
        """Modelled: each term at its achievable share of the peak, added, plus TP waits and host overhead."""
        return self.memory_s + self.compute_s + self.communication_s + self.overhead_s

    @property
    def roofline_seconds(self) -> float:
        """The datasheet roofline: max(bytes / peak bandwidth, FLOPs / peak FLOP/s), a bound no engine beats."""
        return max(self.peak_memory_s, self.peak_compute_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size / self.seconds

    @property
    def roofline_tokens_per_s(self) -> float:
        return self.batch_size / self.roofline_seconds

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def joules_per_token(self) -> float:
        return self.power_w * self.seconds / max(self.batch_size, 1)

    def to_dict(self) -> dict[str, float | str]:
        derived = ("seconds", "roofline_seconds", "tokens_per_s", "roofline_tokens_per_s", "bound",
                   "joules_per_token")
        return {**self.__dict__, **{name: getattr(self, name) for name in derived}}


@dataclass(frozen=True)
class StepModel:
    """Everything a step estimate depends on, bound once."""

    hw: Hardware
    model: ModelSpec
    weights: Weights
    kv: KVDtype

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.bytes_per_token(self.model.config)

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs for one query token attending to one cached token, all layers: QK^T + PV = 4 * q_size."""
        cfg = self.model.config
        return 4.0 * cfg.num_layers * cfg.q_size

    def step(self, batch_size: int, context_tokens: float, prefill_tokens: float = 0.0,
             prompt_tokens: float = 0.0) -> StepEstimate:
        if batch_size < 0 or context_tokens < 0 or prefill_tokens < 0:
            raise ValueError("batch_size, context_tokens and prefill_tokens must be >= 0")
        hw, kv = self.hw, self.kv_bytes_per_token
        kv_bytes = (batch_size * context_tokens + prefill_tokens) * kv
        memory_s = (self.weights.read_bytes_per_step / hw.weight_bandwidth(self.weights.precision)
                    + kv_bytes / hw.kv_bandwidth)
        flops = (2.0 * self.model.matmul_params * (batch_size + prefill_tokens)
                 + self.attention_flops_per_pair * (batch_size * context_tokens
                                                    + prefill_tokens * prompt_tokens / 2))
        compute_s = flops / hw.flops(self.weights.precision.compute_dtype)
        communication_s = hw.communication_s(memory_s + compute_s)
        overhead_s = hw.efficiency.step_overhead_s
        power = hw.count * hw.card_power_w(memory_s, compute_s, communication_s + overhead_s)
        moved = self.weights.read_bytes_per_step + kv_bytes
        peak_memory_s = moved / (hw.count * hw.device.bandwidth_bytes_per_s)
        peak_compute_s = flops / (hw.count * hw.device.peak_flops(self.weights.precision.compute_dtype))
        return StepEstimate(batch_size, context_tokens, prefill_tokens, moved, flops, memory_s, compute_s,
                            communication_s, overhead_s, power, peak_memory_s, peak_compute_s)

    def decode(self, batch_size: int, context_tokens: float) -> StepEstimate:
        """A pure decode step: every sequence produces one token, no prompt work."""
        return self.step(batch_size, context_tokens)

    def serving(self, batch_size: int, workload: Workload) -> StepEstimate:
        """Steady-state continuous batching: B sequences decode while finished ones are replaced, so
        each step also prefills B * prompt/output prompt tokens (every output token 'carries' its
        share of a prompt)."""
        return self.step(batch_size, workload.mean_context_tokens,
                         batch_size * workload.prompt_per_output, workload.prompt_tokens)

    def prefill(self, prompt_tokens: float) -> StepEstimate:
        """One prompt alone (time to first token on an idle replica); yields one token."""
        return self.step(1, 0.0, prompt_tokens, prompt_tokens)

    def crossover_batch(self, context_tokens: float) -> float | None:
        """Batch at which compute time equals memory time in a decode step; None if compute never
        catches up (the KV reads grow as fast as the FLOPs: long contexts with little GQA)."""
        base = self.decode(0, context_tokens)
        one = self.decode(1, context_tokens)
        mem_slope = one.memory_s - base.memory_s
        comp_slope = one.compute_s - base.compute_s
        if comp_slope <= mem_slope:
            return None
        return base.memory_s / (comp_slope - mem_slope)

    def max_batch_within(self, tpot_s: float, workload: Workload, limit: int) -> int:
        """Largest batch (<= limit) whose serving step takes at most `tpot_s`; 0 if even one is slower."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.serving(mid, workload).seconds <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo
