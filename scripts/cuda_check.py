"""CUDA correctness and speed check, for a machine with an NVIDIA GPU (the model file is not needed there).

A random-weight model with the bundled SmolLM2-135M's shapes runs the same greedy requests on the CPU in
float32 and on CUDA in float32 and bfloat16, and int4 on both (CUDA's tinygemm kernel against the CPU's).
For each, the position of the first greedy token that differs from the CPU's (32: none); the check passes
when CUDA float32 matches the CPU on all 32 tokens of every prompt. Then decode speed on CUDA at batch 1
and 32, and the decode step through CUDA graphs against eager (tokens, speed, start-up, memory; issue 29).
Memory (#18): for none/int8/int4 weights (int4 with and without its dense copy), the peak CUDA memory while the
engine is placed and the memory it keeps, against `planned_weight_bytes` (what the start-up
check counts) plus the KV pool; the default KV budget measured after the weights landed; an int8 KV cache and
a sliding window on CUDA (PyTorch path) against the CPU (kernel). Prints one JSON object (and writes it to
$OUT/cuda_check.json when OUT is set).

    python scripts/cuda_check.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from tokenfactory.bench.spec import first_difference
from tokenfactory.config import EngineConfig, ModelConfig
from tokenfactory.engine.engine import LLMEngine
from tokenfactory.models.loader import LoadedModel
from tokenfactory.types import SamplingParams

SMOLLM2_135M = ModelConfig("llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                           num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                           max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=(2,))


class ByteTokenizer:
    """Enough of a tokenizer for token-id prompts: the check compares token ids, not text."""

    bos_token_id, eos_token_ids, vocab_size, all_special_ids = 1, (2,), 49152, frozenset({1, 2})

    def decode_stream(self, skip_special_tokens: bool = True, prompt_ids: tuple = ()) -> object:
        class Stream:
            def step(self, token_id: int) -> str:
                return f"<{token_id}>"

            def flush(self) -> str:
                return ""
        return Stream()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, h), "model.norm.weight": 1 + w(h, scale=0.1)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        weights |= {p + "input_layernorm.weight": 1 + w(h, scale=0.1),
                    p + "post_attention_layernorm.weight": 1 + w(h, scale=0.1),
                    p + "self_attn.q_proj.weight": w(cfg.num_heads * d, h),
                    p + "self_attn.k_proj.weight": w(cfg.num_kv_heads * d, h),
                    p + "self_attn.v_proj.weight": w(cfg.num_kv_heads * d, h),
                    p + "self_attn.o_proj.weight": w(h, cfg.num_heads * d),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i)}
    return weights


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    finals = engine.run_to_completion(ids)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return [finals[i].outputs[0].token_ids for i in ids], time.perf_counter() - start


def equal_until(want: list[list[int]], got: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens agree."""
    return [len(x) if (i := first_difference(x, y)) is None else i for x, y in zip(want, got, strict=True)]


def decode_speed(engine: LLMEngine, batch: int) -> float:
    prompts = [[(7 * b + k) % 40000 + 100 for k in range(128)] for b in range(batch)]
    run(engine, prompts[:1], 4)
    _, first = run(engine, prompts, 1)
    _, total = run(engine, prompts, 129)
    return batch * 128 / max(total - first, 1e-9)


def memory_accounting(loaded: LoadedModel) -> dict[str, object]:
    """Peak and kept CUDA bytes per weight scheme, against the plan; the default KV budget after the weights."""
    from tokenfactory.engine.placement import planned_weight_bytes

    out: dict[str, object] = {}
    piece = SMOLLM2_135M.vocab_size * SMOLLM2_135M.hidden_size * 4  # the embedding in float32: the largest piece
    for scheme, dense in (("none", "copy"), ("int8", "copy"), ("int4", "copy"), ("int4", "on-the-fly")):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        config = EngineConfig(device="cuda", dtype="bfloat16", quantization=scheme, quantization_dense=dense,
                              kv_cache_memory=64 << 20, max_model_len=1024, decode_step="eager")
        engine = LLMEngine(config, loaded)
        kept, peak = torch.cuda.memory_allocated() - before, torch.cuda.max_memory_allocated() - before
        planned = planned_weight_bytes(loaded, config, engine.device, engine.dtype)
        out[f"{scheme}-{dense}"] = {
            "planned_weight_bytes": planned, "engine_weight_bytes": engine.weight_bytes,
            "kv_bytes": engine.capacity.total_bytes, "kept_bytes": kept, "peak_bytes": peak,
            # kept = weights + KV pool (+ RoPE tables, 2 x 1024 x 32 float32); the peak adds one piece in flight
            "kept_matches_plan": abs(kept - planned - engine.capacity.total_bytes) <= 1 << 20,
            "peak_within_one_piece": peak <= kept + 3 * piece}
        del engine
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    engine = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", max_model_len=1024, decode_step="eager"), loaded)
    weights = engine.weight_bytes
    out["default_kv_budget"] = {"free_before_bytes": free_before, "weight_bytes": weights,
                                "kv_bytes": engine.capacity.total_bytes,
                                # 0.85 of what the weights left (memory/DEFAULT_FRACTION), within a block
                                "share_of_free_after_weights": engine.capacity.total_bytes / (free_before - weights)}
    return out


def kv_and_window(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, object]:
    """int8 KV and a sliding window: CUDA's PyTorch path against the CPU kernel, greedy tokens in float32."""
    import dataclasses

    windowed = LoadedModel(dataclasses.replace(SMOLLM2_135M, sliding_window=64), loaded.weights, loaded.tokenizer,
                           loaded.path, loaded.format)
    base = dict(dtype="float32", kv_cache_memory=256 << 20, max_model_len=1024, max_num_batched_tokens=256,
                decode_step="eager")
    out: dict[str, object] = {}
    for name, model, kv in (("int8_kv", loaded, "int8"), ("window_64", windowed, "auto"),
                            ("window_64_int8_kv", windowed, "int8")):
        cpu_tokens, _ = run(LLMEngine(EngineConfig(device="cpu", kv_cache_dtype=kv, **base), model), prompts, 32)
        gpu = LLMEngine(EngineConfig(device="cuda", kv_cache_dtype=kv, **base), model)
        gpu_tokens, _ = run(gpu, prompts, 32)
        out[name] = {"tokens_equal_to_cpu_until": equal_until(cpu_tokens, gpu_tokens),
                     "decode_tok_s_batch32": decode_speed(gpu, 32)}
    return out


def compiled_decode(loaded: LoadedModel, prompts: list[list[int]]) -> dict[str, object]:
    """The decode step through torch.compile's CUDA graphs (engine/compiled_decode.py) against the eager forward:
    greedy tokens (float32: equal; bfloat16 and int4 may part at a near-tie, as batch sizes do), decode speed at
    batch 1 and 32, the start-up (compile and record every row bucket), the graphs' memory, the buckets used."""
    out: dict[str, object] = {}
    base = dict(device="cuda", kv_cache_memory=256 << 20, max_model_len=1024, max_num_batched_tokens=256)
    for name, extra in (("float32", dict(dtype="float32")), ("bfloat16", dict(dtype="bfloat16")),
                        ("int4", dict(dtype="bfloat16", quantization="int4"))):
        eager = LLMEngine(EngineConfig(decode_step="eager", **base, **extra), loaded)  # type: ignore[arg-type]
        eager_tokens, _ = run(eager, prompts, 32)
        eager_speed = {"batch1": decode_speed(eager, 1), "batch32": decode_speed(eager, 32)}
        del eager
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        graphs = LLMEngine(EngineConfig(decode_step="cuda-graphs", **base, **extra), loaded)  # type: ignore[arg-type]
        startup_s = time.perf_counter() - start
        graph_tokens, _ = run(graphs, prompts, 32)
        out[name] = {"tokens_equal_to_eager_until": equal_until(eager_tokens, graph_tokens),
                     "startup_s": startup_s, "kept_bytes": torch.cuda.memory_allocated() - before,
                     "decode_tok_s_eager": eager_speed,
                     "decode_tok_s_graphs": {"batch1": decode_speed(graphs, 1), "batch32": decode_speed(graphs, 32)},
                     "buckets_used": sorted(graphs.runner.decode_step.bucket_to_steps),  # type: ignore[union-attr]
                     "free_blocks_back": graphs.kv.num_free_blocks == graphs.kv.num_blocks}
        del graphs
    return out


def main() -> None:
    loaded = LoadedModel(SMOLLM2_135M, random_weights(SMOLLM2_135M), ByteTokenizer(), Path("random"), "random")  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (5, 40, 130, 300)]
    base = dict(kv_cache_memory=256 << 20, max_model_len=1024, max_num_batched_tokens=256, decode_step="eager")
    cpu = LLMEngine(EngineConfig(device="cpu", dtype="float32", **base), loaded)
    cpu_tokens, _ = run(cpu, prompts, 32)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for dtype in ("float32", "bfloat16"):
        gpu = LLMEngine(EngineConfig(device="cuda", dtype=dtype, **base), loaded)
        gpu_tokens, _ = run(gpu, prompts, 32)
        report[dtype] = {"tokens_equal_to_cpu_until": equal_until(cpu_tokens, gpu_tokens),
                         "decode_tok_s_batch1": decode_speed(gpu, 1), "decode_tok_s_batch32": decode_speed(gpu, 32),
                         "free_blocks_back": gpu.kv.num_free_blocks == gpu.kv.num_blocks}
    # int4 on CUDA (tinygemm's packed kernel for small steps, the dense copy for big ones): the same codes on
    # the CPU's int4 kernel give the reference; compare greedy tokens and the speed against bf16.
    cpu4 = LLMEngine(EngineConfig(device="cpu", dtype="bfloat16", quantization="int4", **base), loaded)
    cpu4_tokens, _ = run(cpu4, prompts, 32)
    gpu4 = LLMEngine(EngineConfig(device="cuda", dtype="bfloat16", quantization="int4", **base), loaded)
    gpu4_tokens, _ = run(gpu4, prompts, 32)
    report["int4"] = {"tokens_equal_to_cpu_int4_until": equal_until(cpu4_tokens, gpu4_tokens),
                      "kernels": sorted({m.describe() for m in gpu4.runner.model.modules() if hasattr(m, "describe")}),
                      "decode_tok_s_batch1": decode_speed(gpu4, 1), "decode_tok_s_batch32": decode_speed(gpu4, 32)}
    report["compiled_decode"] = compiled_decode(loaded, prompts)
    report["memory"] = memory_accounting(loaded)
    report["kv_and_window"] = kv_and_window(loaded, prompts)
    report["pass"] = (all(n == 32 for n in report["float32"]["tokens_equal_to_cpu_until"])  # type: ignore[index]
                      and all(n == 32 for n in report["compiled_decode"]["float32"]  # type: ignore[index]
                              ["tokens_equal_to_eager_until"]))
    text = json.dumps(report, indent=2)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cuda_check.json").write_text(text)


if __name__ == "__main__":
    main()
