"""Memory benchmark (#18): what loading and serving take, with none/int8/int4 weights and bf16/int8 KV, JSON out.

    python -m tokenfactory.bench.memory --out memory.json             the bundled model and a random 1B Llama
    python -m tokenfactory.bench.memory --models bundled --seq-len 512

Per model and weight scheme (each load in a fresh process, so one run's memory never hides in the next):
peak resident memory while the engine is built (VmHWM, reset just before) and steady memory after it, both
above the process's baseline with the model's files opened; the weight bytes the engine counts
(`LLMEngine.weight_bytes`) and what the start-up check planned before loading
(`planned_weight_bytes`). Per KV dtype: how many `--seq-len`-token sequences fit in a fixed KV budget (int8
holds ~1.94x bf16's: a byte a value plus a float16 scale per head and token), and, on the bundled model,
decode tokens/s with that many sequences running at once (fixed seed, one warm-up; the 1B model is too slow
for that on a small CPU, so only its fit is reported).

The 1B model is Llama-shaped (hidden 2048, 16 layers, 32 heads / 8 KV heads, MLP 8192, untied 49152-token
head: 1.2B parameters) with seeded random bf16 weights, written once as one safetensors file per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ONE_B_SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8}


def write_random_llama(folder: Path, *, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                       num_attention_heads: int, num_key_value_heads: int, seed: int = 0,
                       tie_word_embeddings: bool = False) -> Path:
    """A Llama-shaped HF folder with seeded random bf16 weights (one safetensors shard per layer, so writing
    never holds the model) and the bundled model's tokenizer (49152 tokens). Returns the folder."""
    import torch
    from safetensors.torch import save_file

    from tokenfactory.models.gguf import gguf_tokenizer, read_gguf
    from tokenfactory.models.loader import bundled_model_path

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = gguf_tokenizer(read_gguf(bundled_model_path()))
    h, i, vocab = hidden_size, intermediate_size, 49152
    head_dim = h // num_attention_heads
    kv = num_key_value_heads * head_dim
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * scale).to(torch.bfloat16)

    shards: dict[str, dict[str, torch.Tensor]] = {"outer": {"model.embed_tokens.weight": rand(vocab, h),
                                                            "model.norm.weight": 1 + rand(h, scale=0.1)}}
    if not tie_word_embeddings:
        shards["outer"]["lm_head.weight"] = rand(vocab, h)
    weight_map: dict[str, str] = {}
    for name, tensors in shards.items():
        save_file(tensors, folder / f"{name}.safetensors")
        weight_map |= dict.fromkeys(tensors, f"{name}.safetensors")
    del shards
    for layer in range(num_hidden_layers):
        p = f"model.layers.{layer}."
        tensors = {p + "input_layernorm.weight": 1 + rand(h, scale=0.1),
                   p + "post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
                   p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
                   p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                   p + "mlp.down_proj.weight": rand(h, i)}
        save_file(tensors, folder / f"layer{layer}.safetensors")
        weight_map |= dict.fromkeys(tensors, f"layer{layer}.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": h,
        "intermediate_size": i, "num_hidden_layers": num_hidden_layers, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "tie_word_embeddings": tie_word_embeddings, "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_ids[0]}))
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str(), encoding="utf-8")
    return folder


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def measure_load(model: str | None, quantization: str, kv_cache_dtype: str = "auto", dense: str = "copy",
                 kv_cache_memory: int = 16 << 20, dtype: str = "auto") -> dict[str, Any]:
    """In this process: load the files, then build the engine with VmHWM reset; bytes above the baseline.
    Run it in a fresh process (`python -m tokenfactory.bench.memory --measure-load ...`) for honest peaks."""
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.engine.placement import planned_weight_bytes
    from tokenfactory.models.loader import load_model

    loaded = load_model(model)
    # The machine profile off: its first-start timing runs are not the load (docs/memory.md says what they add).
    config = EngineConfig(model=model, quantization=quantization, quantization_dense=dense, dtype=dtype,
                          kv_cache_memory=kv_cache_memory, kv_cache_dtype=kv_cache_dtype, max_num_seqs=256,
                          machine_profile="off")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    engine = LLMEngine(config, loaded)
    build_s = time.perf_counter() - start
    peak, steady = _status_kib("VmHWM") * 1024, _status_kib("VmRSS") * 1024
    kv_bytes = engine.capacity.total_bytes
    return {"model": str(loaded.path), "quantization": quantization, "dense": dense, "kv_cache_dtype": kv_cache_dtype,
            "dtype": str(engine.dtype).removeprefix("torch."), "build_s": round(build_s, 2),
            "peak_load_bytes": peak - base, "steady_bytes": steady - base, "kv_cache_bytes": kv_bytes,
            "steady_minus_kv_bytes": steady - base - kv_bytes, "weight_bytes": engine.weight_bytes,
            "planned_weight_bytes": planned_weight_bytes(loaded, config, engine.device, engine.dtype),
            "num_params": loaded.config.num_params, "max_model_len": engine.max_model_len}


def _in_fresh_process(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "tokenfactory.bench.memory", "--measure-load", *args],
                         capture_output=True, text=True, check=True, env=os.environ | {"PYTHONWARNINGS": "ignore"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def concurrency(model: str | None, kv_cache_dtype: str, kv_budget: int, seq_len: int, output_len: int,
                measure_speed: bool, num_seqs: int | None = None) -> dict[str, Any]:
    """How many seq_len-token sequences (plus their output) fit in kv_budget and, when asked, decode tok/s
    with that many running (or `num_seqs`, to compare KV dtypes at one concurrency): decode tokens over the
    time of the steps that only decoded (StepStats)."""
    import random

    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.types import SamplingParams, StepStats

    steps: list[StepStats] = []
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=kv_budget, kv_cache_dtype=kv_cache_dtype,
                                    max_model_len=seq_len + output_len, max_num_seqs=512,
                                    max_num_batched_tokens=4096, enable_prefix_caching=False),
                       step_listeners=[steps.append])
    fits = min(num_seqs, engine.capacity.num_tokens // (seq_len + output_len)) if num_seqs else \
        engine.capacity.num_tokens // (seq_len + output_len)
    result: dict[str, Any] = {"kv_cache_dtype": kv_cache_dtype, "kv_budget_bytes": kv_budget,
                              "kv_bytes_per_token": engine.capacity.bytes_per_token,
                              "kv_tokens": engine.capacity.num_tokens, "seq_len": seq_len + output_len,
                              "seqs_that_fit": fits}
    if not measure_speed or fits < 1:
        return result
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    engine.run_to_completion([engine.add_request([rng.randrange(vocab) for _ in range(16)],
                                                 SamplingParams(max_tokens=4, ignore_eos=True))])  # warm-up
    steps.clear()
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.run_to_completion([engine.add_request([rng.randrange(vocab) for _ in range(seq_len)], params)
                              for _ in range(fits)])
    decode = [s for s in steps if s.num_prefill_tokens == 0 and s.num_running == fits]
    seconds = sum(s.duration_s for s in decode)
    result |= {"decode_tokens_per_s": round(sum(s.num_decode_tokens for s in decode) / seconds, 1) if seconds else None,
               "decode_steps_timed": len(decode), "preemptions": sum(s.num_preemptions for s in steps)}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="bundled,1b", help="comma-separated: bundled, 1b, or a path")
    p.add_argument("--schemes", default="none,int8,int4", help="weight schemes")
    p.add_argument("--dense", default="prepacked,copy,on-the-fly",
                   help="quantized layers' large-step paths to load with (comma-separated): prepacked, copy, "
                        "on-the-fly")
    p.add_argument("--kv-budget", type=int, default=512 << 20, help="KV bytes for the concurrency figure")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--workdir", default=None, help="where the random 1B folder is written (kept; default: cache)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    p.add_argument("--measure-load", nargs=4, metavar=("MODEL", "SCHEME", "KV", "DENSE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure_load:
        model, scheme, kv, dense = args.measure_load
        print(json.dumps(measure_load(None if model == "bundled" else model, scheme, kv, dense)))
        return 0
    report: dict[str, Any] = {"machine": os.uname().nodename, "cpus": os.cpu_count(), "runs": []}
    for name in args.models.split(","):
        model = _model_path(name, args.workdir)
        entry: dict[str, Any] = {"model": name, "loads": [], "kv": []}
        for scheme in args.schemes.split(","):
            for dense in args.dense.split(",") if scheme != "none" else ["copy"]:
                entry["loads"].append(_in_fresh_process([model or "bundled", scheme, "auto", dense]))
                print(json.dumps(entry["loads"][-1]), file=sys.stderr)
        for kv in ("auto", "int8"):
            entry["kv"].append(concurrency(model, kv, args.kv_budget, args.seq_len, args.output_len,
                                           measure_speed=name == "bundled"))
            print(json.dumps(entry["kv"][-1]), file=sys.stderr)
        if name == "bundled":  # int8's cost in tok/s at bf16's concurrency (its own fit is twice that)
            entry["kv_int8_at_bf16_concurrency"] = concurrency(model, "int8", args.kv_budget, args.seq_len,
                                                               args.output_len, True, entry["kv"][0]["seqs_that_fit"])
        report["runs"].append(entry)
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


def _model_path(name: str, workdir: str | None) -> str | None:
    if name == "bundled":
        return None
    if name != "1b":
        return name
    root = Path(workdir) if workdir else Path.home() / ".cache" / "tokenfactory" / "bench"
    folder = root / "random-llama-1b"
    if not (folder / "config.json").is_file():
        write_random_llama(folder, **ONE_B_SHAPE)
    return str(folder)


if __name__ == "__main__":
    sys.exit(main())
