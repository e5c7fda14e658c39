"""`python -m tokenfactory.bench.embed`: are embeddings as fast per token as the prefill they are?

An embedding request is a prefill that samples nothing (engine/pooling.py). This measures prompt tokens per
second on the bundled model (or --model), in one engine, for:
- `prefill`: generation requests with max_tokens 1: the prefill, the last row's logits and one sampled token
  (what a request's time to first token pays for);
- `embed-last`, `embed-mean`: embedding requests (PoolingParams), pooled each way;
- `score`: prompt-only requests (max_tokens 0) that read nothing, the bare prefill.

Each run sends `--batch` requests of `--prompt-tokens` random token ids (a fixed seed) at once and times them to
the last output; the prefix cache is emptied before every run, so nothing is reused. Runs are interleaved across
modes (a busy machine's drift hits them alike) after one warm-up of each; the median and the best of `--repeats`
are reported next to every run, with `embed_vs_prefill` = embed tokens/s / prefill tokens/s (>= 1: not slower
per token), of the medians and of the best runs.
JSON out (--out or stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from tokenfactory.config import EngineConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.types import PoolingParams, SamplingParams

MODES = ("prefill", "embed-last", "embed-mean", "score")


def mode_params(mode: str) -> SamplingParams | PoolingParams:
    if mode == "prefill":
        return SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    if mode == "score":
        return SamplingParams(max_tokens=0)
    return PoolingParams()


def time_run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | PoolingParams) -> float:
    """Seconds from queueing the prompts to the last one's final output."""
    engine.reset_prefix_cache()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    engine.run_to_completion(ids)
    return time.perf_counter() - start


def run(model: str | None, batch: int, prompt_tokens: int, repeats: int, max_num_batched_tokens: int,
        dtype: str) -> dict[str, Any]:
    config = EngineConfig(model=model, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max(prompt_tokens + 16, 256))
    # Pooling is the engine's (EngineConfig.pooling): one engine each way, on the same weights and kernels.
    engines = {"last": LLMEngine(config), "mean": LLMEngine(dataclasses.replace(config, pooling="mean"))}
    vocab = engines["last"].info.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (prompt_tokens,), generator=gen).tolist() for _ in range(batch)]
    mode_to_engine = {"prefill": engines["last"], "embed-last": engines["last"], "embed-mean": engines["mean"],
                      "score": engines["last"]}
    for mode in MODES:  # warm-up
        time_run(mode_to_engine[mode], prompts[:2], mode_params(mode))
    mode_to_seconds: dict[str, list[float]] = {m: [] for m in MODES}
    load_before = os.getloadavg()
    for _ in range(repeats):
        for mode in MODES:
            mode_to_seconds[mode].append(time_run(mode_to_engine[mode], prompts, mode_params(mode)))
    num_tokens = batch * prompt_tokens
    figures = {m: {"tokens_per_s": num_tokens / statistics.median(s), "best_tokens_per_s": num_tokens / min(s),
                   "runs_tokens_per_s": [round(num_tokens / x, 1) for x in s]} for m, s in mode_to_seconds.items()}
    prefill, best_prefill = figures["prefill"]["tokens_per_s"], figures["prefill"]["best_tokens_per_s"]
    return {
        "benchmark": "embed", "model": engines["last"].model_path, "dtype": engines["last"].info.dtype,
        "batch": batch, "prompt_tokens": prompt_tokens, "repeats": repeats,
        "max_num_batched_tokens": max_num_batched_tokens, "threads": torch.get_num_threads(),
        "cpu": _cpu_name(), "machine": platform.machine(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "modes": figures,
        "embed_vs_prefill": {m: figures[m]["tokens_per_s"] / prefill for m in ("embed-last", "embed-mean")},
        # Contention only adds time: on a shared machine the best runs are the steadier comparison.
        "embed_vs_prefill_best": {m: figures[m]["best_tokens_per_s"] / best_prefill
                                  for m in ("embed-last", "embed-mean")},
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2)")
    parser.add_argument("--batch", type=int, default=8, help="requests per run")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    result = run(args.model, args.batch, args.prompt_tokens, args.repeats, args.max_num_batched_tokens, args.dtype)
    text = json.dumps(result, indent=2)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
