"""The metric names and the flags of the servers `doctor --url` diagnoses: tokenfactory, vLLM, SGLang and llama.cpp.

The live rules (live.py) read quantities by our names (tokenfactory's, which are vLLM's with our prefix); a dialect
maps each to the sample names that server exports (the first one present wins: newer names first, older ones
after), and names its own flag for each lever, so the advice reads in the server's own terms. A quantity a server
does not export reads as missing (None), never 0, and the rules that need it stay silent.

Sources, read 2026-12: vLLM `vllm/v1/metrics/loggers.py` and docs/design/metrics.md (V1 `vllm:kv_cache_usage_perc`,
before 0.10 `vllm:gpu_cache_usage_perc`; `vllm:inter_token_latency_seconds`, before it
`vllm:time_per_output_token_seconds`); SGLang `python/sglang/srt/metrics/collector.py` (`sglang:token_usage`,
`sglang:num_retracted_requests_total`, `sglang:queue_time_seconds`); llama.cpp `tools/server/server.cpp`
`/metrics` with --metrics (`llamacpp:requests_processing`, `llamacpp:requests_deferred`, older builds also
`llamacpp:kv_cache_usage_ratio`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

# Quantities the rules read (our names, without the prefix).
QUANTITIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
              "prompt_tokens_total", "generation_tokens_total", "prefix_cache_hits_total",
              "prefix_cache_queries_total", "prefix_cache_hit_rate", "time_to_first_token_seconds",
              "inter_token_latency_seconds", "request_queue_time_seconds", "max_num_seqs", "max_num_batched_tokens",
              "energy_joules_total", "joules_per_output_token", "power_watts")
# Fractions of a whole: several engines behind one page (vLLM data parallel) report one each; the fullest counts.
FRACTIONS = ("kv_cache_usage_perc", "prefix_cache_hit_rate")
LEVERS = ("max_num_seqs", "max_model_len", "kv_cache_dtype", "kv_memory", "max_num_batched_tokens",
          "prefix_caching")


@dataclass(frozen=True)
class Dialect:
    """One server's names: `names` maps a quantity to its samples (absent: it is ours with `prefix`, or, with
    `only_listed`, not exported); `flags` maps a lever to the server's own setting."""

    name: str
    prefix: str
    flags: Mapping[str, str]
    names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    only_listed: bool = False

    def samples(self, quantity: str) -> tuple[str, ...]:
        if quantity in self.names:
            return self.names[quantity]
        return () if self.only_listed else (self.prefix + quantity,)

    def flag(self, lever: str) -> str:
        return self.flags[lever]


TOKENFACTORY = Dialect("tokenfactory", "tokenfactory:", {
    "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
    "kv_cache_dtype": "--kv-cache-dtype int8",
    "kv_memory": "--kv-cache-memory", "max_num_batched_tokens": "--max-num-batched-tokens",
    "prefix_caching": "prefix caching (on unless --no-prefix-caching)"})

VLLM = Dialect("vLLM", "vllm:", {
    "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
    "kv_cache_dtype": "--kv-cache-dtype fp8", "kv_memory": "--gpu-memory-utilization",
    "max_num_batched_tokens": "--max-num-batched-tokens", "prefix_caching": "--enable-prefix-caching"}, {
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "inter_token_latency_seconds": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hit_rate": (), "max_num_seqs": (), "max_num_batched_tokens": (), "energy_joules_total": (),
    "joules_per_output_token": (), "power_watts": ()})

SGLANG = Dialect("SGLang", "sglang:", {
    "max_num_seqs": "--max-running-requests", "max_model_len": "--context-length",
    "kv_cache_dtype": "--kv-cache-dtype fp8_e5m2", "kv_memory": "--mem-fraction-static",
    "max_num_batched_tokens": "--chunked-prefill-size", "prefix_caching": "the radix cache (on unless "
    "--disable-radix-cache)"}, {
    "num_requests_running": ("sglang:num_running_reqs",), "num_requests_waiting": ("sglang:num_queue_reqs",),
    "kv_cache_usage_perc": ("sglang:token_usage",), "num_preemptions_total": ("sglang:num_retracted_requests_total",),
    "prompt_tokens_total": ("sglang:prompt_tokens_total",),
    "generation_tokens_total": ("sglang:generation_tokens_total",),
    "prefix_cache_hit_rate": ("sglang:cache_hit_rate",),
    "time_to_first_token_seconds": ("sglang:time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    "request_queue_time_seconds": ("sglang:queue_time_seconds",),
    "max_num_seqs": ("sglang:max_running_requests",)}, only_listed=True)

LLAMA_CPP = Dialect("llama.cpp", "llamacpp:", {
    "max_num_seqs": "--parallel (-np)", "max_model_len": "--ctx-size (-c, shared by the slots)",
    "kv_cache_dtype": "--cache-type-k q8_0 --cache-type-v q8_0",
    "kv_memory": "--ctx-size", "max_num_batched_tokens": "--batch-size (-b)",
    "prefix_caching": "--cache-reuse"}, {
    "num_requests_running": ("llamacpp:requests_processing",),
    "num_requests_waiting": ("llamacpp:requests_deferred",),
    "kv_cache_usage_perc": ("llamacpp:kv_cache_usage_ratio",),
    "prompt_tokens_total": ("llamacpp:prompt_tokens_total",),
    "generation_tokens_total": ("llamacpp:tokens_predicted_total",)}, only_listed=True)

DIALECTS: tuple[Dialect, ...] = (TOKENFACTORY, VLLM, SGLANG, LLAMA_CPP)


def detect(sample_names: set[str]) -> Dialect | None:
    """The dialect whose prefix the page's samples carry (tokenfactory first: our page is vLLM-shaped)."""
    return next((d for d in DIALECTS if any(n.startswith(d.prefix) for n in sample_names)), None)
