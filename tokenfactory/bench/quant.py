"""Quantization benchmark: bf16 vs int8 vs int4 (vs a GGUF's own blocks) on one model, JSON out.

    python -m tokenfactory.bench.quant                 single stream and 32 concurrent, per scheme
    python -m tokenfactory.bench.quant --crossover     per-layer kernel times by rows T (sets KERNELS)

Per scheme: decode tokens/s of one stream (prefill excluded; from the median step, which a shared machine
disturbs least, and from wall time), output tokens/s of `--concurrency` requests started together, weight
bytes (resident, and read per decode token), perplexity on the bundled text, and memory-bandwidth
utilisation as gpt-fast defines it:

    MBU = decode tok/s x bytes read per token / peak bandwidth       (bytes/token = weights read + KV read)

Fixed seed, one warm-up request per engine; peak bandwidth is measured (a 512 MiB float32 sum).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

DEFAULT_SCHEMES = "none,int8,int4,auto"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file, HF folder or quantized file (default: bundled)")
    p.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default {DEFAULT_SCHEMES})")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dense", default="copy", help="large steps: copy | on-the-fly")
    p.add_argument("--skip-ppl", action="store_true", help="no perplexity (saves ~10 s per scheme)")
    p.add_argument("--crossover", action="store_true", help="time kernels per row count instead")
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's). On a shared machine use 1: a 2-thread op whose second "
                        "core is busy waits a scheduler slice (~4-8 ms) per parallel region, which swamps bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench-quant.json")


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def single_stream(engine: Any, prompt: list[int], output_len: int) -> dict[str, float]:
    from tokenfactory.types import SamplingParams

    engine.reset_prefix_cache()
    engine.add_request(prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0))
    times = []
    while engine.has_unfinished_requests:
        engine.step()
        times.append(time.perf_counter())
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]  # decode steps (the first is prefill)
    return {"decode_tokens_per_s": (len(times) - 1) / (times[-1] - times[0]),
            "median_step_ms": statistics.median(steps) * 1e3,
            "decode_tokens_per_s_median_step": 1 / statistics.median(steps)}


def concurrent(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from tokenfactory.types import SamplingParams

    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    engine.run_to_completion(ids)
    elapsed = time.perf_counter() - start
    return {"num_requests": len(prompts), "elapsed_s": elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed}


def bench_scheme(loaded: Any, scheme: str, args: argparse.Namespace, text_ids: list[int] | None) -> dict[str, Any]:
    from tokenfactory.layers.quant import QuantOptions
    from tokenfactory.quality.eval import load_engine, perplexity

    engine, summary = load_engine(loaded, scheme, dtype=args.dtype, max_model_len=1024,
                                  max_num_seqs=args.concurrency, options=QuantOptions(dense=args.dense))
    engine.warmup()
    rng = random.Random(args.seed)
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(args.concurrency)]
    out: dict[str, Any] = {
        "scheme": scheme, "dtype": str(engine.dtype).removeprefix("torch."),
        "layers_by_format": _count(summary.path_to_format.values()),
        "resident_weight_bytes": engine.weight_bytes,
        "decode_weight_bytes": engine.decode_weight_bytes,
        "kv_bytes_per_token": engine.capacity.bytes_per_token,
        "single_stream": single_stream(engine, prompts[0], args.output_len),
        f"concurrent_{args.concurrency}": concurrent(engine, prompts, args.output_len),
    }
    if text_ids is not None:
        out["perplexity"], out["perplexity_tokens"] = perplexity(engine, [text_ids])
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        key = v.split(" (")[0]
        counts[key] = counts.get(key, 0) + 1
    return counts


def crossover(args: argparse.Namespace) -> dict[str, Any]:
    """Time a forward through 30 distinct copies of the bundled model's layer shapes (so the weights stream
    from memory as in a real step, rather than sitting in cache) per path and row count; best of 7."""
    import torch

    from tokenfactory.layers.quant import QuantizedLinear
    from tokenfactory.layers.quant_formats import Int8Weight, quantize_int4, quantize_int8

    torch.manual_seed(args.seed)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down per layer
    make = {
        "int8": lambda w: quantize_int8(w),
        "int4-g32": lambda w: quantize_int4(w, 32),
        "int8-g32 (Q8_0)": lambda w: Int8Weight(*_q8_0(w)),
    }
    rows = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    dense_matmul = lambda m, x: torch.nn.functional.linear(x, m._dense_fn())  # noqa: E731
    paths = {"packed": ("copy", lambda m, x: m._packed_fn(x)), "dense-copy": ("copy", dense_matmul),
             "dense-on-the-fly": ("on-the-fly", dense_matmul)}
    table: dict[str, dict[str, list[float]]] = {}
    for name, quantize in make.items():
        table[name] = {label: [] for label in paths}
        for dense in ("copy", "on-the-fly"):
            mods = [QuantizedLinear.build(quantize(torch.randn(n, k) * 0.02), torch.zeros(n, k, dtype=bf16), None,
                                          dtype=bf16, device=cpu, dense=dense) for n, k in shapes]
            for label, (path_dense, fn) in paths.items():
                if path_dense != dense:
                    continue
                for t in rows:
                    xs = [torch.randn(t, k).to(bf16) for _, k in shapes]
                    run = lambda fn=fn, mods=mods, xs=xs: [fn(m, x) for m, x in zip(mods, xs, strict=True)]  # noqa: E731
                    table[name][label].append(_best_ms(run, repeats=7))
            del mods
    crossings = {name: {d: max([t for t, p, q in zip(rows, v["packed"], v[d], strict=True) if p < q], default=0)
                        for d in ("dense-copy", "dense-on-the-fly")} for name, v in table.items()}
    return {"rows": rows, "ms_per_forward_30_layers": table, "largest_rows_where_packed_wins": crossings}


def _q8_0(w: Any) -> tuple[Any, Any]:
    import torch

    n, k = w.shape
    d = w.view(n, -1, 32).abs().amax(-1) / 127
    q = torch.round(w.view(n, -1, 32) / d.unsqueeze(-1)).clamp(-128, 127).to(torch.int8).view(n, k)
    return q, d


def _best_ms(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main(args: argparse.Namespace) -> int:
    import torch

    from tokenfactory.bench.offline import measure_peak_bandwidth_gbs, roofline_bandwidth
    from tokenfactory.layers.quant import get_scheme
    from tokenfactory.models.loader import load_model
    from tokenfactory.quality.texts import bundled_text

    torch.manual_seed(args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    env = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu": platform.processor() or platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    if args.crossover:
        result: dict[str, Any] = {"benchmark": "quant-crossover", "environment": env, **crossover(args)}
    else:
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        for s in schemes:
            get_scheme(s)
        peak = args.peak_bandwidth_gbs or measure_peak_bandwidth_gbs()
        loaded = load_model(args.model)
        text_ids = None if args.skip_ppl else loaded.tokenizer.encode(bundled_text())
        runs = [bench_scheme(loaded, s, args, text_ids) for s in schemes]
        for run in runs:  # each scheme against its own roofline: a smaller model may fit in the cache (offline.py)
            bytes_per_token = run["decode_weight_bytes"] + run["kv_bytes_per_token"] * (
                args.prompt_len + args.output_len / 2)
            run["bandwidth"] = roofline_bandwidth(peak, int(bytes_per_token), given=bool(args.peak_bandwidth_gbs))
            s = run["single_stream"]
            s["mbu"] = s["decode_tokens_per_s_median_step"] * bytes_per_token / (
                run["bandwidth"]["peak_bandwidth_gbs"] * 1e9)
        base = runs[0]
        for run in runs:
            run["vs_first"] = {
                "single_stream": run["single_stream"]["decode_tokens_per_s_median_step"]
                / base["single_stream"]["decode_tokens_per_s_median_step"],
                "concurrent": run[f"concurrent_{args.concurrency}"]["output_tokens_per_s"]
                / base[f"concurrent_{args.concurrency}"]["output_tokens_per_s"],
                "decode_weight_bytes": run["decode_weight_bytes"] / base["decode_weight_bytes"]}
            if "perplexity" in run:
                run["vs_first"]["perplexity_change"] = run["perplexity"] / base["perplexity"] - 1
        env |= {"peak_bandwidth_gbs": peak, "model": str(loaded.path)}
        result = {"benchmark": "quant", "environment": env, "config": {k: v for k, v in vars(args).items()
                                                                       if k != "func"}, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
