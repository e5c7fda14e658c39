"""Scenario profiles: the essay's trade-off between latency, throughput and cost, as engine and SLO settings
chosen from the planner's model of the machine (`serve --profile`, `plan --profile`).

    latency     TPOT within 1.5 x the one-sequence step: the batch the step model allows at that target (at least
                4, so one long request cannot hold a replica alone), short
                prefill chunks (512 tokens: a decode waits behind at most one chunk), n-gram speculation (small
                batches are memory-bound: a draft's verification rides on the weight read), the slo autoscaler.
    throughput  the largest batch the KV cache holds (up to 256), 8192-token steps, no speculation (at large
                batches the step is compute-bound and rejected drafts cost real FLOPs), TPOT SLO 1.2 x that
                step, the slo autoscaler.
    efficiency  the batch with the fewest joules per token whose TPOT stays within 4 x the one-sequence step,
                2048-token steps, no speculation, the energy autoscaler (consolidate, stop idle replicas).

`choose_profile` picks one for a stated workload: latency when the TPOT target leaves room for few sequences,
throughput when the demand needs at least half a replica's largest-batch capacity, efficiency otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfactory.planner.perf import StepModel, Workload

PROFILES = ("latency", "throughput", "efficiency")


@dataclass(frozen=True)
class ScenarioProfile:
    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    speculative: str  # none | ngram
    ttft_slo_s: float
    tpot_slo_s: float
    autoscaler: str  # slo | energy
    tokens_per_s: float  # per replica at max_num_seqs (modelled)
    joules_per_token: float
    reason: str

    def describe(self) -> str:
        return (f"{self.name}: max_num_seqs {self.max_num_seqs}, max_num_batched_tokens "
                f"{self.max_num_batched_tokens}, speculative {self.speculative}, SLO TTFT {self.ttft_slo_s:.2f} s / "
                f"TPOT {self.tpot_slo_s * 1000:.0f} ms, autoscaler {self.autoscaler}; modelled "
                f"{self.tokens_per_s:,.0f} tok/s, {self.joules_per_token:.3g} J/token per replica")


def make_profile(name: str, steps: StepModel, workload: Workload, kv_limit_seqs: int, reason: str = "",
                 limit: int = 256) -> ScenarioProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}")
    cap = max(1, min(kv_limit_seqs, limit))
    one = steps.serving(1, workload).seconds
    ttft = max(0.5, 2 * steps.prefill(workload.prompt_tokens).seconds)
    if name == "latency":
        tpot = 1.5 * one
        batch = max(min(4, cap), steps.max_batch_within(tpot, workload, cap))
        tpot = max(tpot, 1.2 * steps.serving(batch, workload).seconds)
        chunk, spec, scaler = 512, "ngram", "slo"
    elif name == "throughput":
        batch = cap
        tpot = 1.2 * steps.serving(batch, workload).seconds
        chunk, spec, scaler, ttft = 8192, "none", "slo", max(ttft, 2.0)
    else:
        within = max(1, steps.max_batch_within(4 * one, workload, cap))
        batch = min(range(1, within + 1), key=lambda b: (steps.serving(b, workload).joules_per_token, -b))
        tpot = 1.2 * steps.serving(batch, workload).seconds
        chunk, spec, scaler, ttft = 2048, "none", "energy", max(ttft, 2.0)
    step = steps.serving(batch, workload)
    return ScenarioProfile(name, batch, chunk, spec, ttft, tpot, scaler, step.tokens_per_s, step.joules_per_token,
                           reason)


def choose_profile(steps: StepModel, workload: Workload, kv_limit_seqs: int, tpot_slo_s: float | None = None,
                   tokens_per_s_demand: float | None = None) -> ScenarioProfile:
    """The profile for a stated workload (TPOT target, demand in output tokens/s), with the reason."""
    cap = max(1, min(kv_limit_seqs, 256))
    one = steps.serving(1, workload).seconds
    if tpot_slo_s is not None:
        room = steps.max_batch_within(tpot_slo_s, workload, cap)
        if tpot_slo_s <= 1.5 * one or room <= 4:
            return make_profile("latency", steps, workload, kv_limit_seqs,
                                f"the TPOT target {tpot_slo_s * 1000:.0f} ms leaves room for {room} sequences a step "
                                f"(one alone takes {one * 1000:.0f} ms)")
    best = steps.serving(cap, workload).tokens_per_s
    if tokens_per_s_demand is not None and tokens_per_s_demand < 0.5 * best:
        return make_profile("efficiency", steps, workload, kv_limit_seqs,
                            f"the demand ({tokens_per_s_demand:,.0f} tok/s) is under half of one replica's "
                            f"{best:,.0f} tok/s at its largest batch: consolidate, batch for joules, stop idle "
                            "replicas")
    if tokens_per_s_demand is not None:
        why = f"the demand ({tokens_per_s_demand:,.0f} tok/s) needs at least half of a replica's {best:,.0f} tok/s"
    elif tpot_slo_s is not None:
        why = (f"the TPOT target {tpot_slo_s * 1000:.0f} ms allows large batches and no low demand is stated: the "
               "most tokens per replica-hour")
    else:
        why = "no latency target or low demand stated: the most tokens per replica-hour"
    return make_profile("throughput", steps, workload, kv_limit_seqs, why)
