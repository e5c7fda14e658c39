"""The figures in docs/memory.md's "On-the-fly reads the packed kernel's own codes": what a quantized layer's
large-step (dense) paths cost per row count, and the bytes a model's quantized layers keep per weight.

    python scripts/dense_paths.py rows [--layers 8] [--rows 32,64,128,256,512]
    python scripts/dense_paths.py bytes [MODEL] [--dense copy,on-the-fly] [--quantization auto]
    python scripts/dense_paths.py q4km OUT.gguf        (the Q4_K_M-like file: random Q4_K / Q6_K blocks)

`rows` times, on one thread, `--layers` copies of the bundled model's four layer shapes (scaled to 30 layers,
the model's depth), best of 7, interleaved: the kept bf16 copy, the old on-the-fly (a second copy of the codes,
PyTorch ops), on-the-fly from the packed buffer (compiled, and the PyTorch-ops fallback), the packed kernel
for every row, and the packed kernel against an identity matrix then a matmul.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down of SmolLM2-135M


def best_ms(fns: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: t * 1e3 for name, t in best.items()}


def rows(num_layers: int, row_counts: list[int]) -> None:
    from tokenfactory.layers import cpu_kernels
    from tokenfactory.layers.quant import DequantizeOnTheFly, QuantizedLinear
    from tokenfactory.layers.quant_formats import quantize_int4

    torch.set_num_threads(1)
    torch.manual_seed(0)
    bf16, cpu = torch.bfloat16, torch.device("cpu")
    weights = [quantize_int4(torch.randn(n, k) * 0.02, 32) for n, k in SHAPES * num_layers]
    mods = [QuantizedLinear.build(w, torch.zeros(*w.shape, dtype=bf16), None, dtype=bf16, device=cpu,
                                  dense="on-the-fly") for w in weights]
    old = [DequantizeOnTheFly(w, torch.empty(0), bf16, cpu) for w in weights]
    dense = [w.dequantize().to(bf16) for w in weights]
    eye = {k: torch.eye(k, dtype=bf16) for k in {k for _, k in SHAPES}}
    kernel = cpu_kernels.int4pack_dequantize_kernel

    def fallback(m: QuantizedLinear) -> torch.Tensor:
        cpu_kernels.int4pack_dequantize_kernel = lambda: None  # type: ignore[assignment]
        try:
            return m._dense_fn()
        finally:
            cpu_kernels.int4pack_dequantize_kernel = kernel  # type: ignore[assignment]

    scale = 30 / num_layers
    for t in row_counts:
        xs = [torch.randn(t, k).to(bf16) for _, k in SHAPES * num_layers]
        ms = best_ms(path_calls(xs, mods, old, dense, eye, fallback))
        print(json.dumps({"rows": t, "ms_per_30_layers": {k: round(v * scale, 1) for k, v in ms.items()}}), flush=True)


def path_calls(xs: list[torch.Tensor], mods: list, old: list, dense: list[torch.Tensor], eye: dict[int, torch.Tensor],
               fallback: Callable[..., torch.Tensor]) -> dict[str, Callable[[], object]]:
    pairs = list(zip(mods, xs, strict=True))
    fns: dict[str, Callable[[], object]] = {
        "copy": lambda: [F.linear(x, w) for w, x in zip(dense, xs, strict=True)],
        "on-the-fly old": lambda: [F.linear(x, o.weight()) for o, x in zip(old, xs, strict=True)],
        "from packed": lambda: [F.linear(x, m._dense_fn()) for m, x in pairs],
        "from packed, PyTorch ops": lambda: [F.linear(x, fallback(m)) for m, x in pairs],
        "packed": lambda: [m._packed_fn(x) for m, x in pairs],
    }
    if xs[0].shape[0] <= 64:
        fns["packed x identity"] = lambda: [x @ m._packed_fn(eye[x.shape[1]]) for m, x in pairs]
    return fns


def bytes_per_weight(model: str | None, dense_paths: list[str], quantization: str) -> None:
    from tokenfactory.config import EngineConfig
    from tokenfactory.engine.engine import LLMEngine
    from tokenfactory.layers.quant import QuantizedLinear
    from tokenfactory.models.loader import load_model

    loaded = load_model(model)
    for dense in dense_paths:
        engine = LLMEngine(EngineConfig(model=model, quantization=quantization, quantization_dense=dense,
                                        kv_cache_memory=16 << 20, max_model_len=512, machine_profile="off"), loaded)
        embedding = engine.runner.model.embed_tokens.weight.data_ptr()  # a tied head's copy is the embedding
        seen, num_bytes, num_weights = {embedding}, 0, 0
        for m in engine.runner.model.modules():
            if isinstance(m, QuantizedLinear):
                num_weights += m.in_features * m.out_features
                for b in m.buffers():
                    if b.data_ptr() not in seen:
                        seen.add(b.data_ptr())
                        num_bytes += b.numel() * b.element_size()
        print(json.dumps({"model": str(loaded.path), "file_bytes": loaded.path.stat().st_size, "dense": dense,
                          "bytes_per_weight": round(num_bytes / max(num_weights, 1), 3),
                          "linear_bytes": num_bytes, "engine_weight_bytes": engine.weight_bytes}), flush=True)
        del engine


def write_q4km(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.reference import q4_k_m_types, tiny_gguf_file

    tiny_gguf_file(out, "llama", ggml_type="Q4_K", num_layers=8, hidden_size=1024, intermediate_size=2816,
                   num_heads=16, num_kv_heads=4, tensor_types=q4_k_m_types(8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("rows")
    r.add_argument("--layers", type=int, default=8)
    r.add_argument("--rows", default="32,64,128,256,512")
    b = sub.add_parser("bytes")
    b.add_argument("model", nargs="?", default=None)
    b.add_argument("--dense", default="copy,on-the-fly")
    b.add_argument("--quantization", default="auto")
    q = sub.add_parser("q4km")
    q.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.what == "rows":
        rows(args.layers, [int(t) for t in args.rows.split(",")])
    elif args.what == "bytes":
        bytes_per_weight(args.model, args.dense.split(","), args.quantization)
    else:
        write_q4km(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
