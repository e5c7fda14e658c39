"""`tokenfactory bench offline`: the engine's throughput and single-stream decode speed, side by side with
the naive baseline the industry started from (Hugging Face `generate` with static batches) on the same
weights, in one run, with a fixed seed, a warm-up, and JSON out.

Figures:
- throughput: N requests with random prompt and output lengths (uniform in the given ranges), ignore_eos;
  output tokens / wall seconds. The baseline runs them in static batches of `--hf-batch-size`, sorted by
  nothing (arrival order), each batch generating until its longest request is done; only each request's own
  output tokens count. The baseline's dtype (`--hf-dtype auto`) is the faster of float32 and bfloat16 on this
  machine, each timed on the first batch (the JSON keeps both rates).
- single stream: one request, decode tokens/s after the first token (prefill excluded), and
  MBU = decode tok/s x bytes read per token / peak memory bandwidth (gpt-fast's definition; bytes per token
  = weights + the KV cache read at the mean context). Peak bandwidth is measured here (a large sum) unless
  given with --peak-bandwidth-gbs.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path
from typing import Any

from tokenfactory.config import OFFLINE_BATCHING
from tokenfactory.progress import track


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="weights: auto (a GGUF's own blocks), none, int8, int4")
    p.add_argument("--quantization-dense", default="prepacked", choices=["prepacked", "copy", "on-the-fly"],
                   help="quantized layers' large steps: the dense copy and oneDNN's copy of it (what serve keeps on a "
                        "CPU where it fits; the plain copy elsewhere), the dense copy, or dequantized per call")
    p.add_argument("--machine-profile", default="auto", choices=["auto", "remeasure", "off"],
                   help="the engine's measured kernel crossovers and thread policy (off: built-in constants)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--prompt-len", default="32:512", help="min:max prompt tokens")
    p.add_argument("--output-len", default="32:256", help="min:max output tokens")
    p.add_argument("--single-prompt-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=OFFLINE_BATCHING["max_num_seqs"],
                   help="the offline LLM class's batching (config.OFFLINE_BATCHING)")
    p.add_argument("--max-num-batched-tokens", type=int, default=OFFLINE_BATCHING["max_num_batched_tokens"])
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-dtype", default="auto", choices=["auto", *HF_DTYPES],
                   help="the baseline's dtype; auto: each of float32 and bfloat16 timed on one batch, the faster run "
                        "(transformers advises float32 for GGUF weights, but on a CPU with AMX its bfloat16 was 1.7x "
                        "faster: the comparison is against the baseline's best)")
    p.add_argument("--skip-hf", action="store_true", help="engine only (no baseline)")
    p.add_argument("--peak-bandwidth-gbs", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench-offline.json")


HF_DTYPES = ("float32", "bfloat16", "float16")
HF_PROBED = ("float32", "bfloat16")  # float16 on a CPU is emulated: never the fastest, only asked for by name
HF_PROBE_TOKENS = 32


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_workload(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(num)]


def measure_peak_bandwidth_gbs(num_bytes: int = 512 << 20, repeats: int = 5) -> float:
    """Sustained read bandwidth: a float32 sum over `num_bytes` (512 MiB: past any cache, memory's), best of
    `repeats` after a first pass that brings it in."""
    import torch

    x = torch.ones(max(num_bytes // 4, 1))
    best = 0.0
    for _ in range(repeats + 1):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def roofline_bandwidth(dram_gbs: float, bytes_per_token: int, *, given: bool = False) -> dict[str, Any]:
    """The read bandwidth that bounds batch-1 decode: memory's (a 512 MiB sum), or, where the bytes one decode token
    reads fit in the last-level cache (a 480 MiB L3 on some Xeons, for a 94 MB model), the bandwidth of a sum over
    exactly that many bytes, read again and again as decode reads them. The faster of the two is the roofline: an
    MBU against memory alone would flatter a model that the cache holds. `given`: the user's figure, used as is."""
    if given:
        return {"peak_bandwidth_gbs": dram_gbs, "peak_bandwidth_source": "given"}
    working_set_gbs = measure_peak_bandwidth_gbs(bytes_per_token, repeats=10)
    return {"peak_bandwidth_gbs": max(dram_gbs, working_set_gbs), "dram_bandwidth_gbs": dram_gbs,
            "working_set_bandwidth_gbs": working_set_gbs, "working_set_bytes": bytes_per_token,
            "peak_bandwidth_source": f"measured: the faster of a 512 MiB float32 sum ({dram_gbs:.1f} GB/s) and a sum "
                                     f"over the {bytes_per_token / 2**20:.0f} MiB one decode token reads "
                                     f"({working_set_gbs:.1f} GB/s)"}


def build_engine(args: argparse.Namespace) -> Any:
    """Our engine as `bench offline` measures it (the offline API's batching), warmed up."""
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed,
                                    quantization=args.quantization, machine_profile=args.machine_profile,
                                    quantization_dense=args.quantization_dense))
    engine.warmup()
    return engine


def run_engine(args: argparse.Namespace) -> tuple[dict[str, Any], list[tuple[list[int], int]]]:
    from tokenfactory.types import SamplingParams

    engine = build_engine(args)
    workload = make_workload(args.num_requests, _range(args.prompt_len), _range(args.output_len),
                             engine.model_config.vocab_size, args.seed)
    # Warm-up at batch size, then the timed run (prefix caching off for the timed run's fairness:
    # random prompts would not hit anyway).
    ids = [engine.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p, _ in workload[:8]]
    engine.run_to_completion(ids)
    engine.reset_prefix_cache()
    t = time.perf_counter()
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)) for p, n in workload]
    finals = engine.run_to_completion(ids)
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(finals[i].outputs[0].token_ids) for i in ids)
    single = single_stream_engine(engine, args)

    return {"dtype": str(engine.dtype).removeprefix("torch."), "quantization": engine.config.quantization,
            "weight_bytes_resident": engine.weight_bytes,
            "weight_bytes_read_per_decode_token": engine.decode_weight_bytes,
            "kv_bytes_per_token": engine.capacity.bytes_per_token,
            "throughput": {"elapsed_s": elapsed, "output_tokens": out_tokens,
                           "prompt_tokens": sum(len(p) for p, _ in workload),
                           "output_tokens_per_s": out_tokens / elapsed, "num_steps": engine.num_steps},
            "single_stream": single}, workload


def single_stream_engine(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    from tokenfactory.types import SamplingParams

    prompt = make_workload(1, (args.single_prompt_len,) * 2, (1, 1), engine.model_config.vocab_size,
                           args.seed + 1)[0][0]
    engine.reset_prefix_cache()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=args.single_output_len, ignore_eos=True,
                                                    temperature=0))
    times = []
    while engine.has_unfinished_requests:
        engine.step()
        times.append(time.perf_counter())
    del rid
    decode_s = times[-1] - times[0]
    return {"prompt_tokens": len(prompt), "output_tokens": args.single_output_len,
            "decode_tokens_per_s": (args.single_output_len - 1) / decode_s}


def run_hf(args: argparse.Namespace, workload: list[tuple[list[int], int]], dtype: str,
           model: Any = None) -> dict[str, Any]:
    """The baseline's run in `dtype` (on `model` when the dtype probe already loaded it)."""
    import torch

    model = model if model is not None else load_hf(args.model, dtype)
    pad = 0
    model.generation_config.pad_token_id = pad
    with torch.inference_mode():
        _hf_generate(model, [workload[0][0][:16]], 4, pad)  # warm-up
        t = time.perf_counter()
        out_tokens = 0
        for i in track(range(0, len(workload), args.hf_batch_size), "HF baseline"):
            batch = workload[i:i + args.hf_batch_size]
            _hf_generate(model, [p for p, _ in batch], max(n for _, n in batch), pad)
            out_tokens += sum(n for _, n in batch)
        elapsed = time.perf_counter() - t
        prompt = make_workload(1, (args.single_prompt_len,) * 2, (1, 1), model.config.vocab_size, args.seed + 1)[0][0]
        t0 = time.perf_counter()
        _hf_generate(model, [prompt], 1, pad)
        t1 = time.perf_counter()
        _hf_generate(model, [prompt], args.single_output_len, pad)
        t2 = time.perf_counter()
    decode_s = (t2 - t1) - (t1 - t0)
    return {"dtype": dtype, "batch_size": args.hf_batch_size,
            "throughput": {"elapsed_s": elapsed, "output_tokens": out_tokens,
                           "output_tokens_per_s": out_tokens / elapsed},
            "single_stream": {"decode_tokens_per_s": (args.single_output_len - 1) / decode_s}}


def probe_hf_dtypes(args: argparse.Namespace, workload: list[tuple[list[int], int]]) \
        -> tuple[dict[str, float], str, Any]:
    """Output tok/s of HF `generate` in each of HF_PROBED on the workload's first static batch (HF_PROBE_TOKENS new
    tokens each, after a warm-up); the dtype the baseline runs fastest in on this machine (the first of equals), and
    its model, kept for the run (a GGUF loads in transformers in ~10 s)."""
    import torch

    batch = [p for p, _ in workload[:args.hf_batch_size]]
    rates: dict[str, float] = {}
    fastest, fastest_model = "", None
    for dtype in HF_PROBED:
        model = load_hf(args.model, dtype)
        model.generation_config.pad_token_id = 0
        with torch.inference_mode():
            _hf_generate(model, [batch[0][:16]], 4, 0)
            t = time.perf_counter()
            _hf_generate(model, batch, HF_PROBE_TOKENS, 0)
            rates[dtype] = round(HF_PROBE_TOKENS * len(batch) / (time.perf_counter() - t), 1)
        if not fastest or rates[dtype] > rates[fastest]:
            fastest, fastest_model = dtype, model
        del model
    return rates, fastest, fastest_model


def _hf_generate(model: Any, prompts: list[list[int]], max_new: int, pad: int) -> None:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                   do_sample=False)


def load_hf(model: str | None, dtype: str) -> Any:
    """transformers' own loading of the same file: the GGUF dequantized by transformers, or the HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from tokenfactory.models.loader import bundled_model_path

    path = Path(model) if model else bundled_model_path()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()


def main(args: argparse.Namespace) -> int:
    import torch

    torch.manual_seed(args.seed)
    dram = args.peak_bandwidth_gbs or measure_peak_bandwidth_gbs()
    ours, workload = run_engine(args)
    s = ours["single_stream"]
    bytes_per_token = ours["weight_bytes_read_per_decode_token"] + ours["kv_bytes_per_token"] * (args.single_prompt_len
                                                                           + args.single_output_len / 2)
    bandwidth = roofline_bandwidth(dram, int(bytes_per_token), given=bool(args.peak_bandwidth_gbs))
    s["mbu"] = s["decode_tokens_per_s"] * bytes_per_token / (bandwidth["peak_bandwidth_gbs"] * 1e9)
    result: dict[str, Any] = {
        "benchmark": "offline", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                        **bandwidth},
        "tokenfactory": ours}
    if not args.skip_hf:
        if args.hf_dtype == "auto":
            probe, dtype, model = probe_hf_dtypes(args, workload)
            hf = run_hf(args, workload, dtype, model)
            hf["dtype_probe_tok_s"] = probe
        else:
            hf = run_hf(args, workload, args.hf_dtype)
        result["hf_generate"] = hf
        result["ratios"] = {
            "throughput": ours["throughput"]["output_tokens_per_s"] / hf["throughput"]["output_tokens_per_s"],
            "single_stream_decode": s["decode_tokens_per_s"] / hf["single_stream"]["decode_tokens_per_s"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"tokenfactory": {"throughput_tok_s": round(ours["throughput"]["output_tokens_per_s"], 1),
                                       "single_stream_tok_s": round(s["decode_tokens_per_s"], 1),
                                       "mbu": round(s["mbu"], 3)},
                      **({"hf_generate": {"throughput_tok_s": round(result["hf_generate"]["throughput"]
                                                                    ["output_tokens_per_s"], 1),
                                          "single_stream_tok_s": round(result["hf_generate"]["single_stream"]
                                                                       ["decode_tokens_per_s"], 1)},
                         "ratios": {k: round(v, 2) for k, v in result["ratios"].items()}}
                         if "ratios" in result else {}),
                      "out": str(out)}, indent=2))
    return 0
